"""Blame the device, not the host: rank 0's per-task watchdog and the strikes against tasks
whose host died or hung (issue 25, F2).

A worker rank trains its devices' tasks one at a time, in the order their TRAINs came. Rank
0 keeps, per rank, the tasks it sent and has not had an answer to, in that order
(:class:`TaskWatch`). From it, rank 0

- **times tasks** (the watchdog, ``fleet.task_timeout_s``): the rank's current task started
  no earlier than the rank's last message (or the task's TRAIN, if later), so the time since
  then bounds how long it has run. Past its deadline the rank is stuck (a Python call in a
  user's ``train.client`` cannot be abandoned from inside): rank 0 gives up on the rank as
  on a frozen one (a "declared dead" STOP, SIGKILL on rank 0's host) and its devices move
  (:mod:`edgefl.runtime.rehost`). The deadline (``auto``, the default of ``edgefl
  simulate``) is ``max(FLOOR_S, FACTOR x the device's slowest observed task)``, in seconds
  of real time (a hang is real time even under the virtual clock); a device not measured
  yet takes the fleet's median, and ``FIRST_S`` when nothing is measured; a device's first
  task on a rank gets ``FIRST_S`` more (its data is built then). With
  ``comm.failure_timeout_s = T > 0`` rank silence finds a hang first: ``auto`` waits longer
  than T.
- **blames tasks** when a rank dies (ULFM), is declared dead (silence, the watchdog) or was
  killed by rank 0: the tasks that may have been running then (the rank's oldest unanswered
  ones; a worker holds up to ``HOLD_UPDATES`` finished updates before sending them) get a
  strike and are re-run on their new rank *isolated*: the TRAIN carries
  :data:`~edgefl.comm.taskflags.ISOLATE`, so the worker first sends what it holds, tells
  rank 0 when the task starts (a ``STARTED`` heartbeat, after its data is built) and sends
  its answer at once. When a rank then fails while its oldest unanswered task is an isolated
  one, that task is known to be the one running: a second strike, and its device is
  quarantined (``summary.json`` ``quarantined`` with the reason, e.g. "task 7 timed out
  twice"; a ``quarantine`` event in events.jsonl). Its task is not run again; its host's
  other devices move without it.

Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from ..comm.taskflags import ISOLATE, unpack_flags

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

FLOOR_S = 10.0  # the shortest deadline of the sized watchdog (seconds)
FACTOR = 10.0  # x the device's slowest observed task
FIRST_S = 60.0  # nothing measured yet; and added for a device's first task on a rank
TICK_S = 0.25  # how often the watchdog looks (seconds)
STARTED = 2.0  # aux[0] of a worker HEARTBEAT that says "isolated task (device, round) starts"

TIMED_OUT = "timed out"
KILLED_HOST = "killed its host"


class TaskWatch:
    """Rank 0's record of the tasks each worker rank owes, their watchdog and strikes.

    Args:
        core: the :class:`~edgefl.runtime.coordinator.Coordinator`.
        hold: the most finished updates a worker holds back before sending them
            (:data:`edgefl.runtime.worker.HOLD_UPDATES`).
    """

    def __init__(self, core: Coordinator, hold: int) -> None:
        self.core = core
        self.hold = hold
        cfg = core.cfg
        mode = cfg["fleet"]["task_timeout_s"]
        self.auto = mode == "auto"
        self.fixed = 0.0 if self.auto else float(mode)
        self.on = (self.auto and core.virtual) or self.fixed > 0
        self.silence_s = float(cfg["comm"]["failure_timeout_s"])
        # rank -> {(device, task): (sent at, isolated)} in the order sent (dicts keep it)
        self.owed: dict[int, dict[tuple[int, int], tuple[float, bool]]] = {}
        self.heard: dict[int, float] = {}  # rank -> its last message
        self.started: dict[int, tuple[tuple[int, int], float]] = {}  # rank -> isolated task
        self.slow: dict[int, float] = {}  # device -> slowest observed task (seconds)
        self.answered_on: set[tuple[int, int]] = set()  # (device, rank): it answered there
        self.strikes: dict[tuple[int, int], list[str]] = {}  # (device, task) -> causes
        self.isolate: set[tuple[int, int]] = set()  # tasks to re-run isolated
        self.cause: dict[int, str] = {}  # rank -> why rank 0 gave up on it
        self.timeouts: list[dict] = []  # (summary.json "task_timeouts")
        self._median: float | None = None
        self._median_at = -math.inf
        self._next_tick = 0.0

    # -- bookkeeping -------------------------------------------------------------------------
    def sent(self, rank: int, d: int, task: int, aux: tuple, now: float) -> None:
        """A TRAIN of (``d``, ``task``) went to ``rank``."""
        iso = bool(unpack_flags(int(aux[3]))[0] & ISOLATE) if len(aux) > 3 else False
        self.owed.setdefault(rank, {})[(d, task)] = (now, iso)

    def heard_from(self, rank: int, now: float) -> None:
        """Any message of ``rank`` arrived at ``now``."""
        self.heard[rank] = now

    def answered(self, msg: Any, now: float) -> None:
        """The answer to task (``msg.device``, ``msg.round``) came from ``msg.src``."""
        rank, key = msg.src, (msg.device, msg.round)
        self.heard[rank] = now
        owed = self.owed.get(rank)
        if owed is None or owed.pop(key, None) is None:
            return
        st = self.started.get(rank)
        if st is not None and st[0] == key:
            del self.started[rank]
        self.answered_on.add((msg.device, rank))
        seconds = float(msg.aux[2]) if len(msg.aux) > 2 else math.nan
        if math.isfinite(seconds) and 0 <= seconds < 1e7:
            if seconds > self.slow.get(msg.device, -1.0):
                self.slow[msg.device] = seconds

    def on_started(self, msg: Any, now: float) -> None:
        """A worker's STARTED: its isolated task (``msg.device``, ``msg.round``) starts."""
        self.heard[msg.src] = now
        key = (msg.device, msg.round)
        if key in self.owed.get(msg.src, {}):
            self.started[msg.src] = (key, now)

    def forget(self, rank: int) -> dict[tuple[int, int], tuple[float, bool]]:
        """``rank`` is gone: its unanswered tasks (in the order sent), no longer watched."""
        self.started.pop(rank, None)
        self.heard.pop(rank, None)
        return self.owed.pop(rank, {})

    # -- the watchdog --------------------------------------------------------------------------
    def median(self) -> float | None:
        """The fleet's median of the devices' slowest tasks (recomputed at most every s)."""
        now = time.monotonic()
        if now - self._median_at > 1.0 and self.slow:
            self._median = statistics.median(self.slow.values())
            self._median_at = now
        return self._median

    def deadline(self, d: int, rank: int, started: bool) -> float:
        """Seconds task of device ``d`` may run on ``rank`` (``started``: timed from its
        STARTED, so its data is already built)."""
        if not self.auto:
            return self.fixed
        s = self.slow.get(d)
        if s is None:
            s = self.median()
        limit = FIRST_S if s is None else max(FLOOR_S, FACTOR * s)
        if not started and (d, rank) not in self.answered_on:
            limit += FIRST_S  # (the device's first task here: its data is built first)
        if self.silence_s > 0:  # (rank silence, comm.failure_timeout_s, finds it first)
            limit = max(limit, 1.25 * self.silence_s + 1.0)
        return limit

    def running(self, rank: int) -> tuple[tuple[int, int], float, float] | None:
        """The task ``rank`` is running as far as rank 0 can tell: ((device, task), since,
        deadline), or None when it owes nothing."""
        owed = self.owed.get(rank)
        if not owed:
            return None
        st = self.started.get(rank)
        if st is not None and st[0] in owed:
            key, since = st
            return key, since, self.deadline(key[0], rank, True)
        key = next(iter(owed))
        since = max(self.heard.get(rank, -math.inf), owed[key][0])
        # (one of the oldest may be the one running: the worker may hold the others' updates)
        limit = 0.0
        for i, (d, _task) in enumerate(owed):
            if i > self.hold:
                break
            limit = max(limit, self.deadline(d, rank, False))
        return key, since, limit

    def tick(self, now: float) -> None:
        """Called as rank 0 polls: give up on a rank whose task ran past its deadline."""
        if not self.on or now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        t = self.core.t
        for rank in list(self.owed):
            if rank in t.failed or rank in t.retired:
                continue
            got = self.running(rank)
            if got is None:
                continue
            (d, task), since, limit = got
            ran = now - since
            if ran > limit:
                self.fire(rank, d, task, ran, limit)

    def fire(self, rank: int, d: int, task: int, ran: float, limit: float) -> None:
        """Task (``d``, ``task``) has run ``ran`` s on ``rank``, past ``limit``: the rank is
        stuck in it. Rank 0 gives up on the rank (its devices move; the task is blamed)."""
        core = self.core
        setting = "auto" if self.auto else f"{self.fixed:g}"
        why = (f"device {d} task {task} ran for {ran:.0f} s, past its deadline of {limit:.0f} s "
               f"(fleet.task_timeout_s = {setting})")  # fmt: skip
        self.timeouts.append({"rank": rank, "device": d, "task": task,
                              "ran_s": round(ran, 1), "deadline_s": round(limit, 1)})  # fmt: skip
        self.cause[rank] = TIMED_OUT
        print(f"edgefl: rank {rank}: {why}; the rank is stuck in it: rank 0 gives up on the "
              "rank and moves its devices", flush=True)  # fmt: skip
        core.log_event("timeout", core.ev.now, d, task, rank=rank, ran_s=round(ran, 1))
        core.watch.give_up(rank, why)
        core.t.declare_failed(rank, why)

    # -- blame ---------------------------------------------------------------------------------
    def rank_lost(self, rank: int) -> dict[int, tuple[int, str]]:
        """``rank`` failed (died, declared dead, given up on): strike the tasks that may have
        been running. Returns the devices to quarantine: {device: (task, reason)} (an
        isolated task that was running when its rank failed, struck before)."""
        owed = self.forget(rank)
        cause = self.cause.pop(rank, KILLED_HOST)
        if not owed:
            return {}
        items = list(owed.items())
        key, (_sent, iso) = items[0]
        if iso:  # (the worker sent all it held before it began: this one was running)
            causes = self.strikes.setdefault(key, [])
            causes.append(cause)
            if len(causes) >= 2:
                return {key[0]: (key[1], reason(key[1], causes))}
            return {}
        for i, (k, (_s, isolated)) in enumerate(items):
            if i > self.hold or isolated:
                break
            self.strikes.setdefault(k, []).append(cause)
            self.isolate.add(k)
        return {}

    def isolated(self, d: int, task: int) -> bool:
        """Is (``d``, ``task``) to be re-run isolated (it was struck)?"""
        return (d, task) in self.isolate


def reason(task: int, causes: list[str]) -> str:
    """e.g. "task 7 timed out twice", "task 7 timed out, then killed its host"."""
    if all(c == causes[0] for c in causes):
        n = len(causes)
        times = "twice" if n == 2 else f"{n} times"
        return f"task {task} {causes[0]} {times}"
    return f"task {task} " + ", then ".join(causes)
