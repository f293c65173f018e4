"""HermesGUP and AlwaysGate on hand-computed loss sequences; WI metrics."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.hermes.gate import (
    AlwaysGate,
    HermesGUP,
    make_gate,
    max_z_possible,
    min_losses_for,
    min_losses_for_percentile,
)
from edgefl.algorithms.hermes.metrics import HermesMetrics, worker_independence
from edgefl.errors import ConfigError


def feed(gate, losses):
    return [gate.observe(x) for x in losses]


def test_always_gate_pushes_every_iteration():
    g = AlwaysGate()
    assert feed(g, [3.0, 2.0, 5.0]) == [True, True, True]
    assert g.iterations == 3 and g.wait_for_model


def test_cold_start_and_two_losses():
    g = HermesGUP(alpha=-0.9)
    assert g.observe(1.0) is False  # one loss: no test at all
    assert math.isnan(g.last.score) and g.last.window == 1
    # [1.0, 0.5]: mean 0.75, population std 0.25, z = -1 <= -0.9
    assert g.observe(0.5) is True
    assert g.last.score == pytest.approx(-1.0)
    assert g.window == [] and g.minor == 0 and g.pushes == 1
    # the default alpha = -1.3 cannot fire on two losses (z >= -sqrt(1) = -1)
    g = HermesGUP()
    assert feed(g, [1.0, 0.5]) == [False, False]
    assert g.last.score == pytest.approx(-1.0)


def test_minus_sqrt_n_minus_one_bound():
    assert max_z_possible(1) == 0.0
    assert max_z_possible(3) == pytest.approx(-math.sqrt(2))
    assert [min_losses_for(a) for a in (-0.9, -1.0, -1.3, -1.6, -2.5)] == [2, 2, 3, 4, 8]
    assert min_losses_for_percentile(10) == 10 and min_losses_for_percentile(25) == 4
    # alpha = -1.3 needs >= 3 losses since the last push: [1, 1, 0] reaches z = -sqrt(2)
    g = HermesGUP(alpha=-1.3)
    assert feed(g, [1.0, 1.0, 0.0]) == [False, False, True]
    assert g.last.score == pytest.approx(-math.sqrt(2)) and g.last.window == 3
    # after the push the window restarts: the next two losses can never push
    assert feed(g, [5.0, -100.0]) == [False, False]
    # alpha = -1.6 needs 4: [1, 1, 0] is not enough (-1.414 > -1.6), [1, 1, 1, 0] is (-1.732)
    g = HermesGUP(alpha=-1.6)
    assert feed(g, [1.0, 1.0, 0.0]) == [False] * 3
    g = HermesGUP(alpha=-1.6)
    assert feed(g, [1.0, 1.0, 1.0, 0.0]) == [False, False, False, True]
    assert g.last.score == pytest.approx(-math.sqrt(3))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=40),
    st.sampled_from([-0.9, -1.3, -1.6, -2.2]),
    st.integers(2, 12),
)
def test_z_never_below_bound(losses, alpha, window):
    g = HermesGUP(alpha=alpha, window=window)
    for x in losses:
        push = g.observe(x)
        d = g.last
        if not math.isnan(d.score):
            assert d.score >= max_z_possible(d.window) - 1e-9
        if push:
            assert d.window >= min_losses_for(d.threshold)
            assert d.score <= d.threshold
        assert len(g.window) <= window


def test_threshold_decays_after_lambda_minor_updates():
    g = HermesGUP(alpha=-1.3, lam=5, beta=0.1)
    rising = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # never a major update
    alphas = []
    for x in rising:
        assert g.observe(x) is False
        alphas.append(g.alpha)
    # minor updates 1..4 keep alpha; the 5th (counter reaches lambda) and later relax it
    expected = [-1.3] * 4 + [-1.3 * 0.9, -1.3 * 0.9**2, -1.3 * 0.9**3]
    assert alphas == pytest.approx(expected)
    assert g.minor == 7
    g = HermesGUP(alpha=-1.3, lam=0, beta=0.5)
    g.observe(1.0)
    assert g.alpha == pytest.approx(-0.65)  # lam = 0: the first minor update relaxes
    g = HermesGUP(alpha=-1.3, lam=0, beta=0.0)
    feed(g, rising)
    assert g.alpha == -1.3  # beta = 0 never relaxes


def test_relaxed_threshold_fires_and_reset_option():
    # alpha -1.3, lam 1, beta 0.3: every minor update relaxes by 0.7
    losses = [3.0, 4.0, 5.0, 4.0]  # last: mean 4, z = 0 > -1.3 * 0.7^3 = -0.446 -> minor
    g = HermesGUP(alpha=-1.3, lam=1, beta=0.3)
    assert feed(g, losses) == [False] * 4
    assert g.alpha == pytest.approx(-1.3 * 0.7**4)
    # [3, 4, 5, 4, 3.6]: mean 3.92, std 0.6524, z = -0.4905 <= -1.3 * 0.7^4 = -0.3121
    assert g.observe(3.6) is True
    assert g.last.score == pytest.approx((3.6 - 3.92) / np.std([3, 4, 5, 4, 3.6]))
    assert g.alpha == pytest.approx(-1.3 * 0.7**4)  # default: the relaxed alpha persists
    g = HermesGUP(alpha=-1.3, lam=1, beta=0.3, reset_alpha=True)
    assert feed(g, losses + [3.6]) == [False] * 4 + [True]
    assert g.alpha == -1.3 and g.minor == 0 and g.window == []


def test_zero_spread_is_minor_and_does_not_crash():
    g = HermesGUP(alpha=-0.5, lam=100)
    assert feed(g, [2.0] * 6) == [False] * 6
    assert math.isnan(g.last.score)
    g = HermesGUP(test="percentile", percentile=50, lam=100)
    assert feed(g, [2.0] * 6) == [False] * 6


def test_window_truncation():
    # window 3: [0, 10, 10, 10] then 5 -> window [10, 10, 5], z = -sqrt(2) <= -1.1 -> push.
    # Without truncation [0, 10, 10, 10, 5] would give z = (5 - 7) / 4 = -0.5.
    g = HermesGUP(alpha=-1.1, window=3)
    assert feed(g, [0.0, 10.0, 10.0, 10.0]) == [False] * 4
    assert g.window == [10.0, 10.0, 10.0]
    assert g.observe(5.0) is True
    assert g.last.window == 3 and g.last.score == pytest.approx(-math.sqrt(2))
    g = HermesGUP(alpha=-1.1, window=10)
    assert feed(g, [0.0, 10.0, 10.0, 10.0, 5.0]) == [False] * 5
    assert g.last.score == pytest.approx(-0.5)


def test_percentile_test():
    # p = 25 needs 4 losses: rank of the current loss = 100 * #{x <= L} / n
    g = HermesGUP(test="percentile", percentile=25, lam=100)
    assert feed(g, [4.0, 3.0, 2.0, 1.0]) == [False, False, False, True]
    assert g.last.score == pytest.approx(25.0)
    # ties count against the current loss: in [2, 1, 3, 1] the last 1 has rank 50 %
    g = HermesGUP(test="percentile", percentile=25, lam=100)
    assert feed(g, [2.0, 1.0, 3.0, 1.0]) == [False] * 4
    assert g.last.score == pytest.approx(50.0)
    # with p = 10 the current loss must be the strict minimum of at least 10 losses
    g = HermesGUP(test="percentile", percentile=10, lam=100)
    assert feed(g, [float(x) for x in range(10, 1, -1)]) == [False] * 9
    assert g.observe(1.0) is True
    # relaxation moves p toward 50: p <- 50 - (50 - p)(1 - beta)
    g = HermesGUP(test="percentile", percentile=10, lam=1, beta=0.1)
    g.observe(1.0)
    assert g.percentile == pytest.approx(14.0) and g.threshold == g.percentile


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(3)
    losses = list(np.cumsum(rng.normal(-0.05, 0.2, 60)) + 10)
    a = HermesGUP(alpha=-1.3, window=6, lam=3, beta=0.2)
    feed(a, losses[:25])
    state = json.loads(json.dumps(a.state_dict()))  # plain floats/lists only
    b = HermesGUP(alpha=-1.3, window=6, lam=3, beta=0.2)
    b.load_state_dict(state)
    assert feed(a, losses[25:]) == feed(b, losses[25:])
    assert a.state_dict() == b.state_dict()
    assert a.pushes > 0
    small = HermesGUP(window=2)
    with pytest.raises(ValueError):
        small.load_state_dict(a.state_dict() | {"window": [1.0, 2.0, 3.0]})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"alpha": 0.0}, "hermes.alpha"),
        ({"alpha": 0.5}, "hermes.alpha"),
        ({"alpha": float("nan")}, "hermes.alpha"),
        ({"alpha": "-1"}, "hermes.alpha"),
        ({"window": 1}, "hermes.window"),
        ({"window": 2.5}, "hermes.window"),
        ({"window": True}, "hermes.window"),
        ({"lam": -1}, "hermes.lam"),
        ({"beta": 1.0}, "hermes.beta"),
        ({"beta": -0.1}, "hermes.beta"),
        ({"test": "ttest"}, "hermes.test"),
        ({"percentile": 0.0}, "hermes.percentile"),
        ({"percentile": 60.0}, "hermes.percentile"),
        ({"reset_alpha": "yes"}, "hermes.reset_alpha"),
        ({"wait_for_model": 1}, "hermes.wait_for_model"),
    ],
)
def test_bad_parameters_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        HermesGUP(**kwargs)


def test_make_gate():
    g = make_gate("hermes", {"alpha": -1.6, "window": 8, "softmax_temperature": 2.0})
    assert isinstance(g, HermesGUP) and g.alpha == -1.6 and g.window_size == 8
    assert g.reset_alpha is False and g.wait_for_model is True
    assert isinstance(make_gate("always"), AlwaysGate)
    assert make_gate("always", {"wait_for_model": False}).wait_for_model is False
    with pytest.raises(ConfigError, match="algorithm.gate"):
        make_gate("sometimes")
    with pytest.raises(ConfigError, match="hermes.alpha"):
        make_gate("hermes", {"alpha": 1.0})


def test_worker_independence_metrics():
    assert worker_independence(10, 2) == 5.0
    assert worker_independence(7, 0) == 7.0
    with pytest.raises(ValueError):
        worker_independence(-1, 1)
    m = HermesMetrics()
    # device 0 behaves like BSP (request after each iteration); device 1 like Hermes
    for t in (1.0, 2.0, 3.0):
        m.record_iteration(0, t)
        m.record_request(0)
        m.record_message("update", 400)
        m.record_message("model", 400)
    for t in (1.0, 1.0, 1.0, 1.0, 1.0, 1.0):
        m.record_iteration(1, t)
    m.record_push(1)
    m.record_request(1)
    m.record_message("update", 400)
    m.record_message("model", 400)
    m.record_message("control", 16, count=2)
    assert m.wi(0) == 1.0 and m.wi(1) == 6.0 and m.wi_mean() == 3.5
    s = m.summary()
    assert s["iterations"] == 9 and s["api_calls"] == 10 and s["bytes"] == 3216
    assert s["messages_by_kind"] == {"control": 2, "model": 4, "update": 4}
    # CV per iteration index across devices: [1, 1] -> 0, [2, 1] -> 1/3, [3, 1] -> 0.5
    assert m.cv_by_iteration() == pytest.approx([0.0, 1 / 3, 0.5])
    assert s["cv_first"] == 0.0 and s["cv_last"] == pytest.approx(0.5)
    json.dumps(s)
    m2 = HermesMetrics()
    m2.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert m2.summary() == s
