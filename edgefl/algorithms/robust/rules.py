"""Byzantine-robust aggregation and update validation on the coordinator (pure numpy, no MPI).

Aggregators (all on the :class:`~edgefl.policies.aggregation.Aggregator` API, all
deterministic: inputs are put in ascending device order first, ties are broken by device id):

- ``median``: coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).
- ``trimmed-mean``: coordinate-wise trimmed mean, dropping the ``floor(beta * n)`` largest and
  smallest values of every coordinate (same paper); config key ``robust.trim_fraction``.
- ``krum`` / ``multi-krum``: Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017. Each update is scored by
  the sum of squared distances to its ``n - f - 2`` nearest other updates; Krum returns the
  best-scored update, Multi-Krum the mean of the ``m`` best. Keys ``robust.krum_f``,
  ``robust.multi_krum_m``. Needs ``n >= 2f + 3`` updates in the round.
- ``norm-clip``: every update scaled down to norm at most ``C`` and then averaged (norm
  bounding, Sun, Kairouz, Suresh, McMahan, "Can You Really Backdoor Federated Learning?",
  2019); key ``robust.clip_norm`` (0 = the median norm of the round).

The robust aggregators weigh every update equally: sample counts are reported by the devices
themselves, so a Byzantine device could otherwise claim any weight.

:class:`UpdateFilter` runs before any aggregator: it rejects non-finite updates and bounds the
update norm (absolute, or relative to the round's median norm), rejecting or clipping
outliers, and returns the (device, reason) of every rejection for the coordinator's log.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from edgefl.config import checks
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Aggregator, Update

# Leaf names of the [robust] config keys (make_aggregator / UpdateFilter options).
ROBUST_KEYS: tuple[str, ...] = (
    "trim_fraction",
    "krum_f",
    "multi_krum_m",
    "clip_norm",
    "norm_bound",
    "norm_bound_relative",
    "norm_bound_mode",
)

# Defaults of the optional keys; robust.krum_f has none (the threat model must be stated).
DEFAULTS: dict[str, object] = {
    "trim_fraction": 0.1,
    "krum_f": -1,  # -1 = not set
    "multi_krum_m": 0,  # 0 = n - f
    "clip_norm": 0.0,  # 0 = median norm of the round
    "norm_bound": 0.0,  # 0 = off
    "norm_bound_relative": 0.0,  # 0 = off
    "norm_bound_mode": "reject",
}
NORM_BOUND_MODES = ("reject", "clip")

# Coordinates handled at once (float64 elements per block, all updates together): bounds the
# temporary memory of the coordinate-wise aggregators to about 32 MiB.
_BLOCK_ELEMENTS = 1 << 22


# -- shared numerics ----------------------------------------------------------------------
def _blocks(size: int, n: int):
    """(start, stop) coordinate ranges so that n rows x block stay within _BLOCK_ELEMENTS."""
    step = max(1, _BLOCK_ELEMENTS // max(n, 1))
    for start in range(0, size, step):
        yield start, min(start + step, size)


def _stack(ordered: Sequence[Update], start: int, stop: int) -> np.ndarray:
    """Rows = updates (in the given order), columns = coordinates start..stop, float64."""
    x = np.empty((len(ordered), stop - start), np.float64)
    for i, u in enumerate(ordered):
        x[i] = u.delta[start:stop]
    return x


def l2_norm(x: np.ndarray) -> float:
    """Euclidean norm accumulated in float64 (numpy's pairwise sum: the same bits on any
    machine with the same numpy, unlike BLAS dot products)."""
    total = 0.0
    for start, stop in _blocks(x.size, 1):
        c = x[start:stop].astype(np.float64)
        total += float(np.square(c).sum())
    return math.sqrt(total)


def pairwise_sq_distances(ordered: Sequence[Update]) -> np.ndarray:
    """Squared Euclidean distances between all updates, (n, n) float64, exact differences
    (no Gram-matrix cancellation). Cost O(n^2 d) additions."""
    n = len(ordered)
    dist = np.zeros((n, n), np.float64)
    for start, stop in _blocks(ordered[0].delta.size, n):
        x = _stack(ordered, start, stop)
        for i in range(n - 1):
            diff = x[i + 1 :] - x[i]
            dist[i, i + 1 :] += np.square(diff).sum(axis=1)
    return dist + dist.T


# -- aggregators --------------------------------------------------------------------------
class CoordinateMedian(Aggregator):
    """Coordinate-wise median (the mean of the two middle values when n is even).

    Tolerates up to ``ceil(n/2) - 1`` arbitrary updates per coordinate. No arguments.
    """

    name = "median"

    def combine(self, ordered: list[Update]) -> np.ndarray:
        out = np.empty(ordered[0].delta.size, np.float64)
        for start, stop in _blocks(out.size, len(ordered)):
            out[start:stop] = np.median(_stack(ordered, start, stop), axis=0)
        return out


class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean.

    Args:
        trim_fraction: fraction beta of the updates dropped at *each* end of every
            coordinate, ``0 <= beta < 0.5`` (default 0.1); ``floor(beta * n)`` values are
            dropped per side, so choose ``beta >= f / n`` to remove f Byzantine updates.
            beta = 0 is the plain mean.
    """

    name = "trimmed-mean"

    def __init__(self, trim_fraction: float = 0.1) -> None:
        beta = checks.number("robust.trim_fraction", trim_fraction)
        if not 0.0 <= beta < 0.5:
            raise ConfigError(
                f"config key 'robust.trim_fraction' = {trim_fraction!r}: must be >= 0 and < 0.5"
            )
        self.trim_fraction = beta

    def trimmed(self, n: int) -> int:
        """Values dropped per side of each coordinate for a round of ``n`` updates."""
        return int(math.floor(self.trim_fraction * n))

    def combine(self, ordered: list[Update]) -> np.ndarray:
        n = len(ordered)
        k = self.trimmed(n)
        out = np.empty(ordered[0].delta.size, np.float64)
        for start, stop in _blocks(out.size, n):
            x = np.sort(_stack(ordered, start, stop), axis=0)
            out[start:stop] = x[k : n - k].mean(axis=0)
        return out


