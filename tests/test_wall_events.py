"""The wall clock's event source hands out stashed task answers smallest (device, task)
first among those expected, as sorting the stash at every event did (the order decides
how updates are aggregated), with a heap of the stash's keys instead of a sort."""

from __future__ import annotations

import random

from edgefl.comm import Kind, Message
from edgefl.runtime.events import ARRIVE, WallEvents


class _Fake:
    """Just what the event source calls on a transport; poll hands out queued messages."""

    def __init__(self) -> None:
        self.queue: list[Message] = []

    def poll(self, timeout: float = 0.0) -> list[Message]:
        out, self.queue = self.queue, []
        return out

    def take_failures(self) -> list[int]:
        return []

    def release(self, msg: Message) -> None:
        pass


def _reference(stash: dict, expected: set) -> tuple[int, int] | None:
    return next((k for k in sorted(stash) if k in expected), None)


def test_arrivals_come_smallest_expected_key_first():
    rng = random.Random(0)
    t = _Fake()
    ev = WallEvents(t)
    taken = []
    for _ in range(3000):
        op = rng.random()
        key = (rng.randrange(30), rng.randrange(5))
        if op < 0.45:  # an answer arrives (sometimes again: a re-delivery replaces it)
            t.queue.append(Message(Kind.UPDATE, 1, key[0], 1, key[1]))
            ev.take(0.0)
        elif op < 0.75:  # a task is dispatched
            ev.schedule(0.0, ARRIVE, *key)
        elif op < 0.8 and ev.stash:  # taken by another path (a flush)
            ev.stash.pop(rng.choice(sorted(ev.stash)))
        else:
            want = _reference(ev.stash, ev.expected - ev.cancelled)
            if want is None:
                continue
            got = ev.next()
            assert got is not None and got.kind == ARRIVE
            assert (got.device, got.task) == want
            taken.append(want)
    assert len(taken) > 100
