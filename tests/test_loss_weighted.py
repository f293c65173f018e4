"""Loss-weighted aggregation (Hermes): hand-computed running averages and softmax weights."""

import json
import math

import numpy as np
import pytest

from edgefl.algorithms.hermes.loss_weighted import (
    LOSS_AGGREGATORS,
    LossSoftmax,
    LossWeighted,
    candidate,
    make_loss_aggregator,
)
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Update


def up(device, delta, loss=1.0, samples=10):
    return Update(device, np.asarray(delta, np.float32), samples, loss)


def test_running_inverse_loss_average_hand_computed():
    agg = LossWeighted()
    # first update: saved = g (nothing to average with)
    np.testing.assert_array_equal(agg.push(np.array([1.0, 0.0]), candidate_loss=0.7), [1, 0])
    # global loss 0.5 -> w1 = 2; candidate loss 0.25 -> w2 = 4: (2 [1, 0] + 4 [0, 1]) / 6
    out = agg.push(np.array([0.0, 1.0]), candidate_loss=0.25, global_loss=0.5)
    np.testing.assert_allclose(out, [1 / 3, 2 / 3], rtol=1e-6)
    assert out.dtype == np.float32 and agg.pushes == 2
    # global loss 1.0 -> w1 = 1; candidate 1.0 -> w2 = 1: plain halving toward g
    agg.set_global_loss(1.0)
    out = agg.push(np.array([3.0, 3.0]), candidate_loss=1.0)
    np.testing.assert_allclose(out, [(1 / 3 + 3) / 2, (2 / 3 + 3) / 2], rtol=1e-6)


def test_without_a_global_loss_the_update_replaces_saved():
    agg = LossWeighted()
    agg.push(np.ones(3), 0.5)
    np.testing.assert_array_equal(agg.push(np.full(3, 7.0), 0.5), [7, 7, 7])


def test_contributions_sum_to_one_with_equal_losses():
    # applied after every push, the second update's total contribution is 1 (rho = 1/2)
    agg = LossWeighted()
    agg.set_global_loss(0.8)
    d = 40
    model = np.zeros(d)
    for t in range(d):
        g = np.zeros(d)
        g[t] = 1.0
        model += agg.push(g, candidate_loss=0.8)
    assert model[0] == pytest.approx(2.0, rel=1e-6)  # the first starts the average: 1/(1-rho)
    assert model[1] == pytest.approx(1.0, rel=1e-6)
    assert model[10] == pytest.approx(1.0 - 0.5 ** (d - 10), rel=1e-5)


def test_aggregate_round_uses_candidate_losses_in_device_order():
    ups = [up(2, [0, 3], loss=9.0), up(0, [3, 0], loss=9.0)]
    a = LossWeighted()
    a.set_global_loss(1.0)
    # device 0 first: saved = [3, 0]; then device 2 with candidate loss 0.5 (w2 = 2, w1 = 1)
    out = a.aggregate(ups, losses={0: 2.0, 2: 0.5})
    np.testing.assert_allclose(out, [1.0, 2.0], rtol=1e-6)
    b = LossWeighted()
    b.set_global_loss(1.0)
    assert np.array_equal(b.aggregate(ups[::-1], losses={0: 2.0, 2: 0.5}), out)
    with pytest.raises(ValueError, match="device 2"):
        LossWeighted().aggregate(ups, losses={0: 1.0})
    with pytest.raises(ValueError):
        LossWeighted().aggregate([])
    np.testing.assert_allclose(LossWeighted().weights(ups), [1 / 9, 1 / 9])


def test_candidate_model():
    g = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(candidate(g, np.array([0.5, -2.0], np.float32)), [1.5, 0.0])
    with pytest.raises(ValueError):
        candidate(g, np.zeros(3, np.float32))


def test_bad_losses():
    agg = LossWeighted()
    for bad in (float("nan"), -0.1, float("inf")):
        with pytest.raises(ValueError):
            agg.push(np.ones(2), bad)
    agg.push(np.ones(2), 1.0)
    agg.set_global_loss(1.0)
    out = agg.push(np.zeros(2), 0.0)  # a perfect candidate: weight 1e12, no division by 0
    assert np.all(np.isfinite(out)) and np.all(np.abs(out) < 1e-9)


