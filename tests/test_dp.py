"""Client-level DP: the DP-FedAvg aggregator and the Rényi-DP accountant, checked against
values derived independently (closed forms, numerical integration, the exact Gaussian
mechanism)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, optimize
from scipy.stats import norm

from edgefl.algorithms.dp.dpfedavg import (
    DEFAULT_ORDERS,
    DPFedAvg,
    RDPAccountant,
    epsilon_from_rdp,
    rdp_gaussian,
    rdp_subsampled_gaussian,
)
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Update

ORDERS = np.array(DEFAULT_ORDERS)


# -- RDP of one step ------------------------------------------------------------------------
@pytest.mark.parametrize("z", [0.5, 1.0, 1.1, 4.0])
def test_full_participation_is_the_gaussian_mechanism_exactly(z):
    want = ORDERS / (2 * z * z)
    assert np.array_equal(rdp_subsampled_gaussian(1.0, z), want)
    assert np.array_equal(rdp_gaussian(z), want)
    # the binomial sum tends to the same value as q -> 1
    near = rdp_subsampled_gaussian(1 - 1e-12, z, [2, 3, 5, 10])
    np.testing.assert_allclose(near, np.array([2, 3, 5, 10]) / (2 * z * z), rtol=1e-6)


def _a_alpha_by_integration(q: float, z: float, alpha: int) -> float:
    """E_{x ~ N(0, z^2)}[((1 - q) + q exp((2x - 1) / (2 z^2)))^alpha], the moment whose log
    over (alpha - 1) is the RDP of the sampled Gaussian (mixture of N(1, z^2) over N(0, z^2))."""

    def f(x):
        # log((1 - q) + q e^t) with t = (2x - 1) / (2 z^2), computed without overflow
        t = (2 * x - 1) / (2 * z * z)
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + t)
        return math.exp(norm.logpdf(x, scale=z) + alpha * log_ratio)

    val, _ = integrate.quad(f, -30 * z, 30 * z + alpha, limit=400, epsabs=0, epsrel=1e-11)
    return val


@pytest.mark.parametrize("q, z", [(0.01, 1.0), (0.1, 1.5), (0.3, 0.8), (0.5, 2.0)])
def test_binomial_sum_matches_numerical_integration(q, z):
    orders = [2, 3, 4, 8, 16]
    got = rdp_subsampled_gaussian(q, z, orders)
    want = [math.log(_a_alpha_by_integration(q, z, a)) / (a - 1) for a in orders]
    np.testing.assert_allclose(got, want, rtol=1e-7)


def test_alpha_2_closed_form():
    # A_2 = 1 + q^2 (e^{1/z^2} - 1), from the binomial sum with alpha = 2
    for q, z in [(0.01, 1.0), (0.2, 0.7), (0.9, 3.0)]:
        want = math.log1p(q * q * math.expm1(1 / (z * z)))
        assert rdp_subsampled_gaussian(q, z, [2])[0] == pytest.approx(want, rel=1e-12)


def test_edge_cases():
    assert np.array_equal(rdp_subsampled_gaussian(0.0, 1.0), np.zeros(len(ORDERS)))
    assert np.isinf(rdp_subsampled_gaussian(0.5, 0.0)).all()
    with pytest.raises(ValueError):
        rdp_subsampled_gaussian(1.5, 1.0)
    with pytest.raises(ValueError):
        rdp_subsampled_gaussian(0.5, 1.0, [1, 2])


@settings(max_examples=40, deadline=None)
@given(
    q=st.floats(1e-4, 0.99),
    dq=st.floats(1e-3, 0.5),
    z=st.floats(0.5, 5.0),
    dz=st.floats(1e-2, 2.0),
)
def test_rdp_is_monotone_in_q_and_sigma(q, dq, z, dz):
    orders = [2, 4, 8, 32, 128]
    base = rdp_subsampled_gaussian(q, z, orders)
    more_q = rdp_subsampled_gaussian(min(q + dq, 1.0), z, orders)
    more_z = rdp_subsampled_gaussian(q, z + dz, orders)
    assert (more_q >= base * (1 - 1e-12)).all()  # sampling more often costs more privacy
    assert (more_z <= base * (1 + 1e-12)).all()  # more noise costs less
    assert (base <= np.array(orders) / (2 * z * z) * (1 + 1e-12)).all()  # subsampling helps
    assert (np.diff(base) >= -1e-12).all()  # RDP is non-decreasing in the order


# -- accounting and conversion ----------------------------------------------------------------
def test_composition_is_additive_and_epsilon_grows_with_steps():
    acc = RDPAccountant()
    acc.step(1.2, 0.05, 10)
    one = rdp_subsampled_gaussian(0.05, 1.2)
    np.testing.assert_allclose(acc.rdp, 10 * one, rtol=1e-12)
    assert acc.steps == 10
    eps = []
    for _ in range(5):
        acc.step(1.2, 0.05, 50)
        eps.append(acc.epsilon(1e-5)[0])
    assert all(b > a for a, b in zip(eps, eps[1:]))
    assert RDPAccountant().epsilon(1e-5) == (0.0, 2)  # nothing spent yet
    # a smaller delta costs more epsilon
    assert acc.epsilon(1e-8)[0] > acc.epsilon(1e-5)[0]


@pytest.mark.parametrize("z, steps, delta", [(1.0, 1, 1e-5), (2.0, 100, 1e-5), (5.0, 1000, 1e-6)])
def test_classic_epsilon_for_full_participation_matches_the_closed_form(z, steps, delta):
    acc = RDPAccountant()
    acc.step(z, 1.0, steps)
    eps, order = acc.epsilon(delta, "classic")

    # eps(alpha) = T alpha / (2 z^2) + log(1/delta) / (alpha - 1), minimised over integers
    def e(a):
        return steps * a / (2 * z * z) + math.log(1 / delta) / (a - 1)

    best = min(DEFAULT_ORDERS, key=e)
    assert order == best and eps == pytest.approx(e(best), rel=1e-12)
    # the continuous optimum: alpha* = 1 + z sqrt(2 log(1/delta) / T)
    a_star = 1 + z * math.sqrt(2 * math.log(1 / delta) / steps)
    cont = steps / (2 * z * z) + math.sqrt(2 * steps * math.log(1 / delta)) / z
    assert e(a_star) == pytest.approx(cont, rel=1e-12)
    assert cont <= eps <= cont * 1.05
    assert order in (math.floor(a_star), math.ceil(a_star)) or a_star < 2


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon of the Gaussian mechanism with sensitivity/std ratio mu (Balle & Wang,
    ICML 2018, Thm. 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""

    def gap(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps + norm.logcdf(-mu / 2 - eps / mu)) - delta

    return optimize.brentq(gap, 0.0, 500.0, xtol=1e-12)


@pytest.mark.parametrize("z, steps", [(1.0, 1), (1.0, 10), (3.0, 200), (0.8, 50)])
def test_rdp_epsilon_is_a_sound_and_reasonable_upper_bound(z, steps):
    """T Gaussian steps with noise multiplier z are one Gaussian mechanism with ratio
    sqrt(T)/z; its exact epsilon is a lower bound for any valid accountant."""
    delta = 1e-5
    exact = _exact_gaussian_epsilon(math.sqrt(steps) / z, delta)
    acc = RDPAccountant()
    acc.step(z, 1.0, steps)
    tight, _ = acc.epsilon(delta)
    classic, _ = acc.epsilon(delta, "classic")
    assert exact <= tight <= classic
    assert tight <= 1.6 * exact  # RDP conversions lose little at these settings


@settings(max_examples=40, deadline=None)
@given(
    rdp=st.lists(st.floats(0.0, 100.0), min_size=5, max_size=5),
    delta=st.floats(1e-12, 0.5),
)
def test_tighter_conversion_never_exceeds_the_classic_one(rdp, delta):
    orders = [2, 3, 10, 50, 200]
    tight = epsilon_from_rdp(rdp, orders, delta)[0]
    classic = epsilon_from_rdp(rdp, orders, delta, "classic")[0]
    assert 0.0 <= tight <= classic + 1e-12


def test_subsampling_amplifies_privacy():
    """The same 100 steps cost much less at q = 0.01 than at q = 1, and epsilon grows with q."""
    eps = []
    for q in (0.01, 0.1, 0.5, 1.0):
        acc = RDPAccountant()
        acc.step(1.0, q, 100)
        eps.append(acc.epsilon(1e-5)[0])
    assert all(b > a for a, b in zip(eps, eps[1:]))
    assert eps[0] < eps[-1] / 20


def test_accountant_state_round_trips():
    acc = RDPAccountant([2, 5, 9])
    acc.step(1.0, 0.3, 7)
    other = RDPAccountant()
    other.load_state_dict(acc.state_dict())
    assert other.orders == (2, 5, 9) and other.steps == 7
    assert other.epsilon(1e-5) == acc.epsilon(1e-5)
    with pytest.raises(ConfigError, match="'dp.delta'"):
        acc.epsilon(0.0)


# -- the DP-FedAvg aggregator --------------------------------------------------------------------
def _ups(rows, ids=None):
    ids = range(len(rows)) if ids is None else ids
    return [Update(i, np.asarray(r, np.float32), 10, 0.1) for i, r in zip(ids, rows)]


def test_without_noise_it_is_the_mean_of_clipped_updates():
    agg = DPFedAvg(clip=1.0, noise_multiplier=0.0)
    got = agg.aggregate(_ups([[3, 4], [0.3, 0.4], [0, -2]]))  # norms 5, 0.5, 2
    np.testing.assert_allclose(got, [(0.6 + 0.3 + 0) / 3, (0.8 + 0.4 - 1) / 3], rtol=1e-6)
    assert agg.last_clipped == [0, 2] and agg.last_noise_std == 0.0
    assert agg.steps == 1 and agg.epsilon() == math.inf


def test_noise_has_the_dp_fedavg_scale():
    n, d, clip, z = 8, 200_000, 0.5, 1.3
    rows = np.zeros((n, d), np.float32)
    agg = DPFedAvg(clip=clip, noise_multiplier=z, seed=11)
    noise = agg.aggregate(_ups(rows)).astype(np.float64)
    assert agg.last_noise_std == pytest.approx(z * clip / n)
    assert noise.std() == pytest.approx(z * clip / n, rel=0.01)  # 200k samples: ~0.16% error
    assert abs(noise.mean()) < 4 * z * clip / n / math.sqrt(d)


def test_noise_is_seeded_per_step_and_independent_of_arrival_order():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((6, 50))
    u = _ups(rows)
    a, b = DPFedAvg(1.0, 1.0, seed=3), DPFedAvg(1.0, 1.0, seed=3)
    first = a.aggregate(u)
    assert np.array_equal(b.aggregate(u[::-1]), first)  # bit-identical, any order
    second = a.aggregate(u)
    assert not np.array_equal(second, first)  # fresh noise every step
    assert not np.array_equal(DPFedAvg(1.0, 1.0, seed=4).aggregate(u), first)
    # a resumed aggregator continues the same noise stream
    c = DPFedAvg(1.0, 1.0, seed=3)
    c.load_state_dict(b.state_dict())
    assert np.array_equal(c.aggregate(u), b.aggregate(u))
    assert c.epsilon() == b.epsilon()


def test_epsilon_reported_by_the_aggregator():
    agg = DPFedAvg(clip=1.0, noise_multiplier=1.0, delta=1e-5, sample_rate=0.1)
    u = _ups(np.ones((3, 4)))
    for _ in range(20):
        agg.aggregate(u)
    acc = RDPAccountant()
    acc.step(1.0, 0.1, 20)
    assert agg.epsilon() == acc.epsilon(1e-5)[0] and agg.epsilon() > 0


def test_non_finite_updates_are_refused():
    agg = DPFedAvg(1.0, 1.0)
    with pytest.raises(ValueError, match="device 1"):
        agg.aggregate(_ups([[1.0, 0.0], [np.nan, 0.0], [0.0, 1.0]]))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": -1.0, "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": "1", "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": 1.0, "noise_multiplier": -0.1}, "dp.noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": math.inf}, "dp.noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 0.0}, "dp.delta"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, "dp.delta"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.0}, "server.participation"),
    ],
)
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DPFedAvg(**kwargs)


def test_from_config():
    cfg = {
        "seed": 5,
        "server": {"participation": 0.5},
        "algorithm": {"aggregation": "sample-weighted"},
        "dp": {"clip": 0.7, "noise_multiplier": 1.1, "delta": 1e-6},
    }
    agg = DPFedAvg.from_config(cfg)
    assert (agg.clip, agg.noise_multiplier, agg.delta, agg.sample_rate, agg.seed) == (
        0.7,
        1.1,
        1e-6,
        0.5,
        5,
    )
    cfg["algorithm"]["aggregation"] = "krum"
    with pytest.raises(ConfigError, match="'algorithm.aggregation' = 'krum'"):
        DPFedAvg.from_config(cfg)
