"""The task watchdog's deadlines and the strikes against tasks (edgefl/runtime/blame.py),
without processes; tests/fault/test_blame.py runs them in real jobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgefl.comm.taskflags import ISOLATE, pack_flags
from edgefl.runtime import blame


def _core(task_timeout_s="auto", failure_timeout_s=0.0, virtual=True):
    cfg = {"fleet": {"task_timeout_s": task_timeout_s},
           "comm": {"failure_timeout_s": failure_timeout_s}}  # fmt: skip
    return SimpleNamespace(cfg=cfg, virtual=virtual)


def _answer(rank, d, task, seconds):
    return SimpleNamespace(src=rank, device=d, round=task, aux=(10.0, 0.5, seconds, 0.0))


PLAIN = (0.0, 0.0, 0.0, 0.0)
ISO = (0.0, 0.0, 0.0, float(pack_flags(ISOLATE, 0)))


def test_auto_is_on_under_the_virtual_clock_only():
    assert blame.TaskWatch(_core(), 64).on
    assert not blame.TaskWatch(_core(virtual=False), 64).on  # (edgefl run)
    assert not blame.TaskWatch(_core(0.0), 64).on
    assert blame.TaskWatch(_core(30.0, virtual=False), 64).on


def test_the_deadline_is_sized_from_measured_speed():
    w = blame.TaskWatch(_core(), 64)
    # nothing measured: 60 s, and 60 s more for a device's first task on a rank
    assert w.deadline(0, 1, False) == blame.FIRST_S + blame.FIRST_S
    w.sent(1, 0, 0, PLAIN, 0.0)
    w.answered(_answer(1, 0, 0, 0.004), 1.0)
    assert w.deadline(0, 1, False) == blame.FLOOR_S  # (the floor: 10 x 4 ms is less)
    w.sent(1, 1, 0, PLAIN, 0.0)
    w.answered(_answer(1, 1, 0, 3.0), 1.0)
    assert w.deadline(1, 1, False) == 30.0  # 10 x its slowest task
    w.sent(1, 1, 1, PLAIN, 0.0)
    w.answered(_answer(1, 1, 1, 1.0), 2.0)
    assert w.deadline(1, 1, False) == 30.0  # (the slowest counts)
    # a device not measured yet: the fleet's median (of 4 ms and 3 s), plus its first task
    assert w.deadline(7, 1, False) == pytest.approx(10 * 1.502 + blame.FIRST_S)
    assert w.deadline(7, 1, True) == pytest.approx(10 * 1.502)  # (timed from STARTED)
    # rank silence finds a hang first: auto waits longer than comm.failure_timeout_s
    w = blame.TaskWatch(_core(failure_timeout_s=20.0), 64)
    w.sent(1, 0, 0, PLAIN, 0.0)
    w.answered(_answer(1, 0, 0, 0.004), 1.0)
    assert w.deadline(0, 1, False) == 26.0
    # a number: that deadline for every task
    assert blame.TaskWatch(_core(5.0), 64).deadline(0, 1, False) == 5.0


def test_the_running_task_is_timed_from_the_ranks_last_message():
    w = blame.TaskWatch(_core(), 2)
    for d in (0, 1, 2, 3):
        w.sent(1, d, 0, PLAIN, 0.0)
        w.answered(_answer(1, d, 0, 0.01), 0.5)  # (all measured, all answered once here)
    for d in (0, 1, 2, 3):
        w.sent(1, d, 1, PLAIN, 1.0)
    w.answered(_answer(1, 0, 1, 0.01), 3.0)
    key, since, limit = w.running(1)
    assert key == (1, 1) and since == 3.0 and limit == blame.FLOOR_S
    w.heard_from(1, 4.0)  # (any message counts)
    assert w.running(1)[1] == 4.0
    w.sent(2, 5, 0, ISO, 1.0)  # an isolated task: timed from its STARTED
    w.on_started(SimpleNamespace(src=2, device=5, round=0), 6.0)
    assert w.running(2) == ((5, 0), 6.0, blame.FLOOR_S)  # (the fleet's median x 10: floor)
    assert w.running(3) is None


def test_two_failures_in_the_same_task_quarantine_its_device():
    w = blame.TaskWatch(_core(), 2)
    for d in (0, 1, 2, 3):
        w.sent(1, d, 4, PLAIN, 0.0)
    w.cause[1] = blame.TIMED_OUT
    # the first failure: the oldest unanswered tasks may have been running (held updates):
    # each gets a strike and goes isolated; nothing is quarantined
    assert w.rank_lost(1) == {}
    assert w.isolated(0, 4) and w.isolated(1, 4) and w.isolated(2, 4)
    assert not w.isolated(3, 4)  # (beyond the updates a worker holds: never started)
    assert w.owed.get(1) is None
    # device 1's isolated re-run was what rank 2 ran when it failed: quarantined
    w.sent(2, 9, 4, PLAIN, 1.0)
    w.answered(_answer(2, 9, 4, 0.01), 1.5)
    w.sent(2, 1, 4, ISO, 1.0)
    w.sent(2, 0, 4, ISO, 1.0)
    assert w.rank_lost(2) == {1: (4, "task 4 timed out, then killed its host")}
    # an isolated task with no strike yet (a resumed run's): the first failure strikes it
    w.sent(3, 6, 2, ISO, 0.0)
    assert w.rank_lost(3) == {}
    w.sent(4, 6, 2, ISO, 0.0)
    w.cause[4] = blame.TIMED_OUT
    assert w.rank_lost(4) == {6: (2, "task 2 killed its host, then timed out")}


def test_reasons():
    assert blame.reason(3, ["timed out", "timed out"]) == "task 3 timed out twice"
    assert blame.reason(3, ["killed its host"] * 3) == "task 3 killed its host 3 times"
    assert blame.reason(3, ["killed its host", "timed out"]) == (
        "task 3 killed its host, then timed out"
    )
