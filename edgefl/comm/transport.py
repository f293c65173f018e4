"""The transport interface shared by the MPI transport and the in-process loopback.

A transport moves :class:`~edgefl.comm.wire.Message` objects between ranks. Sends are
non-blocking and zero-copy: the payload array must not be modified until the send completed
(``release`` is called then, or :meth:`Transport.wait_sends` returns). Receives are polled.

Failures: a rank found dead (by the MPI library under ULFM, by a time-out through an attached
:class:`~edgefl.comm.liveness.Liveness`, or declared by the caller) joins
:attr:`Transport.failed`; :meth:`Transport.take_failures` hands each such rank out once. From
then on nothing is received from it and sends to it are dropped; ``poll``, ``wait_sends``
and ``close`` never raise or hang because of it (docs/fault-tolerance.md).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from .liveness import Liveness
from .wire import HEADER_BYTES, Header, Kind, Message, Validator

log = logging.getLogger("edgefl.comm")


class BufferPool:
    """Reuses receive buffers by (elements, dtype) so large payloads do not page-fault each
    time. Keyed by the dtype's one-letter code: every buffer comes from :meth:`get` with a
    dtype of :data:`~edgefl.comm.wire.NUMPY_OF` (one byte order), and ``dtype.str`` costs
    more than the rest of a lookup."""

    def __init__(self, max_per_key: int = 4) -> None:
        self._free: dict[tuple[int, str], list[np.ndarray]] = {}
        self.max_per_key = max_per_key

    def get(self, count: int, dtype: np.dtype) -> np.ndarray:
        free = self._free.get((count, dtype.char))
        if free:
            return free.pop()
        return np.empty(count, dtype)

    def put(self, arr: np.ndarray) -> None:
        key = (arr.size, arr.dtype.char)
        free = self._free.get(key)
        if free is None:
            self._free[key] = [arr]
        elif len(free) < self.max_per_key:
            free.append(arr)


class Tally(dict):
    """A count per key, 0 for a key never counted (like :class:`collections.Counter` when
    read, but ``tally[k] += 1`` costs half as much: it runs on every message)."""

    def __missing__(self, key: int) -> int:
        return 0


class Stats:
    """Per-peer counters of messages and payload+header bytes, both directions."""

    def __init__(self) -> None:
        self.msgs_sent: Tally = Tally()
        self.bytes_sent: Tally = Tally()
        self.msgs_recv: Tally = Tally()
        self.bytes_recv: Tally = Tally()
        self.rejected: Tally = Tally()
        self.duplicates: Tally = Tally()


class Transport(ABC):
    """Point-to-point, non-blocking messaging between ``size`` ranks.

    Args:
        rank: this process's rank.
        size: number of ranks.
        validator: checks every received header (see :class:`Validator`).
        poll_min_s: first back-off sleep when nothing arrived (seconds).
        poll_max_s: longest back-off sleep (seconds); bounds the added latency.
        spin_s: how long a waiting poll re-tests without sleeping before backing off
            (seconds). A short spin catches replies that are already on their way; Linux
            sleeps at least ~60 us however short the request, which would dominate.

    Attributes:
        failed: ranks found dead (never shrinks; ranks retired before dying not included).
        retired: ranks that finished normally (see :meth:`retire`).
        liveness: optional time-out detector (default None). When set, every message
            received (also a rejected one) counts as a sign of life, and ``poll`` declares
            the ranks it reports overdue failed (checked at most every ``timeout_s / 8``).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        validator: Validator,
        poll_min_s: float = 5e-5,
        poll_max_s: float = 1e-3,
        spin_s: float = 5e-4,
    ) -> None:
        self.rank = rank
        self.spin_s = spin_s
        self.size = size
        self.validator = validator
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self.pool = BufferPool()
        self.stats = Stats()
        self._seq: dict[tuple[int, int, int], int] = {}
        self.failed: set[int] = set()
        self.retired: set[int] = set()
        self._dead: set[int] = set()  # failed or retired: nothing goes to or comes from them
        self._new_failures: list[int] = []
        self.liveness: Liveness | None = None
        self._next_liveness_check = 0.0
        # called with a rank just before the liveness detector declares it failed (rank 0
        # tells a frozen rank it was given up on, so it leaves quietly if it ever wakes)
        self.on_suspect: Callable[[int], None] | None = None

    # -- failures ----------------------------------------------------------------------
    def take_failures(self) -> list[int]:
        """Ranks found dead since the last call, sorted; each dead rank is reported once."""
        out = sorted(set(self._new_failures))
        self._new_failures = []
        return out

    def refresh_failures(self) -> list[int]:
        """Ask the communication library which ranks it knows to be dead now (e.g. before
        deciding where a dead rank's devices go: its peers may have died with it); the
        newly found ones are recorded in :attr:`failed` and reported by
        :meth:`take_failures`. Returns them (none for transports without such a query)."""
        return []

    def declare_failed(self, rank: int, reason: str = "declared failed") -> bool:
        """Treat ``rank`` as dead from now on (e.g. after a heartbeat time-out): stop
        receiving from it, drop sends to it, report it through :meth:`take_failures`.
        Returns True if it was not already known dead. Ignores this rank itself."""
        return bool(self._mark_failed([rank], reason))

    def retire(self, rank: int) -> None:
        """``rank`` finished its part (e.g. acknowledged STOP): stop receiving from it, drop
        sends to it, and do not report it when it exits. After a failure, ranks leave without
        ``MPI_Finalize`` (see :func:`edgefl.comm.mpi.finalize`), which ULFM reports to the
        ranks still running exactly like a crash."""
        if rank == self.rank or rank in self._dead or not 0 <= rank < self.size:
            return
        self.retired.add(rank)
        self._dead.add(rank)
        if self.liveness is not None:
            self.liveness.forget(rank)
        self._forget([rank])

    def _mark_failed(self, ranks, reason: str) -> list[int]:
        """Record newly dead ranks (others, retired ones included, ignored), log them, let
        the subclass forget them."""
        new = sorted({int(r) for r in ranks if 0 <= r < self.size and r != self.rank} - self._dead)
        if not new:
            return []
        self.failed.update(new)
        self._dead.update(new)
        self._new_failures.extend(new)
        for r in new:
            log.warning("rank %d: rank %d failed (%s)", self.rank, r, reason)
        if self.liveness is not None:
            for r in new:
                self.liveness.forget(r)
        self._forget(new)
        return new

    def _forget(self, ranks: list[int]) -> None:
        """Stop serving dead ``ranks``: cancel receives from them, drop sends to them."""

    def _check_liveness(self) -> None:
        """Declare failed the ranks the attached :class:`Liveness` reports overdue."""
        lv = self.liveness
        if lv is None:
            return
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + lv.timeout_s / 8
        for r in lv.overdue(now):
            if self.on_suspect is not None and r not in self._dead:
                self.on_suspect(r)
            self._mark_failed([r], f"silent for more than {lv.timeout_s:g} s")

    def next_seq(self, dest: int, device: int, kind: Kind) -> int:
        """Next sequence number for (dest, device, kind), starting at 1."""
        key = (dest, device, int(kind))
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        return seq

    def send(
        self,
        dest: int,
        kind: Kind,
        *,
        device: int = -1,
        round: int = 0,
        vtime: float = 0.0,
        aux: tuple[float, ...] = (),
        payload: np.ndarray | None = None,
        seq: int | None = None,
        release: Callable[[], None] | None = None,
    ) -> int:
        """Start sending one message; returns its sequence number.

        ``payload`` is sent without copying: leave it untouched until ``release`` is called
        (or :meth:`wait_sends`). ``seq`` overrides the automatic sequence number (used to
        re-deliver a message, which the receiver then ignores). A send to a rank in
        :attr:`failed` or :attr:`retired` is dropped (logged at debug level; ``release`` is
        called at once).
        """
        if seq is None:
            seq = self.next_seq(dest, device, kind)
        if dest in self._dead:
            log.debug("rank %d: dropped kind %d to dead rank %d", self.rank, int(kind), dest)
            if release is not None:
                release()
            return seq
        if payload is not None and (payload.ndim != 1 or not payload.flags.c_contiguous):
            payload = np.ascontiguousarray(payload).reshape(-1)
        self._send(
            dest, int(kind), int(device), seq, int(round), float(vtime), aux, payload, release
        )
        return seq

    @abstractmethod
    def _send(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> None: ...

    @abstractmethod
    def _poll_once(self) -> list[Message]:
        """Receive, validate and return whatever has arrived, without waiting."""

    @abstractmethod
    def wait_sends(self) -> None:
        """Block until every send started so far completed (buffers may then be reused).

        Sends to ranks that die meanwhile are dropped instead of waited for."""

    def flush_bundles(self) -> None:
        """Send now the messages a transport holds to go out together (the MPI transport's
        BUNDLEs, otherwise sent at the next poll); a transport that holds none: nothing."""

    def poll(self, timeout: float = 0.0) -> list[Message]:
        """Return the messages that arrived, waiting up to ``timeout`` seconds for at least one.

        Waiting sleeps with exponential back-off between ``poll_min_s`` and ``poll_max_s``
        so an idle rank does not burn a core. A waiting poll also returns (empty) as soon as
        a rank is found dead, so the caller can look at :meth:`take_failures`. Never raises
        because a peer died.
        """
        known = len(self.failed)
        self._check_liveness()
        msgs = self._poll_once()
        if msgs or timeout <= 0:
            return msgs
        start = time.monotonic()
        deadline = start + timeout
        spin_until = start + min(self.spin_s, timeout)
        while time.monotonic() < spin_until:
            msgs = self._poll_once()
            if msgs or len(self.failed) != known:
                return msgs
        sleep = self.poll_min_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                return []
            time.sleep(min(sleep, deadline - now))
            sleep = min(sleep * 2, self.poll_max_s)
            self._check_liveness()
            msgs = self._poll_once()
            if msgs or len(self.failed) != known:
                return msgs

    def release(self, msg: Message) -> None:
        """Give a received payload buffer back for reuse (optional; call when done with it)."""
        if msg._pooled and msg.payload is not None:
            self.pool.put(msg.payload)
            msg.payload = None
            msg._pooled = False

    def close(self) -> None:
        """Cancel posted receives and wait for pending sends."""

    def _deliver(
        self, src: int, h: Header, kind: Kind, payload: np.ndarray | None, pooled: bool
    ) -> Message | None:
        """Count a fully received message; None if it is a duplicate (then it is dropped)."""
        if self.liveness is not None:
            self.liveness.heard(src, time.monotonic())
        stats = self.stats
        stats.msgs_recv[src] += 1
        stats.bytes_recv[src] += HEADER_BYTES + h.nbytes
        if self.validator.is_duplicate(src, h):
            stats.duplicates[src] += 1
            if pooled and payload is not None:
                self.pool.put(payload)
            return None
        # positional: this is on every message's path, and keyword parsing costs
        return Message(
            kind,
            src,
            h.device,
            h.seq,
            h.round,
            h.vtime,
            h.aux,  # type: ignore[arg-type]
            payload,
            h.nbytes,
            pooled and payload is not None,
        )

    def reject(self, src: int, reason: str) -> None:
        """Count and log a rejected message from ``src`` (also used by the runtime for
        updates that pass the wire checks but fail content checks, e.g. non-finite values)."""
        if self.liveness is not None:
            self.liveness.heard(src, time.monotonic())
        self.stats.rejected[src] += 1
        log.warning("rank %d: rejected message from rank %d: %s", self.rank, src, reason)
