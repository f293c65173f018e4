"""Adaptive tau: bounds, direction of change, hand-computed steps, determinism, state."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.gddr.tau import AdaptiveTau, FixedTau, make_tau_controller
from edgefl.errors import ConfigError


def test_stable_gradient_lengthens_tau_with_patience():
    c = AdaptiveTau(tau=4, tau_min=2, tau_max=8, patience=3)
    taus = [c.update([1.0, 1.0]) for _ in range(16)]
    # the first step only seeds the EMA; then one step up every 3 steps of zero drift
    assert taus == [4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7, 8, 8, 8, 8]


def test_hand_computed_drop():
    c = AdaptiveTau(tau=6, tau_min=2, tau_max=8, smoothing=0.5, drift_budget=0.2)
    assert c.update([1.0]) == 6 and c.ema == 1.0 and c.rate == 0.0
    # ema = 0.5*1 + 0.5*3 = 2, change = |2 - 1| / 1 = 1, rate = 0.5*0 + 0.5*1 = 0.5
    # target = floor(0.2 / 0.5) = 0 -> clipped to tau_min 2; shortening is immediate
    assert c.update([2.0, 4.0]) == 2
    assert c.ema == pytest.approx(2.0) and c.rate == pytest.approx(0.5)
    assert c.target() == 2


def test_target_formula():
    c = AdaptiveTau(tau=4, tau_min=2, tau_max=8, drift_budget=0.2)
    for rate, want in [(0.0, 8), (0.01, 8), (0.025, 8), (0.04, 5), (0.05, 4), (0.09, 2), (1, 2)]:
        c.rate = rate
        assert c.target() == want, rate


def test_acceleration_shortens_then_stability_lengthens():
    c = AdaptiveTau(tau=4)
    seq = [1.0] * 30 + [1.0 * 1.3**k for k in range(15)] + [1.3**14] * 80
    taus = [c.update([x]) for x in seq]
    assert taus[29] == 8  # stable: tau_max
    fast = taus[30:45]
    assert min(fast) == 2  # accelerating gradient: tau_min
    assert fast.index(2) < 6  # and quickly
    assert taus[-1] == 8  # stable again: back to tau_max
    # only one step up at a time
    assert all(b - a <= 1 for a, b in zip(taus, taus[1:]))


@settings(max_examples=60, deadline=None)
@given(
    norms=st.lists(
        st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=0, max_size=5), max_size=60
    ),
    lo=st.integers(1, 5),
    span=st.integers(0, 6),
    tau=st.integers(1, 20),
)
def test_bounds_and_determinism(norms, lo, span, tau):
    hi = lo + span
    a = AdaptiveTau(tau=tau, tau_min=lo, tau_max=hi)
    b = AdaptiveTau(tau=tau, tau_min=lo, tau_max=hi)
    out_a = [a.update(step) for step in norms]
    out_b = [b.update(list(reversed(step))) for step in norms]  # arrival order is irrelevant
    assert out_a == out_b
    assert all(lo <= t <= hi for t in out_a)


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    seq = [list(rng.uniform(0.5, 2.0, 4)) for _ in range(60)]
    ref = AdaptiveTau()
    ref_out = [ref.update(s) for s in seq]
    c = AdaptiveTau()
    out = [c.update(s) for s in seq[:25]]
    d = AdaptiveTau()
    d.load_state_dict(c.state_dict())
    out += [d.update(s) for s in seq[25:]]
    assert out == ref_out
    with pytest.raises(ValueError, match="bounds"):
        AdaptiveTau(tau_min=1, tau_max=3).load_state_dict(c.state_dict())


def test_empty_step_and_bad_norms():
    c = AdaptiveTau(tau=5)
    assert c.update([]) == 5 and c.steps == 0
    with pytest.raises(ValueError, match="finite"):
        c.update([1.0, float("nan")])
    with pytest.raises(ValueError, match="finite"):
        c.update([-1.0])


def test_initial_tau_clipped_into_bounds():
    assert AdaptiveTau(tau=20, tau_min=2, tau_max=8).tau == 8
    assert AdaptiveTau(tau=1, tau_min=2, tau_max=8).tau == 2


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"tau_min": 0}, r"'gddr.tau_min' = 0: must be an integer >= 1"),
        ({"tau_max": 1.5}, r"'gddr.tau_max' = 1.5"),
        ({"tau_min": 5, "tau_max": 3}, r"'gddr.tau_max' = 3: must be >= gddr.tau_min \(5\)"),
        ({"tau": 0}, r"'gddr.tau' = 0"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"drift_budget": 0.0}, "drift_budget"),
        ({"patience": 0}, "patience"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        AdaptiveTau(**kw)


def test_fixed_and_factory():
    f = make_tau_controller(False, tau=3)
    assert isinstance(f, FixedTau) and f.update([1.0, 100.0]) == 3
    g = FixedTau(1)
    g.load_state_dict(f.state_dict())
    assert g.tau == 3
    a = make_tau_controller(True, tau=4, tau_min=3, tau_max=6)
    assert isinstance(a, AdaptiveTau) and (a.tau_min, a.tau_max) == (3, 6)
    with pytest.raises(ConfigError, match="'gddr.adaptive' = 'yes'"):
        make_tau_controller("yes")