def test_softmax_weights_hand_computed():
    s = LossSoftmax(temperature=1.0)
    # losses 0 and ln 2: weights 2/3 and 1/3
    ups = [up(0, [3, 0], loss=0.0), up(1, [0, 3], loss=math.log(2))]
    np.testing.assert_allclose(s.weights(ups), [2 / 3, 1 / 3])
    np.testing.assert_allclose(s.aggregate(ups), [2.0, 1.0], rtol=1e-6)
    # candidate losses override Update.loss
    np.testing.assert_allclose(s.aggregate(ups, losses={0: 1.0, 1: 1.0}), [1.5, 1.5])
    # huge losses do not overflow (shifted by the minimum)
    w = s.softmax_weights([1000.0, 1001.0])
    np.testing.assert_allclose(w, [1 / (1 + math.exp(-1)), 1 / (1 + math.e)])


def test_softmax_temperature_limits():
    ups = [up(0, [1, 0, 0], 0.3), up(1, [0, 1, 0], 0.2), up(2, [0, 0, 1], 0.9)]
    np.testing.assert_allclose(LossSoftmax(1e6).aggregate(ups), [1 / 3] * 3, atol=1e-5)
    np.testing.assert_allclose(LossSoftmax(1e-4).aggregate(ups), [0, 1, 0], atol=1e-6)


def test_softmax_buffer_of_major_updates():
    s = LossSoftmax(temperature=1.0, buffer=2)
    np.testing.assert_array_equal(s.push(0, np.array([4.0, 0.0]), 1.0), [4, 0])
    out = s.push(1, np.array([0.0, 4.0]), 1.0)  # equal losses: the mean of the two
    np.testing.assert_allclose(out, [2, 2])
    out = s.push(2, np.array([8.0, 8.0]), 1.0)  # buffer 2: device 0 leaves
    assert s.buffered == [1, 2]
    np.testing.assert_allclose(out, [4, 6])
    out = s.push(1, np.array([2.0, 2.0]), 1.0 + math.log(3))  # replaces device 1's entry
    assert s.buffered == [2, 1]
    np.testing.assert_allclose(out, [0.75 * 8 + 0.25 * 2] * 2, rtol=1e-6)
    t = LossSoftmax(temperature=1.0, buffer=2)
    t.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(t.push(3, np.ones(2), 1.0), s.push(3, np.ones(2), 1.0))
    with pytest.raises(ValueError):
        s.push(4, np.ones(5), 1.0)


def test_state_round_trip_loss_weighted():
    rng = np.random.default_rng(0)
    a = LossWeighted()
    a.set_global_loss(0.9)
    for _ in range(3):
        a.push(rng.standard_normal(5), rng.uniform(0.1, 1))
    st = a.state_dict()
    b = LossWeighted()
    b.load_state_dict({**st, "saved": st["saved"].tolist()})
    g, lc = rng.standard_normal(5), 0.4
    np.testing.assert_array_equal(a.push(g, lc), b.push(g, lc))
    json.dumps({k: v for k, v in b.state_dict().items() if k != "saved"})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": 0.0}, "hermes.softmax_temperature"),
        ({"temperature": -1.0}, "hermes.softmax_temperature"),
        ({"temperature": "hot"}, "hermes.softmax_temperature"),
        ({"buffer": 0}, "hermes.softmax_buffer"),
    ],
)
def test_bad_parameters_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LossSoftmax(**kwargs)


def test_factory_and_registry():
    assert isinstance(make_loss_aggregator("loss-weighted"), LossWeighted)
    s = make_loss_aggregator("loss-softmax", {"softmax_temperature": 2.0, "alpha": -1.3})
    assert isinstance(s, LossSoftmax) and s.temperature == 2.0 and s.buffer == 4
    with pytest.raises(ConfigError, match="algorithm.aggregation"):
        make_loss_aggregator("loss-median")
    with pytest.raises(ConfigError, match="hermes.softmax_temperature"):
        make_loss_aggregator("loss-softmax", {"softmax_temperature": 0})
    # constructible without arguments, like the other registered aggregators
    for name, cls in LOSS_AGGREGATORS.items():
        assert cls().name == name
