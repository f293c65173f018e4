"""A worker rank SIGKILLed from outside in the middle of a vectorized run (``train.vectorize
= "auto"``: a worker's TRAINs and UPDATEs travel as BUNDLE messages, a stack's devices of
different sizes train padded together): rank 0 finds the rank dead, re-hosts its devices on
the workers left, and the run completes with the failure recorded; its devices still train
stacked there."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import when_rows
from test_stops import _start, _summary

MPI = pytest.mark.mpi


def _killed(out, rows: int, rounds: int, *sets: str) -> dict:
    """A 400-device run on 4 ranks whose rank 2 is SIGKILLed (from here, not a debug hook)
    once ``rows`` metrics rows are out: it completes, with rank 2 failed and its devices
    re-hosted on the workers left; its summary."""
    p = _start(out, "fleet.ranks=4", "fleet.devices=400", f"run.rounds={rounds}",
               "run.checkpoint_every=0", *sets)  # fmt: skip
    pids = when_rows(p, out, rows)
    os.kill(pids[2], signal.SIGKILL)
    o, e = p.communicate(timeout=240)
    assert p.returncode == 0, (o + e)[-3000:]
    s = _summary(out)
    assert s["rounds_done"] == rounds and s["stopped"] == "", s["stopped"]
    assert list(s["failed_ranks"]) == ["2"], (o + e)[-3000:]
    assert s["rehosted"] and {m["to"] for m in s["rehosted"]} <= {1, 3}
    return s


@MPI
def test_a_worker_killed_mid_run_of_a_vectorized_job(tmp_path, launcher):
    # (no debug.delay_s to slow it down: a debug hook keeps every task one by one; 400
    # devices make a round long enough to be killed in)
    s = _killed(tmp_path / "run", 4, 20, 'train.vectorize="auto"')
    # the tasks trained stacked (400 devices x 20 rounds, less the killed rank's share of
    # the run up to its death, which it could not report)
    assert s["stacked_tasks"] >= 400 * 20 * 2 // 3, s["stacked_tasks"]
    # and it learnt as the run without the kill does (in one process, the same job)
    import edgefl

    clean = edgefl.simulate(
        overrides={"output.progress": "quiet", "fleet.devices": 400, "run.checkpoint_every": 0,
                   "train.vectorize": "auto"},
        out=tmp_path / "clean", backend="inline",
    ).summary  # fmt: skip
    assert abs(s["final_accuracy"] - clean["final_accuracy"]) <= 0.03, (s, clean)


@MPI
@pytest.mark.parametrize("vectorize", ["off", "auto"])
def test_a_worker_killed_mid_run_of_a_gated_vectorized_job(tmp_path, launcher, vectorize):
    """Hermes with its gate, stacked or not: each device trains from its own local model on
    its worker. A worker SIGKILLed mid-run loses its devices' local models; rank 0 re-hosts
    them on the workers left, where they start again from the global model, and the run
    completes with only the killed rank failed (before the fix, a re-hosted device's next
    local iteration named a local model its new rank never had, or the model version of
    its re-run was dropped before its TRAIN came: the new rank ignored the task, rank 0
    declared it dead at the task's deadline, and the run ended with no worker left)."""
    s = _killed(tmp_path / "run", 40, 400, f'train.vectorize="{vectorize}"',
                'algorithm.gate="hermes"', 'algorithm.consistency="asp"',
                "hermes.max_local_iterations=3")  # fmt: skip
    assert (s["stacked_tasks"] > 400) == (vectorize == "auto"), s["stacked_tasks"]
