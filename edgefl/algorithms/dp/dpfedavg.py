"""Client-level differential privacy at the coordinator, with a Rényi-DP accountant.

Mechanism (DP-FedAvg, McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018): every device's delta is clipped to L2 norm at most
``C`` (``dp.clip``), the clipped deltas are averaged with equal weights over the ``n``
updates of the step, and Gaussian noise with standard deviation ``z * C / n`` per coordinate
is added to the mean (``z`` = ``dp.noise_multiplier``). Equivalently, the *sum* of the
clipped deltas, whose sensitivity to adding or removing one device is ``C``, gets noise
``N(0, (z C)^2)``: a Gaussian mechanism with noise multiplier ``z``. The noise stream is a
pure function of the run seed and the aggregation step (:func:`edgefl.seeding.derive_seed`).

Accountant: each aggregation step is the Poisson-subsampled Gaussian mechanism with sampling
rate ``q`` (the fraction of devices taking part, ``server.participation``) and noise
multiplier ``z``, under add/remove-one-device adjacency. Its Rényi DP at integer order
``alpha >= 2`` is exactly (Mironov, Talwar, Zhang, "Rényi Differential Privacy of the
Sampled Gaussian Mechanism", 2019, Section 3.3)::

    RDP(alpha) = log(A_alpha) / (alpha - 1),
    A_alpha = sum_{k=0}^{alpha} C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 z^2))

which for ``q = 1`` reduces to the Gaussian mechanism's ``alpha / (2 z^2)`` (Mironov, "Rényi
Differential Privacy", CSF 2017). Steps compose by adding RDP order by order; the total is
converted to (epsilon, delta)-DP by minimising over the orders either the classic bound
``eps = RDP(alpha) + log(1/delta) / (alpha - 1)`` (Mironov 2017, Prop. 3) or the tighter
``eps = RDP(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha) / (alpha - 1)``
(Balle, Barthe, Gaboardi, Hsu, Sato, "Hypothesis Testing Interpretations and Rényi
Differential Privacy", AISTATS 2020, Thm. 21), the default. Both are upper bounds on the true
epsilon; restricting to integer orders only loosens them slightly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from edgefl.algorithms.robust.rules import l2_norm
from edgefl.config import checks
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Aggregator, Update
from edgefl.seeding import derive_seed

# stream purpose of the DP noise (last part of derive_seed's key, after the step)
DP_NOISE = 0xD9

# Integer Rényi orders tried by the accountant.
DEFAULT_ORDERS: tuple[int, ...] = tuple(range(2, 257))

CONVERSIONS = ("balle2020", "classic")

# Aggregations DP-FedAvg may replace (it always averages the clipped updates uniformly).
DP_COMPATIBLE_AGGREGATIONS = ("mean", "sample-weighted")


def _check_orders(orders: Sequence[int]) -> np.ndarray:
    a = np.asarray(list(orders))
    if a.size == 0 or a.dtype.kind not in "iu" or (a < 2).any():
        raise ValueError(f"Rényi orders must be integers >= 2, got {list(orders)[:5]}...")
    return a.astype(np.int64)


def _check_rate(q: float) -> float:
    q = float(q)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate {q!r}: must be in [0, 1]")
    return q


def rdp_gaussian(noise_multiplier: float, orders: Sequence[int] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of one Gaussian mechanism (sensitivity 1, std ``noise_multiplier``) at ``orders``:
    ``alpha / (2 z^2)`` (inf when z = 0)."""
    a = _check_orders(orders).astype(np.float64)
    z = float(noise_multiplier)
    if z <= 0:
        return np.full(a.shape, math.inf)
    return a / (2.0 * z * z)


