"""Per-device timelines: waiting / offline / dead fill-in, idle fractions, CSV
(edgefl.sim.timeline)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.sim.clock import plan_task
from edgefl.sim.profiles import Availability, Failure, Profile
from edgefl.sim.timeline import STATES, Timeline, read_csv

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (golden.configs)


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


def test_streamed_csv_equals_the_kept_rows(tmp_path: Path):
    """finish(csv_path=...) writes the file write_csv writes from kept rows, keeps none of
    them, and gives the same idle fractions (the coordinator streams: a large fleet's long
    run has millions of rows)."""
    prof = Profile("p", availability=Availability("trace", intervals=((0.0, 5.0), (6.0, 9.0))))

    def filled() -> Timeline:
        tl = Timeline()
        for d in (3, 0, 2):  # devices added out of order, intervals too
            for r in range(4, 0, -1):
                tl.add(d, "compute", r + 0.1 * d, r + 0.5 + 1 / 3)
                tl.add(d, "download", r, r + 0.1 * d)
        return tl

    kept, streamed = filled(), filled()
    profiles = {0: Profile("q"), 2: prof, 3: prof}
    kept.finish([0, 2, 3], 7.5, profiles=profiles, seed=1)
    kept.write_csv(tmp_path / "kept.csv")
    path = tmp_path / "timeline.csv"
    streamed.finish([0, 2, 3], 7.5, profiles=profiles, seed=1, csv_path=path)
    assert path.read_bytes() == (tmp_path / "kept.csv").read_bytes()
    assert streamed.rows == [] and len(kept.rows) > 12
    assert streamed.idle == kept.idle and 0 < streamed.idle_fraction() < 1
    assert streamed.idle_fraction() == kept.idle_fraction()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.csv", "timeline.csv"]


# -- across resumes and on the wall clock ---------------------------------------------------
def test_state_dict_round_trip_keeps_or_cuts_the_tasks_in_flight():
    tl = Timeline()
    tl.add(0, "download", 0.5, 1.0)
    tl.add(0, "compute", 1.0, 4.0)  # in flight at the checkpoint (t = 2)
    tl.add(3, "upload", 0.25, 1.5)
    st = tl.state_dict()
    assert st["busy"].shape == (3, 4) and st["origin"] == 0.0
    kept = Timeline()
    kept.load_state_dict(st, 2.0, keep_future=True)
    assert dict(kept.busy) == dict(tl.busy)
    cut = Timeline()
    cut.load_state_dict(st, 2.0, keep_future=False)
    assert cut.busy[0] == [("download", 0.5, 1.0), ("compute", 1.0, 2.0)]
    empty = Timeline().state_dict()
    assert empty["busy"].shape == (0, 4)


def test_a_checkpoint_without_a_timeline_starts_it_at_the_checkpoint():
    tl = Timeline()
    tl.load_state_dict(None, 5.0, keep_future=True)  # (a checkpoint of an older edgefl)
    tl.add(0, "compute", 6.0, 8.0)
    tl.finish([0], 10.0)
    assert _rows(tl, 0) == [("waiting", 5.0, 6.0), ("compute", 6.0, 8.0), ("waiting", 8.0, 10.0)]
    assert tl.idle[0] == pytest.approx(0.6)  # not 8 / 10: the first 5 s are not waiting


def test_a_bad_timeline_in_a_checkpoint_is_one_error():
    import numpy as np

    from edgefl.errors import CheckpointError

    with pytest.raises(CheckpointError, match="timeline/busy"):
        Timeline().load_state_dict({"busy": np.zeros((2, 3))}, 1.0, keep_future=True)
    with pytest.raises(CheckpointError, match="bad row"):
        Timeline().load_state_dict({"busy": np.array([[0, 9, 0, 1.0]])}, 1.0, keep_future=True)


def _loopback(sets: list[str], run_dir: Path, resume: Path | None = None):
    """Run a golden configuration in one process, writing ``run_dir``; the coordinator and
    summary.json."""
    import json

    from conftest import run_loopback_job
    from golden.configs import effective_config

    from edgefl.ckpt import load_checkpoint
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg, ranks = effective_config(sets)
    task0 = build_task(cfg)
    state = load_checkpoint(resume) if resume is not None else None

    def coordinator(cfg_, t, task, out_dir=None):
        return Coordinator(cfg_, t, task0, out_dir=run_dir, resume=state)

    coord, statuses = run_loopback_job(cfg, ranks, coordinator_cls=coordinator)
    assert statuses == [0] * ranks, statuses
    return coord, json.loads((run_dir / "summary.json").read_text())


# BSP on devices going on and off line, ASP (tasks in flight at every checkpoint), Hermes
# (gated pushes: planned uploads)
RESUMED = [
    ("bsp_churn", ["algorithm.consistency=bsp", "run.rounds=6"], "churn_asp"),
    ("asp", [], "asp"),
    ("hermes", [], "hermes"),
]


@pytest.mark.parametrize("label, extra, base", RESUMED, ids=[r[0] for r in RESUMED])
def test_resumed_run_has_the_uninterrupted_timeline(tmp_path: Path, label, extra, base):
    from golden.configs import CONFIGS, effective_config, job

    sets = job(CONFIGS[base], *extra)
    k = max(1, effective_config(sets)[0]["run"]["rounds"] // 2)
    _, whole = _loopback(sets, tmp_path / "whole")
    _, part = _loopback(job(sets, f"debug.stop_after_round={k}"), tmp_path / "part")
    ckpt = tmp_path / "part" / "checkpoints" / f"ckpt-{k:06d}.h5"
    _, resumed = _loopback(sets, tmp_path / "resumed", resume=ckpt)
    assert resumed["model_sha256"] == whole["model_sha256"]
    a = (tmp_path / "whole" / "timeline.csv").read_text()
    b = (tmp_path / "resumed" / "timeline.csv").read_text()
    assert read_csv(tmp_path / "resumed" / "timeline.csv")[0][2] == 0.0  # from second 0
    assert b == a, f"{label}: timeline.csv after the resume differs"
    assert resumed["idle_fraction"] == whole["idle_fraction"]
    for d, dev in whole["devices"].items():
        assert resumed["devices"][d]["idle_fraction"] == dev["idle_fraction"], d
    if label == "bsp_churn":  # (idle time and offline rows exist, so the check can fail)
        assert 0.0 < whole["idle_fraction"] < 1.0 and ",offline," in a


def test_wall_clock_idle_fraction_comes_from_the_measured_compute(tmp_path: Path):
    from golden.configs import SMALL, job

    sets = job(SMALL, "sim.clock=wall", "run.rounds=4")
    coord, summary = _loopback(sets, tmp_path / "run")
    rows = read_csv(tmp_path / "run" / "timeline.csv")
    states = {s for _, s, _, _ in rows}
    assert states == {"compute", "waiting"}
    compute = sum(b - a for _, s, a, b in rows if s == "compute")
    measured = sum(dev["time_s"] for dev in summary["devices"].values())  # sum of aux[2]
    assert compute == pytest.approx(measured, rel=1e-6) and compute > 0
    end = summary["time_s"]
    n = len(summary["devices"])
    assert sum(b - a for _, _, a, b in rows) == pytest.approx(n * end)  # rows tile the run
    idle = summary["idle_fraction"]
    assert 0.0 < idle < 1.0
    assert idle == pytest.approx(1.0 - measured / (n * end), rel=1e-6)
    for dev in summary["devices"].values():
        assert dev["idle_fraction"] == pytest.approx(1.0 - dev["time_s"] / end, rel=1e-6)
    assert coord.timeline.idle_fraction() == idle


def test_busy_intervals_are_kept_as_columns():
    """Issue 27: rank 0 keeps every task's busy intervals for the whole run; as columns
    they take about 25 bytes an interval (a tuple in a list per device took about 120),
    and read back as before: by device, each device's in the order added."""
    import tracemalloc

    tl = Timeline()
    tracemalloc.start()
    try:
        for d in range(10_000):
            for k, s in enumerate(("download", "compute", "upload")):
                tl.add(d, s, d + k + 0.5, d + k + 1.25)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 40 * 30_000, f"{kept / 30_000:.0f} bytes per interval"
    tl.add(3, "compute", 0.0, 0.25)
    assert tl.busy[3] == [("download", 3.5, 4.25), ("compute", 4.5, 5.25),
                          ("upload", 5.5, 6.25), ("compute", 0.0, 0.25)]  # fmt: skip
    busy = tl.state_dict()["busy"]
    assert busy.shape == (30_001, 4) and str(busy.dtype) == "float64"
    assert busy[9].tolist() == [3.0, 0.0, 3.5, 4.25] and busy[12].tolist() == [3.0, 1.0, 0.0, 0.25]
