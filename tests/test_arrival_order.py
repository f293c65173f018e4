"""The TRAINs of tasks planned together go out in the order their updates are planned to
arrive (Coordinator._send_in_arrival_order): rank 0 takes updates in virtual-time order and
a worker trains its tasks in the order their TRAINs came, so sent in the devices' order
most updates waited at rank 0 until the workers were done. The order of the sends is all
that changes: the model, the rows and events.jsonl are those of the devices' order."""

from __future__ import annotations

import json

from golden.configs import CHURN, MIXED, job, run_loopback_dir

from edgefl.runtime import planning
from edgefl.runtime.coordinator import Coordinator

BSP = job(MIXED, "fleet.devices=12", "run.rounds=4", "run.checkpoint_every=0")


def _run(tmp_path, name: str, sets: list[str], monkeypatch, ordered: bool = True):
    """(summary, rows, events.jsonl, the TRAINs of each multi-task decision as (planned
    arrival, device)) of a loopback run; ``ordered`` False sends them in the devices'
    order, as before the ordering."""
    waves: list[list[tuple[float, int]]] = []
    arrival: dict[int, float] = {}
    plan, send_train, in_order = planning.plan, Coordinator._send_train, None

    def planned(core, d, task, now, spec, download):
        ok = plan(core, d, task, now, spec, download)
        arrival[d] = core.planned_arrival
        return ok

    def sending(self, d, task, now, spec):
        if in_order is not None:
            in_order.append((arrival[d], d))
        send_train(self, d, task, now, spec)

    def wave(self, later, now):
        nonlocal in_order
        in_order = []
        if ordered:
            send(self, later, now)
        else:  # (the devices' order: the order they were planned in)
            for _, _, d, task, spec in later:
                self.model_to_rank(self.devices[d]["rank"])
                self._send_train(d, task, now, spec)
        waves.append(in_order)
        in_order = None

    send = Coordinator._send_in_arrival_order
    monkeypatch.setattr(planning, "plan", planned)
    monkeypatch.setattr(Coordinator, "_send_train", sending)
    monkeypatch.setattr(Coordinator, "_send_in_arrival_order", wave)
    got = run_loopback_dir(sets, tmp_path / name)
    monkeypatch.undo()
    rows = [
        json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    ]
    for row in rows:
        del row["wall_time_s"]
    return got, rows, (tmp_path / name / "events.jsonl").read_text(), waves


def test_a_round_is_sent_earliest_arrival_first_and_computes_the_same(tmp_path, monkeypatch):
    """BSP on devices of very different speeds: each round's TRAINs go out earliest planned
    arrival first (not the devices' order), and the model, rows and events are those of
    the devices' order."""
    got, rows, events, waves = _run(tmp_path, "ordered", BSP, monkeypatch)
    plain, plain_rows, plain_events, plain_waves = _run(
        tmp_path, "plain", BSP, monkeypatch, ordered=False
    )
    assert len(waves) == 4 and all(len(w) == 12 for w in waves), [len(w) for w in waves]
    for w in waves:
        assert w == sorted(w)
    assert any([d for _, d in w] != sorted(d for _, d in w) for w in waves)  # (it reorders)
    assert [sorted(w) for w in plain_waves] == waves  # (the same tasks, the same plans)
    assert got["model_sha256"] == plain["model_sha256"]
    assert rows == plain_rows
    assert events == plain_events


def test_lost_tasks_and_churn_are_unchanged(tmp_path, monkeypatch):
    """Devices going offline and one crashing (tasks lost when planned: never sent): the
    same run either way."""
    sets = job(CHURN, "run.rounds=4", "run.checkpoint_every=0")
    got, rows, events, waves = _run(tmp_path, "ordered", sets, monkeypatch)
    plain, plain_rows, plain_events, _ = _run(tmp_path, "plain", sets, monkeypatch, ordered=False)
    assert all(w == sorted(w) for w in waves)
    assert got["model_sha256"] == plain["model_sha256"]
    assert rows == plain_rows and events == plain_events
