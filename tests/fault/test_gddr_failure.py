"""GDDR when a device dies: its last residual checkpoint is replayed (or, if that checkpoint
is missing or corrupt, the run goes on without it and says so).

Two kinds of death: a worker rank SIGKILLed over real mpiexec (ULFM detects it), and a
simulated device crash from its profile (virtual clock, deterministic)."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_edgefl

pytestmark = pytest.mark.mpi

IID = ["--set", "data.source=partition", "--set", 'data.args={scheme="iid"}']
GDDR = ["--set", "algorithm.residual=gddr", "--set", "gddr.checkpoint_every=2"]
QUIET = ["--set", "output.progress=quiet", "--set", "run.checkpoint_every=0"]


def _run(out, *extra):
    proc = run_edgefl(
        "simulate", "--out", str(out), "--devices", "8", "--ranks", "5", "--rounds", "40",
        *IID, *GDDR, *QUIET, *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_sigkilled_worker_residual_replayed_and_accuracy_kept(tmp_path, launcher):
    clean = _run(tmp_path / "clean")
    hit = _run(tmp_path / "hit", "--set", "debug.kill_ranks=[2]", "--set",
               "debug.kill_after_tasks=12")  # fmt: skip
    assert hit["failed_ranks"] and len(hit["failed_devices"]) == 2
    replays = hit["gddr"]["replays"]
    assert sorted(r["device"] for r in replays) == sorted(int(d) for d in hit["failed_devices"])
    assert all(r["coordinates"] > 0 for r in replays)
    assert hit["gddr"]["replay_errors"] == []
    assert hit["rounds_done"] >= 40
    # the run goes on and ends as accurate as the run without the failure (0.3 points)
    assert abs(hit["final_accuracy"] - clean["final_accuracy"]) <= 0.003 + 1e-9
    # from the kill to the next model change
    killed_at = float((tmp_path / "hit" / "kill-rank2.time").read_text())
    resumed = hit["progress_after_failure_unix"][0] - killed_at
    print(f"kill -> resumed progress: {resumed * 1000:.1f} ms")
    assert 0 < resumed < 2.0


def _crash_fleet(path):
    path.write_text(
        "shuffle = false\n"
        '[[device]]\nname = "doomed"\ncount = 1\n'
        '[device.failure]\nmode = "crash"\nat_s = 0.25\n'
        '[[device]]\nname = "steady"\ncount = 5\n'
    )
    return path


def test_simulated_crash_replays_the_residual(tmp_path, launcher):
    fleet = _crash_fleet(tmp_path / "fleet.toml")
    s = _run_sim(tmp_path / "ok", fleet, [])
    assert s["failed_devices"] == {"0": pytest.approx(0.25)}
    assert [r["device"] for r in s["gddr"]["replays"]] == [0]
    assert s["gddr"]["replay_errors"] == []


def test_missing_residual_checkpoint_logged_and_run_goes_on(tmp_path, launcher):
    fleet = _crash_fleet(tmp_path / "fleet.toml")
    s = _run_sim(tmp_path / "none", fleet, ["--set", "gddr.checkpoint_every=0"])
    errs = s["gddr"]["replay_errors"]
    assert [e["device"] for e in errs] == [0] and "gddr-residual-000000.h5" in errs[0]["error"]
    assert s["gddr"]["replays"] == [] and s["rounds_done"] >= 12


def _run_sim(out, fleet, extra):
    t0 = time.monotonic()
    proc = run_edgefl(
        "simulate", "--out", str(out), "--devices", "6", "--ranks", "3", "--rounds", "12",
        "--set", f"sim.profiles={fleet}", *GDDR, *QUIET, *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    return json.loads((out / "summary.json").read_text())
