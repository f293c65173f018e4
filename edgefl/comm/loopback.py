"""In-process loopback transport, for unit tests of protocol logic (not a replacement for MPI).

All ranks live in one process (typically one thread each) and share a :class:`Fabric`.
Messages are copied on send, as a network would, and go through the same decode/validate
path as the MPI transport. :meth:`Fabric.kill` simulates a rank dying: the others find it in
:attr:`~edgefl.comm.transport.Transport.failed` at their next poll, as under ULFM.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from .transport import Transport
from .wire import (
    HEADER_BYTES,
    NUMPY_OF,
    DType,
    Message,
    Validator,
    WireError,
    decode_header,
    encode_header,
)


class Fabric:
    """The shared 'network' of a loopback job: one FIFO per (src, dest) pair."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[tuple[int, int], deque] = {
            (s, d): deque() for s in range(size) for d in range(size) if s != d
        }
        self.lock = threading.Lock()
        self.dead: set[int] = set()

    def inject(self, src: int, dest: int, header: np.ndarray, payload: bytes | None) -> None:
        """Put raw bytes on the wire (tests use this to forge malformed messages). Messages
        from or to a killed rank vanish."""
        with self.lock:
            if src in self.dead or dest in self.dead:
                return
            self.queues[(src, dest)].append((np.asarray(header, np.uint8).copy(), payload))

    def kill(self, rank: int) -> None:
        """Simulate ``rank`` dying: what it sent and nobody received yet is lost, and every
        other rank's transport reports it failed at its next poll."""
        with self.lock:
            self.dead.add(rank)
            for (s, d), q in self.queues.items():
                if s == rank or d == rank:
                    q.clear()


class LoopbackTransport(Transport):
    """Transport over a :class:`Fabric`. Same interface and validation as MPI."""

    def __init__(self, fabric: Fabric, rank: int, validator: Validator, **kw) -> None:
        super().__init__(rank, fabric.size, validator, **kw)
        self.fabric = fabric

    def _send(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> None:
        header = encode_header(kind, device, seq, round_, vtime, payload, aux)
        data = None if payload is None else payload.tobytes()
        self.fabric.inject(self.rank, dest, header, data)
        self.stats.msgs_sent[dest] += 1
        self.stats.bytes_sent[dest] += HEADER_BYTES + (0 if data is None else len(data))
        if release is not None:
            release()

    def wait_sends(self) -> None:
        return None

    def _poll_once(self) -> list[Message]:
        if self.fabric.dead:
            with self.fabric.lock:
                dead = self.fabric.dead - self._dead
            if dead:
                self._mark_failed(dead, "killed (loopback)")
        out = []
        for src in range(self.size):
            if src == self.rank or src in self._dead:
                continue
            q = self.fabric.queues[(src, self.rank)]
            while True:
                with self.fabric.lock:
                    if not q:
                        break
                    raw, data = q.popleft()
                msg = self._receive(src, raw, data)
                if msg is not None:
                    out.append(msg)
        return out

    def _receive(self, src: int, raw: np.ndarray, data: bytes | None) -> Message | None:
        try:
            h = decode_header(raw, raw.size)
            kind = self.validator.check(src, h)
        except WireError as e:
            self.reject(src, str(e))
            return None
        nbytes = h.nbytes
        got = 0 if data is None else len(data)
        if got != nbytes:
            self.reject(src, f"payload of {got} bytes, header says {nbytes}")
            return None
        payload = None
        if nbytes:
            payload = np.frombuffer(data, NUMPY_OF[DType(h.dtype)]).copy()
        return self._deliver(src, h, kind, payload, pooled=False)
