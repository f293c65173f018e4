"""A version's metrics row (its test-set evaluation) finished after the next tasks are
dispatched (Coordinator._row_can_wait): the workers train while rank 0 evaluates. The rows
and the model are the ones of the order before (the row first), and every condition that
lets the row change what follows keeps that order."""

from __future__ import annotations

import json

import pytest
from golden.configs import MIXED, SMALL, job, run_loopback_dir

from edgefl.runtime import summary
from edgefl.runtime.coordinator import Coordinator

BSP = job(SMALL, "run.rounds=5", "run.checkpoint_every=0")


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        del row["wall_time_s"]
    return rows


def _run(tmp_path, name: str, sets: list[str], monkeypatch, wait: bool | None = None):
    """(summary, rows, tasks out at each evaluation) of a loopback run; ``wait`` forces
    _row_can_wait's answer (None: its own)."""
    out: list[int] = []
    evaluate = summary.evaluate_into

    def counting(core, row):
        out.append(len(core.inflight))
        evaluate(core, row)

    monkeypatch.setattr(summary, "evaluate_into", counting)
    if wait is not None:
        monkeypatch.setattr(Coordinator, "_row_can_wait", lambda self: wait)
    got = run_loopback_dir(sets, tmp_path / name)
    monkeypatch.undo()
    return got, _rows(tmp_path / name), out


def test_the_row_after_the_dispatch_is_the_row_before_it(tmp_path, monkeypatch):
    """BSP: every version but the last is evaluated with the next round's tasks out, and
    the metrics rows (but their wall times), the events and the model are those of the row
    written first."""
    late, late_rows, late_out = _run(tmp_path, "late", BSP, monkeypatch)
    first, first_rows, first_out = _run(tmp_path, "first", BSP, monkeypatch, wait=False)
    assert late_out[:-1] and all(n == 4 for n in late_out[:-1]), late_out  # (4 devices out)
    assert late_out[-1] == 0 and first_out == [0] * len(first_out)
    assert late["model_sha256"] == first["model_sha256"]
    assert late_rows == first_rows
    events = [(tmp_path / n / "events.jsonl").read_text() for n in ("late", "first")]
    assert events[0] == events[1]


@pytest.mark.parametrize(
    "sets, tasks_out",
    [
        (["run.checkpoint_every=2"], [4, 0, 4, 0, 0]),  # (a checkpoint holds its row)
        (["run.target_accuracy=0.99"], [0] * 5),  # (any row may stop the run)
        (["debug.stop_after_round=2"], [4, 0]),  # (row 2 stops it)
        # (a flush at the end: its apply makes a sixth version)
        (["algorithm.residual=gddr", "gddr.alpha=0.4", "gddr.tau=4"], [0] * 6),
    ],
    ids=["checkpoint", "target", "debug-stop", "flushing-plugin"],
)
def test_a_row_that_can_change_what_follows_comes_first(tmp_path, monkeypatch, sets,
                                                        tasks_out):  # fmt: skip
    """Tasks out at each evaluation: none where the row decides what follows."""
    _, _, out = _run(tmp_path, "run", job(BSP, *sets), monkeypatch)
    assert out == tasks_out


def test_asp_evaluates_after_the_next_task_is_out_too(tmp_path, monkeypatch):
    """Each version of an asynchronous run dispatches the device that made it again before
    its row: evaluated with that task out, the same model as row first."""
    sets = job(MIXED, "run.rounds=8", "algorithm.consistency=asp")
    late, late_rows, late_out = _run(tmp_path, "late", sets, monkeypatch)
    first, first_rows, _ = _run(tmp_path, "first", sets, monkeypatch, wait=False)
    assert max(late_out) == 6, late_out
    assert late["model_sha256"] == first["model_sha256"] and late_rows == first_rows