def rdp_subsampled_gaussian(
    sample_rate: float, noise_multiplier: float, orders: Sequence[int] = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism at integer ``orders``.

    Args:
        sample_rate: probability q that a device takes part in the step, 0 <= q <= 1.
        noise_multiplier: z, noise std divided by the sensitivity (the clip norm), >= 0.
        orders: integer Rényi orders alpha >= 2 (default 2..256).

    Returns the RDP epsilon at each order (float64; inf everywhere when z = 0 and q > 0).
    """
    q = _check_rate(sample_rate)
    a = _check_orders(orders)
    z = float(noise_multiplier)
    if q == 0.0:
        return np.zeros(a.shape)
    if z <= 0:
        return np.full(a.shape, math.inf)
    if q == 1.0:
        return rdp_gaussian(z, a)
    from scipy.special import gammaln, logsumexp  # (here: scipy costs every rank 0.2 s)

    log_q, log_1q = math.log(q), math.log1p(-q)
    out = np.empty(a.shape, np.float64)
    for i, alpha in enumerate(a.tolist()):
        k = np.arange(alpha + 1, dtype=np.float64)
        log_terms = (
            gammaln(alpha + 1.0)
            - gammaln(k + 1.0)
            - gammaln(alpha - k + 1.0)
            + (alpha - k) * log_1q
            + k * log_q
            + (k * k - k) / (2.0 * z * z)
        )
        out[i] = max(float(logsumexp(log_terms)), 0.0) / (alpha - 1)
    return out


def epsilon_from_rdp(
    rdp: Sequence[float] | np.ndarray,
    orders: Sequence[int],
    delta: float,
    conversion: str = "balle2020",
) -> tuple[float, int]:
    """Smallest epsilon over the orders for which the RDP curve gives (epsilon, delta)-DP.

    Args:
        rdp: accumulated RDP epsilon at each order.
        orders: the integer orders (alpha >= 2) of ``rdp``.
        delta: target delta, 0 < delta < 1 (``dp.delta``).
        conversion: ``"balle2020"`` (default, tighter) or ``"classic"`` (Mironov 2017).

    Returns (epsilon, the order that attains it; the smallest such order on ties).
    """
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"config key 'dp.delta' = {delta!r}: must be > 0 and < 1")
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion {conversion!r}: expected one of {', '.join(CONVERSIONS)}")
    a = _check_orders(orders).astype(np.float64)
    r = np.asarray(rdp, np.float64)
    if r.shape != a.shape:
        raise ValueError(f"{r.size} RDP values for {a.size} orders")
    if conversion == "classic":
        eps = r + math.log(1.0 / delta) / (a - 1.0)
    else:
        eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
    eps = np.maximum(eps, 0.0)
    i = int(np.argmin(eps))  # first minimum = smallest order
    return float(eps[i]), int(a[i])


class RDPAccountant:
    """Accumulates the RDP of a sequence of subsampled Gaussian steps.

    Args:
        orders: integer Rényi orders tracked (default 2..256).
    """

    def __init__(self, orders: Sequence[int] = DEFAULT_ORDERS) -> None:
        self.orders = tuple(int(x) for x in _check_orders(orders))
        self.rdp = np.zeros(len(self.orders))
        self.steps = 0
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Account for ``steps`` steps with noise multiplier z and sampling rate q."""
        if steps < 0:
            raise ValueError(f"steps = {steps}: must be >= 0")
        key = (float(noise_multiplier), float(sample_rate))
        per = self._cache.get(key)
        if per is None:
            per = rdp_subsampled_gaussian(key[1], key[0], self.orders)
            self._cache[key] = per
        self.rdp = self.rdp + steps * per
        self.steps += steps

    def epsilon(self, delta: float, conversion: str = "balle2020") -> tuple[float, int]:
        """(epsilon, best order) of everything accounted so far at ``delta``."""
        if self.steps == 0:
            return 0.0, self.orders[0]
        return epsilon_from_rdp(self.rdp, self.orders, delta, conversion)

    def state_dict(self) -> dict:
        """Plain values for a checkpoint (orders, accumulated RDP, steps)."""
        return {"orders": list(self.orders), "rdp": self.rdp.tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        orders = tuple(int(x) for x in state["orders"])
        rdp = np.asarray(state["rdp"], np.float64)
        if rdp.shape != (len(orders),):
            raise ValueError("accountant state: rdp and orders differ in length")
        self.orders, self.rdp, self.steps = orders, rdp, int(state["steps"])


class DPFedAvg(Aggregator):
    """Uniform mean of clipped updates plus Gaussian noise (DP-FedAvg), with its accountant.

    Args:
        clip: per-update L2 clip norm C (``dp.clip``, units of the model parameters), > 0.
        noise_multiplier: z (``dp.noise_multiplier``), >= 0; noise std on the mean is
            ``z * C / n`` for n updates. 0 = no noise (clipping only; epsilon is inf).
        delta: the delta at which epsilon is reported (``dp.delta``), 0 < delta < 1
            (default 1e-5).
        sample_rate: fraction q of devices that take part in a step, 0 < q <= 1 (default 1;
            ``server.participation``).
        seed: run seed (``seed``); the noise of step t is drawn from
            ``derive_seed(seed, t, DP_NOISE)``.
        orders: Rényi orders of the accountant (default 2..256).

    The update count n is treated as public (it is in the coordinator's log). Restore
    :meth:`state_dict` on resume, or the noise stream and the accountant restart.
    """

    name = "dp-mean"

    def __init__(
        self,
        clip: float,
        noise_multiplier: float,
        delta: float = 1e-5,
        sample_rate: float = 1.0,
        seed: int = 0,
        orders: Sequence[int] = DEFAULT_ORDERS,
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
        q = checks.number("server.participation", sample_rate)
        if not 0.0 < q <= 1.0:
            raise ConfigError(
                f"config key 'server.participation' = {sample_rate!r}: must be > 0 and <= 1"
            )
        self.sample_rate = q
        self.seed = int(seed)
        self.accountant = RDPAccountant(orders)
        self.last_clipped: list[int] = []
        self.last_noise_std = 0.0

    @classmethod
    def from_config(cls, cfg: dict) -> DPFedAvg:
        """Build from a full config: ``dp.clip``, ``dp.noise_multiplier``, ``dp.delta``,
        ``seed`` and ``server.participation``; ConfigError when ``algorithm.aggregation`` is
        not one DP-FedAvg can stand in for (mean, sample-weighted)."""
        agg = cfg["algorithm"]["aggregation"]
        if agg not in DP_COMPATIBLE_AGGREGATIONS:
            raise ConfigError(
                f"config key 'algorithm.aggregation' = {agg!r}: client-level DP averages the "
                f"clipped updates; expected one of {', '.join(DP_COMPATIBLE_AGGREGATIONS)}"
            )
        dp = cfg["dp"]
        return cls(
            dp["clip"],
            dp["noise_multiplier"],
            dp["delta"],
            cfg["server"]["participation"],
            cfg["seed"],
        )

    @property
    def steps(self) -> int:
        """Aggregation steps taken (each one is a released noisy mean)."""
        return self.accountant.steps

    def combine(self, ordered: list[Update]) -> np.ndarray:
        n = len(ordered)
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
        acc /= n
        std = self.noise_multiplier * c / n
        if std > 0:
            rng = np.random.default_rng(derive_seed(self.seed, self.steps, DP_NOISE))
            acc += std * rng.standard_normal(acc.size)
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.last_clipped = clipped
        self.last_noise_std = std
        return acc

    def epsilon(self, conversion: str = "balle2020") -> float:
        """Epsilon spent so far at :attr:`delta` (0 before the first step, inf without noise)."""
        return self.accountant.epsilon(self.delta, conversion)[0]

    def state_dict(self) -> dict:
        """Plain values for a checkpoint (the accountant; its step count keys the noise)."""
        return {"accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.accountant.load_state_dict(state["accountant"])


__all__ = [
    "CONVERSIONS",
    "DEFAULT_ORDERS",
    "DP_COMPATIBLE_AGGREGATIONS",
    "DP_NOISE",
    "DPFedAvg",
    "RDPAccountant",
    "epsilon_from_rdp",
    "rdp_gaussian",
    "rdp_subsampled_gaussian",
]
