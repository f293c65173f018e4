"""The MPI transport: the only module in edgefl that imports mpi4py.

Each rank pre-posts one header receive per peer (``Irecv`` into a fixed 80-byte buffer) and
completes them with ``Testsome``, so every peer is served in turn and no ``ANY_SOURCE`` probe
starves high ranks. Payloads travel as raw buffers (uppercase calls), split into chunks of at
most ``chunk_bytes`` so MPI's int counts never overflow, on a tag derived from the sequence
number (modulo 16384): with MPI's in-order delivery per (source, tag), a payload left behind
by a rejected header is drained and cannot be taken for the next message's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from .transport import Transport, log
from .wire import (
    HEADER_BYTES,
    NUMPY_OF,
    DType,
    Message,
    Validator,
    WireError,
    decode_header,
    pack_header,
    peek_payload,
)

TAG_HEADER = 1
_F32 = int(DType.FLOAT32)
_F32_NP = np.dtype(np.float32)
TAG_DATA_BASE = 16
TAG_DATA_SPAN = 1 << 14  # data tags lie in [16, 16 + 16384): within MPI's guaranteed 32767


def data_tag(seq: int) -> int:
    """The MPI tag of a message's payload chunks (derived from its sequence number)."""
    return TAG_DATA_BASE + (seq % TAG_DATA_SPAN)


