"""Aggregation policies: weights, normalisation and independence from arrival order."""

import numpy as np
import pytest

from edgefl.algorithms.aggregators import make_aggregator
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Mean, SampleWeighted, Update


def _updates(rng, n=5, d=100):
    return [
        Update(i, rng.standard_normal(d).astype(np.float32), int(rng.integers(1, 50)), 0.1)
        for i in range(n)
    ]


def test_sample_weighted_is_fedavg():
    ups = [
        Update(0, np.array([1.0, 0.0], np.float32), 1, 0.0),
        Update(1, np.array([0.0, 4.0], np.float32), 3, 0.0),
    ]
    np.testing.assert_allclose(SampleWeighted().aggregate(ups), [0.25, 3.0])
    np.testing.assert_allclose(Mean().aggregate(ups), [0.5, 2.0])


def test_result_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(0)
    ups = _updates(rng, n=20)
    a = SampleWeighted().aggregate(ups)
    for _ in range(5):
        perm = [ups[i] for i in rng.permutation(len(ups))]
        assert np.array_equal(SampleWeighted().aggregate(perm), a)  # bit-identical


def test_bad_inputs():
    with pytest.raises(ValueError):
        SampleWeighted().aggregate([])
    with pytest.raises(ValueError):
        SampleWeighted().aggregate([Update(0, np.zeros(3, np.float32), 0, 0.0)])
    with pytest.raises(ConfigError, match="algorithm.aggregation"):
        make_aggregator("bogus")
