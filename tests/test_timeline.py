"""Per-device timelines: waiting / offline / dead fill-in, idle fractions, CSV
(edgefl.sim.timeline)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.sim.clock import plan_task
from edgefl.sim.profiles import Availability, Failure, Profile
from edgefl.sim.timeline import STATES, Timeline, read_csv


def _rows(tl: Timeline, d: int) -> list[tuple[str, float, float]]:
    return [(s, a, b) for dd, s, a, b in tl.rows if dd == d]


def test_waiting_fills_the_gaps_without_profiles():
    tl = Timeline()
    tl.add(0, "compute", 2.0, 5.0)  # added out of order
    tl.add(0, "download", 1.0, 2.0)
    tl.add(0, "upload", 5.0, 6.0)
    tl.add(1, "compute", 3.0, 3.0)  # empty: ignored
    tl.finish([0, 1], 10.0)
    assert _rows(tl, 0) == [
        ("waiting", 0.0, 1.0),
        ("download", 1.0, 2.0),
        ("compute", 2.0, 5.0),
        ("upload", 5.0, 6.0),
        ("waiting", 6.0, 10.0),
    ]
    assert _rows(tl, 1) == [("waiting", 0.0, 10.0)]
    assert tl.idle == {0: 0.5, 1: 1.0}
    assert tl.idle_fraction() == pytest.approx(15 / 20)


def test_busy_intervals_are_clipped_at_the_end():
    tl = Timeline()
    tl.add(0, "compute", 0.0, 4.0)
    tl.add(0, "upload", 8.0, 12.0)  # runs past the end
    tl.add(0, "download", 12.0, 13.0)  # starts after the end
    tl.finish([0], 10.0)
    assert _rows(tl, 0) == [("compute", 0.0, 4.0), ("waiting", 4.0, 8.0), ("upload", 8.0, 10.0)]
    assert tl.idle[0] == pytest.approx(0.4)


def test_offline_and_dead_from_profiles():
    # online [0, 4) and [6, inf), crashes at 15; busy 1-3 and 7-9; the run ends at 20
    prof = Profile(
        "p",
        availability=Availability("trace", intervals=((0.0, 4.0), (6.0, 1e9))),
        failure=Failure("crash", at_s=15.0),
    )
    tl = Timeline()
    tl.add(0, "compute", 1.0, 3.0)
    tl.add(0, "compute", 7.0, 9.0)
    tl.finish([0], 20.0, profiles=[prof], seed=0)
    assert _rows(tl, 0) == [
        ("waiting", 0.0, 1.0),
        ("compute", 1.0, 3.0),
        ("waiting", 3.0, 4.0),
        ("offline", 4.0, 6.0),
        ("waiting", 6.0, 7.0),
        ("compute", 7.0, 9.0),
        ("waiting", 9.0, 15.0),
        ("dead", 15.0, 20.0),
    ]
    # waiting 1 + 1 + 1 + 6 = 9 of 13 s online and alive
    assert tl.idle[0] == pytest.approx(9 / 13)
    assert tl.idle_fraction() == pytest.approx(9 / 13)


def test_offline_at_start_and_after_a_finite_trace():
    prof = Profile("p", availability=Availability("trace", intervals=((2.0, 5.0),)))
    tl = Timeline()
    tl.add(0, "compute", 3.0, 4.0)
    tl.finish([0], 10.0, profiles=[prof])
    assert _rows(tl, 0) == [
        ("offline", 0.0, 2.0),
        ("waiting", 2.0, 3.0),
        ("compute", 3.0, 4.0),
        ("waiting", 4.0, 5.0),
        ("offline", 5.0, 10.0),
    ]
    assert tl.idle[0] == pytest.approx(2 / 3)


def test_periodic_trace():
    # online [0, 3) every 5 s, run ends at 12: offline 3-5, 8-10
    prof = Profile("p", availability=Availability("trace", intervals=((0.0, 3.0),), period_s=5.0))
    tl = Timeline()
    tl.finish([0], 12.0, profiles=[prof])
    assert _rows(tl, 0) == [
        ("waiting", 0.0, 3.0),
        ("offline", 3.0, 5.0),
        ("waiting", 5.0, 8.0),
        ("offline", 8.0, 10.0),
        ("waiting", 10.0, 12.0),
    ]
    assert tl.idle[0] == 1.0


def test_dead_from_the_start_and_overall_fraction():
    dead = Profile("dead", failure=Failure("crash", at_s=0.0))
    alive = Profile("alive")
    tl = Timeline()
    tl.add(1, "compute", 0.0, 6.0)
    tl.finish([0, 1], 8.0, profiles=[dead, alive])
    assert _rows(tl, 0) == [("dead", 0.0, 8.0)]
    assert tl.idle == {0: 0.0, 1: 0.25}
    assert tl.idle_fraction() == pytest.approx(0.25)  # the dead device counts for nothing


def test_empty_timeline_overall_fraction_is_zero():
    tl = Timeline()
    tl.finish([], 5.0)
    assert tl.rows == [] and tl.idle_fraction() == 0.0


def test_lost_task_meets_the_offline_interval():
    # a task lost when the device goes offline ends exactly where "offline" begins
    prof = Profile(
        "p",
        s_per_sample=0.25,
        up_bps=1000.0,
        down_bps=2000.0,
        latency_s=0.5,
        availability=Availability("trace", intervals=((0.0, 15.0), (17.0, 100.0))),
    )
    plan = plan_task(prof, 0, 0, 0, 10.0, 4000, 3000, 8, 1.0)
    assert plan.lost_at == 15.0
    tl = Timeline()
    for s, a, b in plan.intervals():
        tl.add(0, s, a, b)
    tl.finish([0], 20.0, profiles=[prof])
    assert _rows(tl, 0) == [
        ("waiting", 0.0, 10.0),
        ("download", 10.0, 12.5),
        ("compute", 12.5, 14.5),
        ("upload", 14.5, 15.0),
        ("offline", 15.0, 17.0),
        ("waiting", 17.0, 20.0),
    ]
    assert tl.idle[0] == pytest.approx(13 / 18)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    mtbf=st.floats(20.0, 400.0),
    gap=st.floats(0.0, 3.0),
    end=st.floats(1.0, 120.0),
)
def test_rows_tile_the_run_and_match_the_profile(seed, mtbf, gap, end):
    """A device that works whenever it can: its rows cover [0, end] without gaps or
    overlaps, offline exactly where its availability says so, dead after its crash."""
    prof = Profile(
        "p",
        s_per_sample=0.05,
        latency_s=0.2,
        jitter=0.3,
        availability=Availability("random", mean_on_s=8.0, mean_off_s=3.0),
        failure=Failure("mtbf", mtbf_s=mtbf),
    )
    av, d = prof.availability, 5
    crash = prof.failure.crash_time(seed, d)
    tl = Timeline()
    t, task = 0.0, 0
    while t < min(end, crash):
        if not av.is_online(t, seed, d):
            t = av.next_online(t, seed, d)
            continue
        plan = plan_task(prof, seed, d, task, t, 10_000, 10_000, 40, 1.0)
        task += 1
        for s, a, b in plan.intervals():
            tl.add(d, s, a, b)
        t = plan.end + gap
    tl.finish([d], end, profiles={d: prof}, seed=seed)
    rows = _rows(tl, d)
    assert rows[0][1] == 0.0 and rows[-1][2] == end
    assert all(s in STATES and a < b for s, a, b in rows)
    assert all(x[2] == y[1] for x, y in zip(rows, rows[1:]))
    for s, a, b in rows:
        mid = (a + b) / 2
        if s == "dead":
            assert a == crash
        elif s == "offline":
            assert not av.is_online(mid, seed, d) and b <= crash
        else:
            assert av.is_online(mid, seed, d) and b <= crash
    waiting = sum(b - a for s, a, b in rows if s == "waiting")
    present = sum(b - a for s, a, b in rows if s not in ("offline", "dead"))
    assert tl.idle[d] == pytest.approx(waiting / present if present else 0.0)
    assert tl.idle_fraction() == pytest.approx(tl.idle[d])


def test_csv_round_trip(tmp_path: Path):
    tl = Timeline()
    tl.add(0, "compute", 0.1 + 0.2, 1 / 3)  # floats that need every digit
    tl.add(2, "upload", math.pi, 2 * math.pi)
    prof = Profile("p", availability=Availability("trace", intervals=((0.0, 5.0),)))
    tl.finish([0, 2], 7.5, profiles={0: Profile("q"), 2: prof})
    path = tmp_path / "timeline.csv"
    tl.write_csv(path)
    assert read_csv(path) == tl.rows
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "device,state,start_s,end_s"
    assert len(lines) == len(tl.rows) + 1
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    devices = [r[0] for r in tl.rows]
    assert devices == sorted(devices)
