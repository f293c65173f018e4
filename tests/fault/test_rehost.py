"""Ranks killed or frozen from outside a real ``edgefl simulate`` job (issue 15): their
devices move to the surviving ranks and the run completes as if nothing happened.

1. One of the two worker ranks of the default job is SIGKILLed (``kill(1)`` from this test,
   not a debug hook) at a random round: under BSP without GDDR the final model is
   bit-identical to the clean run's, and the next model change follows the kill within 1 s.
2. (tests/fault/test_gddr_failure.py) The same with GDDR residuals: final accuracy within
   0.3 points of the clean run.
3. A worker is SIGSTOPped for 30 s with ``comm.failure_timeout_s = 5``: rank 0 declares
   it dead, moves its devices (bit-identical model again) and the job exits 0; the healthy
   workers never blame rank 0 (it sends liveness beats while it waits).
4. One device produces NaN under the Hermes gate: it is quarantined (excluded from
   aggregation, counted in summary.json) and the job goes on.

The rank pids come from ``ranks.json``, which rank 0 writes into the run directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import start_launch, when_rows

MPI = pytest.mark.mpi
TESTS = Path(__file__).parent.parent  # (tests/nan_client.py: the broken user client)


def _start(out: Path, *sets: str, env: dict | None = None) -> subprocess.Popen:
    """The run, started (its ranks.json written; an Open MPI launch failure repeated)."""
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(out)]
    # 2 worker ranks (fleet.ranks = 3, not the machine's "auto"): the tests name victims 1-2
    for s in ("output.progress=quiet", "fleet.ranks=3", *sets):
        cmd += ["--set", s]
    e = {**os.environ, **(env or {})}
    return start_launch(cmd, out / "ranks.json", env=e)


def _run(out: Path, *sets: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    p = _start(out, *sets, env=env)
    o, e = p.communicate(timeout=300)
    return p, o + e


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _signal_at(p: subprocess.Popen, out: Path, rank: int, at_round: int, sig: int) -> float:
    """Send ``sig`` to worker ``rank`` once ``at_round`` rounds are done; its time.time()."""
    os.kill(when_rows(p, out, at_round)[rank], sig)
    return time.time()


@pytest.fixture(scope="module")
def clean(tmp_path_factory, launcher) -> dict:
    """The default job without faults (20 BSP rounds, 8 devices), in one
    process: the inline backend trains the MPI run's model bit for bit
    (tests/test_golden_models.py, tests/test_api.py), in a fraction of the start-up."""
    import edgefl

    out = tmp_path_factory.mktemp("clean") / "run"
    return edgefl.simulate(
        overrides={"output.progress": "quiet"}, out=out, backend="inline"
    ).summary


def _check_moved(s: dict, victim: int, text: str) -> None:
    assert s["rounds_done"] >= 20 and s["stopped"] == ""  # (GDDR's flush: one more)
    assert list(s["failed_ranks"]) == [str(victim)]
    moved = {m["device"] for m in s["rehosted"]}
    assert moved == {d for d in range(8) if d % 2 == victim - 1}  # round-robin hosting
    assert all(m["to"] != victim for m in s["rehosted"])
    assert s["failed_devices"] == {}
    assert all(v["rounds"] == 20 for v in s["devices"].values())  # nobody left out
    assert f"rank {victim} failed; devices" in text and "re-hosted on ranks" in text


@MPI
def test_sigkill_from_outside_is_bit_identical(tmp_path, clean):
    rng = random.Random()
    victim, at = rng.randint(1, 2), rng.randint(2, 14)
    print(f"SIGKILL rank {victim} after round {at}")
    out = tmp_path / "run"
    # (debug.delay_s: some real time per task, so the kill lands mid-run; the virtual clock,
    # and so the result, does not see it)
    p = _start(out, "debug.delay_s=0.05")
    killed = _signal_at(p, out, victim, at, signal.SIGKILL)
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, (o + e)[-3000:]
    s = _summary(out)
    _check_moved(s, victim, o + e)
    assert s["model_sha256"] == clean["model_sha256"]
    after = [t for t in s["progress_after_failure_unix"] if t > killed]
    assert after and min(after) - killed < 1.0
    print(f"kill -> next model change {1e3 * (min(after) - killed):.0f} ms")


@MPI
def test_sigstop_frozen_rank_is_declared_dead(tmp_path, clean):
    out = tmp_path / "run"
    p = _start(out, "comm.failure_timeout_s=5", "debug.delay_s=0.05")
    t0 = time.monotonic()
    pid = None
    _signal_at(p, out, 2, 4, signal.SIGSTOP)
    pid = json.loads((out / "ranks.json").read_text())["2"]["pid"]
    try:
        o, e = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        o, e = "", ""
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # (rank 0 killed it: it runs on the same host)
    if p.returncode is None:
        o2, e2 = p.communicate(timeout=120)
        o, e = o + o2, e + e2
    text = o + e
    assert p.returncode == 0, text[-3000:]
    s = _summary(out)
    _check_moved(s, 2, text)
    assert s["model_sha256"] == clean["model_sha256"]
    assert "silent for more than 5 s" in text and "declared dead" in text
    assert "the coordinator (rank 0) is gone" not in text  # healthy workers kept faith
    print(f"SIGSTOP for up to 30 s: job done after {time.monotonic() - t0:.1f} s")


@MPI
def test_nan_device_is_quarantined_under_the_gate(tmp_path, launcher):
    out = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    p, text = _run(
        out, "algorithm.gate=hermes", 'train.client="nan_client:nan_on_one_device"', env=env
    )
    assert p.returncode == 0, text[-3000:]
    s = _summary(out)
    assert s["rounds_done"] == 20 and s["stopped"] == ""
    q = s["quarantined"]
    assert list(q) == ["3"] and q["3"]["updates"] == 3 and q["3"]["excluded_at"] is not None
    assert "device 3 (rank 2) task" in text and "device 3 quarantined" in text
    assert s["final_accuracy"] > 0.6
