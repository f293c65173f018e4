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


def test_event_lines_are_the_json_of_their_record():
    """events.jsonl lines are formatted directly (a large fleet writes two per device and
    round); the text is json.dumps's of the record, whatever the values."""
    from edgefl.runtime.coordinator import event_line

    cases = [(0.0, "dispatch", 3, 0, 1, {}), (1.5e-7, "apply", -1, -1, 4, {"updates": 3}),
             (123456.789, "timer", -1, -1, 2, {"token": 5}), (float("nan"), "x", 1, 1, 1, {}),
             (0, "x", 1, 1, 1, {}), (1.0, "x", True, 1, 1, {}), (2.0, "lost", 1, 2, 3, {"t": 9}),
             (1e300, "arrive", 10**6, 7, 0, {"a": 1.5, "b": "x"}),
             (2.5, "é", 1, 1, 1, {})]  # fmt: skip
    for now, event, device, task, v, extra in cases:
        rec = {"t": now, "event": event, "device": device, "task": task, "v": v, **extra}
        assert event_line(now, event, device, task, v, extra) == json.dumps(rec) + "\n"
