"""Robust aggregators and the update filter: hand-computed cases, Byzantine resistance,
determinism under arrival order, and config errors naming the key."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.aggregators import all_aggregators, make_aggregator
from edgefl.algorithms.robust.rules import (
    CoordinateMedian,
    Krum,
    MultiKrum,
    NormClip,
    TrimmedMean,
    UpdateFilter,
    l2_norm,
    pairwise_sq_distances,
)
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Mean, Update


def ups(*rows, samples=1):
    """Updates of devices 0..n-1 from rows of numbers."""
    return [
        Update(i, np.asarray(r, np.float32).reshape(-1), samples, 0.1) for i, r in enumerate(rows)
    ]


# -- hand-computed cases ------------------------------------------------------------------
def test_median_hand_computed():
    u = ups([1, -5], [2, 0], [3, 7], [100, 1])
    np.testing.assert_array_equal(CoordinateMedian().aggregate(u), [2.5, 0.5])  # even n
    np.testing.assert_array_equal(CoordinateMedian().aggregate(u[:3]), [2, 0])  # odd n


def test_trimmed_mean_hand_computed():
    u = ups([0], [1], [2], [10], [11])
    # beta 0.2 of 5 drops one value per side: mean(1, 2, 10)
    np.testing.assert_allclose(TrimmedMean(0.2).aggregate(u), [13 / 3], rtol=1e-6)
    # beta 0.1 of 5 drops floor(0.5) = 0: the plain mean
    np.testing.assert_allclose(TrimmedMean(0.1).aggregate(u), [24 / 5], rtol=1e-6)
    assert TrimmedMean(0.49).trimmed(5) == 2  # only the median is left
    np.testing.assert_array_equal(TrimmedMean(0.49).aggregate(u), [2])


def test_krum_scores_hand_computed():
    # 1-D points 0, 1, 2, 10, 11 with f = 1: each score sums n - f - 2 = 2 nearest sq. distances
    u = ups([0], [1], [2], [10], [11])
    k = Krum(f=1)
    np.testing.assert_array_equal(k.scores(u), [1 + 4, 1 + 1, 1 + 4, 1 + 64, 1 + 81])
    np.testing.assert_array_equal(k.aggregate(u), [1])
    assert k.last_selected == [1]
    assert k.last_scores == {0: 5.0, 1: 2.0, 2: 5.0, 3: 65.0, 4: 82.0}


def test_multi_krum_ties_go_to_the_lower_device_id():
    u = ups([0], [1], [2], [10], [11])
    mk = MultiKrum(f=1, m=2)  # scores 5, 2, 5, ...: device 1 then the tie 0/2 -> device 0
    np.testing.assert_array_equal(mk.aggregate(u), [0.5])
    assert mk.last_selected == [1, 0]
    # same points, devices renumbered so that the tied pair is (0 -> id 7, 2 -> id 3)
    ids = [7, 1, 3, 10, 11]
    v = [Update(i, x.delta, 1, 0.0) for i, x in zip(ids, u)]
    mk.aggregate(v)
    assert mk.last_selected == [1, 3]
    # m = 0 means n - f = 4: all but the farthest point
    mk0 = MultiKrum(f=1)
    np.testing.assert_allclose(mk0.aggregate(u), [(0 + 1 + 2 + 10) / 4])
    assert sorted(mk0.last_selected) == [0, 1, 2, 3]


def test_norm_clip_hand_computed():
    u = ups([3, 4], [0.3, 0.4])  # norms 5 and 0.5
    np.testing.assert_allclose(NormClip(1.0).aggregate(u), [(0.6 + 0.3) / 2, (0.8 + 0.4) / 2])
    # C = 0: the median norm (2.75) of the round
    nc = NormClip()
    got = nc.aggregate(u)
    assert nc.last_clip_norm == pytest.approx(2.75) and nc.last_clipped == [0]
    np.testing.assert_allclose(got, [(3 * 2.75 / 5 + 0.3) / 2, (4 * 2.75 / 5 + 0.4) / 2], rtol=1e-6)


def test_pairwise_distances_and_norm_match_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 33)).astype(np.float32)
    u = ups(*x)
    want = ((x[:, None, :].astype(np.float64) - x[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(pairwise_sq_distances(u), want, rtol=1e-12)
    assert l2_norm(x[0]) == pytest.approx(float(np.linalg.norm(x[0].astype(np.float64))))


def test_blocked_computation_equals_unblocked(monkeypatch):
    """Coordinates are processed in blocks to bound memory; the block size must not matter."""
    import edgefl.algorithms.robust.rules as robust

    rng = np.random.default_rng(4)
    u = ups(*rng.standard_normal((7, 101)))
    aggs = [CoordinateMedian(), TrimmedMean(0.2), MultiKrum(2, 2), NormClip()]
    whole = [a.aggregate(u) for a in aggs]
    monkeypatch.setattr(robust, "_BLOCK_ELEMENTS", 7 * 8)  # 8 coordinates per block
    for a, w in zip(aggs, whole):
        np.testing.assert_allclose(a.aggregate(u), w, rtol=1e-6, atol=1e-7)


# -- Byzantine resistance ------------------------------------------------------------------
D = 64


def byzantine_round(attack: str, f: int = 2, n: int = 10, seed: int = 0):
    """n updates: honest = mu + small noise; the last f devices attack."""
    rng = np.random.default_rng(seed)
    mu = np.full(D, 0.5)
    honest = mu + 0.1 * rng.standard_normal((n - f, D))
    if attack == "scaled":
        bad = -10 * honest[:f]
    elif attack == "sign-flip":
        bad = -honest[:f]
    else:  # colluding: all attackers send the same far vector
        bad = np.tile(-5 * mu, (f, 1))
    rows = np.vstack([honest, bad]).astype(np.float32)
    return ups(*rows), honest.mean(0), list(range(n - f))


@pytest.mark.parametrize("attack", ["scaled", "sign-flip", "colluding"])
def test_two_of_ten_byzantine(attack):
    u, honest_mean, honest_ids = byzantine_round(attack)
    scale = np.linalg.norm(honest_mean)  # 4.0
    err = {
        name: np.linalg.norm(agg.aggregate(u) - honest_mean) / scale
        for name, agg in {
            "mean": Mean(),
            "median": CoordinateMedian(),
            "trimmed-mean": TrimmedMean(0.2),
            "krum": Krum(2),
            "multi-krum": MultiKrum(2),
            "norm-clip": NormClip(),
        }.items()
    }
    assert err["mean"] > 0.35  # the plain mean is pulled away (0.4 for a sign flip)
    for name in ("median", "trimmed-mean", "multi-krum"):
        assert err[name] < 0.1, (name, err)
    # Krum returns one honest update: as close as an honest update is (0.1 * sqrt(64) / 4)
    assert err["krum"] < 0.3, err
    assert err["multi-krum"] < 0.02  # the mean of the 8 honest updates, exactly
    if attack == "scaled":  # clipping limits the pull of large updates, but does not remove it
        assert 0.1 < err["norm-clip"] < err["mean"] / 2
    else:  # attackers within the honest norm are not affected by clipping
        assert err["norm-clip"] > 0.35
    k = Krum(2)
    k.aggregate(u)
    assert k.last_selected[0] in honest_ids
    mk = MultiKrum(2)
    mk.aggregate(u)
    assert sorted(mk.last_selected) == honest_ids


def test_trimming_less_than_f_is_not_enough():
    """beta * n must reach f: with one value trimmed per side, one attacker stays in."""
    u, honest_mean, _ = byzantine_round("scaled")
    scale = np.linalg.norm(honest_mean)
    assert np.linalg.norm(TrimmedMean(0.1).aggregate(u) - honest_mean) / scale > 0.5
    assert np.linalg.norm(TrimmedMean(0.2).aggregate(u) - honest_mean) / scale < 0.1


# -- determinism ---------------------------------------------------------------------------
def _all_robust():
    return [
        CoordinateMedian(),
        TrimmedMean(0.2),
        Krum(2),
        MultiKrum(2, 3),
        NormClip(),
        NormClip(1.0),
    ]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), perm_seed=st.integers(0, 2**32 - 1))
def test_result_is_bit_identical_under_any_arrival_order(seed, perm_seed):
    u, _, _ = byzantine_round("scaled", seed=seed % 1000)
    perm = np.random.default_rng(perm_seed).permutation(len(u))
    shuffled = [u[i] for i in perm]
    for agg in _all_robust():
        a = agg.aggregate(u)
        sel = getattr(agg, "last_selected", None)
        b = agg.aggregate(shuffled)
        assert np.array_equal(a, b), agg.name
        assert getattr(agg, "last_selected", None) == sel


def test_krum_tie_is_broken_by_device_id_not_arrival():
    # devices 5 and 2 hold the same vector: equal scores; device 2 must win either way
    x = np.array([1.0, 1.0], np.float32)
    base = [Update(5, x.copy(), 1, 0), Update(2, x.copy(), 1, 0)]
    far = {7: (100, 0), 8: (0, 100), 9: (-100, -100)}  # each other's neighbours are far
    others = [Update(d, np.array(p, np.float32), 1, 0) for d, p in far.items()]
    for order in (base + others, others[::-1] + base[::-1]):
        k = Krum(1)
        k.aggregate(order)
        assert k.last_selected == [2]


def test_out_buffer_and_input_untouched():
    u, _, _ = byzantine_round("scaled")
    before = [x.delta.copy() for x in u]
    out = np.empty(D, np.float32)
    for agg in _all_robust():
        assert agg.aggregate(u, out=out) is out
    for x, b in zip(u, before):
        assert np.array_equal(x.delta, b)


# -- registry and config errors -----------------------------------------------------------
def test_make_aggregator_builds_every_registered_name():
    names = set(all_aggregators())
    assert {"mean", "sample-weighted", "median", "trimmed-mean", "krum", "multi-krum"} <= names
    assert "norm-clip" in names
    opts = {"trim_fraction": 0.2, "krum_f": 1, "multi_krum_m": 2, "clip_norm": 0.0}
    for name in names:
        agg = make_aggregator(name, **opts)
        assert agg.name == name
    # the whole [robust] table may be passed; keys of other aggregators are ignored
    full = {**opts, "norm_bound": 1.0, "norm_bound_relative": 3.0, "norm_bound_mode": "clip"}
    assert isinstance(make_aggregator("median", **full), CoordinateMedian)
    assert make_aggregator("trimmed-mean", **full).trim_fraction == 0.2


@pytest.mark.parametrize(
    "name, options, key",
    [
        ("trimmed-mean", {"trim_fraction": 0.5}, "robust.trim_fraction"),
        ("trimmed-mean", {"trim_fraction": -0.1}, "robust.trim_fraction"),
        ("trimmed-mean", {"trim_fraction": "a lot"}, "robust.trim_fraction"),
        ("trimmed-mean", {"trim_fraction": math.nan}, "robust.trim_fraction"),
        ("krum", {}, "robust.krum_f"),  # f is required: no universal default
        ("krum", {"krum_f": -1}, "robust.krum_f"),
        ("krum", {"krum_f": -2}, "robust.krum_f"),
        ("krum", {"krum_f": 1.5}, "robust.krum_f"),
        ("krum", {"krum_f": True}, "robust.krum_f"),
        ("multi-krum", {"krum_f": 1, "multi_krum_m": -1}, "robust.multi_krum_m"),
        ("norm-clip", {"clip_norm": -1.0}, "robust.clip_norm"),
        ("median", {"trim_fractoin": 0.1}, "robust.trim_fractoin"),
        ("bogus", {}, "algorithm.aggregation"),
    ],
)
def test_bad_options_raise_config_error_naming_the_key(name, options, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        make_aggregator(name, **options)


def test_krum_f_too_large_for_n():
    with pytest.raises(ConfigError, match=r"'robust.krum_f' = 4: krum needs n >= 2f \+ 3 = 11"):
        make_aggregator("krum", expected_updates=10, krum_f=4)
    make_aggregator("krum", expected_updates=10, krum_f=3)  # 10 >= 9
    with pytest.raises(ConfigError, match="'robust.multi_krum_m' = 9: must be <= n - f = 8"):
        make_aggregator("multi-krum", expected_updates=10, krum_f=2, multi_krum_m=9)
    # a round with fewer updates than the run expected (devices died) is checked again
    k = Krum(2)
    with pytest.raises(ConfigError, match="got n = 6"):
        k.aggregate(ups(*np.eye(6)))


def test_empty_or_mismatched_rounds_are_value_errors():
    for agg in _all_robust():
        with pytest.raises(ValueError):
            agg.aggregate([])
    with pytest.raises(ValueError, match="device 1"):
        CoordinateMedian().aggregate(
            [Update(0, np.zeros(3, np.float32), 1, 0), Update(1, np.zeros(4, np.float32), 1, 0)]
        )


# -- the update filter ---------------------------------------------------------------------
def test_filter_rejects_non_finite_and_bad_metadata():
    u = ups([1, 1], [np.nan, 0], [0, np.inf], [2, 2], [3, 3])
    u[3].loss = math.nan
    u[4].samples = -1
    res = UpdateFilter()(u)
    assert [x.device for x in res.accepted] == [0]
    assert [d for d, _ in res.rejected] == [1, 2, 3, 4]
    reasons = dict(res.rejected)
    assert "non-finite values" in reasons[1] and "non-finite values" in reasons[2]
    assert "loss" in reasons[3] and "sample count" in reasons[4]
    assert res.bound == math.inf and res.clipped == []


def test_filter_absolute_bound_reject_and_clip():
    u = ups([3, 4], [0.6, 0.8], [30, 40])  # norms 5, 1, 50
    res = UpdateFilter(norm_bound=5.0)(u)
    assert [x.device for x in res.accepted] == [0, 1]  # the bound itself is allowed
    assert res.rejected == [(2, "norm 50 above the bound 5 (robust.norm_bound)")]
    res = UpdateFilter(norm_bound=2.0, mode="clip")(u)
    assert [x.device for x in res.accepted] == [0, 1, 2] and res.clipped == [0, 2]
    np.testing.assert_allclose(res.accepted[0].delta, [1.2, 1.6], rtol=1e-6)
    np.testing.assert_allclose(res.accepted[2].delta, [1.2, 1.6], rtol=1e-6)
    assert res.accepted[1] is u[1]  # untouched updates are passed through
    np.testing.assert_array_equal(u[2].delta, [30, 40])  # inputs are not modified


def test_filter_relative_bound_uses_the_round_median():
    # norms 1, 2, 3, 4, 100: median 3, bound 3 x 3 = 9 rejects only the outlier
    u = ups([1, 0], [0, 2], [3, 0], [0, 4], [100, 0])
    res = UpdateFilter(norm_bound_relative=3.0)(u)
    assert [x.device for x in res.accepted] == [0, 1, 2, 3]
    assert res.bound == 9.0 and res.rejected[0][0] == 4 and "x median 3" in res.rejected[0][1]
    # with both bounds the smaller applies
    assert UpdateFilter(norm_bound=2.5, norm_bound_relative=3.0)(u).bound == 2.5
    assert UpdateFilter(norm_bound=50.0, norm_bound_relative=3.0)(u).bound == 9.0
    # non-finite updates do not enter the median
    v = u + [Update(9, np.array([np.inf, 0], np.float32), 1, 0.0)]
    assert UpdateFilter(norm_bound_relative=3.0)(v).bound == 9.0


def test_filter_relative_bound_catches_the_scaled_attack():
    u, _, honest = byzantine_round("scaled")
    res = UpdateFilter(norm_bound_relative=3.0)(u)
    assert [x.device for x in res.accepted] == honest
    assert [d for d, _ in res.rejected] == [8, 9]
    # order of arrival does not matter
    res2 = UpdateFilter(norm_bound_relative=3.0)(u[::-1])
    assert [x.device for x in res2.accepted] == honest and res2.rejected == res.rejected


def test_filter_rejects_updates_of_the_wrong_shape():
    good = [Update(i, np.ones(4, np.float32), 1, 0.1) for i in range(3)]
    bad = [
        Update(7, np.ones(5, np.float32), 1, 0.1),
        Update(8, np.ones((2, 2), np.float32), 1, 0.1),
    ]
    res = UpdateFilter()(good + bad)  # the most common size is the model's
    assert [u.device for u in res.accepted] == [0, 1, 2]
    assert [d for d, _ in res.rejected] == [7, 8] and "model has (4,)" in res.rejected[0][1]
    res = UpdateFilter(numel=5)(good + bad)  # or the size the coordinator knows
    assert [u.device for u in res.accepted] == [7]


def test_numpy_scalars_are_accepted_as_options():
    assert Krum(np.int64(2)).f == 2
    assert TrimmedMean(np.float32(0.25)).trim_fraction == 0.25
    with pytest.raises(ConfigError, match="robust.krum_f"):
        Krum(np.bool_(True))


def test_filter_options():
    f = UpdateFilter.from_options(norm_bound_relative=3.0, trim_fraction=0.2, krum_f=1)
    assert f.norm_bound_relative == 3.0 and f.mode == "reject" and f.bounds_norm
    assert not UpdateFilter.from_options().bounds_norm
    for kw, key in [
        ({"norm_bound": -1.0}, "robust.norm_bound"),
        ({"norm_bound_relative": -3.0}, "robust.norm_bound_relative"),
        ({"norm_bound_relative": 0.5}, "robust.norm_bound_relative"),
        ({"norm_bound_mode": "drop"}, "robust.norm_bound_mode"),
        ({"norm_bound": math.inf}, "robust.norm_bound"),
        ({"norm_bond": 1.0}, "robust.norm_bond"),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            UpdateFilter.from_options(**kw)
    assert UpdateFilter()([]).accepted == []
