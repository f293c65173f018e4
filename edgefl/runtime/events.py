"""Where the coordinator's events come from: the virtual clock or the wall clock.

Both sources hand the coordinator one :class:`Event` at a time, in time order.

- :class:`VirtualEvents` (``edgefl simulate``): every task is planned when it is dispatched
  (:mod:`edgefl.sim.clock`), so the time of its arrival (or loss) is known then and goes
  into a heap with the timers and online events. The coordinator takes the earliest event;
  for an arrival it then waits (in real time) for that very update to come in, keeping any
  other update that arrives first for later. No device can produce an earlier event than
  the one taken, because every busy device's next event is already in the heap: this is
  the conservative rule (docs/architecture.md, Clocks), and why the event order, and so the model,
  never depend on how fast the ranks really are.
- :class:`WallEvents` (``edgefl run``): arrivals are processed as they come; timers fire
  at their wall time.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

from ..comm import Kind, Message, Transport
from ..errors import EdgeflError

log = logging.getLogger("edgefl.coordinator")

# event kinds, in the order they are processed when their times are equal
ARRIVE, LOST, TIMER, ONLINE, PUSH, FAILED = 0, 1, 2, 3, 4, 5
KIND_NAMES = {
    ARRIVE: "arrive",
    LOST: "lost",
    TIMER: "timer",
    ONLINE: "online",
    PUSH: "push",
    FAILED: "failed",
}


class WorkerFailed(EdgeflError):
    """A worker reported a fatal error (its text is the message)."""


@dataclass
class Event:
    """One thing that happened at ``time`` seconds (virtual or wall since the start).

    ``device``/``task`` name the task for ARRIVE and LOST, the device for ONLINE; ``token``
    is the timer's token; ``msg`` is the UPDATE message of an arrival.
    """

    time: float
    kind: int
    device: int = -1
    task: int = -1
    token: int = 0
    msg: Message | None = None


class _Source:
    def __init__(self, transport: Transport) -> None:
        self.t = transport
        self.stash: dict[tuple[int, int], Message] = {}
        self.failures: list[int] = []  # ranks found dead, not yet handed out as events
        self.cancelled: set[tuple[int, int]] = set()  # tasks of dead ranks
        self.received_hook = None  # called with every task answer as it is received
        self.tick_hook = None  # called after every poll (rank 0's liveness duties)
        self.heard_hook = None  # called with (rank, time.monotonic()) of every message
        self.heartbeat_hook = None  # called with a worker's HEARTBEAT (blame.py: STARTED)
        self.halt = False  # no more events (a stop signal): next() returns None
        # kind -> handler of a plugin's own upward messages (called as they are received)
        self.handlers: dict[int, object] = {}
        self.update_kinds: set[int] = {Kind.UPDATE, Kind.REPORT}  # task answers (stashed)

    def cancel(self, device: int, task: int) -> None:
        """The task of a dead device will never report: skip its event."""
        self.cancelled.add((device, task))

    def _failed_event(self, now: float) -> Event | None:
        if self.failures:
            return Event(now, FAILED, token=self.failures.pop(0))
        return None

    def take(self, timeout: float) -> None:
        """Receive what is there: task answers into the stash, a plugin's messages to its
        handler; raise on a worker's ERROR."""
        msgs = self.t.poll(timeout=timeout)
        self.failures += self.t.take_failures()
        for msg in msgs:
            self.keep(msg)
        if self.tick_hook is not None:
            self.tick_hook()

    def keep(self, msg: Message) -> None:
        """Route one received message (see :meth:`take`)."""
        if msg.kind == Kind.ERROR:
            raise WorkerFailed(error_text(msg))
        if self.heard_hook is not None:
            self.heard_hook(msg.src, time.monotonic())
        if msg.kind == Kind.HEARTBEAT and self.heartbeat_hook is not None:
            self.heartbeat_hook(msg)
            self.t.release(msg)
            return
        handler = self.handlers.get(msg.kind)
        if handler is not None:
            handler(msg)
            self.t.release(msg)
        elif msg.kind in self.update_kinds:
            if self.received_hook is not None:
                self.received_hook(msg)
            key = (msg.device, msg.round)
            old = self.stash.get(key)
            if old is not None:
                self.t.release(old)
            self.stash[key] = msg
            self._stashed(key)
        else:
            log.warning("ignoring %s from rank %d", msg.kind.name, msg.src)
            self.t.release(msg)

    def _stashed(self, key: tuple[int, int]) -> None:
        """A task answer was stashed under ``key`` (a source that orders them hooks in)."""

    def release_all(self) -> None:
        for msg in self.stash.values():
            self.t.release(msg)
        self.stash.clear()


