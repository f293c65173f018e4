"""The virtual-clock contract over real mpiexec: the same config and seed give the same
event log and a bit-identical final model, even when workers are slowed down at random."""

from __future__ import annotations

import json

import pytest
from conftest import run_edgefl

pytestmark = pytest.mark.mpi

BASE = [
    "--devices",
    "12",
    "--ranks",
    "3",
    "--set",
    "sim.profiles=edge-mix",
    "--set",
    "output.progress=quiet",
    "--set",
    "run.checkpoint_every=0",
]


def _run(tmp_path, name, policy, rounds, *extra):
    out = tmp_path / name
    proc = run_edgefl(
        "simulate",
        "--out",
        str(out),
        "--rounds",
        str(rounds),
        *BASE,
        "--set",
        f"algorithm.consistency={policy}",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    return out, summary


# ASP: the policy whose order of events depends on every device's timing (BSP rounds wait
# for everyone, so delays cannot reorder what they apply)
@pytest.mark.parametrize("policy,rounds", [("asp", 40)])
def test_same_events_and_model_under_random_real_delays(tmp_path, launcher, policy, rounds):
    a, sa = _run(tmp_path, "a", policy, rounds)
    b, sb = _run(tmp_path, "b", policy, rounds, "--set", "debug.delay_s=0.02")
    events_a = (a / "events.jsonl").read_bytes()
    assert len(events_a.splitlines()) > 3 * rounds
    assert events_a == (b / "events.jsonl").read_bytes()
    assert sa["model_sha256"] == sb["model_sha256"]
    assert sa["time_s"] == sb["time_s"]
    assert (a / "timeline.csv").read_bytes() == (b / "timeline.csv").read_bytes()
    # and the delays were real: the slowed run took longer on the wall clock
    assert sb["wall_time_s"] > sa["wall_time_s"]


def test_different_seed_changes_the_run(tmp_path):
    """(In one process: the inline backend trains what the MPI run trains.)"""
    import edgefl

    sets = {"fleet.devices": 12, "fleet.ranks": 3, "sim.profiles": "edge-mix",
            "output.progress": "quiet", "run.checkpoint_every": 0, "run.rounds": 20,
            "algorithm.consistency": "asp"}  # fmt: skip
    a = edgefl.simulate(overrides=sets, out=tmp_path / "a", backend="inline")
    b = edgefl.simulate(overrides={**sets, "seed": 1}, out=tmp_path / "b", backend="inline")
    assert a.model_sha256 != b.model_sha256
