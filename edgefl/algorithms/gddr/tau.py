"""Adaptive GDDR delay: the coordinator picks tau from how fast the global gradient changes.

Withheld coordinates reach the model up to tau steps late. That is harmless while the
gradient changes slowly relative to tau steps and destabilising when it changes fast
(see ``docs/gddr.md``, the quadratic demo: tau = 20 diverged in the original description).
:class:`AdaptiveTau` shortens tau when the gradient accelerates and lengthens it when the
gradient is stable, always within [``gddr.tau_min``, ``gddr.tau_max``].

Signal: every update message carries the L2 norm of the device's update
(:attr:`edgefl.algorithms.gddr.residual.Release.norm`). Once per coordinator step (a BSP round, or
every few messages under SSP/ASP) the controller gets that step's norms and computes, in
float64:

    n_t   = mean of the norms (summed in ascending order)
    m_t   = beta * m_{t-1} + (1 - beta) * n_t            (EMA of the norm; m_0 = n_0)
    c_t   = |m_t - m_{t-1}| / m_{t-1}                     (relative change per step)
    rho_t = beta * rho_{t-1} + (1 - beta) * c_t           (EMA of the rate; rho_0 = 0)

rho is the relative drift of the gradient scale per step. A value held tau steps is stale by
about tau * rho, so the controller aims for ``target = floor(drift_budget / rho)`` clipped to
the bounds (tau_max when rho = 0). It moves down to a lower target at once (safety first) and
up by one only after ``patience`` consecutive steps with a higher target (no oscillation).
Deterministic: the output is a pure function of the sequence of inputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from edgefl.algorithms.gddr.residual import check_tau
from edgefl.errors import ConfigError


def check_tau_bounds(tau_min: int, tau_max: int) -> tuple[int, int]:
    """``gddr.tau_min`` and ``gddr.tau_max``: ints, 1 <= tau_min <= tau_max."""
    lo = check_tau(tau_min, "gddr.tau_min")
    hi = check_tau(tau_max, "gddr.tau_max")
    if hi < lo:
        raise ConfigError(
            f"config key 'gddr.tau_max' = {tau_max!r}: must be >= gddr.tau_min ({tau_min})"
        )
    return lo, hi


class FixedTau:
    """tau never changes (``gddr.adaptive = false``); same interface as :class:`AdaptiveTau`.

    Args:
        tau: ``gddr.tau`` (default 4).
    """

    def __init__(self, tau: int = 4) -> None:
        self.tau = check_tau(tau)

    def update(self, norms: Iterable[float]) -> int:
        """Ignores ``norms``; returns tau."""
        return self.tau

    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tau = check_tau(int(state["tau"]))


class AdaptiveTau:
    """Coordinator-side tau controller (see the module docstring for the rule).

    Args:
        tau: ``gddr.tau``, the starting tau (default 4; clipped into the bounds).
        tau_min: ``gddr.tau_min`` (default 2).
        tau_max: ``gddr.tau_max`` (default 8).
        smoothing: beta of both EMAs, 0 <= beta < 1 (default 0.8; about a 5-step memory).
        drift_budget: tolerated relative drift of the gradient scale over tau steps
            (default 0.2: at 5% drift per step tau = 4).
        patience: consecutive steps with a higher target before tau grows by one (default 3).
    """

    def __init__(
        self,
        tau: int = 4,
        tau_min: int = 2,
        tau_max: int = 8,
        smoothing: float = 0.8,
        drift_budget: float = 0.2,
        patience: int = 3,
    ) -> None:
        self.tau_min, self.tau_max = check_tau_bounds(tau_min, tau_max)
        self.tau = min(max(check_tau(tau), self.tau_min), self.tau_max)
        b = float(smoothing)
        if not (0.0 <= b < 1.0):
            raise ConfigError(f"AdaptiveTau smoothing = {smoothing!r}: must be >= 0 and < 1")
        self.smoothing = b
        d = float(drift_budget)
        if not (math.isfinite(d) and d > 0):
            raise ConfigError(f"AdaptiveTau drift_budget = {drift_budget!r}: must be > 0")
        self.drift_budget = d
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"AdaptiveTau patience = {patience!r}: must be an integer >= 1")
        self.patience = patience
        self.ema: float | None = None  # m_t
        self.rate = 0.0  # rho_t
        self.steps = 0
        self._up = 0  # consecutive steps with target > tau

    def target(self) -> int:
        """tau the current rate asks for: floor(drift_budget / rho), clipped to the bounds."""
        if self.rate <= 0.0:
            return self.tau_max
        want = self.drift_budget / self.rate
        if want >= self.tau_max:
            return self.tau_max
        return max(self.tau_min, int(math.floor(want)))

    def update(self, norms: Iterable[float]) -> int:
        """Feed one coordinator step's update norms (one per message); returns the new tau.

        Norms must be finite and >= 0; an empty step changes nothing. Tell the devices when
        the returned tau differs from the previous one.
        """
        vals = sorted(float(x) for x in norms)
        if not vals:
            return self.tau
        if any(not math.isfinite(v) or v < 0 for v in vals):
            raise ValueError(f"AdaptiveTau: norms must be finite and >= 0, got {vals}")
        n = math.fsum(vals) / len(vals)
        b = self.smoothing
        self.steps += 1
        if self.ema is None:
            self.ema = n
            return self.tau
        prev = self.ema
        self.ema = b * prev + (1.0 - b) * n
        change = abs(self.ema - prev) / prev if prev > 0 else (0.0 if self.ema == 0 else 1.0)
        self.rate = b * self.rate + (1.0 - b) * change
        want = self.target()
        if want < self.tau:
            self.tau = want
            self._up = 0
        elif want > self.tau:
            self._up += 1
            if self._up >= self.patience:
                self.tau += 1
                self._up = 0
        else:
            self._up = 0
        return self.tau

    def state_dict(self) -> dict[str, Any]:
        """Controller state (tau, EMAs, counters) for coordinator checkpoints."""
        return {
            "tau": self.tau,
            "tau_min": self.tau_min,
            "tau_max": self.tau_max,
            "ema": self.ema,
            "rate": self.rate,
            "steps": self.steps,
            "up": self._up,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (bounds must match this controller's)."""
        if (int(state["tau_min"]), int(state["tau_max"])) != (self.tau_min, self.tau_max):
            raise ValueError(
                f"AdaptiveTau state has bounds [{state['tau_min']}, {state['tau_max']}], "
                f"this controller [{self.tau_min}, {self.tau_max}]"
            )
        self.tau = int(state["tau"])
        self.ema = None if state["ema"] is None else float(state["ema"])
        self.rate = float(state["rate"])
        self.steps = int(state["steps"])
        self._up = int(state["up"])


def make_tau_controller(
    adaptive: bool, tau: int = 4, tau_min: int = 2, tau_max: int = 8
) -> FixedTau | AdaptiveTau:
    """The controller for config ``gddr.adaptive``, ``gddr.tau``, ``gddr.tau_min/max``."""
    if not isinstance(adaptive, bool):
        raise ConfigError(f"config key 'gddr.adaptive' = {adaptive!r}: must be true or false")
    if adaptive:
        return AdaptiveTau(tau=tau, tau_min=tau_min, tau_max=tau_max)
    return FixedTau(tau)
