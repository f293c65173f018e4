"""The virtual clock: task times planned from a device profile (edgefl.sim.clock)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.sim.clock import TaskPlan, plan_task
from edgefl.sim.profiles import Availability, Failure, Profile, jitter_factor

INF = math.inf

# 0.5 s latency, 2000 B/s down, 1000 B/s up, 0.25 s per sample: all times exact in binary
BASE = dict(s_per_sample=0.25, up_bps=1000.0, down_bps=2000.0, latency_s=0.5)


def _plan(profile: Profile, now: float = 10.0, task: int = 0, seed: int = 1, device: int = 3):
    return plan_task(profile, seed, device, task, now, 4000, 3000, 8, 1.0)


def test_times_add_up():
    p = _plan(Profile("p", **BASE))
    # download 0.5 + 4000/2000 = 2.5; compute 8 * 0.25 = 2; upload 0.5 + 3000/1000 = 3.5
    assert p == TaskPlan(3, 0, 10.0, 12.5, 14.5, 18.0)
    assert not p.lost and p.reason == "" and p.lost_at == INF and p.end == 18.0
    assert p.intervals() == [
        ("download", 10.0, 12.5),
        ("compute", 12.5, 14.5),
        ("upload", 14.5, 18.0),
    ]


def test_compute_from_speed_and_reference():
    # no s_per_sample: reference 1.0 s / speed 4 = 0.25 s per sample, as above
    kw = {k: v for k, v in BASE.items() if k != "s_per_sample"}
    p = plan_task(Profile("p", speed=4.0, **kw), 1, 3, 0, 10.0, 4000, 3000, 8, 1.0)
    assert (p.model_at, p.compute_end, p.arrive) == (12.5, 14.5, 18.0)
    p = plan_task(Profile("p", speed=4.0, **kw), 1, 3, 0, 10.0, 4000, 3000, 8, 2.0)
    assert p.compute_end - p.model_at == 4.0  # twice the reference cost


def test_zero_samples_and_zero_latency():
    p = plan_task(
        Profile("p", s_per_sample=1.0, latency_s=0.0, up_bps=8.0, down_bps=4.0),
        0,
        0,
        0,
        0.0,
        8,
        16,
        0,
        1.0,
    )
    assert (p.model_at, p.compute_end, p.arrive) == (2.0, 2.0, 4.0)
    assert [s for s, _, _ in p.intervals()] == ["download", "upload"]  # empty compute


def test_jitter_zero_gives_factor_one():
    prof = Profile("p", **BASE)
    for task in range(50):
        assert jitter_factor(prof, 1, 3, task) == 1.0
        assert _plan(prof, task=task).compute_end == 14.5


def test_jitter_scales_compute_only():
    prof = Profile("p", jitter=0.4, **BASE)
    factors = []
    for task in range(40):
        f = jitter_factor(prof, 1, 3, task)
        p = _plan(prof, task=task)
        assert p.model_at == 12.5  # links are not jittered
        assert p.compute_end - p.model_at == pytest.approx(2.0 * f, rel=1e-12)
        assert p.arrive - p.compute_end == pytest.approx(3.5, rel=1e-12)
        factors.append(f)
    assert len(set(factors)) == 40 and min(factors) < 1.0 < max(factors)


def _random_profile() -> Profile:
    return Profile(
        "p",
        jitter=0.3,
        availability=Availability("random", mean_on_s=20.0, mean_off_s=5.0),
        failure=Failure("mtbf", mtbf_s=60.0),
        **BASE,
    )


def test_plan_is_deterministic():
    a, b = _random_profile(), _random_profile()  # separate objects: separate caches
    queries = [(d, k, t) for d in range(4) for k, t in enumerate((0.0, 7.0, 30.0))]
    pa = [_plan(a, now=t, task=k, device=d) for d, k, t in queries]
    # query b in the reverse order: plans must not depend on the order of queries
    pb = [_plan(b, now=t, task=k, device=d) for d, k, t in reversed(queries)]
    assert pa == list(reversed(pb))
    # and they differ with the seed or the device
    assert _plan(a, seed=1).compute_end != _plan(a, seed=2).compute_end
    assert _plan(a, device=1).compute_end != _plan(a, device=2).compute_end


def test_task_crossing_offline_is_lost_then():
    prof = Profile("p", availability=Availability("trace", intervals=((0.0, 15.0),)), **BASE)
    p = _plan(prof)
    assert p.lost and p.lost_at == 15.0 and p.reason == "offline" and p.end == 15.0
    assert p.arrive == 18.0  # the planned arrival is kept, but never happens
    assert p.intervals() == [
        ("download", 10.0, 12.5),
        ("compute", 12.5, 14.5),
        ("upload", 14.5, 15.0),
    ]


def test_offline_during_download_cuts_there():
    prof = Profile("p", availability=Availability("trace", intervals=((5.0, 11.0),)), **BASE)
    p = _plan(prof)
    assert (p.lost_at, p.reason) == (11.0, "offline")
    assert p.intervals() == [("download", 10.0, 11.0)]


def test_task_crossing_crash_is_lost_then():
    p = _plan(Profile("p", failure=Failure("crash", at_s=13.0), **BASE))
    assert (p.lost_at, p.reason, p.end) == (13.0, "crash", 13.0)
    assert p.intervals() == [("download", 10.0, 12.5), ("compute", 12.5, 13.0)]


@pytest.mark.parametrize(
    "crash, online_end, lost_at, reason",
    [
        (16.0, 15.0, 15.0, "offline"),  # offline first
        (14.0, 15.0, 14.0, "crash"),  # crash first
        (15.0, 15.0, 15.0, "crash"),  # same moment: the crash counts
        (30.0, 20.0, INF, ""),  # both after the arrival at 18
    ],
)
def test_crash_and_offline_earliest_wins(crash, online_end, lost_at, reason):
    prof = Profile(
        "p",
        availability=Availability("trace", intervals=((0.0, online_end),)),
        failure=Failure("crash", at_s=crash),
        **BASE,
    )
    p = _plan(prof)
    assert (p.lost_at, p.reason) == (lost_at, reason)


def test_periodic_trace_lost_at_the_next_offline_moment():
    av = Availability("trace", intervals=((0.0, 5.0), (8.0, 10.0)), period_s=10.0)
    prof = Profile("p", availability=av, **BASE)
    # dispatched at 9: online until 15 (the period wraps into [10, 15)); arrival at 17
    p = plan_task(prof, 1, 0, 0, 9.0, 4000, 3000, 8, 1.0)
    assert (p.lost_at, p.reason) == (15.0, "offline")
    # a shorter task (no samples: 2.5 + 3.5 s) dispatched at 8.5 arrives at 14.5 < 15
    p = plan_task(prof, 1, 0, 0, 8.5, 4000, 3000, 0, 1.0)
    assert p.arrive == 14.5 and not p.lost


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    device=st.integers(0, 500),
    now=st.floats(0.0, 500.0),
    samples=st.integers(0, 200),
)
def test_random_availability_loss_matches_queries(seed, device, now, samples):
    av = Availability("random", mean_on_s=30.0, mean_off_s=10.0)
    prof = Profile("p", jitter=0.2, availability=av, **BASE)
    if not av.is_online(now, seed, device):
        now = av.next_online(now, seed, device)
    p = plan_task(prof, seed, device, 7, now, 4000, 3000, samples, 1.0)
    assert p.start == now <= p.model_at <= p.compute_end <= p.arrive
    until = av.online_until(now, seed, device)
    assert p.lost == (until < p.arrive)
    if p.lost:
        assert p.lost_at == until and p.reason == "offline"
        assert not av.is_online(until, seed, device)
        assert p.intervals()[-1][2] == until
    # the intervals tile [start, end] without gaps
    iv = p.intervals()
    assert iv[0][1] == now and iv[-1][2] == p.end
    assert all(a[2] == b[1] for a, b in zip(iv, iv[1:]))
