"""Worker-side update filters that never lose mass (pure numpy, no MPI).

A filter takes the sparse update a device produced, ``(keys, values)``, and returns the part
to send now, ``(keys, values)``. What it holds back stays in its **residual** (float64, sparse:
sorted keys with values), so after any sequence of calls, element by element,

    sum of everything sent + residual == sum of everything produced

(exactly, up to float64 rounding of the running sums). Filters compose with
:class:`FilterChain`; the chain's residual is the sum of its filters' residuals. Sent values
are float32 (or what ``quantize`` makes of them); the rounding error of that cast stays in the
residual too, and entries whose sent value would be 0 are not sent.

Filters (Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014, section 4.3 "User-defined filters"):

* :class:`SignificantlyModified` (``ps.sig_threshold``): adds the update to the residual and
  sends the entries whose accumulated change since they were last sent exceeds the threshold
  in absolute value; the others keep accumulating locally and go out once they do (or on
  :meth:`UpdateFilter.flush`).
* :class:`KKTFilter` (``ps.l1``, ``ps.kkt_margin``): for L1-regularised logistic regression,
  ``min_w loss(w) + l1 * ||w||_1``, coordinate ``j`` with ``w_j = 0`` stays at 0 after a
  proximal step whenever ``|g_j| <= l1`` (the optimality condition; ``g`` is the gradient of
  the smooth loss). The filter skips such coordinates when ``|g_j| <= l1 - margin``. With
  ``carry = False`` (default) the skipped values are only tallied in the residual (the server's
  soft threshold would have zeroed them); with ``carry = True`` they are added to the
  coordinate's next update, like the significantly-modified filter.
* :class:`ErrorFeedback`: sends everything, quantized by ``quantize`` (e.g. float16 values,
  :func:`edgefl.algorithms.ps.compress.round_values`); the rounding error is added to the entry
  the next time that key is sent.

Weights and gradients for the KKT test come in a :class:`FilterContext` (keys with the
device's current model values and gradients there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import checks
from ...errors import ConfigError
from ...policies.keyrange import KEY_DTYPE, check_keys

Quantize = Callable[[np.ndarray], np.ndarray]
"""Maps float32 values to the float32 values the receiver will decode (same shape)."""

_EMPTY_K = np.zeros(0, KEY_DTYPE)
_EMPTY_V = np.zeros(0, np.float64)


def _union_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Union of two sorted unique int64 arrays (a merge: timsort finds the two runs)."""
    if not a.size:
        return b
    if not b.size:
        return a
    c = np.concatenate([a, b])
    c.sort(kind="stable")
    keep = np.empty(c.size, bool)
    keep[0] = True
    np.not_equal(c[1:], c[:-1], out=keep[1:])
    return c[keep]


