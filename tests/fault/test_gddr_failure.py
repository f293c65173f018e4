"""GDDR when a device dies or moves: its last residual checkpoint is replayed (or, if that
checkpoint is missing or corrupt, the run goes on without it and says so).

Two kinds of death: a worker rank SIGKILLed from outside over real mpiexec (ULFM detects
it; its devices are re-hosted and their residual checkpoints folded in at rank 0), and a
simulated device crash from its profile (virtual clock, deterministic: the device is dead,
its residual replayed; run in one process)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
from conftest import start_launch, when_rows

IID = ["--set", "data.source=partition", "--set", 'data.args={scheme="iid"}']
GDDR = ["--set", "algorithm.residual=gddr", "--set", "gddr.checkpoint_every=2"]
QUIET = ["--set", "output.progress=quiet", "--set", "run.checkpoint_every=0"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """The same job without the kill, in one process: under the virtual clock the inline
    backend trains the MPI run's model bit for bit (tests/test_golden_models.py), in a
    fraction of the start-up."""
    import edgefl

    sets = {"fleet.devices": 8, "fleet.ranks": 5, "run.rounds": 40,
            "data.source": "partition", "data.args": {"scheme": "iid"},
            "algorithm.residual": "gddr", "gddr.checkpoint_every": 2,
            "output.progress": "quiet", "run.checkpoint_every": 0}  # fmt: skip
    out = tmp_path_factory.mktemp("gddr-clean") / "run"
    return edgefl.simulate(overrides=sets, out=out, backend="inline").summary


@pytest.mark.mpi
def test_rehosted_after_sigkill_from_outside_keeps_accuracy(tmp_path, clean):
    """The default (re-hosting): rank 3 SIGKILLed by this test after 16 rounds (the round-16
    residual checkpoints exist); its devices move, their checkpointed residuals are folded
    in at rank 0, and the run ends within 0.3 points of the clean one."""
    out = tmp_path / "hit"
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(out), "--devices", "8",
           "--ranks", "5", "--rounds", "40", *IID, *GDDR, *QUIET,
           "--set", "debug.delay_s=0.03"]  # fmt: skip
    p = start_launch(cmd, out / "ranks.json")  # (an Open MPI launch failure repeated)
    os.kill(when_rows(p, out, 16)[3], signal.SIGKILL)  # (the round-16 checkpoints exist)
    killed = time.time()
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, o[-2000:] + e[-3000:]
    hit = json.loads((out / "summary.json").read_text())
    assert list(hit["failed_ranks"]) == ["3"] and hit["failed_devices"] == {}
    assert sorted(m["device"] for m in hit["rehosted"]) == [2, 6]
    assert sorted(r["device"] for r in hit["gddr"]["replays"]) == [2, 6]
    assert hit["gddr"]["replay_errors"] == []
    assert all(v["rounds"] >= 40 for v in hit["devices"].values())
    assert hit["final_accuracy"] >= clean["final_accuracy"] - 0.003 - 1e-9
    after = [t for t in hit["progress_after_failure_unix"] if t > killed]
    assert after and min(after) - killed < 1.0
    print(
        f"GDDR re-hosted: accuracy {hit['final_accuracy']:.4f} (clean "
        f"{clean['final_accuracy']:.4f}), kill -> progress {min(after) - killed:.3f} s"
    )


def _crash_fleet(path):
    path.write_text(
        "shuffle = false\n"
        '[[device]]\nname = "doomed"\ncount = 1\n'
        '[device.failure]\nmode = "crash"\nat_s = 0.25\n'
        '[[device]]\nname = "steady"\ncount = 5\n'
    )
    return path


def test_simulated_crash_replays_the_residual(tmp_path):
    fleet = _crash_fleet(tmp_path / "fleet.toml")
    s = _run_sim(tmp_path / "ok", fleet, [])
    assert s["failed_devices"] == {"0": pytest.approx(0.25)}
    assert [r["device"] for r in s["gddr"]["replays"]] == [0]
    assert s["gddr"]["replay_errors"] == []


def test_missing_residual_checkpoint_logged_and_run_goes_on(tmp_path):
    fleet = _crash_fleet(tmp_path / "fleet.toml")
    s = _run_sim(tmp_path / "none", fleet, ["--set", "gddr.checkpoint_every=0"])
    errs = s["gddr"]["replay_errors"]
    assert [e["device"] for e in errs] == [0] and "gddr-residual-000000.h5" in errs[0]["error"]
    assert s["gddr"]["replays"] == [] and s["rounds_done"] >= 12


def _run_sim(out, fleet, extra):
    """A device crash from its profile is a virtual-clock event, not a process death: the
    job runs in this process (the inline backend: the MPI run's arithmetic)."""
    import edgefl
    from edgefl.config.load import parse_override

    sets = ["fleet.devices=6", "fleet.ranks=3", "run.rounds=12", f"sim.profiles={fleet}"]
    sets += [s for s in (*GDDR, *QUIET, *extra) if s != "--set"]
    over = dict(parse_override(s) for s in sets)
    return edgefl.simulate(overrides=over, out=out, backend="inline").summary