class MPITransport(Transport):
    """Non-blocking point-to-point messaging over an MPI communicator.

    Args:
        comm: communicator (default ``MPI.COMM_WORLD``).
        peers: ranks this rank receives from (default: all others).
        validator: header checks (see :class:`~edgefl.comm.wire.Validator`).
        chunk_bytes: largest payload piece per MPI message (bytes, default 1 GiB).
        payload_timeout_s: how long to wait for a payload whose header arrived (seconds).
        poll_min_s / poll_max_s / spin_s: idle back-off bounds (seconds), see
            :class:`~edgefl.comm.transport.Transport`.
    """

    def __init__(
        self,
        validator: Validator,
        comm: MPI.Comm | None = None,
        peers: Sequence[int] | None = None,
        chunk_bytes: int = 1 << 30,
        payload_timeout_s: float = 30.0,
        poll_min_s: float = 5e-5,
        poll_max_s: float = 1e-3,
        spin_s: float = 5e-4,
    ) -> None:
        comm = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(
            comm.Get_rank(), comm.Get_size(), validator, poll_min_s, poll_max_s, spin_s
        )
        if not 0 < chunk_bytes < (1 << 31):
            raise ValueError(f"chunk_bytes must be in (0, 2**31), got {chunk_bytes}")
        self.comm = comm
        self.chunk_bytes = chunk_bytes
        self.validator.chunk_bytes = chunk_bytes
        self.payload_timeout_s = payload_timeout_s
        self.peers = (
            list(peers) if peers is not None else [r for r in range(self.size) if r != self.rank]
        )
        self._hbuf = [np.empty(HEADER_BYTES, np.uint8) for _ in self.peers]
        self._hreq = [self._post_header(i) for i in range(len(self.peers))]
        self._status = MPI.Status()
        # pending sends: (requests, keep-alive buffers, release callback)
        self._pending: list[tuple[list[MPI.Request], tuple, Callable[[], None] | None]] = []
        self._closed = False
        self._repost: list[int] = []

    # -- sending ------------------------------------------------------------------------
    def _send(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> None:
        header = pack_header(kind, device, seq, round_, vtime, payload, aux, self.chunk_bytes)
        reqs = [self.comm.Isend([header, MPI.BYTE], dest, TAG_HEADER)]
        nbytes = HEADER_BYTES
        if payload is not None:
            tag = data_tag(seq)
            if payload.nbytes <= self.chunk_bytes:
                reqs.append(self.comm.Isend([payload, MPI.BYTE], dest, tag))
            else:
                raw = payload.view(np.uint8)
                for start in range(0, raw.size, self.chunk_bytes):
                    piece = raw[start : start + self.chunk_bytes]
                    reqs.append(self.comm.Isend([piece, MPI.BYTE], dest, tag))
            nbytes += payload.nbytes
        self._pending.append((reqs, (header, payload), release))
        self.stats.msgs_sent[dest] += 1
        self.stats.bytes_sent[dest] += nbytes
        if len(self._pending) > 64:
            self._reap()

    def _reap(self) -> None:
        still = []
        for reqs, bufs, release in self._pending:
            if MPI.Request.Testall(reqs):
                if release is not None:
                    release()
            else:
                still.append((reqs, bufs, release))
        self._pending = still

    def wait_sends(self) -> None:
        for reqs, _bufs, release in self._pending:
            MPI.Request.Waitall(reqs)
            if release is not None:
                release()
        self._pending = []

    # -- receiving ----------------------------------------------------------------------
    def _post_header(self, i: int) -> MPI.Request:
        return self.comm.Irecv([self._hbuf[i], MPI.BYTE], self.peers[i], TAG_HEADER)

    def _poll_once(self) -> list[Message]:
        if self._pending:
            self._reap()
        if self._repost:  # header receives consumed by the previous poll
            for i in self._repost:
                self._hreq[i] = self._post_header(i)
            self._repost = []
        if len(self._hreq) == 1:  # a single peer: a plain Test is cheaper than Testsome
            done = [0] if self._hreq[0].Test() else None
        else:
            done = MPI.Request.Testsome(self._hreq)
        if not done:
            return []
        out = []
        for i in sorted(done):
            # re-posted at the next poll, off the path between arrival and the caller
            self._repost.append(i)
            msg = self._receive(self.peers[i], self._hbuf[i])
            if msg is not None:
                out.append(msg)
        return out

    def _receive(self, src: int, raw: np.ndarray) -> Message | None:
        code, nchunks, seq, nbytes = peek_payload(raw)
        early = None
        if (
            code == _F32
            and nchunks == 1
            and nbytes == self.validator.model_numel * 4
            and 0 < nbytes <= self.chunk_bytes
        ):
            # A model-sized payload (the common case): post its receive before decoding and
            # validating, so the transfer overlaps the checks. The size is the one the
            # receiver expects anyway, so a lying header cannot make this allocate more.
            payload = self.pool.get(nbytes >> 2, _F32_NP)
            early = self.comm.Irecv([payload, MPI.BYTE], src, data_tag(seq))
        try:
            h = decode_header(raw)
        except WireError as e:
            if early is not None:
                self._cancel_early(early, payload, src, seq, nchunks)
            self.reject(src, str(e))
            return None
        try:
            kind = self.validator.check(src, h)
        except WireError as e:
            if early is not None:
                self._cancel_early(early, payload, src, seq, nchunks)
            else:
                self._drain(src, h.seq, h.nchunks)
            self.reject(src, str(e))
            return None
        if early is not None:
            err = self._finish_payload(early, nbytes)
        elif nbytes:
            dtype = NUMPY_OF[DType(h.dtype)]
            payload = self.pool.get(nbytes // dtype.itemsize, dtype)
            err = self._recv_payload(src, h.seq, payload.view(np.uint8))
        else:
            payload = None
            err = None
        if err:
            self.pool.put(payload)
            self.reject(src, err)
            return None
        return self._deliver(src, h, kind, payload, pooled=True)

    def _cancel_early(self, req, payload, src: int, seq: int, nchunks: int) -> None:
        """Undo an early payload receive of a header that turned out to be bad."""
        req.Cancel()
        req.Wait(self._status)
        self.pool.put(payload)
        if self._status.Is_cancelled():
            self._drain(src, seq, nchunks)

    def _finish_payload(self, req: MPI.Request, size: int) -> str | None:
        """Wait for one posted payload piece of ``size`` bytes; an error text or None."""
        try:
            if not self._wait(req):
                return f"payload did not arrive within {self.payload_timeout_s} s"
        except MPI.Exception as e:
            if e.Get_error_class() == MPI.ERR_TRUNCATE:
                return "payload longer than its header says"
            raise
        got = self._status.Get_count(MPI.BYTE)
        if got != size:
            return f"payload chunk of {got} bytes, header says {size}"
        return None

    def _wait(self, req: MPI.Request) -> bool:
        """Wait for a payload request already in flight: spin (no sleep, not even a yield)
        for up to 10 ms, as its data is on the way, then back off up to the time-out."""
        status = self._status
        if req.Test(status):
            return True
        t0 = time.monotonic()
        spin_until = t0 + 0.01
        while time.monotonic() < spin_until:
            if req.Test(status):
                return True
        sleep = self.poll_min_s
        while not req.Test(status):
            if time.monotonic() - t0 > self.payload_timeout_s:
                req.Cancel()
                req.Wait()
                return False
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_max_s)
        return True

    def _recv_payload(self, src: int, seq: int, raw: np.ndarray) -> str | None:
        tag = data_tag(seq)
        if raw.size <= self.chunk_bytes:
            pieces = [raw]
        else:
            pieces = [raw[i : i + self.chunk_bytes] for i in range(0, raw.size, self.chunk_bytes)]
        for piece in pieces:
            err = self._finish_payload(self.comm.Irecv([piece, MPI.BYTE], src, tag), piece.size)
            if err:
                return err
        return None

    def _drain(self, src: int, seq: int, nchunks: int) -> None:
        """Consume the payload chunks of a rejected header so they never match anything.

        The real size comes from a matched probe, so a lying header cannot make this
        allocate more than was actually sent. Gives up after 1 s per chunk.
        """
        tag = data_tag(seq)
        status = MPI.Status()
        for _ in range(min(nchunks, 1 << 16)):
            deadline = time.monotonic() + 1.0
            while (m := self.comm.Improbe(src, tag, status)) is None:
                if time.monotonic() > deadline:
                    return
                time.sleep(self.poll_min_s)
            m.Recv([np.empty(status.Get_count(MPI.BYTE), np.uint8), MPI.BYTE])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i in self._repost:
            self._hreq[i] = MPI.REQUEST_NULL
        try:
            for req in self._hreq:
                if req != MPI.REQUEST_NULL:
                    req.Cancel()
            MPI.Request.Waitall(self._hreq)
            self.wait_sends()
        except MPI.Exception as e:  # a peer died (ULFM): nothing left to drain from it
            log.warning("rank %d: closing after a communication failure: %s", self.rank, e)


def world_info() -> tuple[int, int, int]:
    """(rank, size, node-local rank) of this process in ``MPI.COMM_WORLD``.

    The local rank comes from a shared-memory split of the world communicator (collective:
    every rank must call this once at start-up).
    """
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    return comm.Get_rank(), comm.Get_size(), local


def mpi_library() -> str:
    """The MPI library's version string (first line)."""
    return MPI.Get_library_version().splitlines()[0].strip()
