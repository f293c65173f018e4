"""``edgefl bench startup`` without MPI: the phases read from a run directory and a process
tree, the /proc sampler of a process tree, the report's verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefl.bench import startup
from edgefl.bench.startup import PHASES, Proc, TreeSampler

linux = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux /proc")


def _proc(pid, ppid, start, argv, last=None):
    return Proc(pid, ppid, start, argv, start, last if last is not None else start)


def _touch(path: Path, t: float, text: str = "") -> None:
    path.write_text(text)
    os.utime(path, (t, t))


def _run_dir(root: Path, t0: float, ready: float) -> Path:
    run = root / "run"
    run.mkdir()
    rows = [{"round": r, "wall_time_s": 0.5 + 0.1 * (r - 1)} for r in (1, 2, 3)]
    _touch(run / "config.toml", t0 + ready)  # rank 0's copy
    _touch(run / "ranks.json", t0 + 6.0)
    _touch(run / "metrics.jsonl", t0 + 7.2, "".join(json.dumps(r) + "\n" for r in rows))
    _touch(run / "summary.json", t0 + 7.4)
    _touch(run / "final_model.pt", t0 + 7.5)
    return run


PY = ["/venv/bin/python3", "-P", "-m", "edgefl"]


def _tree(t0: float) -> list[Proc]:
    procs = [
        _proc(10, 1, t0, [*PY, "simulate", "job.toml"]),
        _proc(11, 10, t0 + 0.5, ["/venv/bin/mpiexec", "--version"]),
        _proc(12, 10, t0 + 0.8, ["/venv/bin/prterun", "-n", "2", *PY, "run", "c.toml"]),
        _proc(13, 12, t0 + 1.0, [*PY, "run", "c.toml"], last=t0 + 8.0),
        _proc(14, 12, t0 + 1.1, [*PY, "run", "c.toml"], last=t0 + 8.1),
    ]
    procs.append(_proc(15, 14, t0 + 5.0, [*PY, "run", "c.toml"]))  # a fork of a rank
    procs[-1].fork = True
    return procs


def test_phases_of_a_run_directory_and_process_tree(tmp_path):
    t0 = 1000.0
    run = _run_dir(tmp_path, t0, ready=4.1)
    procs = _tree(t0)
    assert [startup.is_rank(p) for p in procs] == [False, False, False, True, True, False]
    banner = startup.banner_time([
        (t0 + 0.2, "edgefl simulate: checked the data of ...\n"),
        (t0 + 4.0, "edgefl simulate: 4 devices on 1 worker ranks + coordinator (openmpi "
                   "5.0.11), run directory run\n"),
    ])  # fmt: skip
    assert banner == t0 + 4.0
    marks = startup.edgefl_marks(t0, t0 + 9.0, procs, run, banner)
    assert startup.phase_order(marks) == [
        "launch", "pre-check", "imports", "registration", "warm-up", "rounds",
        "final checkpoint", "finalize",
    ]  # fmt: skip
    got = startup.phase_seconds(marks)
    want = {"launch": 1.0, "pre-check": 3.0, "imports": 0.1, "registration": 1.9,
            "warm-up": 1.0, "rounds": 0.2, "final checkpoint": 0.3, "finalize": 1.5}  # fmt: skip
    assert list(got) == list(PHASES)
    assert got == pytest.approx(want)
    assert sum(got.values()) == pytest.approx(9.0)  # the phases add up to the whole command
    assert marks["ranks_exited"] == t0 + 8.1


def test_phases_when_the_check_runs_before_the_launch(tmp_path):
    t0 = 1000.0
    run = _run_dir(tmp_path, t0, ready=4.1)
    procs = [p for p in _tree(t0) if p.pid != 11]
    marks = startup.edgefl_marks(t0, t0 + 9.0, procs, run, banner=t0 + 0.6)
    assert startup.phase_order(marks)[:3] == ["pre-check", "launch", "imports"]
    got = startup.phase_seconds(marks)
    assert got["pre-check"] == pytest.approx(0.6) and got["launch"] == pytest.approx(0.4)
    assert got["imports"] == pytest.approx(3.1)


def test_a_missing_mark_leaves_its_phase_out_and_the_next_one_starts_earlier(tmp_path):
    t0 = 50.0
    _touch(tmp_path / "config.toml", t0 + 0.1)  # the launcher's copy: before mpiexec
    _touch(tmp_path / "ranks.json", t0 + 3.0)
    procs = [_proc(2, 1, t0 + 1.0, ["mpiexec", "-n", "2", "python", "-m", "edgefl", "run"]),
             _proc(3, 2, t0 + 1.2, ["python", "-m", "edgefl", "run", "c.toml"])]  # fmt: skip
    got = startup.phase_seconds(startup.edgefl_marks(t0, t0 + 4.0, procs, tmp_path))
    assert got["imports"] is None and got["warm-up"] is None and got["rounds"] is None
    assert got["pre-check"] is None
    assert got["registration"] == pytest.approx(1.8)  # from the rank's start
    assert got["finalize"] == pytest.approx(1.0)


def test_loop_marks_and_batches():
    marks = {"imported": 11.0, "built": 11.5, "round1": 12.0, "last_round": 14.0, "saved": 14.1}
    got = startup.phase_seconds(startup.loop_marks(10.0, 14.6, marks))
    assert got["pre-check"] == 0 and got["launch"] == 0 and got["imports"] == 1.0
    assert got["rounds"] == 2.0 and got["finalize"] == pytest.approx(0.5)
    import torch

    gen = torch.Generator().manual_seed(0)
    assert list(startup._batches(10, 0, 1, 5, gen)) == [None] * 5  # full batch, 5 steps
    sizes = [len(b) for b in startup._batches(10, 4, 2, 0, gen)]
    assert sizes == [4, 4, 2, 4, 4, 2]  # two epochs, the last batch short
    assert len(list(startup._batches(10, 4, 1, 7, gen))) == 7  # steps cycle through epochs


def test_summary_verdicts():
    rows = []
    for system, wall, rss in (("edgefl", 9.0, 700.0), ("loop", 4.0, 300.0)):
        row = {"job": "rounds", "system": system, "wall_s": wall, "peak_rss_mib": rss}
        rows.append({**row, **dict.fromkeys(PHASES, 1.0), "final_accuracy": 0.5})
    text, verdicts, med = startup.summarize(rows, ["rounds"])
    assert "rounds:ratio" in text.splitlines()[0]
    assert verdicts[0].startswith("# target 1") and "rounds job 2.25 (NOT met)" in verdicts[0]
    assert "rounds job 2.33 (NOT met)" in verdicts[1]
    assert med[("rounds", "loop")]["wall_s"] == 4.0


@linux
def test_sampler_sees_the_tree_and_leaves_forks_out():
    prog = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '0.6'])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(0.6); os._exit(0)\n"
        "time.sleep(0.7); p.wait(); os.waitpid(pid, 0)\n"
    )
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", prog])
    sampler = TreeSampler(proc.pid, 0.02).start()
    proc.wait()
    sampler.stop()
    procs = sampler.procs
    assert proc.pid in procs and sampler.samples > 5
    sleeps = [p for p in procs.values() if p.exe == "sleep"]
    forks = [p for p in procs.values() if p.fork]
    assert len(sleeps) == 1 and len(forks) == 1
    assert t0 - 0.05 < sleeps[0].start < time.time()  # /proc start time, in unix seconds
    assert sleeps[0].ppid == proc.pid
    # the fork (sharing its parent's pages) is not counted: the sum is the parent plus sleep
    assert procs[proc.pid].peak_rss > 0
    assert sampler.peak_rss <= procs[proc.pid].peak_rss + sleeps[0].peak_rss + (1 << 20)