class SparseResidual:
    """Held-back mass: sorted unique int64 ``keys`` with float64 ``values`` (zeros dropped)."""

    def __init__(self) -> None:
        self.keys: np.ndarray = _EMPTY_K
        self.values: np.ndarray = _EMPTY_V

    def __len__(self) -> int:
        return int(self.keys.size)

    def total(self) -> float:
        """Sum of all held values."""
        return float(self.values.sum())

    def set(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the contents by ``values`` at sorted unique ``keys`` (zeros dropped)."""
        nz = values != 0
        self.keys = np.asarray(keys, KEY_DTYPE)[nz]
        self.values = np.asarray(values, np.float64)[nz]

    def combine(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(union of keys, residual + values)`` in float64; the residual is left unchanged."""
        cand = _union_sorted(self.keys, np.asarray(keys, KEY_DTYPE))
        acc = np.zeros(cand.size, np.float64)
        if self.keys.size:
            acc[np.searchsorted(cand, self.keys)] += self.values
        acc[np.searchsorted(cand, keys)] += np.asarray(values, np.float64)
        return cand, acc

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add ``values`` at sorted unique ``keys`` to the residual."""
        if np.size(keys):
            self.set(*self.combine(keys, values))

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Residual values at sorted unique ``keys`` (0 where none is held), float64."""
        out = np.zeros(np.size(keys), np.float64)
        if self.keys.size and np.size(keys):
            pos = np.searchsorted(self.keys, keys)
            pos_c = np.minimum(pos, self.keys.size - 1)
            hit = self.keys[pos_c] == keys
            out[hit] = self.values[pos_c[hit]]
        return out

    def to_dense(self, space: int) -> np.ndarray:
        """The residual as a dense float64 vector of ``space`` elements."""
        out = np.zeros(space, np.float64)
        out[self.keys] = self.values
        return out

    def clear(self) -> None:
        """Drop everything held."""
        self.keys, self.values = _EMPTY_K, _EMPTY_V


@dataclass
class FilterContext:
    """What the device knows about keys it may send (aligned arrays).

    Args:
        keys: sorted unique keys (e.g. the device's working set).
        weights: model values at ``keys`` (the pulled global model), or None.
        grads: gradient of the smooth loss at ``keys`` (at ``weights``), or None.
    """

    keys: np.ndarray
    weights: np.ndarray | None = None
    grads: np.ndarray | None = None

    def lookup(self, keys: np.ndarray, arr: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """``(found mask, values of arr at keys)``; keys not in the context are not found."""
        n = np.size(keys)
        if arr is None or self.keys.size == 0 or n == 0:
            return np.zeros(n, bool), np.zeros(n, np.float64)
        pos = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        found = self.keys[pos] == keys
        return found, np.where(found, np.asarray(arr, np.float64)[pos], 0.0)


class UpdateFilter(ABC):
    """Base class: holds a :class:`SparseResidual` and counts entries seen and sent."""

    name = "abstract"

    def __init__(self) -> None:
        self.residual = SparseResidual()
        self.seen = 0  # entries received by apply()
        self.sent = 0  # entries returned by apply()/flush()

    @abstractmethod
    def apply(
        self,
        keys: Any,
        values: np.ndarray,
        ctx: FilterContext | None = None,
        quantize: Quantize | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Filter one update; returns ``(keys int64 ascending, values float32)`` to send now.

        Args:
            keys: sorted unique keys of the update.
            values: the update's values (float32 or float64).
            ctx: model values and gradients at the device's keys (needed by the KKT filter).
            quantize: what the receiver will decode for given float32 values; the rounding
                error stays in the residual. Default: float32 as is.
        """

    def flush(self, quantize: Quantize | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Release everything held (e.g. at the end of training); returns ``(keys, values)``."""
        k, acc = self.residual.keys, self.residual.values
        return self._emit(k, acc, np.ones(k.size, bool), quantize)

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """The residual ``(keys, float64 values)`` (copies)."""
        return self.residual.keys.copy(), self.residual.values.copy()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Checkpointable state (numpy arrays)."""
        return {
            "keys": self.residual.keys.copy(),
            "values": self.residual.values.copy(),
            "counts": np.array([self.seen, self.sent], np.int64),
        }

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` output."""
        self.residual.set(np.asarray(state["keys"], KEY_DTYPE), np.asarray(state["values"]))
        self.seen, self.sent = (int(x) for x in np.asarray(state["counts"]))

    # -- helpers ---------------------------------------------------------------------------
    def _input(self, keys: Any, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = check_keys(keys, np.iinfo(np.int64).max, f"{self.name} filter keys")
        v = np.asarray(values, np.float64).reshape(-1)
        if v.size != k.size:
            raise ValueError(f"{self.name} filter: {k.size} keys but {v.size} values")
        self.seen += int(k.size)
        return k, v

    def _emit(
        self,
        cand: np.ndarray,
        acc: np.ndarray,
        send: np.ndarray,
        quantize: Quantize | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Send ``acc[send]`` (cast/quantized, nonzero only); the residual becomes the rest."""
        out = acc[send].astype(np.float32)
        if quantize is not None:
            out = np.asarray(quantize(out), np.float32).reshape(-1)
        nz = out != 0
        rest = acc.copy()
        idx = np.flatnonzero(send)[nz]
        rest[idx] = acc[idx] - out[nz].astype(np.float64)
        self.residual.set(cand, rest)
        self.sent += int(nz.sum())
        return cand[idx], out[nz]


class ErrorFeedback(UpdateFilter):
    """Sends every entry, quantized; the rounding error joins the key's next send.

    The residual of a key is added only when that key is in an update again, so quantization
    never creates extra entries. No arguments.
    """

    name = "error-feedback"

    def apply(self, keys, values, ctx=None, quantize=None):
        k, v = self._input(keys, values)
        held = self.residual.lookup(k)
        acc = v + held
        # keys not in this update keep their residual untouched
        others = ~np.isin(self.residual.keys, k, assume_unique=True)
        ok, ov = self.residual.keys[others], self.residual.values[others]
        sk, sv = self._emit(k, acc, np.ones(k.size, bool), quantize)
        self.residual.add(ok, ov)
        return sk, sv


class SignificantlyModified(UpdateFilter):
    """Send entries whose accumulated change since their last send exceeds ``threshold``.

    Args:
        threshold: absolute threshold (>= 0, model units; ``ps.sig_threshold``); an entry is
            sent when ``|residual + update| > threshold``. 0 sends every nonzero entry.
    """

    name = "significant"

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = checks.non_negative("ps.sig_threshold", threshold)

    def apply(self, keys, values, ctx=None, quantize=None):
        k, v = self._input(keys, values)
        cand, acc = self.residual.combine(k, v)
        return self._emit(cand, acc, np.abs(acc) > self.threshold, quantize)


class KKTFilter(UpdateFilter):
    """Skip coordinates an L1 proximal step would leave at zero (Li et al. 2014, sec. 5.1).

    Coordinate ``j`` is skipped when ``ctx`` holds it with weight exactly 0 and
    ``|grad_j| <= l1 - margin``, unless it is in ``exempt``. Keys absent from ``ctx`` are sent.

    Args:
        l1: L1 strength of the objective (>= 0; ``ps.l1``), in gradient units.
        margin: safety margin (>= 0; ``ps.kkt_margin``); default 0. Larger skips less.
        carry: add skipped values to the coordinate's next update (True) or only tally them in
            the residual (False, default).
        exempt: keys never skipped (e.g. unpenalised biases); default none.
    """

    name = "kkt"

    def __init__(
        self,
        l1: float,
        margin: float = 0.0,
        carry: bool = False,
        exempt: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        super().__init__()
        self.l1 = checks.non_negative("ps.l1", l1)
        self.margin = checks.non_negative("ps.kkt_margin", margin)
        self.carry = bool(carry)
        ex = np.unique(np.asarray(exempt if exempt is not None else [], KEY_DTYPE))
        self.exempt = ex
        self.skipped = 0  # entries skipped so far

    def _skip(self, keys: np.ndarray, ctx: FilterContext | None) -> np.ndarray:
        if ctx is None or ctx.weights is None or ctx.grads is None:
            raise ValueError("kkt filter needs a FilterContext with weights and grads")
        found, w = ctx.lookup(keys, ctx.weights)
        _, g = ctx.lookup(keys, ctx.grads)
        skip = found & (w == 0) & (np.abs(g) <= self.l1 - self.margin)
        if self.exempt.size:
            skip &= ~np.isin(keys, self.exempt)
        return skip

    def apply(self, keys, values, ctx=None, quantize=None):
        k, v = self._input(keys, values)
        if self.carry:
            cand, acc = self.residual.combine(k, v)
            skip = self._skip(cand, ctx)
            self.skipped += int((skip & np.isin(cand, k, assume_unique=True)).sum())
            return self._emit(cand, acc, ~skip & (acc != 0), quantize)
        skip = self._skip(k, ctx)
        self.skipped += int(skip.sum())
        # the tally keeps its old keys; skipped values are added to it
        old_k, old_v = self.residual.keys, self.residual.values
        sent_k, sent_v = self._emit(k, v, ~skip, quantize)
        self.residual.add(old_k, old_v)
        return sent_k, sent_v

    def state_dict(self) -> dict[str, np.ndarray]:
        d = super().state_dict()
        d["skipped"] = np.array(self.skipped, np.int64)
        return d

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.skipped = int(state["skipped"])


class FilterChain(UpdateFilter):
    """Apply ``filters`` in order; the last one gets ``quantize`` (then an :class:`ErrorFeedback`
    stage is appended if ``quantize`` is given at construction).

    Args:
        filters: the filters, applied first to last.
        quantize: receiver-side rounding of sent values (e.g. float16); default None. When
            given, an :class:`ErrorFeedback` stage that applies it is appended.
    """

    name = "chain"

    def __init__(self, filters: Sequence[UpdateFilter], quantize: Quantize | None = None) -> None:
        super().__init__()
        self.filters = list(filters)
        self.quantize = quantize
        if quantize is not None:
            self.filters.append(ErrorFeedback())

    def apply(self, keys, values, ctx=None, quantize=None):
        k, v = self._input(keys, values)
        q = quantize if quantize is not None else self.quantize
        for i, f in enumerate(self.filters):
            last = i == len(self.filters) - 1
            k, v = f.apply(k, v, ctx, q if last else None)
        self.sent += int(k.size)
        return k, v.astype(np.float32)

    def flush(self, quantize=None):
        """Release the sum of every stage's residual; the final rounding error (float32 or
        ``quantize``) stays in the last stage's residual."""
        q = quantize if quantize is not None else self.quantize
        if not self.filters:
            return _EMPTY_K, np.zeros(0, np.float32)
        total = self.residual_total
        for f in self.filters:
            f.residual.clear()
        k, acc = total.keys, total.values
        out = acc.astype(np.float32)
        if q is not None:
            out = np.asarray(q(out), np.float32).reshape(-1)
        nz = out != 0
        err = acc.copy()
        err[nz] -= out[nz].astype(np.float64)
        self.filters[-1].residual.add(k, err)
        self.sent += int(nz.sum())
        return k[nz], out[nz]

    @property
    def residual_total(self) -> SparseResidual:
        """Sum of every stage's residual."""
        r = SparseResidual()
        for f in self.filters:
            r.add(f.residual.keys, f.residual.values)
        return r

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        r = self.residual_total
        return r.keys.copy(), r.values.copy()

    def state_dict(self) -> dict[str, np.ndarray]:
        d: dict[str, np.ndarray] = {"counts": np.array([self.seen, self.sent], np.int64)}
        for i, f in enumerate(self.filters):
            for key, val in f.state_dict().items():
                d[f"{i}.{key}"] = val
        return d

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.seen, self.sent = (int(x) for x in np.asarray(state["counts"]))
        for i, f in enumerate(self.filters):
            f.load_state_dict(
                {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{i}.")}
            )


_GOLDEN = 0.6180339887498949


def mass_checksum(keys: Any, values: np.ndarray) -> float:
    """A weighted sum ``sum_j r_j * values_j`` with fixed weights ``r_j = 1 + frac(j * phi)``
    in [1, 2) (``phi`` the golden ratio's fractional part), in float64.

    It is additive over messages, so the sum over everything a device produced equals the sum
    over everything the receiver decoded iff no mass was lost (up to float rounding), and,
    unlike a plain sum, it does not cancel for updates whose entries sum to 0 (e.g. the two
    class rows of a 2-class softmax layer)."""
    k = np.asarray(keys, np.float64)
    r = 1.0 + np.modf(k * _GOLDEN)[0]
    return float(np.dot(r, np.asarray(values, np.float64)))


FILTER_NAMES = ("significant", "kkt")


def make_filter_chain(
    ps: Mapping[str, Any],
    quantize: Quantize | None = None,
    exempt: Sequence[int] | np.ndarray | None = None,
) -> FilterChain:
    """The worker's filter chain from the ``[ps]`` config table.

    Keys read: ``filters`` (list of names in order, from ``significant``, ``kkt``; default
    empty), ``sig_threshold`` (default 0.0), ``l1`` (default 0.0), ``kkt_margin`` (default
    0.0), ``kkt_carry`` (default False). ``quantize``: see :class:`FilterChain`; ``exempt``:
    keys the KKT filter never skips.
    """
    names = ps.get("filters", [])
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"config key 'ps.filters' = {names!r}: must be a list of names")
    out: list[UpdateFilter] = []
    for n in names:
        if n == "significant":
            out.append(SignificantlyModified(ps.get("sig_threshold", 0.0)))
        elif n == "kkt":
            carry = ps.get("kkt_carry", False)
            if not isinstance(carry, bool):
                raise ConfigError(f"config key 'ps.kkt_carry' = {carry!r}: must be true or false")
            out.append(KKTFilter(ps.get("l1", 0.0), ps.get("kkt_margin", 0.0), carry, exempt))
        else:
            raise ConfigError(
                f"config key 'ps.filters' = {list(names)!r}: unknown filter {n!r}; "
                f"allowed: {', '.join(FILTER_NAMES)}"
            )
    return FilterChain(out, quantize)


def make_ps_filter_chain(cfg: dict, quantize=None, exempt=None):
    """A device's filter chain (``ps.filters``); the KKT filter's threshold is ``server.l1``
    (delta units: the worker scales its gradients by ``train.lr`` x local steps)."""
    return make_filter_chain({**cfg["ps"], "l1": cfg["server"]["l1"]}, quantize, exempt)
