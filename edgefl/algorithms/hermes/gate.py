"""Worker-side push gates: after each local iteration, decide whether to push now (pure, no MPI).

A gate sees one number per local iteration, the loss of the device's current local model on a
held-out split of its own data, and answers "push now" or "keep training". ``AlwaysGate``
pushes after every iteration (the classic BSP/ASP/SSP behaviour). ``HermesGUP`` is the
generalization update policy of Hermes (Basani, Vivek, Krishna, Paul, "When Less is More:
Achieving Faster Convergence in Distributed Edge Machine Learning", HiPC 2024,
arXiv:2410.20495): it pushes only when the newest loss is a statistically significant
improvement over the recent ones (a *major update*).

The rule, as in the authors' public worker code (DaSH-Lab-CSIS/Hermes, ``worker.py``):

1. append the loss L to a window holding at most ``window`` losses (oldest dropped first; L
   itself is in the window);
2. with fewer than 2 losses there is no decision (minor update);
3. z = (L - mean(window)) / std(window), population std (numpy ``std`` with ddof=0);
4. major update when z <= alpha (alpha < 0): push, clear the window, reset the minor counter;
5. otherwise a minor update: the counter grows by one and, once it has reached ``lam``, the
   threshold relaxes toward 0: alpha <- min(0, alpha * (1 - beta)). The minor update that
   brings the counter to ``lam`` already relaxes (the authors increment, then compare with >=).

Zero spread (all losses in the window equal) is a minor update; the authors' code divides by
zero there, this one does not.

By Samuelson's inequality (Samuelson, JASA 1968) no value of an n-item sample lies more than
sqrt(n - 1) population standard deviations from the sample mean, so z >= -sqrt(n - 1) whenever
the current loss is one of the n items. A threshold alpha can therefore fire only once the
window holds at least ``min_losses_for(alpha)`` = ceil(1 + alpha^2) losses: 3 for the default
-1.3, 4 for -1.6, 2 for -0.9. See :func:`max_z_possible`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefl.config import checks
from edgefl.errors import ConfigError

TESTS = ("zscore", "percentile")


def max_z_possible(n: int) -> float:
    """The most negative z-score a value can have within an ``n``-item sample containing it.

    Equals -sqrt(n - 1) (Samuelson's inequality, population std); reached when the value is
    the unique minimum and all other n - 1 items are equal. Raises ``ValueError`` for n < 1.
    (Named after the issue's wording: it bounds how strong a major update can possibly be.)
    """
    if n < 1:
        raise ValueError(f"max_z_possible needs n >= 1, got {n}")
    return -math.sqrt(n - 1)


def min_losses_for(alpha: float) -> int:
    """Fewest losses since the last push for which z <= ``alpha`` is possible: ceil(1 + alpha^2).

    Never below 2 (with one loss there is no spread). Exact boundary cases (alpha^2 an integer,
    e.g. alpha = -1) fire only when the other losses are exactly equal.
    """
    return max(2, math.ceil(1.0 + float(alpha) ** 2 - 1e-12))


def min_losses_for_percentile(p: float) -> int:
    """Fewest losses for which the percentile test at ``p`` percent can fire: ceil(100 / p)."""
    return max(2, math.ceil(100.0 / float(p) - 1e-12))


@dataclass(frozen=True)
class GateDecision:
    """What a gate decided for one local iteration (for logs and major-update markers).

    Args:
        push: True on a major update (the worker pushes now).
        loss: the held-out loss the decision was made on.
        score: z-score (``zscore`` test) or percentile rank in percent (``percentile`` test);
            NaN when no test was possible (fewer than 2 losses or zero spread).
        threshold: alpha (``zscore``) or p in percent (``percentile``) in force for this test.
        window: number of losses in the window at the test, the current one included.
    """

    push: bool
    loss: float
    score: float
    threshold: float
    window: int


class Gate(ABC):
    """Worker-side push policy. One instance per device.

    The worker calls :meth:`observe` after every local iteration with the held-out local loss
    and pushes its accumulated update (local model minus the last global model it received)
    when it returns True. ``wait_for_model`` tells the worker whether to block after a push
    until the new global model arrives (True) or to keep training its local model meanwhile.
    """

    name = "abstract"
    wait_for_model: bool = True

    @abstractmethod
    def observe(self, loss: float) -> bool:
        """Record this iteration's held-out loss; True = push now (a major update)."""

    def on_model_received(self) -> None:
        """Hook: the worker installed a new global model. Default: nothing."""

    @property
    def last(self) -> GateDecision | None:
        """The decision of the latest :meth:`observe` call (None before the first)."""
        return getattr(self, "_last", None)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (floats, ints, bools, lists) for checkpoints."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class AlwaysGate(Gate):
    """Push after every local iteration (BSP/ASP/SSP workers).

    Args:
        wait_for_model: block after each push until the new global model arrives (default True).
    """

    name = "always"

    def __init__(self, wait_for_model: bool = True) -> None:
        self.wait_for_model = checks.boolean("hermes.wait_for_model", wait_for_model)
        self.iterations = 0
        self._last: GateDecision | None = None

    def observe(self, loss: float) -> bool:
        self.iterations += 1
        self._last = GateDecision(True, float(loss), math.nan, math.nan, 0)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"iterations": self.iterations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.iterations = int(state["iterations"])


class HermesGUP(Gate):
    """Hermes' generalization update policy (see the module docstring for the exact rule).

    Args:
        alpha: z-score threshold, < 0 (``hermes.alpha``, default -1.3). The paper's runs use
            -0.9, -1.3 and -1.6; more negative = rarer, stronger pushes.
        window: most losses kept, the current one included, >= 2 (``hermes.window``, default 10).
        lam: minor updates in a row after which the threshold starts relaxing, >= 0
            (``hermes.lam``, default 5; 0 = every minor update relaxes).
        beta: relaxation factor per minor update beyond ``lam``, in [0, 1) (``hermes.beta``,
            default 0.1; 0 = never relax).
        reset_alpha: restore the configured threshold after each major update
            (``hermes.reset_alpha``, default False, as in the authors' code, where the relaxed
            threshold persists for the rest of training and pushes grow more frequent).
        test: ``"zscore"`` (default) or ``"percentile"`` (``hermes.test``).
        percentile: p in percent for the percentile test, in (0, 50] (``hermes.percentile``,
            default 10). The current loss L is a major update when its percentile rank in the
            window, 100 * #{x in window : x <= L} / n (ties count against L; scipy's
            ``percentileofscore(kind="weak")``), is <= p. Under a normal model z <= alpha
            matches rank <= 100 * Phi(alpha): Phi(-1.3) = 9.7 %, so p = 10 is the counterpart
            of alpha = -1.3. Differences: it ignores magnitudes (one outlier cannot mask an
            improvement; a tiny improvement that is the best in the window counts), and with
            n losses the smallest possible rank is 100/n, so it needs ``ceil(100 / p)`` losses
            since the last push (10 for p = 10) where the z-test needs ceil(1 + alpha^2)
            (3 for -1.3). Relaxation moves p toward the median the way alpha moves toward 0:
            p <- 50 - (50 - p) * (1 - beta).
        wait_for_model: block after a push until the new global model arrives
            (``hermes.wait_for_model``, default True, as in the paper).
    """

    name = "hermes"

    def __init__(
        self,
        alpha: float = -1.3,
        window: int = 10,
        lam: int = 5,
        beta: float = 0.1,
        reset_alpha: bool = False,
        test: str = "zscore",
        percentile: float = 10.0,
        wait_for_model: bool = True,
    ) -> None:
        alpha = checks.number("hermes.alpha", alpha)
        if not alpha < 0:
            raise ConfigError(f"config key 'hermes.alpha' = {alpha!r}: must be < 0")
        window = checks.integer("hermes.window", window, minimum=2)
        lam = checks.integer("hermes.lam", lam, minimum=0)
        beta = checks.number("hermes.beta", beta)
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"config key 'hermes.beta' = {beta!r}: must be in [0, 1)")
        if test not in TESTS:
            raise ConfigError(
                f"config key 'hermes.test' = {test!r}: expected one of " + ", ".join(TESTS)
            )
        percentile = checks.number("hermes.percentile", percentile)
        if not 0.0 < percentile <= 50.0:
            raise ConfigError(
                f"config key 'hermes.percentile' = {percentile!r}: must be in (0, 50]"
            )
        self.alpha0 = alpha
        self.window_size = window
        self.lam = lam
        self.beta = beta
        self.reset_alpha = checks.boolean("hermes.reset_alpha", reset_alpha)
        self.test = test
        self.percentile0 = percentile
        self.wait_for_model = checks.boolean("hermes.wait_for_model", wait_for_model)
        # mutable state
        self.alpha = alpha
        self.percentile = percentile
        self.window: list[float] = []
        self.minor = 0  # minor updates since the last major one
        self.iterations = 0
        self.pushes = 0
        self._last: GateDecision | None = None

    @classmethod
    def from_config(cls, hermes: Mapping[str, Any] | None = None) -> HermesGUP:
        """Build from the ``[hermes]`` config table (missing keys take the defaults)."""
        return cls(**checks.pick(hermes, _GUP_KEYS))

    @property
    def threshold(self) -> float:
        """The threshold in force: alpha (``zscore``) or p in percent (``percentile``)."""
        return self.alpha if self.test == "zscore" else self.percentile

    def observe(self, loss: float) -> bool:
        loss = float(loss)
        if not math.isfinite(loss):
            raise ValueError(f"HermesGUP.observe: loss must be finite, got {loss}")
        self.iterations += 1
        if len(self.window) >= self.window_size:
            del self.window[: len(self.window) - self.window_size + 1]
        self.window.append(loss)
        n = len(self.window)
        threshold = self.threshold
        score = math.nan
        major = False
        if n >= 2:
            w = np.asarray(self.window, dtype=np.float64)
            sd = float(w.std())
            if sd > 0 and w.max() > w.min():  # zero spread: no test, a minor update
                if self.test == "zscore":
                    score = float((loss - w.mean()) / sd)
                    major = score <= threshold
                else:
                    score = 100.0 * float(np.count_nonzero(w <= loss)) / n
                    major = score <= threshold
        self._last = GateDecision(major, loss, score, threshold, n)
        if major:
            self.pushes += 1
            self.window.clear()
            self.minor = 0
            if self.reset_alpha:
                self.alpha, self.percentile = self.alpha0, self.percentile0
        else:
            self.minor += 1
            if self.minor >= self.lam:
                self.alpha = min(0.0, self.alpha * (1.0 - self.beta))
                self.percentile = min(50.0, 50.0 - (50.0 - self.percentile) * (1.0 - self.beta))
        return major

    def on_model_received(self) -> None:
        """Nothing: the window was cleared at the push; call :meth:`clear_window` to drop
        losses of a model replaced without a push (e.g. a broadcast global model)."""

    def clear_window(self) -> None:
        """Forget the losses in the window (counters and threshold stay)."""
        self.window.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "alpha": float(self.alpha),
            "percentile": float(self.percentile),
            "window": [float(x) for x in self.window],
            "minor": int(self.minor),
            "iterations": int(self.iterations),
            "pushes": int(self.pushes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        window = [float(x) for x in state["window"]]
        if len(window) > self.window_size:
            raise ValueError(
                f"HermesGUP state holds {len(window)} losses; window is {self.window_size}"
            )
        self.alpha = float(state["alpha"])
        self.percentile = float(state["percentile"])
        self.window = window
        self.minor = int(state["minor"])
        self.iterations = int(state["iterations"])
        self.pushes = int(state["pushes"])


GATES = ("always", "hermes")
_GUP_KEYS = (
    "alpha",
    "window",
    "lam",
    "beta",
    "reset_alpha",
    "test",
    "percentile",
    "wait_for_model",
)


def make_gate(name: str, hermes: Mapping[str, Any] | None = None) -> Gate:
    """Gate by config name (``algorithm.gate``: always | hermes) and the ``[hermes]`` table."""
    if name == "always":
        wait = (hermes or {}).get("wait_for_model", True)
        return AlwaysGate(wait_for_model=wait)
    if name == "hermes":
        return HermesGUP.from_config(hermes)
    raise ConfigError(
        f"config key 'algorithm.gate' = {name!r}: expected one of " + ", ".join(GATES)
    )
