"""A worker rank SIGKILLed from outside in the middle of a vectorized run (``train.vectorize
= "auto"``: a worker's TRAINs and UPDATEs travel as BUNDLE messages, a stack's devices of
different sizes train padded together): rank 0 finds the rank dead, re-hosts its devices on
the workers left, and the run completes with the failure recorded; its devices still train
stacked there."""

from __future__ import annotations

import os
import signal

import pytest
from test_stops import _start, _summary, _when_rows

MPI = pytest.mark.mpi


@MPI
def test_a_worker_killed_mid_run_of_a_vectorized_job(tmp_path, launcher):
    out = tmp_path / "run"
    # (no debug.delay_s to slow it down: a debug hook keeps every task one by one; 400
    # devices make a round long enough to be killed in)
    p = _start(out, "fleet.ranks=4", "fleet.devices=400", 'train.vectorize="auto"',
               "run.checkpoint_every=0")  # fmt: skip
    pids = _when_rows(p, out, 4)
    os.kill(pids[2], signal.SIGKILL)
    o, e = p.communicate(timeout=180)
    assert p.returncode == 0, (o + e)[-3000:]
    s = _summary(out)
    assert s["rounds_done"] == 20 and s["stopped"] == "", s["stopped"]
    assert list(s["failed_ranks"]) == ["2"]
    assert s["rehosted"] and {m["to"] for m in s["rehosted"]} <= {1, 3}
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
    """Hermes with its gate, stacked: each device trains from its own local model on its
    worker. A worker SIGKILLed mid-run loses its devices' local models; rank 0 re-hosts
    them on the workers left, where they start again from the global model (stacked too),
    and the run completes with the failure recorded."""
    out = tmp_path / "run"
    p = _start(out, "fleet.ranks=4", "fleet.devices=400", f'train.vectorize="{vectorize}"',
               'algorithm.gate="hermes"', 'algorithm.consistency="asp"',
               "hermes.max_local_iterations=3", "run.rounds=400",
               "run.checkpoint_every=0")  # fmt: skip
    pids = _when_rows(p, out, 40)
    os.kill(pids[2], signal.SIGKILL)
    o, e = p.communicate(timeout=240)
    assert p.returncode == 0, (o + e)[-3000:]
    s = _summary(out)
    assert s["rounds_done"] == 400 and s["stopped"] == "", s["stopped"]
    assert list(s["failed_ranks"]) == ["2"], (o + e)[-3000:]
    assert s["rehosted"] and {m["to"] for m in s["rehosted"]} <= {1, 3}
    assert (s["stacked_tasks"] > 400) == (vectorize == "auto"), s["stacked_tasks"]
