"""Blame the device, not the host (issue 25, F2): a device whose task hangs or kills its host
is quarantined after its task failed on two ranks; every other device trains every round.

Real ``edgefl simulate`` jobs (the default job, 3 worker ranks) with a ``train.client`` that
breaks device 2 from model version 3 (tests/hang_client.py):

- it sleeps forever, with ``comm.failure_timeout_s = 5`` (rank silence finds it);
- it sleeps forever, default settings (the per-task watchdog ``fleet.task_timeout_s =
  auto`` finds it: before, the job waited forever);
- it SIGKILLs its own process (ULFM reports the death).

Each time the device's host is given up on (or dies), the task is re-run once, isolated, on
another rank; when that rank fails in it too, device 2 is quarantined ("task 3 timed out
twice") and the job completes with status 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_launch

MPI = pytest.mark.mpi
TESTS = Path(__file__).parent.parent  # (tests/hang_client.py)


def _run(out: Path, *sets: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(out)]
    for s in ("output.progress=quiet", "fleet.ranks=4", *sets):  # (3 worker ranks)
        cmd += ["--set", s]
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    proc = run_launch(cmd, timeout=timeout, env={**os.environ, "PYTHONPATH": path})
    return proc, time.monotonic() - t0


def _check(out: Path, text: str, why: str) -> dict:
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds_done"] == 20 and s["stopped"] == "", text[-3000:]
    q = s["quarantined"]
    assert list(q) == ["2"] and q["2"]["excluded_at"] == 3 and q["2"]["reason"] == why, q
    rounds = {int(d): v["rounds"] for d, v in s["devices"].items()}
    assert rounds.pop(2) == 3  # (versions 0, 1, 2)
    assert set(rounds.values()) == {20}, rounds  # every other device trained every round
    assert len(s["failed_ranks"]) == 2  # its first host and the one that re-ran it
    assert f"device 2 quarantined: {why}" in text
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    quarantine = [e for e in events if e["event"] == "quarantine"]
    assert [(e["device"], e["reason"]) for e in quarantine] == [(2, why)]
    assert sum(e["event"] == "failed" for e in events) == 2
    assert s["final_accuracy"] > 0.7
    return s


@MPI
def test_a_hang_found_by_rank_silence_quarantines_the_device(tmp_path, launcher):
    out = tmp_path / "run"
    proc, took = _run(
        out, "comm.failure_timeout_s=5", 'train.client="hang_client:hang_on_one_device"'
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    _check(out, text, "task 3 timed out twice")
    print(f"hang, comm.failure_timeout_s = 5: done in {took:.1f} s")


@MPI
def test_a_hang_under_default_settings_is_found_by_the_task_watchdog(tmp_path, launcher):
    out = tmp_path / "run"
    proc, took = _run(out, 'train.client="hang_client:hang_on_one_device"')
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    s = _check(out, text, "task 3 timed out twice")
    # the first timeout names the task rank 0 takes for the running one: the oldest its
    # host owes, device 2's or one sent before it whose update the host held while device 2
    # hung (TRAINs go out in the order their updates are planned to arrive); the second
    # is device 2's own, re-run isolated
    timeouts = [(t["device"], t["task"], t["rank"]) for t in s["task_timeouts"]]
    assert len(timeouts) == 2 and timeouts[1][:2] == (2, 3), timeouts
    assert timeouts[0][1] == 3 and timeouts[0][2] != timeouts[1][2]
    assert {str(r) for _, _, r in timeouts} == set(s["failed_ranks"]), s["failed_ranks"]
    assert all(t["deadline_s"] >= 10 for t in s["task_timeouts"])  # (the floor: generous)
    assert "past its deadline" in text and "fleet.task_timeout_s = auto" in text
    print(f"hang, default settings (watchdog): done in {took:.1f} s")


@MPI
def test_a_task_that_kills_its_host_twice_quarantines_the_device(tmp_path, launcher):
    out = tmp_path / "run"
    proc, took = _run(out, 'train.client="hang_client:crash_on_one_device"')
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    _check(out, text, "task 3 killed its host twice")
    print(f"crash: done in {took:.1f} s")