class MultiKrum(Aggregator):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): the mean of the ``m`` updates with the
    lowest Krum scores. The score of update i is the sum of its squared distances to its
    ``n - f - 2`` closest other updates; scores are computed once (the paper's Multi-Krum).

    Args:
        f: assumed number of Byzantine updates per round (``robust.krum_f``), >= 0; a round
            needs ``n >= 2f + 3`` updates.
        m: how many updates to average (``robust.multi_krum_m``), ``1 <= m <= n - f``;
            0 (default) = ``n - f``.
        expected_updates: updates per round the run expects (None = unknown), checked
            against f at construction.

    After each :meth:`aggregate`, :attr:`last_selected` holds the selected device ids and
    :attr:`last_scores` the score of every device.
    """

    name = "multi-krum"

    def __init__(self, f: int, m: int = 0, expected_updates: int | None = None) -> None:
        self.f = checks.integer("robust.krum_f", f, minimum=0, allow_float=True)
        self.m = checks.integer("robust.multi_krum_m", m, minimum=0, allow_float=True)
        self.last_selected: list[int] = []
        self.last_scores: dict[int, float] = {}
        if expected_updates is not None:
            self._check_n(int(expected_updates))

    def _check_n(self, n: int) -> int:
        """Number of updates to average for a round of n; ConfigError when n is too small."""
        f = self.f
        if n < 2 * f + 3:
            raise ConfigError(
                f"config key 'robust.krum_f' = {f}: {self.name} needs n >= 2f + 3 = {2 * f + 3} "
                f"updates per round, got n = {n}; lower robust.krum_f to at most "
                f"{max((n - 3) // 2, 0)}"
            )
        m = self.m or n - f
        if m > n - f:
            raise ConfigError(
                f"config key 'robust.multi_krum_m' = {self.m}: must be <= n - f = {n - f} "
                f"(n = {n} updates, f = {f})"
            )
        return m

    def scores(self, ordered: Sequence[Update]) -> np.ndarray:
        """Krum score of each update (same order), float64."""
        n = len(ordered)
        k = n - self.f - 2
        dist = pairwise_sq_distances(ordered)
        out = np.empty(n, np.float64)
        for i in range(n):
            others = np.sort(np.delete(dist[i], i))
            out[i] = others[:k].sum()
        return out

    def select(self, ordered: Sequence[Update]) -> list[int]:
        """Indices (into ``ordered``) of the selected updates, best score first; equal scores
        go to the lower device id (``ordered`` is in device order, the sort is stable)."""
        m = self._check_n(len(ordered))
        s = self.scores(ordered)
        self.last_scores = {u.device: float(x) for u, x in zip(ordered, s)}
        chosen = [int(i) for i in np.argsort(s, kind="stable")[:m]]
        self.last_selected = [ordered[i].device for i in chosen]
        return chosen

    def combine(self, ordered: list[Update]) -> np.ndarray:
        chosen = sorted(self.select(ordered))  # sum in device order
        acc = np.zeros(ordered[0].delta.size, np.float64)
        for i in chosen:
            acc += ordered[i].delta
        acc /= len(chosen)
        return acc


class Krum(MultiKrum):
    """Krum (Blanchard et al., NeurIPS 2017): the single update with the lowest score.

    Args:
        f: assumed number of Byzantine updates per round (``robust.krum_f``), >= 0; a round
            needs ``n >= 2f + 3`` updates.
        expected_updates: updates per round the run expects (None = unknown).
    """

    name = "krum"

    def __init__(self, f: int, expected_updates: int | None = None) -> None:
        super().__init__(f, 1, expected_updates)


class NormClip(Aggregator):
    """Mean of the updates after scaling each down to norm at most C.

    Args:
        clip_norm: C (``robust.clip_norm``, same units as the deltas), >= 0; 0 (default) =
            the median update norm of the round, which needs no tuning and cannot be moved
            by fewer than half of the updates.

    After each :meth:`aggregate`, :attr:`last_clip_norm` holds the C used and
    :attr:`last_clipped` the devices whose update was scaled down.
    """

    name = "norm-clip"

    def __init__(self, clip_norm: float = 0.0) -> None:
        self.clip_norm = checks.non_negative("robust.clip_norm", clip_norm)
        self.last_clip_norm = 0.0
        self.last_clipped: list[int] = []

    def combine(self, ordered: list[Update]) -> np.ndarray:
        norms = np.array([l2_norm(u.delta) for u in ordered])
        c = self.clip_norm or float(np.median(norms))
        self.last_clip_norm = c
        self.last_clipped = []
        acc = np.zeros(ordered[0].delta.size, np.float64)
        for u, norm in zip(ordered, norms):
            if norm > c:
                self.last_clipped.append(u.device)
                acc += np.multiply(u.delta, c / norm, dtype=np.float64)
            else:
                acc += u.delta
        acc /= len(ordered)
        return acc


ROBUST_AGGREGATORS: dict[str, type[Aggregator]] = {
    a.name: a for a in (CoordinateMedian, TrimmedMean, Krum, MultiKrum, NormClip)
}


def build_robust(
    name: str, expected_updates: int | None, options: Mapping[str, object]
) -> Aggregator:
    """A robust aggregator from its name and the ``[robust]`` options (leaf names); called
    by :func:`~edgefl.algorithms.aggregators.make_aggregator`, which checked the names."""
    opt = {**DEFAULTS, **options}
    if name == "median":
        return CoordinateMedian()
    if name == "trimmed-mean":
        return TrimmedMean(opt["trim_fraction"])  # type: ignore[arg-type]
    if name == "norm-clip":
        return NormClip(opt["clip_norm"])  # type: ignore[arg-type]
    if name in ("krum", "multi-krum"):
        if opt["krum_f"] == -1:
            raise ConfigError(
                f"config key 'algorithm.aggregation' = {name!r} needs config key "
                "'robust.krum_f': the assumed number of Byzantine devices f, an integer >= 0 "
                "with n >= 2f + 3 updates per round"
            )
        if name == "krum":
            return Krum(opt["krum_f"], expected_updates)  # type: ignore[arg-type]
        return MultiKrum(opt["krum_f"], opt["multi_krum_m"], expected_updates)  # type: ignore[arg-type]
    raise ConfigError(f"config key 'algorithm.aggregation' = {name!r}: not a robust aggregator")


# -- validation before aggregation ------------------------------------------------------------
@dataclass
class FilterResult:
    """What :class:`UpdateFilter` let through.

    Attributes:
        accepted: the accepted updates in ascending device order (clipped ones replaced by
            a scaled copy; the inputs are never modified).
        rejected: (device, reason) of every rejected update, in device order.
        clipped: devices whose update was scaled down to the bound (mode ``clip``).
        bound: the norm bound applied this round (inf when none).
    """

    accepted: list[Update]
    rejected: list[tuple[int, str]] = field(default_factory=list)
    clipped: list[int] = field(default_factory=list)
    bound: float = math.inf


class UpdateFilter:
    """Checks a round's updates before aggregation.

    Always rejects an update whose delta or loss is NaN/Inf, or whose sample count is
    negative. Optionally bounds the norm of the delta; with both bounds set the smaller
    one applies.

    Args:
        norm_bound: absolute bound on the L2 norm of a delta (``robust.norm_bound``, units
            of the model parameters), >= 0; 0 (default) = off.
        norm_bound_relative: bound as a multiple of the median norm of the round's finite
            updates (``robust.norm_bound_relative``; e.g. 3.0 = 3x the median), >= 1 or 0
            (default) = off. Values below 1 would act on honest updates by design.
        mode: ``"reject"`` (default) drops an update above the bound, ``"clip"`` scales it
            down to the bound (``robust.norm_bound_mode``).
        numel: the model's number of parameters; an update of another shape is rejected
            (default 0 = take the most common size of the round).
    """

    def __init__(
        self,
        norm_bound: float = 0.0,
        norm_bound_relative: float = 0.0,
        mode: str = "reject",
        numel: int = 0,
    ) -> None:
        self.numel = int(numel)
        self.norm_bound = checks.non_negative("robust.norm_bound", norm_bound)
        rel = checks.non_negative("robust.norm_bound_relative", norm_bound_relative)
        if 0 < rel < 1:
            raise ConfigError(
                f"config key 'robust.norm_bound_relative' = {norm_bound_relative!r}: must be "
                ">= 1 (a multiple of the median norm) or 0 (off)"
            )
        self.norm_bound_relative = rel
        if mode not in NORM_BOUND_MODES:
            raise ConfigError(
                f"config key 'robust.norm_bound_mode' = {mode!r}: expected one of "
                + ", ".join(NORM_BOUND_MODES)
            )
        self.mode = mode

    @classmethod
    def from_options(cls, numel: int = 0, **options: object) -> UpdateFilter:
        """Build from ``[robust]`` options by leaf name (the aggregator's keys are ignored);
        ``numel`` as in the constructor."""
        unknown = sorted(set(options) - set(ROBUST_KEYS))
        if unknown:
            raise ConfigError(
                f"config key 'robust.{unknown[0]}': unknown option; expected one of "
                + ", ".join(ROBUST_KEYS)
            )
        opt = {**DEFAULTS, **options}
        return cls(opt["norm_bound"], opt["norm_bound_relative"], opt["norm_bound_mode"], numel)  # type: ignore[arg-type]

    @property
    def bounds_norm(self) -> bool:
        """True when a norm bound is configured."""
        return self.norm_bound > 0 or self.norm_bound_relative > 0

    def __call__(self, updates: Sequence[Update]) -> FilterResult:
        return self.filter(updates)

    def filter(self, updates: Sequence[Update]) -> FilterResult:
        """Split the round's updates into accepted (possibly clipped) and rejected ones."""
        result = FilterResult(accepted=[])
        if not updates:
            return result
        finite: list[Update] = []
        ordered = sorted(updates, key=lambda u: (u.device, u.round))
        numel = self.numel
        if not numel:  # the most common size; ties to the larger one
            sizes = Counter(int(u.delta.size) for u in ordered)
            numel = max(sizes, key=lambda k: (sizes[k], k))
        for u in ordered:
            if u.delta.ndim != 1 or u.delta.size != numel:
                result.rejected.append(
                    (u.device, f"update of shape {u.delta.shape}, model has ({numel},)")
                )
            elif not np.isfinite(u.delta).all():
                result.rejected.append((u.device, "non-finite values in the update"))
            elif not math.isfinite(u.loss):
                result.rejected.append((u.device, f"non-finite loss {u.loss}"))
            elif u.samples < 0:
                result.rejected.append((u.device, f"negative sample count {u.samples}"))
            else:
                finite.append(u)
        if not self.bounds_norm or not finite:
            result.accepted = finite
            return result
        norms = [l2_norm(u.delta) for u in finite]
        bound, source = math.inf, ""
        if self.norm_bound > 0:
            bound, source = self.norm_bound, "robust.norm_bound"
        if self.norm_bound_relative > 0:
            med = float(np.median(norms))
            rel = self.norm_bound_relative * med
            if rel < bound:
                bound = rel
                source = (
                    f"robust.norm_bound_relative = {self.norm_bound_relative:g} x median {med:.4g}"
                )
        result.bound = bound
        for u, norm in zip(finite, norms):
            if norm <= bound:
                result.accepted.append(u)
            elif self.mode == "clip":
                scaled = (u.delta.astype(np.float64) * (bound / norm)).astype(u.delta.dtype)
                result.accepted.append(replace(u, delta=scaled))
                result.clipped.append(u.device)
            else:
                reason = f"norm {norm:.4g} above the bound {bound:.4g} ({source})"
                result.rejected.append((u.device, reason))
        result.rejected.sort(key=lambda r: r[0])  # stable: device order throughout
        return result


__all__ = [
    "CoordinateMedian",
    "DEFAULTS",
    "FilterResult",
    "Krum",
    "MultiKrum",
    "NormClip",
    "ROBUST_AGGREGATORS",
    "ROBUST_KEYS",
    "TrimmedMean",
    "UpdateFilter",
    "build_robust",
    "l2_norm",
    "pairwise_sq_distances",
]
