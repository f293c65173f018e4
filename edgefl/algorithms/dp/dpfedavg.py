"""Client-level differential privacy at the coordinator: DP-FedAvg, accounted with
dp-accounting (:mod:`.accounting`).

Mechanism (DP-FedAvg, McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018): every device's delta is clipped to L2 norm at most
``C`` (``dp.clip``), the clipped deltas are summed, Gaussian noise of standard deviation
``z C`` per coordinate is added to the sum (``z`` = ``dp.noise_multiplier``), and the result
is divided by the public constant ``D`` of the sampling (:attr:`.Sampling.denominator`: the
m devices drawn per step with ``dp.sampling = "fixed"``, the expected q N with
``"poisson"``), never by the number of updates that arrived. With every drawn device
reporting (fixed mode), that is the mean of the clipped deltas plus noise of std ``z C / m``.
The noise stream is a pure function of the run seed and the aggregation step
(:func:`edgefl.seeding.derive_seed`).

A step without any update (no drawn device could train, or every one was lost) is still a
step: the noise alone is released (``0 + N(0, (z C)^2)``, divided by ``D``) and accounted.
Under Poisson sampling this is what the accounted mechanism does on an empty sample, and
skipping the release would tell whether the sample was empty, which the add/remove analysis
does not cover; fixed-size sampling is handled the same way so that every draw is one step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgefl.algorithms.robust.rules import l2_norm
from edgefl.config import checks
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Aggregator, Update
from edgefl.policies.consistency import sample_size
from edgefl.seeding import derive_seed

from .accounting import (
    FIXED,
    POISSON,
    SAMPLINGS,
    Accountant,
    Sampling,
    dp_accounting_version,
)

# stream purpose of the DP noise (last part of derive_seed's key, after the step)
DP_NOISE = 0xD9

# Aggregations DP-FedAvg may replace (it always averages the clipped updates uniformly).
DP_COMPATIBLE_AGGREGATIONS = ("mean", "sample-weighted")


def config_sampling(cfg: dict) -> Sampling:
    """The :class:`.Sampling` of a full config: ``dp.sampling``, ``fleet.devices`` (N),
    ``server.participation`` (q) and ``server.min_devices`` (fixed: m = the BSP round size,
    :func:`edgefl.policies.consistency.sample_size`)."""
    mode = cfg["dp"].get("sampling", FIXED)
    srv, n = cfg["server"], cfg["fleet"]["devices"]
    if mode == POISSON:
        q = checks.number("server.participation", srv["participation"])
        return Sampling.poisson(n, q)
    if mode != FIXED:
        raise ConfigError(
            f"config key 'dp.sampling' = {mode!r}: expected one of {', '.join(SAMPLINGS)}"
        )
    return Sampling.fixed(n, sample_size(n, srv["participation"], min(srv["min_devices"], n)))


class DPFedAvg(Aggregator):
    """Clipped sum plus Gaussian noise over a public denominator (DP-FedAvg), with its
    accountant.

    Args:
        clip: per-update L2 clip norm C (``dp.clip``, units of the model parameters), > 0.
        noise_multiplier: z (``dp.noise_multiplier``), >= 0; noise std on the sum is ``z C``.
            0 = no noise (clipping only; epsilon is inf).
        delta: the delta at which epsilon is reported (``dp.delta``), 0 < delta < 1
            (default 1e-5).
        sampling: how each step's devices are drawn (:class:`.Sampling`; sets the
            denominator and the accounted event). None (default): the updates of each step
            are the whole population (no sampling): the denominator is their number n and a
            step is accounted as ``Sampling.fixed(n, n)`` (replace-one).
        seed: run seed (``seed``); the noise of step t is drawn from
            ``derive_seed(seed, t, DP_NOISE)``.

    Restore :meth:`state_dict` on resume, or the noise stream and the accountant restart.
    """

    name = "dp-mean"

    def __init__(
        self,
        clip: float,
        noise_multiplier: float,
        delta: float = 1e-5,
        sampling: Sampling | None = None,
        seed: int = 0,
    ) -> None:
        self.clip = checks.positive("dp.clip", clip)
        self.noise_multiplier = checks.number("dp.noise_multiplier", noise_multiplier)
        if self.noise_multiplier < 0:
            raise ConfigError(
                f"config key 'dp.noise_multiplier' = {noise_multiplier!r}: must be >= 0"
            )
        self.delta = checks.number("dp.delta", delta)
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"config key 'dp.delta' = {delta!r}: must be > 0 and < 1")
        if sampling is not None and not isinstance(sampling, Sampling):
            raise TypeError(f"sampling: expected a Sampling or None, got {sampling!r}")
        self.sampling = sampling
        self.seed = int(seed)
        self.accountant = Accountant()
        self.last_clipped: list[int] = []
        self.last_noise_std = 0.0

    @classmethod
    def from_config(cls, cfg: dict) -> DPFedAvg:
        """Build from a full config: ``dp.*``, ``seed`` and the sampling
        (:func:`config_sampling`). ConfigError when ``algorithm.aggregation`` is not one
        DP-FedAvg can stand in for (mean, sample-weighted), and for a norm bound
        (``robust.norm_bound*``) with ``dp.sampling = "poisson"``: the bound's filter drops
        a step whose updates it all rejects, and a step not released is not the accounted
        mechanism."""
        agg = cfg["algorithm"]["aggregation"]
        if agg not in DP_COMPATIBLE_AGGREGATIONS:
            raise ConfigError(
                f"config key 'algorithm.aggregation' = {agg!r}: client-level DP averages the "
                f"clipped updates; expected one of {', '.join(DP_COMPATIBLE_AGGREGATIONS)}"
            )
        sampling = config_sampling(cfg)
        robust = cfg.get("robust", {})
        for key in ("norm_bound", "norm_bound_relative"):
            if sampling.mode == POISSON and robust.get(key, 0.0):
                raise ConfigError(
                    f"config key 'robust.{key}' = {robust[key]!r}: not with dp.sampling = "
                    "'poisson' (a step whose updates the bound all rejects would not be "
                    "released, which the Poisson accounting does not model)"
                )
        dp = cfg["dp"]
        return cls(dp["clip"], dp["noise_multiplier"], dp["delta"], sampling, cfg["seed"])

    @property
    def steps(self) -> int:
        """Aggregation steps taken (each one is a released noisy sum)."""
        return self.accountant.steps

    def aggregate(self, updates: Sequence[Update], out: np.ndarray | None = None) -> np.ndarray:
        """As :meth:`Aggregator.aggregate`; also for a step without updates (the noise
        alone, see the module docstring), which needs ``out`` (model-sized) and a
        :attr:`sampling`."""
        if updates:
            return super().aggregate(updates, out)
        if out is None or self.sampling is None:
            raise ValueError("dp: a step without updates needs out= and a sampling")
        acc = self._release(np.zeros(out.size, np.float64), 0)
        np.copyto(out, acc, casting="same_kind")
        return out

    def combine(self, ordered: list[Update]) -> np.ndarray:
        c = self.clip
        acc = np.zeros(ordered[0].delta.size, np.float64)
        clipped = []
        for u in ordered:
            norm = l2_norm(u.delta)
            if not math.isfinite(norm):
                raise ValueError(
                    f"dp: update of device {u.device} is not finite (filter updates first)"
                )
            if norm > c:
                acc += np.multiply(u.delta, c / norm, dtype=np.float64)
                clipped.append(u.device)
            else:
                acc += u.delta
        self.last_clipped = clipped
        return self._release(acc, len(ordered))

    def _release(self, acc: np.ndarray, n: int) -> np.ndarray:
        """(clipped sum ``acc`` of ``n`` updates + noise) / denominator, and one step."""
        sampling = self.sampling or Sampling.fixed(n, n)
        denom = sampling.denominator
        acc /= denom
        std = self.noise_multiplier * self.clip / denom
        if std > 0:
            rng = np.random.default_rng(derive_seed(self.seed, self.steps, DP_NOISE))
            acc += std * rng.standard_normal(acc.size)
        self.accountant.step(sampling, self.noise_multiplier)
        self.last_noise_std = std
        if n == 0:
            self.last_clipped = []
        return acc

    def epsilon(self) -> float:
        """Epsilon spent so far at :attr:`delta` (0 before the first step, inf without
        noise), from dp-accounting (:meth:`.Accountant.epsilon`)."""
        return self.accountant.epsilon(self.delta)

    def summary(self) -> dict:
        """What was accounted, for the run summary: epsilon, delta, steps, the sampling,
        the adjacency, the event and the library."""
        s = self.sampling
        return {
            "dp": {
                "epsilon": self.epsilon(),
                "delta": self.delta,
                "steps": self.steps,
                "sampling": s.mode if s else "none",
                "adjacency": self.accountant.adjacency or (s.adjacency if s else None),
                "event": s.describe(self.noise_multiplier) if s else None,
                "accountant": f"dp-accounting {dp_accounting_version()} RdpAccountant",
            }
        }

    def state_dict(self) -> dict:
        """Plain values for a checkpoint (the accountant; its step count keys the noise)."""
        return {"accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned. A checkpoint of an edgefl whose
        accountant kept only Rényi values (``orders``/``rdp``) has its steps re-accounted
        with this run's sampling and noise multiplier. ConfigError when the checkpoint's
        steps are under the other adjacency (``dp.sampling`` changed)."""
        st = state["accountant"]
        acc = Accountant()
        if "history" in st:
            acc.load_state_dict(st)
        elif int(st.get("steps", 0)) > 0:
            if self.sampling is None:
                raise ValueError("dp: an old accountant state needs a sampling to re-account")
            acc.step(self.sampling, self.noise_multiplier, int(st["steps"]))
        mine = self.sampling.adjacency if self.sampling is not None else None
        if mine is not None and acc.adjacency not in (None, mine):
            raise ConfigError(
                f"config key 'dp.sampling' = {self.sampling.mode!r}: the checkpoint's "
                f"{acc.steps} steps are accounted under {acc.adjacency} adjacency; resume "
                "with the dp.sampling it was written with"
            )
        self.accountant = acc


__all__ = [
    "DP_COMPATIBLE_AGGREGATIONS",
    "DP_NOISE",
    "DPFedAvg",
    "config_sampling",
]
