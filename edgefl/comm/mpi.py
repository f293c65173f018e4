"""The MPI transport: the only module in edgefl that imports mpi4py.

Each rank pre-posts one header receive per peer (``Irecv`` into a fixed 80-byte buffer) and
completes them with ``Testsome``, so every peer is served in turn and no ``ANY_SOURCE`` probe
starves high ranks. Payloads travel as raw buffers (uppercase calls), split into chunks of at
most ``chunk_bytes`` so MPI's int counts never overflow, on a tag derived from the sequence
number (modulo 16384): with MPI's in-order delivery per (source, tag), a payload left behind
by a rejected header is drained and cannot be taken for the next message's.

Failures (ULFM, Open MPI 5 run with ``mpiexec --with-ft ulfm``): a killed peer surfaces as an
error of class ``MPI_ERR_PROC_FAILED`` on the requests involving it, first on the header
receive pre-posted from it (tens of milliseconds after the kill). The transport then
acknowledges the failures (``Comm.Ack_failed``), reads the whole failed group
(``Comm.Get_failed``), stops receiving from those ranks and drops sends to them, and goes on
serving the others. Sends already in flight to a dead rank may never complete (a rendezvous
send is neither finished nor failed by Open MPI): their buffers are kept referenced, never
waited for, and their ``release`` callbacks are called at once.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
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
# error classes that mean "a process involved died" (ULFM; absent names map to nothing)
_FAILURE_CLASSES = frozenset(
    getattr(MPI, name)
    for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    if isinstance(getattr(MPI, name, None), int)
)
_ulfm_failures: set[int] = set()  # ranks the MPI library reported dead to this process
_F32 = int(DType.FLOAT32)
_F32_NP = np.dtype(np.float32)
TAG_DATA_BASE = 16
TAG_DATA_SPAN = 1 << 14  # data tags lie in [16, 16 + 16384): within MPI's guaranteed 32767


def data_tag(seq: int) -> int:
    """The MPI tag of a message's payload chunks (derived from its sequence number)."""
    return TAG_DATA_BASE + (seq % TAG_DATA_SPAN)


def is_failure(e: MPI.Exception) -> bool:
    """Whether an MPI error means a process involved has died (ULFM error classes)."""
    return e.Get_error_class() in _FAILURE_CLASSES


