"""Hermes dynamic allocation on synthetic device speeds; the time model and its searches."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.hermes.allocation import (
    Allocation,
    FixedAllocation,
    HermesAllocation,
    cv,
    make_allocator,
    tukey_fences,
)
from edgefl.errors import ConfigError

# seconds per sample of a 12-device fleet spanning 10x: seven alike mid-range devices, two
# fast ones, three slow ones (the shape fences are made for: a majority and outliers)
TIERED = np.array([0.4, 0.4, 1, 1, 1, 1, 1, 1, 1, 2.5, 4, 4]) * 1e-3
# the same 10x span with no majority: speeds spread log-uniformly
LOGUNIFORM = np.geomspace(1.0, 10.0, 12)[[3, 9, 0, 6, 11, 1, 8, 4, 10, 2, 7, 5]] * 1e-3


class Fleet:
    """Synthetic devices: a step of b samples takes (overhead + cost * b) s, times noise."""

    def __init__(self, cost, noise=0.0, overhead=2e-4, seed=0):
        self.cost, self.noise, self.overhead = np.asarray(cost), noise, overhead
        self.rng = np.random.default_rng(seed)

    def times(self, al):
        out = {}
        for i, c in enumerate(self.cost):
            a = al.allocation(i)
            t = al.epochs * a.samples / a.batch * (self.overhead + c * a.batch)
            out[i] = t * (1.0 + self.noise * self.rng.standard_normal())
        return out


def make(cost, data=5000, cap=None, samples=1000, batch=32, **kw):
    al = HermesAllocation(**kw)
    for i in range(len(cost)):
        d = data[i] if isinstance(data, list) else data
        m = cap[i] if isinstance(cap, list) else cap
        al.add_device(i, d, m, samples=samples, batch=batch)
    return al


def predicted_cv(al):
    return cv([al.predicted_time(i) for i in al.devices])


def test_cv_and_fences_hand_computed():
    assert cv([1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(2 / 3) / 2)
    assert cv([5.0, 5.0]) == 0.0
    with pytest.raises(ValueError):
        cv([])
    assert tukey_fences([1, 2, 3, 4, 5]) == (-1.0, 7.0)  # Q1 2, Q3 4, IQR 2
    assert tukey_fences([1, 2, 3, 4, 5], k=0.5) == (1.0, 5.0)


def test_time_model_and_hand_computed_reallocation():
    # E = 2; four devices take 1 s at D = 100, b = 10 (k = 1 * 10 / (2 * 100) = 0.05 s/step);
    # device 4 takes 4 s (k = 0.2). T* = median(1, 1, 1, 1, 4) = 1 s.
    al = HermesAllocation(epochs=2, max_change=0.5)
    for i in range(5):
        assert al.add_device(i, 1000, samples=100, batch=10) == Allocation(100, 10)
    out = al.update({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 4.0})
    assert al.target == 1.0
    assert al.step_time(0) == pytest.approx(0.05) and al.step_time(4) == pytest.approx(0.2)
    assert al.predicted_time(4, samples=100) == pytest.approx(4.0)
    # the ideal D = T* b / (E k) = 1 * 10 / (2 * 0.2) = 25, but one step may halve D at most
    assert out[4] == Allocation(50, 10)
    assert all(out[i] == Allocation(100, 10) for i in range(4))  # inside the fences: alone
    out = al.update({4: 2.0})  # measured as predicted: 2 * 50 * 0.2 / 10
    assert out == {4: Allocation(25, 10)}
    assert al.predicted_time(4) == pytest.approx(1.0)
    assert al.target == 1.0  # T* never moves
    # with max_change = 1 it goes there in one step
    al = HermesAllocation(epochs=2, max_change=1.0)
    for i in range(5):
        al.add_device(i, 1000, samples=100, batch=10)
    assert al.update({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 4.0})[4] == Allocation(25, 10)


@pytest.mark.parametrize(
    "cost, trigger", [(TIERED, "fences"), (TIERED, "always"), (LOGUNIFORM, "always")]
)
def test_twelve_devices_ten_x_spread_converge(cost, trigger):
    fleet = Fleet(cost, noise=0.05, seed=1)
    al = make(cost, trigger=trigger)
    first = fleet.times(al)
    assert cv(list(first.values())) > 0.5
    al.update(first)
    cvs = []
    for _ in range(5):
        al.update(fleet.times(al))
        cvs.append(predicted_cv(al))
    assert cvs[-1] <= 0.10, cvs  # within 6 measurements per device
    measured = [cv(list(fleet.times(al).values())) for _ in range(5)]
    assert max(measured) <= 0.15  # 5 % noise on top of the balanced predictions
    assert np.mean(measured) <= 0.10


def test_fences_leave_devices_inside_alone():
    # at every update, a device whose time is inside the fences of the others is untouched
    for cost in (TIERED, LOGUNIFORM):
        fleet = Fleet(cost, noise=0.05, seed=2)
        al = make(cost)
        for _ in range(12):
            times = fleet.times(al)
            before = al.allocations()
            al.update(times)
            for i in al.devices:
                lo, hi = tukey_fences([t for j, t in times.items() if j != i])
                if lo <= times[i] <= hi:
                    assert al.allocation(i) == before[i]
    # with no majority only the extreme device is ever outside the fences: the others keep
    # their allocation and the spread stays (this is why `trigger = "always"` exists)
    fleet = Fleet(LOGUNIFORM, noise=0.0)
    al = make(LOGUNIFORM)
    for _ in range(8):
        al.update(fleet.times(al))
    moved = [i for i in al.devices if al.allocation(i) != Allocation(1000, 32)]
    assert moved == [int(np.argmax(LOGUNIFORM))]
    assert cv(list(fleet.times(al).values())) > 0.4


def test_no_oscillation():
    # noise-free: every device moves monotonically toward T*, by at most max_change per step
    fleet = Fleet(TIERED, noise=0.0)
    al = make(TIERED, max_change=0.5)
    hist = []
    for _ in range(15):
        al.update(fleet.times(al))
        hist.append([al.allocation(i).samples for i in al.devices])
    h = np.array([[1000] * 12] + hist)
    steps = np.diff(h, axis=0)
    for i in range(12):
        moves = steps[:, i][steps[:, i] != 0]
        assert np.all(moves > 0) or np.all(moves < 0), (i, h[:, i])
        assert np.all(np.abs(steps[:, i]) <= 0.5 * h[:-1, i] + 1)
    assert np.all(steps[-5:] == 0)  # settled
    # 5 % noise: changes stay bounded, no device ever reverses direction, and once balanced
    # the allocation rarely moves again
    for cost, trigger, seed in ((TIERED, "fences", 4), (LOGUNIFORM, "always", 5)):
        fleet = Fleet(cost, noise=0.05, seed=seed)
        al = make(cost, max_change=0.5, trigger=trigger)
        prev = [1000] * 12
        direction = [0] * 12
        late_changes = 0
        for step in range(40):
            al.update(fleet.times(al))
            cur = [al.allocation(i).samples for i in al.devices]
            for i, (a, b) in enumerate(zip(prev, cur)):
                assert abs(b - a) <= 0.5 * a + 1
                if b != a:
                    d = 1 if b > a else -1
                    assert direction[i] != -d, (trigger, step, i, a, b)
                    direction[i] = d
                    late_changes += step >= 8
            prev = cur
        assert late_changes <= 0.01 * 32 * 12, late_changes


def test_memory_caps_and_dataset_sizes_are_respected():
    data = [5000, 1800] + [5000] * 9 + [300]
    cap = [1500, None] + [None] * 10
    al = make(TIERED, data=data, cap=cap, samples=4000)
    assert al.allocation(0).samples == 1500  # the initial allocation is clamped too
    assert al.allocation(1).samples == 1800 and al.allocation(11).samples == 300
    fleet = Fleet(TIERED, noise=0.05, seed=5)
    for _ in range(12):
        al.update(fleet.times(al))
        for i in al.devices:
            a = al.allocation(i)
            assert 1 <= a.batch <= a.samples <= min(data[i], cap[i] or data[i])
    # the capped fast devices cannot reach T* with D alone: their batch size came down
    assert al.allocation(0).samples == 1500 and al.allocation(0).batch < 32
    assert al.allocation(1).samples == 1800 and al.allocation(1).batch < 32
    assert al.allocation(0).batch in (2, 4, 8, 16)


def test_batch_search_stops_when_smaller_batches_do_not_help():
    # compute-bound device without per-step overhead: time depends on D only, so after one
    # rung the fitted k(b) shows that b buys nothing and the batch size stays put
    cost = TIERED.copy()
    al = make(cost, cap=[1500] + [None] * 11)
    fleet = Fleet(cost, noise=0.0, overhead=0.0)
    for _ in range(10):
        al.update(fleet.times(al))
    assert al.allocation(0) == Allocation(1500, 16)


def test_warmup():
    fleet = Fleet(TIERED)
    al = make(TIERED, warmup=3)
    al.update(fleet.times(al))
    al.update(fleet.times(al))
    assert all(a == Allocation(1000, 32) for a in al.allocations().values())
    al.update(fleet.times(al))
    assert al.allocation(11).samples < 1000  # the slow outliers move first ...
    for _ in range(3):
        al.update(fleet.times(al))
    assert al.allocation(0).samples > 1000  # ... then the fast ones stand out


def test_target_waits_for_every_device_and_single_device_is_left_alone():
    al = make(TIERED[:3])
    assert al.update({0: 1.0, 1: 9.0}) == {0: Allocation(1000, 32), 1: Allocation(1000, 32)}
    assert al.target is None
    al.update({2: 2.0})
    assert al.target == 2.0  # median of the first times 1, 9, 2
    solo = make(TIERED[:1])
    assert solo.update({0: 50.0}) == {0: Allocation(1000, 32)}


def test_fixed_allocation_never_changes():
    al = FixedAllocation(epochs=1)
    for i in range(12):
        al.add_device(i, 5000, batch=0)  # defaults: D = all its data; b = 0 -> full batch
    fleet = Fleet(TIERED, noise=0.05)
    for _ in range(5):
        al.update(fleet.times(al))
    assert all(a == Allocation(5000, 5000) for a in al.allocations().values())
    assert al.predicted_time(0) > 0


def test_state_round_trip_continues_identically():
    fleet_a, fleet_b = Fleet(TIERED, 0.05, seed=7), Fleet(TIERED, 0.05, seed=7)
    a = make(TIERED, cap=[1500] + [None] * 11)
    for _ in range(3):
        t = fleet_a.times(a)
        fleet_b.times(a)  # keep the two noise streams in step
        a.update(t)
    state = json.loads(json.dumps(a.state_dict()))
    b = make(TIERED)  # different caps: load replaces the fleet
    b.load_state_dict(state)
    for _ in range(6):
        assert a.update(fleet_a.times(a)) == b.update(fleet_b.times(b))
    assert a.state_dict() == b.state_dict()


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1e-4, 1.0),
    st.sampled_from([2, 4, 16, 64]),
    st.integers(1, 3),
    st.integers(64, 3000),
    st.floats(0.01, 50.0),
)
def test_binary_search_matches_brute_force(k, b, epochs, limit, target):
    al = HermesAllocation(epochs=epochs)
    al.target = target
    got = al._best_samples(k, b, b, limit)
    errs = [abs(epochs * s * k / b - target) for s in range(b, limit + 1)]
    assert abs(epochs * got * k / b - target) == pytest.approx(min(errs), abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"warmup": 0}, "allocation.warmup"),
        ({"smoothing": 0.0}, "allocation.smoothing"),
        ({"smoothing": 1.5}, "allocation.smoothing"),
        ({"max_change": 0.0}, "allocation.max_change"),
        ({"max_change": 2.0}, "allocation.max_change"),
        ({"tolerance": 1.0}, "allocation.tolerance"),
        ({"fence": 0.0}, "allocation.fence"),
        ({"trigger": "sometimes"}, "allocation.trigger"),
        ({"epochs": 0}, "train.local_epochs"),
    ],
)
def test_bad_parameters_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        HermesAllocation(**kwargs)


def test_make_allocator_and_bad_devices():
    al = make_allocator("hermes", {"max_change": 0.25, "warmup": 2}, epochs=3)
    assert isinstance(al, HermesAllocation)
    assert (al.max_change, al.warmup, al.epochs, al.trigger) == (0.25, 2, 3, "fences")
    assert isinstance(make_allocator("fixed"), FixedAllocation)
    with pytest.raises(ConfigError, match="algorithm.allocation"):
        make_allocator("greedy")
    with pytest.raises(ValueError):
        al.add_device(0, 0)
    al.add_device(0, 10)
    with pytest.raises(ValueError):
        al.add_device(0, 10)
    with pytest.raises(ValueError):
        al.update({0: -1.0})
    with pytest.raises(KeyError):
        al.update({5: 1.0})