class VirtualEvents(_Source):
    """Events in virtual-time order (see the module docstring)."""

    def __init__(self, transport: Transport, start: float = 0.0) -> None:
        super().__init__(transport)
        self.heap: list[tuple[float, int, int, int, int, int]] = []
        self.n = 0
        self.now = start

    def schedule(self, time_s: float, kind: int, device: int = -1, task: int = -1, token=0):
        self.n += 1
        heapq.heappush(self.heap, (time_s, kind, device, task, token, self.n))

    def __len__(self) -> int:
        return len(self.heap)

    def next(self) -> Event | None:
        """The earliest event (None when nothing is left to happen)."""
        while True:
            failed = self._failed_event(self.now)
            if failed is not None:
                return failed
            if not self.heap or self.halt:
                return None
            item = heapq.heappop(self.heap)
            time_s, kind, device, task, token, _ = item
            if (device, task) in self.cancelled and kind in (ARRIVE, LOST, PUSH):
                continue
            if kind == ARRIVE:
                key = (device, task)
                while key not in self.stash and not self.failures and not self.halt:
                    self.take(timeout=1.0)
                if key not in self.stash:  # a rank died meanwhile: handle that first
                    heapq.heappush(self.heap, item)
                    continue
                self.now = time_s
                return Event(time_s, kind, device, task, token, msg=self.stash.pop(key))
            self.now = time_s
            return Event(time_s, kind, device, task, token)


class WallEvents(_Source):
    """Events in the order they happen in real time."""

    def __init__(self, transport: Transport, offset: float = 0.0) -> None:
        super().__init__(transport)
        self.t0 = time.monotonic() - offset
        self.timers: list[tuple[float, int, int, int, int, int]] = []
        self.n = 0
        self.expected: set[tuple[int, int]] = set()
        # the stash's keys as a heap (stale entries, taken or replaced, are skipped): the
        # smallest expected one is found without sorting the stash at every event (a
        # BUNDLE brings thousands of answers at once)
        self._keys: list[tuple[int, int]] = []

    def _stashed(self, key: tuple[int, int]) -> None:
        heapq.heappush(self._keys, key)

    @property
    def now(self) -> float:
        return time.monotonic() - self.t0

    def schedule(self, time_s: float, kind: int, device: int = -1, task: int = -1, token=0):
        if kind == ARRIVE:
            self.expected.add((device, task))
            return
        self.n += 1
        heapq.heappush(self.timers, (time_s, kind, device, task, token, self.n))

    def __len__(self) -> int:
        return len(self.timers) + len(self.expected)

    def next(self) -> Event | None:
        while True:
            failed = self._failed_event(self.now)
            if failed is not None:
                return failed
            if self.halt:
                return None
            self.expected -= self.cancelled
            key = self._first_expected()
            if key is not None:
                self.expected.discard(key)
                msg = self.stash.pop(key)
                return Event(self.now, ARRIVE, key[0], key[1], msg=msg)
            if self.timers and self.timers[0][0] <= self.now:
                time_s, kind, device, task, token, _ = heapq.heappop(self.timers)
                return Event(self.now, kind, device, task, token)
            if not self.expected and not self.timers:
                return None
            wait = 1.0
            if self.timers:
                wait = max(0.0, min(wait, self.timers[0][0] - self.now))
            self.take(timeout=wait)

    def _first_expected(self) -> tuple[int, int] | None:
        """The smallest stashed key that is expected (None if none is): the stash's keys
        in sorted order, as a heap; stashed keys not expected (yet) stay in it."""
        keys, stash, expected = self._keys, self.stash, self.expected
        skipped, found = [], None
        seen = set()
        while keys:
            key = keys[0]
            if key not in stash or key in seen:  # (taken, or a second entry of one key)
                heapq.heappop(keys)
                continue
            if key in expected:
                found = key
                heapq.heappop(keys)
                break
            seen.add(key)
            skipped.append(heapq.heappop(keys))
        for key in skipped:
            heapq.heappush(keys, key)
        return found


def error_text(msg: Message) -> str:
    text = bytes(msg.payload).decode("utf-8", "replace") if msg.payload is not None else "?"
    return f"rank {msg.src}: {text}"


__all__ = [
    "ARRIVE",
    "Event",
    "FAILED",
    "KIND_NAMES",
    "LOST",
    "ONLINE",
    "PUSH",
    "TIMER",
    "VirtualEvents",
    "WallEvents",
    "WorkerFailed",
    "error_text",
]