def _error_class(code: int) -> int:
    try:
        return MPI.Get_error_class(code)
    except MPI.Exception:
        return code


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
        self._index = {p: i for i, p in enumerate(self.peers)}
        self._hbuf = [np.empty(HEADER_BYTES, np.uint8) for _ in self.peers]
        self._hstat = [MPI.Status() for _ in self.peers]
        self._status = MPI.Status()
        # pending sends: (requests, keep-alive buffers, release callback, destination)
        self._pending: list[tuple[list[MPI.Request], tuple, Callable[[], None] | None, int]] = []
        # sends to dead ranks: kept referenced (MPI may still hold their buffers), never waited
        self._abandoned: list[tuple[list[MPI.Request], tuple]] = []
        self._ulfm = True  # False once the library turned out not to offer Ack/Get_failed
        self._group = comm.Get_group()
        self._closed = False
        self._repost: list[int] = []
        self._hreq = [self._post_header(i) for i in range(len(self.peers))]

    # -- sending ------------------------------------------------------------------------
    def _send(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> None:
        header = pack_header(kind, device, seq, round_, vtime, payload, aux, self.chunk_bytes)
        reqs: list[MPI.Request] = []
        try:
            reqs.append(self.comm.Isend([header, MPI.BYTE], dest, TAG_HEADER))
            if payload is not None:
                tag = data_tag(seq)
                if payload.nbytes <= self.chunk_bytes:
                    reqs.append(self.comm.Isend([payload, MPI.BYTE], dest, tag))
                else:
                    raw = payload.view(np.uint8)
                    for start in range(0, raw.size, self.chunk_bytes):
                        piece = raw[start : start + self.chunk_bytes]
                        reqs.append(self.comm.Isend([piece, MPI.BYTE], dest, tag))
        except MPI.Exception as e:
            if not is_failure(e):
                raise
            self._abandon(reqs, (header, payload), release)
            self._refresh_failures([dest], f"send failed: {e.Get_error_string()}")
            log.debug("rank %d: dropped kind %d to dead rank %d", self.rank, kind, dest)
            return
        pending = self._pending
        pending.append((reqs, (header, payload), release, dest))
        stats = self.stats
        stats.msgs_sent[dest] += 1
        stats.bytes_sent[dest] += HEADER_BYTES if payload is None else HEADER_BYTES + payload.nbytes
        if len(pending) > 64:
            self._reap()

    def _abandon(self, reqs, bufs, release) -> None:
        """Give up a send to a dead rank: release it now, keep its buffers referenced."""
        self._abandoned.append((reqs, bufs))
        if release is not None:
            release()

    def _reap(self) -> None:
        """Finish the completed sends; abandon those to dead ranks."""
        pending, self._pending = self._pending, []
        for entry in pending:
            reqs, bufs, release, dest = entry
            if dest in self._dead:
                self._abandon(reqs, bufs, release)
                continue
            try:
                done = MPI.Request.Testall(reqs)
            except MPI.Exception as e:
                if not is_failure(e) and e.Get_error_class() != MPI.ERR_IN_STATUS:
                    raise
                self._abandon(reqs, bufs, release)
                self._refresh_failures([dest], f"send failed: {e.Get_error_string()}")
                continue
            if done:
                if release is not None:
                    release()
            else:
                self._pending.append(entry)

    def wait_sends(self) -> None:
        """Wait for every pending send, except those to ranks found dead meanwhile (a send
        to a dead rank may never complete: checks for failures while waiting)."""
        sleep = self.poll_min_s
        while self._pending:
            self._reap()
            if not self._pending:
                return
            self._refresh_failures()
            self._check_liveness()
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_max_s)

    # -- failures -----------------------------------------------------------------------
    def _refresh_failures(self, seen: Sequence[int] = (), reason: str = "") -> list[int]:
        """Acknowledge the failures the library knows of and record them with the ranks
        ``seen`` failing; returns the newly dead ranks."""
        ranks = set(seen)
        if self._ulfm:
            try:
                self.comm.Ack_failed()
                group = self.comm.Get_failed()
                try:
                    n = group.Get_size()
                    if n:
                        ranks.update(MPI.Group.Translate_ranks(group, list(range(n)), self._group))
                finally:
                    if group != MPI.GROUP_EMPTY:
                        group.Free()
            except (NotImplementedError, MPI.Exception) as e:
                log.debug("rank %d: no ULFM failure queries (%s)", self.rank, e)
                self._ulfm = False
        ranks.discard(MPI.UNDEFINED)
        _ulfm_failures.update(ranks)
        return self._mark_failed(sorted(ranks), reason or "process failure reported by MPI")

    def declare_failed(self, rank: int, reason: str = "declared failed") -> bool:
        """As :meth:`Transport.declare_failed`; also makes :func:`finalize` leave without
        ``MPI_Finalize`` (which can wait forever for the dead rank, e.g. under MPICH)."""
        new = super().declare_failed(rank, reason)
        if rank != self.rank:
            _ulfm_failures.add(rank)
        return new

    def _forget(self, ranks: list[int]) -> None:
        for r in ranks:
            i = self._index.get(r)
            if i is None:
                continue
            if i in self._repost:
                self._repost.remove(i)
            req = self._hreq[i]
            if req:
                try:
                    req.Cancel()
                    req.Wait()
                except MPI.Exception:
                    pass  # completed in error: nothing left to cancel
            self._hreq[i] = MPI.REQUEST_NULL
        if any(dest in self._dead for *_, dest in self._pending):
            self._reap()

    # -- receiving ----------------------------------------------------------------------
    def _post_header(self, i: int) -> MPI.Request:
        try:
            return self.comm.Irecv([self._hbuf[i], MPI.BYTE], self.peers[i], TAG_HEADER)
        except MPI.Exception as e:
            if not is_failure(e) or self._closed:
                raise
            self._hreq[i] = MPI.REQUEST_NULL
            self._refresh_failures([self.peers[i]])
            return MPI.REQUEST_NULL

    def _poll_once(self) -> list[Message]:
        if self._pending:
            self._reap()
        if self._repost:  # header receives consumed by the previous poll
            repost, self._repost = self._repost, []
            for i in repost:
                if self.peers[i] not in self._dead:
                    self._hreq[i] = self._post_header(i)
        try:
            if len(self._hreq) == 1:  # a single peer: a plain Test is cheaper than Testsome
                done = [0] if self._hreq[0] and self._hreq[0].Test() else None
            else:
                done = MPI.Request.Testsome(self._hreq, self._hstat)
        except MPI.Exception as e:
            done = self._sort_out(e)
        if not done:
            return []
        out = []
        for i in sorted(done):
            # re-posted at the next poll, off the path between arrival and the caller
            self._repost.append(i)
            src = self.peers[i]
            try:
                msg = self._receive(src, self._hbuf[i])
            except MPI.Exception as e:  # the sender died while its payload was on the way
                if not is_failure(e):
                    raise
                self._refresh_failures([src], "died while sending")
                continue
            if msg is not None:
                out.append(msg)
        return out

    def _sort_out(self, e: MPI.Exception) -> list[int]:
        """After an error testing the header receives: the indices that completed fine.

        The requests that completed (in error or not) are those now null whose rank is not
        known dead; the statuses of a failed Testsome describe them in index order.
        """
        cls = e.Get_error_class()
        if cls not in _FAILURE_CLASSES and cls != MPI.ERR_IN_STATUS:
            raise e
        if len(self._hreq) == 1:
            errors = {0: cls}
        elif cls != MPI.ERR_IN_STATUS:  # no statuses to tell them apart: all failed
            errors = {
                i: cls
                for i, req in enumerate(self._hreq)
                if not req and self.peers[i] not in self._dead
            }
        else:
            finished = [
                i for i, req in enumerate(self._hreq) if not req and self.peers[i] not in self._dead
            ]
            errors = {}
            for i, st in zip(finished, self._hstat, strict=False):
                src = st.Get_source()
                code = _error_class(st.Get_error())
                if src == self.peers[i] or src in (MPI.ANY_SOURCE, MPI.PROC_NULL):
                    errors[i] = code
                else:  # unexpected order: trust the source the status names
                    errors[self._index.get(src, i)] = code
        done, dead = [], []
        for i, code in errors.items():
            if code == MPI.SUCCESS:
                done.append(i)
            elif code in _FAILURE_CLASSES:
                dead.append(self.peers[i])
            else:  # e.g. a header longer than 80 bytes (ERR_TRUNCATE): drop it, listen again
                self._repost.append(i)
                self.reject(self.peers[i], f"header receive failed: MPI error class {code}")
        self._refresh_failures(dead)
        # a header that arrived before its sender died is still read: its payload may be here
        return done

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
        """Cancel the posted header receives, then wait for the pending sends except those to
        dead ranks. Never raises nor hangs because a peer died."""
        if self._closed:
            return
        self._closed = True
        for i in self._repost:
            self._hreq[i] = MPI.REQUEST_NULL
        self._repost = []
        dead = []
        for i, req in enumerate(self._hreq):
            if not req:
                continue
            try:
                req.Cancel()
                req.Wait()
            except MPI.Exception as e:  # a peer died (ULFM): nothing left to drain from it
                if is_failure(e):
                    dead.append(self.peers[i])
                else:
                    log.warning("rank %d: closing after a communication error: %s", self.rank, e)
            self._hreq[i] = MPI.REQUEST_NULL
        try:
            if dead:
                self._refresh_failures(dead)
            self.wait_sends()
        except MPI.Exception as e:
            log.warning("rank %d: closing after a communication error: %s", self.rank, e)
        self._abandoned = []


