"""``job.new_model``, as the worker core sets it (in one process: the inline backend runs
the worker's own task code): without a gate every task starts from a global model; with
Hermes' gate a device's first task and each task after one of its pushes do, its local
iterations in between do not (and a REFRESH makes one start from the new model)."""

from __future__ import annotations

import threading

import pytest

from edgefl.algorithms import Plugin, WorkerPlugin

SEEN: list[tuple[str, int, int, bool]] = []  # (event, device, task, new_model)
_LOCK = threading.Lock()


class _RecorderWorker(WorkerPlugin):
    def before_train(self, d, job):
        with _LOCK:
            SEEN.append(("task", d, job.task, job.new_model))

    def encode(self, up, job):
        if not up.flush:
            with _LOCK:
                SEEN.append(("push", up.device, up.task, False))


class Recorder(Plugin):
    name = "new_model_recorder"
    worker = _RecorderWorker


def _run(tmp_path, *sets: str) -> dict[int, list[tuple[str, int, bool]]]:
    import edgefl
    from edgefl.config.load import parse_override

    SEEN.clear()
    base = [
        "fleet.devices=4", "fleet.ranks=3", "run.rounds=12", "run.checkpoint_every=0",
        'output.progress="quiet"', 'algorithm.plugins=["test_new_model_flag:Recorder"]',
    ]  # fmt: skip
    over = dict(parse_override(s) for s in [*base, *sets])
    edgefl.simulate(overrides=over, out=tmp_path / "run", backend="inline")
    per: dict[int, list[tuple[str, int, bool]]] = {}
    for ev, d, task, new in SEEN:
        per.setdefault(d, []).append((ev, task, new))
    return per


def test_without_a_gate_every_task_starts_from_a_global_model(tmp_path):
    per = _run(tmp_path)
    tasks = [e for evs in per.values() for e in evs if e[0] == "task"]
    assert len(tasks) >= 4 * 12 and all(new for _, _, new in tasks)


@pytest.mark.parametrize("broadcast", ["pusher", "all"])
def test_with_hermes_gate_only_a_first_task_a_task_after_a_push_or_a_refresh(tmp_path, broadcast):
    per = _run(
        tmp_path, 'algorithm.consistency="asp"', 'algorithm.gate="hermes"',
        'algorithm.allocation="hermes"', 'algorithm.aggregation="loss-weighted"',
        'sim.profiles="hermes-12"', f'hermes.broadcast="{broadcast}"',
    )  # fmt: skip
    local = fresh_after_push = refreshed = 0
    for evs in per.values():
        tasks = [(t, new) for ev, t, new in evs if ev == "task"]
        pushed = {t for ev, t, _ in evs if ev == "push"}
        assert tasks[0][1], "a device's first task starts from a global model"
        for (prev, _), (t, new) in zip(tasks, tasks[1:]):
            if prev in pushed:
                assert new, f"task {t} after push {prev} continues its own model"
                fresh_after_push += 1
            elif not new:
                local += 1
            else:
                assert broadcast == "all", f"task {t}: new model without a push or REFRESH"
                refreshed += 1
    assert local > 0 and fresh_after_push > 0  # both kinds occurred
    assert (refreshed > 0) == (broadcast == "all")  # REFRESHes only with the broadcast
