"""Privacy accounting of DP-FedAvg with Google's ``dp-accounting`` library (RDP accountant).

Every aggregation step releases the sum of the clipped updates of the devices drawn for it
plus Gaussian noise of standard deviation ``z C`` (``z = dp.noise_multiplier``, ``C =
dp.clip``), divided by a public constant (:attr:`Sampling.denominator`). The step is
described to dp-accounting as the event of the sampling edgefl actually does
(``dp.sampling``):

- ``fixed``: ``m`` of the ``N`` devices uniformly without replacement (``m`` from
  ``server.participation``, see :func:`edgefl.policies.consistency.sample_size`):
  ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under **replace-one**
  adjacency (one device's data replaced by anything else; ``N`` is public). The ``/ 2``:
  replacing a clipped update ``v`` by ``v'`` moves the sum by up to ``2 C``, and the RDP
  accountant of dp-accounting 0.6.0 reads the Gaussian's noise multiplier as noise std over
  that sensitivity (google/differential-privacy#378); :func:`replace_one_multiplier` checks
  the installed library's convention instead of assuming it.
- ``poisson``: every device independently with probability ``q``:
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under **add/remove-one** adjacency (one
  device present or absent; sensitivity ``C``).

The steps compose (``ComposedDpEvent`` of ``SelfComposedDpEvent``) and epsilon at
``dp.delta`` is dp-accounting's ``RdpAccountant`` (its default orders) with that neighbouring
relation. dp-accounting 0.6.0's PLD accountant has no ``SampledWithoutReplacementDpEvent``,
so one accountant serves both modes. The two adjacencies give different guarantees: a
replace-one epsilon is about twice an add/remove one for the same mechanism (group privacy:
(eps, delta) add/remove implies (2 eps, (1 + e^eps) delta) replace-one).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

from edgefl.errors import ConfigError

FIXED = "fixed"
POISSON = "poisson"
SAMPLINGS = (FIXED, POISSON)

REPLACE_ONE = "replace-one"
ADD_OR_REMOVE_ONE = "add/remove-one"


@dataclass(frozen=True)
class Sampling:
    """How the devices of one aggregation step are drawn (``dp.sampling``).

    Build with :meth:`fixed` or :meth:`poisson` (they check the values).

    Args:
        mode: ``"fixed"`` or ``"poisson"``.
        devices: N, the devices of the fleet (``fleet.devices``).
        sample_size: m, the devices drawn per step (fixed; 0 for poisson).
        rate: q, each device's probability of being drawn (poisson; 0.0 for fixed).
    """

    mode: str
    devices: int
    sample_size: int = 0
    rate: float = 0.0

    @classmethod
    def fixed(cls, devices: int, sample_size: int) -> Sampling:
        """``sample_size`` (m) of ``devices`` (N) uniformly without replacement, 1 <= m <= N."""
        n = _devices(devices)
        m = int(sample_size)
        if not 1 <= m <= n:
            raise ConfigError(
                f"config key 'server.participation': {m} devices per round of {n}: must be "
                f"between 1 and {n}"
            )
        return cls(FIXED, n, m, 0.0)

    @classmethod
    def poisson(cls, devices: int, rate: float) -> Sampling:
        """Every one of ``devices`` (N) independently with probability ``rate`` (q), 0 < q <= 1."""
        q = float(rate)
        if not 0.0 < q <= 1.0:
            raise ConfigError(f"config key 'server.participation' = {rate!r}: must be > 0 and <= 1")
        return cls(POISSON, _devices(devices), 0, q)

    @property
    def adjacency(self) -> str:
        """``"replace-one"`` (fixed) or ``"add/remove-one"`` (poisson)."""
        return REPLACE_ONE if self.mode == FIXED else ADD_OR_REMOVE_ONE

    @property
    def denominator(self) -> float:
        """What the clipped sum and its noise are divided by: m (fixed) or q N (poisson), the
        expected number of updates; never the number that arrived, which is not public under
        add/remove adjacency (McMahan et al., ICLR 2018, fixed-denominator estimator)."""
        return float(self.sample_size) if self.mode == FIXED else self.rate * self.devices

    def event(self, noise_multiplier: float):
        """The dp-accounting ``DpEvent`` of one step with noise multiplier z (noise std over
        the clip norm C); ``NonPrivateDpEvent`` when z = 0."""
        from dp_accounting import dp_event as ev

        z = float(noise_multiplier)
        if z <= 0:
            return ev.NonPrivateDpEvent()
        if self.mode == FIXED:
            gauss = ev.GaussianDpEvent(replace_one_multiplier(z))
            return ev.SampledWithoutReplacementDpEvent(self.devices, self.sample_size, gauss)
        return ev.PoissonSampledDpEvent(self.rate, ev.GaussianDpEvent(z))

    def describe(self, noise_multiplier: float) -> str:
        """One line naming the event and the adjacency (for the run summary)."""
        return f"{_event_text(self.event(noise_multiplier))} per step, {self.adjacency} adjacency"


def _devices(devices: int) -> int:
    if isinstance(devices, bool) or int(devices) != devices or devices < 1:
        raise ConfigError(f"config key 'fleet.devices' = {devices!r}: must be an integer >= 1")
    return int(devices)


def _event_text(e) -> str:
    name = type(e).__name__
    if name == "SampledWithoutReplacementDpEvent":
        inner = _event_text(e.event)
        return f"{name}({e.source_dataset_size}, {e.sample_size}, {inner})"
    if name == "PoissonSampledDpEvent":
        return f"{name}({e.sampling_probability:g}, {_event_text(e.event)})"
    if name == "GaussianDpEvent":
        return f"{name}({e.noise_multiplier:g})"
    return f"{name}()"


@functools.cache
def _library_accounts_replace_sensitivity() -> bool:
    """True when dp-accounting's RDP accountant itself charges the ``2 C`` replace-one
    sensitivity of a clipped sum for ``SampledWithoutReplacementDpEvent``. 0.6.0 does not:
    it gives a full sample (m = N) of ``GaussianDpEvent(z)`` the RDP ``alpha / (2 z^2)`` of
    sensitivity C, a quarter of the replace-one value (google/differential-privacy#378)."""
    from dp_accounting import NeighboringRelation as Rel
    from dp_accounting import dp_event as ev
    from dp_accounting.rdp import RdpAccountant

    full = RdpAccountant([2.0], Rel.REPLACE_ONE)
    full.compose(ev.SampledWithoutReplacementDpEvent(1, 1, ev.GaussianDpEvent(1.0)))
    plain = RdpAccountant([2.0], Rel.ADD_OR_REMOVE_ONE)
    plain.compose(ev.GaussianDpEvent(1.0))
    return full.get_epsilon(0.5) > 2.0 * plain.get_epsilon(0.5)


def replace_one_multiplier(noise_multiplier: float) -> float:
    """The noise multiplier to give dp-accounting's ``GaussianDpEvent`` inside a
    ``SampledWithoutReplacementDpEvent`` (replace-one) for noise std ``z C`` on a sum of
    updates clipped to C: ``z / 2`` (std over the sensitivity 2 C) unless the installed
    library already accounts the factor 2 itself, then ``z``."""
    z = float(noise_multiplier)
    return z if _library_accounts_replace_sensitivity() else z / 2.0


class _QuietConvergence(logging.Filter):
    """Drops dp-accounting's warning that one fractional RDP order did not converge: the
    library then leaves that order out of the minimum, so epsilon is still an upper bound."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    log, flt = logging.getLogger("absl"), _QuietConvergence()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


class Accountant:
    """The steps accounted so far: runs of (sampling, noise multiplier, count), in order.

    All steps must share one adjacency (one ``dp.sampling``); epsilon is recomputed by
    dp-accounting from the whole history when asked (cached until the next step).
    """

    def __init__(self) -> None:
        self.history: list[tuple[Sampling, float, int]] = []
        self.steps = 0
        self._cache: tuple[tuple, float, float] | None = None

    @property
    def adjacency(self) -> str | None:
        """The adjacency of the steps so far (None before the first)."""
        return self.history[0][0].adjacency if self.history else None

    def step(self, sampling: Sampling, noise_multiplier: float, count: int = 1) -> None:
        """Account ``count`` more steps of ``sampling`` with noise multiplier z."""
        if count < 0:
            raise ValueError(f"steps = {count}: must be >= 0")
        if self.history and sampling.adjacency != self.adjacency:
            raise ConfigError(
                f"config key 'dp.sampling' = {sampling.mode!r}: the steps accounted so far are "
                f"under {self.adjacency} adjacency; one run cannot mix the two"
            )
        z = float(noise_multiplier)
        if self.history and self.history[-1][:2] == (sampling, z):
            s, _, c = self.history[-1]
            self.history[-1] = (s, z, c + count)
        else:
            self.history.append((sampling, z, count))
        self.steps += count

    def dp_event(self):
        """Everything accounted, as one dp-accounting ``ComposedDpEvent``."""
        from dp_accounting import dp_event as ev

        return ev.ComposedDpEvent(
            [ev.SelfComposedDpEvent(s.event(z), c) for s, z, c in self.history]
        )

    def epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of every step so far (0 before the first, inf without
        noise), from dp-accounting's ``RdpAccountant`` under the steps' adjacency."""
        if not 0.0 < delta < 1.0:
            raise ConfigError(f"config key 'dp.delta' = {delta!r}: must be > 0 and < 1")
        if self.steps == 0:
            return 0.0
        if any(z <= 0 and c > 0 for _, z, c in self.history):
            return math.inf
        key = tuple(self.history)
        if self._cache is not None and self._cache[:2] == (key, delta):
            return self._cache[2]
        from dp_accounting import NeighboringRelation as Rel
        from dp_accounting.rdp import RdpAccountant

        rel = Rel.REPLACE_ONE if self.adjacency == REPLACE_ONE else Rel.ADD_OR_REMOVE_ONE
        acc = RdpAccountant(neighboring_relation=rel)
        with _quiet_absl():
            acc.compose(self.dp_event())
            eps = float(acc.get_epsilon(delta))
        self._cache = (key, delta, eps)
        return eps

    def state_dict(self) -> dict:
        """Plain values for a checkpoint: ``history`` as ``[mode, devices, sample_size, rate,
        noise_multiplier, count]`` rows, and ``steps``."""
        rows = [[s.mode, s.devices, s.sample_size, s.rate, z, c] for s, z, c in self.history]
        return {"history": rows, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        history = []
        for mode, n, m, q, z, c in state["history"]:
            s = Sampling(str(mode), int(n), int(m), float(q))
            if s.mode not in SAMPLINGS:
                raise ValueError(f"accountant state: unknown sampling {s.mode!r}")
            history.append((s, float(z), int(c)))
        if len({s.adjacency for s, _, _ in history}) > 1:
            raise ValueError("accountant state: steps of both adjacencies")
        steps = int(state["steps"])
        if steps != sum(c for _, _, c in history):
            raise ValueError("accountant state: steps and history disagree")
        self.history, self.steps, self._cache = history, steps, None


def dp_accounting_version() -> str:
    """The installed dp-accounting's version (for the run summary)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dp-accounting")
    except PackageNotFoundError:  # (imported from a source tree)
        return "unknown"


__all__ = [
    "ADD_OR_REMOVE_ONE",
    "Accountant",
    "FIXED",
    "POISSON",
    "REPLACE_ONE",
    "SAMPLINGS",
    "Sampling",
    "dp_accounting_version",
    "replace_one_multiplier",
]