def finalize(status: int = 0, timeout_s: float = 10.0) -> None:
    """End MPI for this process, never hanging; call it last (files closed, output written).

    Without a process failure this is ``MPI_Finalize`` (then ``MPI_Finalize`` does not run
    again at interpreter exit). After a failure reported by ULFM, Open MPI 5.0's
    ``MPI_Finalize`` can wait forever in its closing PMIx fence (seen here in 3 of 20 runs
    under CPU load; upstream open-mpi/ompi#9434, #11404), so the process instead flushes
    its output and leaves at once with ``os._exit(status)``; under ``--with-ft ulfm`` the
    launcher accepts that as a normal exit. As a last resort a watchdog (a C thread, it works
    even if MPI holds the interpreter lock) ends a finalize still running after
    ``timeout_s`` seconds (default 10.0) with status 1 and a traceback on stderr.

    Args:
        status: exit status used when the process has to leave without finalizing.
        timeout_s: bound on ``MPI_Finalize`` (seconds).
    """
    if MPI.Is_finalized():
        return
    if _ulfm_failures or _failures_known():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        MPI.Finalize()
    finally:
        faulthandler.cancel_dump_traceback_later()


def note_failure(rank: int = -1) -> None:
    """Record that some rank died during the job (told by rank 0): :func:`finalize` then
    leaves without ``MPI_Finalize``, which could wait forever for the dead rank."""
    _ulfm_failures.add(rank)


def _failures_known() -> bool:
    """Whether the library knows of a dead process in ``MPI.COMM_WORLD`` (ULFM only)."""
    comm = MPI.COMM_WORLD
    try:
        comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # progress; fails on an unacknowledged death
        group = comm.Get_failed()
        n = group.Get_size()
        if group != MPI.GROUP_EMPTY:
            group.Free()
        return n > 0
    except MPI.Exception as e:
        return is_failure(e)
    except NotImplementedError:
        return False


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
