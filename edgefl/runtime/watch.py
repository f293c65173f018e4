"""Rank 0's watch over the worker ranks while it waits: liveness beats, straggler warnings,
and the farewell to a rank it gives up on.

- **Beats.** A worker that hears nothing from rank 0 for ``2 x comm.failure_timeout_s``
  decides rank 0 is gone (that is how it leaves when the coordinator dies without ULFM).
  While rank 0 waits for a slow or frozen rank, the healthy workers may have nothing to do
  for that long, so rank 0 sends every live worker rank a liveness ``HEARTBEAT`` every
  ``failure_timeout_s / 4`` seconds of real time (only when time-outs are on).
- **Stragglers.** A rank that owes an answer and has not sent one for
  ``comm.straggler_warn_s`` seconds (default 60; 0 = off) gets one warning line naming it
  and the devices whose tasks it holds; the next answer re-arms it. With time-outs off
  (``comm.failure_timeout_s = 0``, the default under ULFM) this is all that happens: ULFM
  reports ranks that die, not ranks that stop.
- **Giving up.** When the time-out detector declares a rank dead (it owed an answer and was
  silent for ``comm.failure_timeout_s``), rank 0 first sends it a ``STOP`` marked "declared
  dead" (a header only, so it is delivered even to a stopped process), so that if it ever
  wakes up it leaves quietly instead of sending stale updates. A rank on rank 0's own host
  is also killed (SIGKILL reaches a stopped process; the launcher would otherwise wait for
  it forever). Then its devices are moved or given up like those of a crashed rank.

Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from ..comm import Kind

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")

LIVENESS = 1.0  # aux[0] of a rank-0 HEARTBEAT that only says "alive"
STOPPED = 3.0  # aux[0] of a worker HEARTBEAT acknowledging STOP; aux[1]: its stacked tasks
DECLARED_DEAD = 1.0  # aux[2] of the STOP sent to a rank given up on
FAREWELL = 2.0  # aux[2] of the STOP that answers a worker's acknowledgement: it may exit now
WANT_FAREWELL = 1.0  # aux[3] of a STOP whose acknowledgement rank 0 answers (FAREWELL)
FAREWELL_WAIT_S = 10.0  # how long an acknowledging worker waits for FAREWELL (seconds)


class RankWatch:
    """Liveness beats, straggler warnings and farewells of coordinator ``core``.

    Args:
        core: the :class:`~edgefl.runtime.coordinator.Coordinator`.
        comm: the ``[comm]`` config table (``failure_timeout_s``, ``straggler_warn_s``).
    """

    def __init__(self, core: Coordinator, comm: dict) -> None:
        self.core = core
        self.timeout_s = float(comm["failure_timeout_s"])
        self.warn_s = float(comm["straggler_warn_s"])
        self.beat_s = self.timeout_s / 4 if self.timeout_s > 0 else 0.0
        self._last_beat = time.monotonic()
        self._since: dict[int, float] = {}  # rank -> owing and silent since (seconds)
        self._warned: set[int] = set()
        self.warnings: list[dict] = []  # (summary.json "stragglers")
        self.tasks: Any = None  # the per-task watchdog (blame.TaskWatch), set by the core

    def owes(self, rank: int, now: float) -> None:
        """A task went to ``rank``: it owes an answer from ``now`` (if it owed none)."""
        self._since.setdefault(rank, now)

    def answered(self, rank: int, now: float, done: bool) -> None:
        """``rank`` answered a task at ``now``; ``done``: it owes nothing more."""
        if done:
            self._since.pop(rank, None)
        else:
            self._since[rank] = now
        self._warned.discard(rank)

    def tick(self) -> None:
        """Called after every poll of rank 0's event loop."""
        now = time.monotonic()
        if self.tasks is not None:
            self.tasks.tick(now)
        if self.beat_s and now - self._last_beat >= self.beat_s:
            self._last_beat = now
            t = self.core.t
            for r in self.core.workers:
                if r not in t.failed and r not in t.retired:
                    t.send(r, Kind.HEARTBEAT, aux=(LIVENESS, 0.0, 0.0, 0.0))
        if not self.warn_s:
            return
        for rank, since in list(self._since.items()):
            silent = now - since
            if silent < self.warn_s or rank in self._warned or rank in self.core.t.failed:
                continue
            self._warned.add(rank)
            devs = sorted(d for d in self.core.inflight if self.core.devices[d]["rank"] == rank)
            self.warnings.append({"rank": rank, "devices": devs, "silent_s": round(silent, 1)})
            hint = (
                f"it is declared dead after {self.timeout_s:g} s"
                if self.timeout_s
                else "set comm.failure_timeout_s to declare such a rank dead and move its devices"
            )
            print(f"edgefl: warning: rank {rank} (devices {devs}) owes an answer and has been "
                  f"silent for {silent:.0f} s (comm.straggler_warn_s = {self.warn_s:g}); "
                  f"frozen or overloaded? {hint}", flush=True)  # fmt: skip

    def give_up(self, rank: int, why: str = "") -> None:
        """The time-out detector (or the task watchdog, saying ``why``) is about to declare
        ``rank`` dead: tell it (see above)."""
        self._since.pop(rank, None)
        tasks = self.tasks
        if not why:
            log.warning("rank %d: silent for more than %g s while it owed an answer: declared "
                        "dead", rank, self.timeout_s)  # fmt: skip
            if tasks is not None:
                tasks.cause.setdefault(rank, "timed out")  # (its task is blamed: blame.py)
        self.core.t.send(rank, Kind.STOP, aux=(0.0, 1.0, DECLARED_DEAD, 0.0))
        info = self.core.rank_info.get(rank, {})
        pid = info.get("pid")
        local = info.get("host") == socket.gethostname() and pid != os.getpid()  # (inline)
        if local and isinstance(pid, int) and pid > 1:
            # on this machine: end it now, or the launcher would wait for it forever (a
            # stopped process never exits on its own; SIGKILL reaches it even when stopped)
            try:
                os.kill(pid, signal.SIGKILL)
                after = why or f"{self.timeout_s:g} s of silence"
                print(f"edgefl: rank {rank} (pid {pid}) was declared dead after {after} and "
                      "killed", flush=True)  # fmt: skip
            except OSError:
                pass
