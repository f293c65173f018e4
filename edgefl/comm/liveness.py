"""Time-out failure detection, for MPIs without ULFM (site MPICH, Intel MPI, Open MPI run
without ``--with-ft ulfm``).

A rank is declared dead when something is expected from it and it has been silent for more
than ``comm.failure_timeout_s`` seconds. Any message counts as a sign of life, so a peer that
sends heartbeats while it computes is never overdue, and one that cannot (single-threaded, in
a long local step) is given a ``deadline`` before its silence starts to count. This is the
classic time-out detector of Chandra and Toueg ("Unreliable failure detectors for reliable
distributed systems", JACM 1996): it can suspect a live but slow rank, never misses a dead one
(the price of a time-out too short is a false suspicion; of one too long, a late detection).

Pure bookkeeping on a caller-supplied clock (seconds, any monotonic origin): no MPI, no
threads, no wall-clock reads, so it is tested without processes and replayed exactly.
"""

from __future__ import annotations

import math

from ..errors import ConfigError


class Liveness:
    """Tracks when each rank was last heard from and which ranks owe a message.

    Args:
        timeout_s: how long (seconds) a rank may stay silent while something is expected from
            it; config key ``comm.failure_timeout_s``. Must be finite and > 0; no default.
    """

    def __init__(self, timeout_s: float) -> None:
        try:
            t = float(timeout_s)
        except (TypeError, ValueError):
            t = math.nan
        if not (math.isfinite(t) and t > 0):
            raise ConfigError(
                f"config key 'comm.failure_timeout_s' = {timeout_s!r}: must be a finite "
                "number of seconds > 0"
            )
        self.timeout_s = t
        self._last: dict[int, float] = {}
        self._due: dict[int, float] = {}

    def heard(self, rank: int, now: float) -> None:
        """Record a message from ``rank`` at time ``now`` (seconds). Times that go backwards
        are ignored (the latest sign of life counts)."""
        last = self._last.get(rank)
        if last is None or now > last:
            self._last[rank] = now

    def expect(self, rank: int, deadline: float) -> None:
        """Something is owed by ``rank``; its silence counts from ``deadline`` (seconds) or its
        last message, whichever is later. With several open expectations, the earliest
        deadline counts; :meth:`satisfied` closes them all."""
        due = self._due.get(rank)
        if due is None or deadline < due:
            self._due[rank] = deadline

    def satisfied(self, rank: int) -> None:
        """Nothing is owed by ``rank`` any more (e.g. its update arrived)."""
        self._due.pop(rank, None)

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (it was declared dead): it is never reported again unless
        expected again."""
        self._due.pop(rank, None)
        self._last.pop(rank, None)

    def last_heard(self, rank: int) -> float | None:
        """When ``rank`` was last heard from (seconds), or None if never."""
        return self._last.get(rank)

    def expected(self) -> list[int]:
        """The ranks that owe a message, sorted."""
        return sorted(self._due)

    def silence(self, rank: int, now: float) -> float:
        """How long (seconds) ``rank`` has counted as silent at ``now``: 0 when nothing is
        expected from it or its deadline is still ahead."""
        due = self._due.get(rank)
        if due is None:
            return 0.0
        start = max(due, self._last.get(rank, -math.inf))
        return max(0.0, now - start)

    def overdue(self, now: float) -> list[int]:
        """Ranks, sorted, that owe a message and have been silent for more than
        ``timeout_s`` at ``now`` (seconds). A query: nothing changes."""
        return sorted(r for r in self._due if self.silence(r, now) > self.timeout_s)
