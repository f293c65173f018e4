"""The MPI transport: the only module in edgefl that imports mpi4py.

Receiving: each rank keeps one header receive per peer posted, a persistent request
(``Recv_init``, re-armed with ``Start``, cheaper than a fresh ``Irecv``) into a fixed 80-byte
buffer, and completes them with ``Testsome``, so every peer is served in turn and no
``ANY_SOURCE`` probe starves high ranks. Header sends are persistent requests too, a few per
destination, re-packed in place.

Payloads travel as raw buffers (uppercase calls, no copy), split into chunks of at most
``chunk_bytes`` so MPI's int counts never overflow. A payload of one float32 chunk of the
sender's model size (every ``MODEL`` and dense ``UPDATE``) is flagged ``FLAG_POSTED`` in its
header and travels on the sender -> receiver channel's next *model tag*: ``16400 + (n mod
16368)``, ``n`` = the number of earlier flagged messages on that channel, so the receiver
knows it before the header arrives and keeps the receive for it posted in advance (into a
pooled buffer, for model sizes up to :attr:`MPITransport.prepost_max_bytes`); the sender
sends such a payload before its header, so the data is already moving (or in) when the
header is read. Any other payload follows its header on a *data tag*
derived from the message's sequence number, ``16 + (seq mod 16384)``. With MPI's in-order
delivery per (source, tag), a payload left behind by a rejected header is drained and cannot
be taken for the next message's.

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
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..hardexit import flush_and_exit
from .transport import Transport, log
from .wire import (
    CODE_OF_DTYPE_STR,
    FLAG_POSTED,
    HEADER_BYTES,
    HEADER_STRUCT,
    MAGIC,
    NUMPY_OF,
    VERSION,
    DType,
    Kind,
    Message,
    Validator,
    WireError,
    decode_header,
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
_U8 = np.dtype(np.uint8)
_ITEM = {int(d): t for d, t in NUMPY_OF.items()}
_pack_into = HEADER_STRUCT.pack_into
_unpack_from = HEADER_STRUCT.unpack_from
_pack = HEADER_STRUCT.pack
_BYTE = MPI.BYTE
_NO_SOURCE = MPI.ANY_SOURCE  # the source of a status no receive has written
TAG_DATA_BASE = 16
TAG_DATA_SPAN = 1 << 14  # data tags lie in [16, 16400)
TAG_MODEL_BASE = TAG_DATA_BASE + TAG_DATA_SPAN
TAG_MODEL_SPAN = 32768 - TAG_MODEL_BASE  # model tags lie in [16400, 32768): MPI's minimum


def data_tag(seq: int) -> int:
    """The MPI tag of a message's payload chunks (derived from its sequence number)."""
    return TAG_DATA_BASE + (seq % TAG_DATA_SPAN)


def model_tag(n: int) -> int:
    """The MPI tag of the payload of a channel's ``n``-th ``FLAG_POSTED`` message."""
    return TAG_MODEL_BASE + (n % TAG_MODEL_SPAN)


def is_failure(e: MPI.Exception) -> bool:
    """Whether an MPI error means a process involved has died (ULFM error classes)."""
    return e.Get_error_class() in _FAILURE_CLASSES


def _error_class(code: int) -> int:
    try:
        return MPI.Get_error_class(code)
    except MPI.Exception:
        return code


def _free(req: MPI.Request) -> None:
    """Free an inactive persistent request (errors ignored: closing, or the peer is gone)."""
    try:
        if req:
            req.Free()
    except MPI.Exception:
        pass


def _wire_payload(payload: np.ndarray) -> tuple[np.ndarray, int]:
    """``payload`` as one contiguous 1-D array, and its dtype code (a WireError for a dtype
    the wire has no code for)."""
    if payload.ndim != 1 or not payload.flags.c_contiguous:
        payload = np.ascontiguousarray(payload).reshape(-1)
    dt = payload.dtype
    code = _F32 if dt is _F32_NP else CODE_OF_DTYPE_STR.get(dt.str)
    if code is None:
        raise WireError(f"unsupported payload dtype {dt}")
    return payload, code


REAP_AT = 64  # pending sends that make a send reap the completed ones (at least)
REAP_EVERY_S = 0.01  # with more pending, a poll reaps at most this often (seconds)
BUNDLE_MAX = 512  # a BUNDLE goes out once it holds this many messages (its receiver
# starts on the first ones while the sender makes the next: a worker trains a first stack
# while rank 0 is still dispatching the round)
BUNDLE_BYTES = 4 << 20  # a BUNDLE goes out once its messages hold this many bytes
BUNDLE_PAYLOAD_MAX = 1 << 20  # a larger payload of a bundled kind is sent on its own


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

    Attributes:
        prepost_max_bytes: largest model (bytes) whose payload receives are posted in
            advance (default 4 MiB; above that the fixed cost per message does not matter);
            one buffer per peer that sends models, at most ``prepost_total_bytes`` in all
            (default 64 MiB).
    """

    prepost_max_bytes = 4 << 20
    prepost_total_bytes = 64 << 20

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
        self._bundle_max = min(BUNDLE_PAYLOAD_MAX, chunk_bytes)  # largest bundled payload
        self.validator.chunk_bytes = chunk_bytes
        self.payload_timeout_s = payload_timeout_s
        self.peers = (
            list(peers) if peers is not None else [r for r in range(self.size) if r != self.rank]
        )
        n = len(self.peers)
        self._index = {p: i for i, p in enumerate(self.peers)}
        self._single = n == 1  # a plain Test is cheaper than Testsome
        self._status = MPI.Status()
        # Testsome's statuses; a consumed one gets its source reset to _NO_SOURCE, so after
        # a failed Testsome the statuses it wrote are those naming a source
        self._hstat = [MPI.Status() for _ in self.peers]
        # per peer: the header receive buffer and its persistent request (REQUEST_NULL once
        # the peer is dead or retired)
        self._hbuf = [np.empty(HEADER_BYTES, _U8) for _ in self.peers]
        self._hreq: list[MPI.Request] = [MPI.REQUEST_NULL] * n
        # model tags: flagged messages sent per destination, received per peer; per peer
        # the payload receive posted in advance for the next one, (request, buffer) or None
        self._schan: dict[int, int] = {}
        self._rchan = [0] * n
        self._pre: list[tuple[MPI.Request, np.ndarray] | None] = [None] * n
        self._pre_bytes = 0
        # persistent header sends per destination: free (buffer, request) pairs
        self._hsend: dict[int, list[tuple[np.ndarray, MPI.Prequest]]] = {}
        self._hsend_max = 80  # > the pending sends reaped at once: none is made again
        # pending sends: (requests, payload kept alive, release callback, destination,
        # header send)
        self._pending: dict[int, deque[tuple]] = {}  # dest -> its started sends, in order
        self._npending = 0
        self._reaped = 0.0  # time.monotonic() of the last reap
        # a send reaps the completed ones when this many are pending: twice what the last
        # reap left (at least REAP_AT), so a burst of sends to busy ranks (10,000 TRAINs
        # of a BSP round) costs amortized O(1) per send, not a test of every pending one
        self._reap_at = REAP_AT
        # messages of these kinds to one rank go out as one BUNDLE (at the next poll,
        # wait_sends or other send to that rank): a BSP round's thousands of TRAINs reach
        # a worker together, in order, as one MPI message, and a stack's UPDATEs reach rank
        # 0 so (train.vectorize)
        self.bundle_kinds: frozenset[int] = frozenset()
        self._bundles: dict[int, list[bytes]] = {}
        self._bundle_bytes: dict[int, int] = {}  # bytes bundled per destination
        self._bundle_count: dict[int, int] = {}  # messages bundled per destination
        # sends to dead ranks: kept referenced (MPI may still hold their buffers), never waited
        self._abandoned: list[tuple[list[MPI.Request], tuple]] = []
        self._ulfm = True  # False once the library turned out not to offer Ack/Get_failed
        self._group = comm.Get_group()
        self._closed = False
        # work left for the next poll, off the path between an arrival and the caller:
        # header receives to re-arm, payload receives to post in advance (peer indices)
        self._repost: list[int] = []
        self._prepost: list[int] = []
        for i in range(n):
            try:
                self._hreq[i] = comm.Recv_init([self._hbuf[i], _BYTE], self.peers[i], TAG_HEADER)
            except MPI.Exception as e:
                if not is_failure(e):
                    raise
                self._refresh_failures([self.peers[i]])
                continue
            self._arm(i)

    # -- sending ------------------------------------------------------------------------
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
        """As :meth:`Transport.send` (the same steps, fused: this is every message's path).

        A ``FLAG_POSTED`` payload (see the module's doc) is sent first, before the header is
        even packed: the receiver usually has its receive posted, so the data starts moving
        at once. Bookkeeping comes after the message is on its way.
        """
        if dest in self._dead:
            if seq is None:
                seq = self.next_seq(dest, device, kind)
            log.debug("rank %d: dropped kind %d to dead rank %d", self.rank, int(kind), dest)
            if release is not None:
                release()
            return seq
        if kind in self.bundle_kinds and (payload is None or payload.nbytes <= self._bundle_max):
            return self._bundle(dest, kind, device, seq, round, vtime, aux, payload, release)
        code = nchunks = nbytes = flags = 0
        reqs: list[MPI.Request] = []
        if payload is not None:
            payload, code = _wire_payload(payload)
            nbytes = payload.nbytes
            if nbytes:
                nchunks = -(-nbytes // self.chunk_bytes)
                if nchunks > 0xFFFF:
                    raise WireError(
                        f"{nbytes} bytes need {nchunks} chunks of {self.chunk_bytes}; max 65535"
                    )
                if nchunks == 1 and code == _F32 and nbytes == self.validator.model_numel * 4:
                    flags = FLAG_POSTED
                    n = self._schan.get(dest, 0)
                    self._schan[dest] = n + 1
                    tag = TAG_MODEL_BASE + n % TAG_MODEL_SPAN
                    try:
                        reqs.append(self.comm.Isend([payload, _BYTE], dest, tag))
                    except MPI.Exception as e:
                        return self._send_failed(
                            e, dest, kind, device, seq, reqs, payload, None, release
                        )
        if seq is None:
            key = (dest, device, kind)
            seq = self._seq.get(key, 0) + 1
            self._seq[key] = seq
        if len(aux) != 4:
            aux = (*aux, 0.0, 0.0, 0.0, 0.0)[:4]
        if dest in self._bundles:  # (what was bundled for it before goes first)
            self._flush_bundle(dest)
        free = self._hsend.get(dest)
        entry = free.pop() if free else self._new_header_send(dest)
        buf, req = entry
        try:
            _pack_into(
                buf, 0, MAGIC, VERSION, kind, device, code, flags, nchunks, seq, round, vtime,
                nbytes, *aux,
            )  # fmt: skip
        except struct.error:  # fields that need converting first (e.g. a float round)
            try:
                _pack_into(
                    buf, 0, MAGIC, VERSION, int(kind), int(device), code, flags, nchunks,
                    int(seq), int(round), float(vtime), nbytes, *(float(a) for a in aux),
                )  # fmt: skip
            except (struct.error, TypeError, ValueError, OverflowError):
                if flags:  # the payload is out: a header the receiver rejects goes with it
                    _pack_into(buf, 0, MAGIC, VERSION, 0, -1, code, flags, 1, 0, 0, 0.0, nbytes,
                               0.0, 0.0, 0.0, 0.0)  # fmt: skip
                    reqs.append(req)
                    req.Start()
                    self._pend((reqs, payload, None, dest, entry))
                else:
                    self._done(entry, dest)
                raise
        reqs.append(req)
        try:
            req.Start()
            if nchunks and not flags:  # on the data tag of its sequence number
                tag = TAG_DATA_BASE + seq % TAG_DATA_SPAN
                if nchunks == 1:
                    reqs.append(self.comm.Isend([payload, _BYTE], dest, tag))
                else:
                    raw = payload.view(_U8)
                    for start in range(0, nbytes, self.chunk_bytes):
                        piece = raw[start : start + self.chunk_bytes]
                        reqs.append(self.comm.Isend([piece, _BYTE], dest, tag))
        except MPI.Exception as e:
            return self._send_failed(e, dest, kind, device, seq, reqs, payload, entry, release)
        # the message is on its way: the bookkeeping
        self._pend((reqs, payload, release, dest, entry))
        stats = self.stats
        stats.msgs_sent[dest] += 1
        stats.bytes_sent[dest] += HEADER_BYTES + nbytes
        if self._npending > self._reap_at:
            self._reap()
            self._reap_at = max(REAP_AT, 2 * self._npending)
        return seq

    def _bundle(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> int:
        """Keep a message for ``dest``'s next BUNDLE: its header, then its payload (if any:
        one chunk, padded to 8 bytes); returns its sequence number. Counted as sent now
        (its header's and payload's bytes, as if it went alone); the payload is copied, so
        ``release`` is called at once."""
        code = nbytes = 0
        data = b""
        if payload is not None:
            payload, code = _wire_payload(payload)
            nbytes = payload.nbytes
            data = payload.tobytes() + bytes(-nbytes % 8)
        if seq is None:
            seq = self.next_seq(dest, device, kind)
        hdr = _pack(
            MAGIC, VERSION, int(kind), int(device), code, 0, 1 if nbytes else 0, int(seq),
            int(round_), float(vtime), nbytes, *(float(a) for a in (*aux, 0, 0, 0, 0)[:4]),
        )  # fmt: skip
        got = self._bundles.setdefault(dest, [])
        got.append(hdr)
        size = self._bundle_bytes.get(dest, 0) + HEADER_BYTES
        if data:
            got.append(data)
            size += len(data)
        self._bundle_bytes[dest] = size
        self._bundle_count[dest] = count = self._bundle_count.get(dest, 0) + 1
        if release is not None:
            release()
        self.stats.msgs_sent[dest] += 1
        self.stats.bytes_sent[dest] += HEADER_BYTES + nbytes
        if count >= BUNDLE_MAX or size >= BUNDLE_BYTES:
            self._flush_bundle(dest)
        return seq

    def _flush_bundle(self, dest: int) -> None:
        """Send what is bundled for ``dest`` as one BUNDLE. Its messages were counted as
        sent (their headers' and payloads' bytes); the BUNDLE adds its own header's bytes,
        no message."""
        got = self._bundles.pop(dest, None)
        self._bundle_bytes.pop(dest, None)
        self._bundle_count.pop(dest, None)
        if not got:
            return
        payload = np.frombuffer(b"".join(got), _U8)
        stats = self.stats
        msgs, sent = stats.msgs_sent[dest], stats.bytes_sent[dest]
        self.send(dest, Kind.BUNDLE, payload=payload)
        stats.msgs_sent[dest] = msgs
        stats.bytes_sent[dest] = sent + HEADER_BYTES

    def flush_bundles(self) -> None:
        """Send every pending BUNDLE now."""
        for dest in list(self._bundles):
            self._flush_bundle(dest)

    def _send_failed(self, e, dest, kind, device, seq, reqs, payload, entry, release=None) -> int:
        """A send to ``dest`` raised: a process failure drops the message (anything else is
        raised again); returns its sequence number."""
        if not is_failure(e):
            raise e
        if seq is None:
            seq = self.next_seq(dest, device, kind)
        self._abandon(reqs, (payload, entry), release)
        self._refresh_failures([dest], f"send failed: {e.Get_error_string()}")
        log.debug("rank %d: dropped kind %d to dead rank %d", self.rank, int(kind), dest)
        return seq

    def _send(self, dest, kind, device, seq, round_, vtime, aux, payload, release) -> None:
        self.send(
            dest, kind, device=device, round=round_, vtime=vtime, aux=aux, payload=payload,
            seq=seq, release=release,
        )  # fmt: skip

    def _new_header_send(self, dest: int) -> tuple[np.ndarray, MPI.Prequest]:
        buf = np.empty(HEADER_BYTES, _U8)
        return buf, self.comm.Send_init([buf, _BYTE], dest, TAG_HEADER)

    def _done(self, entry, dest: int) -> None:
        """A header send completed: keep it for the next message to ``dest``."""
        free = self._hsend.get(dest)
        if free is None and dest not in self._dead:
            self._hsend[dest] = [entry]
        elif free is not None and len(free) < self._hsend_max:
            free.append(entry)
        else:
            _free(entry[1])

    def _abandon(self, reqs, bufs, release) -> None:
        """Give up a send to a dead rank: release it now, keep its buffers referenced."""
        self._abandoned.append((reqs, bufs))
        if release is not None:
            release()

    def _pend(self, item: tuple) -> None:
        """Keep a started send (reqs, payload, release, dest, entry) until it completes."""
        self._pending.setdefault(item[3], deque()).append(item)
        self._npending += 1

    def _reap(self) -> None:
        """Finish the completed sends; abandon those to dead ranks. Each rank's sends are
        tested in send order up to the first unfinished one: its later sends wait for the
        next reap untested (a test of an unfinished send drives MPI's progress engine,
        hundreds of microseconds each with thousands pending), so a reap costs one test
        per destination plus one per completed send."""
        self._reaped = time.monotonic()
        for dest, q in list(self._pending.items()):
            if self._pending.get(dest) is not q:
                continue  # a reap nested in a release or failure callback took it already
            if dest in self._dead:
                del self._pending[dest]  # (first: a callback below may reap again)
                self._npending -= len(q)
                for reqs, payload, release, _, entry in list(q):
                    self._abandon(reqs, (payload, entry), release)
                continue
            while q:
                reqs, payload, release, _, entry = q[0]
                try:
                    done = MPI.Request.Testall(reqs)
                except MPI.Exception as e:
                    if not is_failure(e) and e.Get_error_class() != MPI.ERR_IN_STATUS:
                        raise
                    q.popleft()
                    self._npending -= 1
                    self._abandon(reqs, (payload, entry), release)
                    self._refresh_failures([dest], f"send failed: {e.Get_error_string()}")
                    continue
                if not done:
                    break
                q.popleft()
                self._npending -= 1
                if release is not None:
                    release()
                self._done(entry, dest)
            if not q:
                self._pending.pop(dest, None)

    def wait_sends(self) -> None:
        """Wait for every pending send, except those to ranks found dead meanwhile (a send
        to a dead rank may never complete: checks for failures while waiting)."""
        if self._bundles:
            self.flush_bundles()
        sleep = self.poll_min_s
        while self._npending:
            self._reap()
            if not self._npending:
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

    def refresh_failures(self) -> list[int]:
        return self._refresh_failures()

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
            if i is not None:
                for work in (self._repost, self._prepost):
                    while i in work:
                        work.remove(i)
                self._disarm(i)
            for entry in self._hsend.pop(r, ()):
                _free(entry[1])
        if any(dest in self._dead for dest in self._pending):
            self._reap()

    # -- receiving ----------------------------------------------------------------------
    def _arm(self, i: int) -> None:
        """(Re-)post the header receive from peer ``i`` (Start its persistent request)."""
        try:
            self._hreq[i].Start()
        except MPI.Exception as e:
            if not is_failure(e) or self._closed:
                raise
            self._refresh_failures([self.peers[i]])

    def _disarm(self, i: int) -> None:
        """Stop receiving from peer ``i`` (it died or retired, or the transport closes)."""
        req = self._hreq[i]
        self._hreq[i] = MPI.REQUEST_NULL
        if req:
            try:
                req.Cancel()
                req.Wait()
            except MPI.Exception:
                pass  # completed in error: nothing left to cancel
            _free(req)
        pre = self._pre[i]
        if pre is not None:
            self._pre[i] = None
            self._pre_bytes -= pre[1].nbytes
            try:
                pre[0].Cancel()
                pre[0].Wait()
            except MPI.Exception:
                pass
            self.pool.put(pre[1])

    def _post_model(self, i: int) -> None:
        """Post in advance the payload receive of peer ``i``'s next model-tag message."""
        numel = self.validator.model_numel
        nbytes = numel * 4
        if (
            not numel
            or self._pre[i] is not None
            or nbytes > self.prepost_max_bytes
            or self._pre_bytes + nbytes > self.prepost_total_bytes
        ):
            return
        buf = self.pool.get(numel, _F32_NP)
        tag = TAG_MODEL_BASE + self._rchan[i] % TAG_MODEL_SPAN
        try:
            req = self.comm.Irecv([buf, _BYTE], self.peers[i], tag)
        except MPI.Exception as e:
            if not is_failure(e):
                raise
            self._refresh_failures([self.peers[i]])
            return
        self._pre[i] = (req, buf)
        self._pre_bytes += nbytes

    def poll(self, timeout: float = 0.0) -> list[Message]:
        """As :meth:`Transport.poll`; with a single peer (and no liveness detector) the
        spin re-tests that peer's header receive directly, seeing an arrival sooner."""
        if timeout <= 0 or not self._single or self.liveness is not None:
            return super().poll(timeout)
        known = len(self.failed)
        msgs = self._poll_once()
        if msgs or len(self.failed) != known:
            return msgs
        start = time.monotonic()
        spin_until = start + min(self.spin_s, timeout)
        st = self._status
        req = self._hreq[0]
        test, clock = req.Test, time.monotonic
        try:
            while req and clock() < spin_until:
                if self._repost:  # (a message was taken, and dropped: post the receive again)
                    msgs = self._poll_once()
                    if msgs or len(self.failed) != known:
                        return msgs
                    req = self._hreq[0]
                    test = req.Test
                elif test(st) or test(st) or test(st) or test(st):
                    msgs = self._take_single(st.Get_count(_BYTE))
                    if msgs or len(self.failed) != known:
                        return msgs
        except MPI.Exception as e:  # (the receive failed: the peer died, or a bad header)
            self._sort_out(e)
            if len(self.failed) != known:
                return []
        # then as Transport.poll, past its spin: sleep with back-off between tests
        deadline = start + timeout
        sleep = self.poll_min_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                return []
            time.sleep(min(sleep, deadline - now))
            sleep = min(sleep * 2, self.poll_max_s)
            msgs = self._poll_once()
            if msgs or len(self.failed) != known:
                return msgs

    def _poll_once(self) -> list[Message]:
        if self._bundles:  # (a burst of sends is over: its bundles go out)
            self.flush_bundles()
        if self._repost:  # receives to post again after the previous poll's messages
            dead, peers = self._dead, self.peers
            if self._prepost:  # first: the next payload may be about to arrive
                prepost, self._prepost = self._prepost, []
                for i in prepost:
                    if peers[i] not in dead:
                        self._post_model(i)
            repost, self._repost = self._repost, []
            for i in repost:
                if peers[i] not in dead:
                    self._arm(i)
        if self._npending and (
            self._npending <= REAP_AT or time.monotonic() - self._reaped >= REAP_EVERY_S
        ):  # (many pending: a busy receiver; testing them at every poll only costs)
            self._reap()
        if self._single:
            req = self._hreq[0]
            if not req:
                return []
            st = self._status
            try:
                if not req.Test(st):
                    return []
            except MPI.Exception as e:
                done = self._sort_out(e)
            else:  # (the common case, without the loop below)
                return self._take_single(st.Get_count(_BYTE))
        else:
            st = self._hstat
            try:
                idx = MPI.Request.Testsome(self._hreq, st)
            except MPI.Exception as e:
                done = self._sort_out(e)
            else:
                if not idx:
                    return []
                done = []
                for j, i in enumerate(idx):
                    s = st[j]
                    done.append((i, s.Get_count(_BYTE)))
                    s.Set_source(_NO_SOURCE)
                if len(done) > 1:
                    done.sort()
        out = []
        for i, count in done:
            # re-armed at the next poll, off the path between arrival and the caller
            self._repost.append(i)
            src = self.peers[i]
            try:
                msg = self._receive(i, src, count)
            except MPI.Exception as e:  # the sender died while its payload was on the way
                if not is_failure(e):
                    raise
                self._refresh_failures([src], "died while sending")
                continue
            if msg is None:
                continue
            if msg.kind == Kind.BUNDLE:
                out += self._unbundle(src, msg)
            else:
                out.append(msg)
        return out

    def _take_single(self, count: int) -> list[Message]:
        """The single peer's header receive completed with ``count`` bytes: its message."""
        self._repost.append(0)  # (re-armed at the next poll)
        src = self.peers[0]
        try:
            msg = self._receive(0, src, count)
        except MPI.Exception as e:  # the sender died while its payload was on the way
            if not is_failure(e):
                raise
            self._refresh_failures([src], "died while sending")
            return []
        if msg is None:
            return []
        return self._unbundle(src, msg) if msg.kind == Kind.BUNDLE else [msg]

    def _unbundle(self, src: int, bundle: Message) -> list[Message]:
        """The messages of a BUNDLE from ``src``, each checked as a header of its own
        (magic, version, kind, dtype, size, duplicates) and followed by its payload if its
        header announces one (one chunk, padded to 8 bytes). A message whose fields are
        rejected is skipped and the others delivered; a header that cannot be read, or a
        payload that runs past the BUNDLE's end, ends it (what follows cannot be framed).
        They are counted as received (their headers' and payloads' bytes), and the
        BUNDLE's own header's bytes, as the sender counts them. The payloads are views of
        the BUNDLE's buffer (which then is not pooled)."""
        raw = bundle.payload
        stats, validator = self.stats, self.validator
        stats.msgs_recv[src] -= 1
        stats.bytes_recv[src] -= bundle.nbytes
        out: list[Message] = []
        if raw is None:
            self.reject(src, "BUNDLE without a payload")
            return out
        size = raw.nbytes
        off = 0
        viewed = False
        try:
            while off < size:
                if size - off < HEADER_BYTES:
                    self.reject(src, f"BUNDLE of {size} bytes: {size - off} bytes at its end")
                    break
                (magic, version, code, device, dtype, flags, nchunks, seq, round_, vtime,
                 nbytes, a0, a1, a2, a3) = _unpack_from(raw, off)  # fmt: skip
                if magic != MAGIC or version != VERSION:
                    try:
                        decode_header(raw[off : off + HEADER_BYTES].tobytes())
                    except WireError as e:
                        self.reject(src, f"in a BUNDLE (the rest dropped): {e}")
                    break
                start = off + HEADER_BYTES
                off = start + nbytes + (-nbytes % 8)
                if nbytes < 0 or off > size:
                    self.reject(src, f"in a BUNDLE (the rest dropped): a payload of {nbytes} "
                                f"bytes past its end")  # fmt: skip
                    break
                try:
                    if flags or code == Kind.BUNDLE or nchunks != (1 if nbytes else 0):
                        raise WireError("a bundled message must be one chunk, not posted")
                    kind = validator.check_fields(src, code, device, dtype, nchunks, nbytes)
                except WireError as e:
                    self.reject(src, f"in a BUNDLE: {e}")
                    continue
                stats.msgs_recv[src] += 1
                stats.bytes_recv[src] += HEADER_BYTES + nbytes
                if validator.seen(src, device, code, seq):
                    stats.duplicates[src] += 1
                    continue
                payload = None
                if nbytes:
                    payload = raw[start : start + nbytes].view(_ITEM[dtype])
                    viewed = True
                out.append(Message(kind, src, device, seq, round_, vtime, (a0, a1, a2, a3),
                                   payload, nbytes, False))  # fmt: skip
        finally:
            if not viewed:
                self.pool.put(raw)
        return out

    def _sort_out(self, e: MPI.Exception) -> list[tuple[int, int]]:
        """After an error testing the header receives: (index, bytes received) of those that
        completed fine.

        The requests that completed (in error or not) are those whose status the failed
        Testsome wrote, i.e. the statuses naming a source (a consumed status has its source
        reset). A failed receive whose status names no source belongs to a dead rank, which
        the ULFM failure query below finds.
        """
        cls = e.Get_error_class()
        if cls not in _FAILURE_CLASSES and cls not in (MPI.ERR_IN_STATUS, MPI.ERR_TRUNCATE):
            raise e
        counts: dict[int, int] = {}
        if self._single:
            errors = {0: cls}
        else:
            errors = {}
            for st in self._hstat:
                i = self._index.get(st.Get_source())
                if i is None:
                    continue
                errors[i] = cls if cls != MPI.ERR_IN_STATUS else _error_class(st.Get_error())
                counts[i] = st.Get_count(_BYTE)
                st.Set_source(_NO_SOURCE)
        done, dead = [], []
        for i, code in sorted(errors.items()):
            if code == MPI.SUCCESS:
                done.append((i, counts[i]))
            elif code in _FAILURE_CLASSES:
                dead.append(self.peers[i])
            else:  # e.g. a header longer than 80 bytes (ERR_TRUNCATE): drop it, listen again
                self._repost.append(i)
                self.reject(self.peers[i], f"header receive failed: MPI error class {code}")
        self._refresh_failures(dead)
        # a header that arrived before its sender died is still read: its payload may be here
        return done

    def _receive(self, i: int, src: int, count: int) -> Message | None:
        """Decode, validate and complete the message whose header (``count`` bytes) arrived
        from peer ``i`` (rank ``src``); None if it was rejected or a duplicate.

        The checks are :func:`~edgefl.comm.wire.decode_header`'s and the validator's, on
        the unpacked fields; the delivery is :meth:`Transport._deliver`'s, inline (this is
        every message's path).
        """
        if count != HEADER_BYTES:  # (a shorter one: the rest of the buffer is older bytes)
            self.reject(src, f"header of {count} bytes, expected {HEADER_BYTES}")
            return None
        raw = self._hbuf[i]
        (magic, version, code, device, dtype, flags, nchunks, seq, round_, vtime, nbytes,
         a0, a1, a2, a3) = _unpack_from(raw)  # fmt: skip
        if magic != MAGIC or version != VERSION:
            try:
                decode_header(raw)  # (raises the error that says why)
            except WireError as e:  # an untrusted header: its payload is not drained
                self.reject(src, str(e))
            return None
        validator = self.validator
        if flags & FLAG_POSTED:  # the payload is on this peer's next model tag
            n = self._rchan[i]
            self._rchan[i] = n + 1
            tag = TAG_MODEL_BASE + n % TAG_MODEL_SPAN
            pre = self._pre[i]
            if pre is not None:
                self._pre[i] = None
                self._pre_bytes -= pre[1].nbytes
            self._prepost.append(i)  # (post the next one in advance, at the next poll)
            try:
                kind = validator.check_fields(src, code, device, dtype, nchunks, nbytes)
                if nchunks != 1 or dtype != _F32:
                    raise WireError(f"{kind.name} payload on a model tag must be one float32 chunk")
            except WireError as e:
                self._discard(src, tag, pre)
                self.reject(src, str(e))
                return None
            if pre is not None and pre[1].nbytes == nbytes:
                req, payload = pre  # posted in advance: the data may be here already
            else:
                if pre is not None and not self._discard(src, tag, pre, drain=False):
                    self.reject(src, f"payload of another size than the {nbytes} bytes announced")
                    return None
                payload = self.pool.get(nbytes >> 2, _F32_NP)
                req = self.comm.Irecv([payload, _BYTE], src, tag)
            st = self._status
            try:  # (usually complete already: _finish_payload's first test, inline)
                got = st.Get_count(_BYTE) if req.Test(st) else -1
            except MPI.Exception as e:
                if e.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                got = -2
            if got == nbytes:
                err = None
            elif got == -1:
                err = self._finish_payload(req, nbytes)
            elif got == -2:
                err = "payload longer than its header says"
            else:
                err = f"payload chunk of {got} bytes, header says {nbytes}"
        else:
            try:
                kind = validator.check_fields(src, code, device, dtype, nchunks, nbytes)
            except WireError as e:
                self._drain(src, data_tag(seq), nchunks)
                self.reject(src, str(e))
                return None
            if nbytes:
                item = _ITEM[dtype]
                payload = self.pool.get(nbytes // item.itemsize, item)
                err = self._recv_payload(src, seq, payload.view(_U8))
            else:
                payload = err = None
        if err:
            self.pool.put(payload)
            self.reject(src, err)
            return None
        if self.liveness is not None:
            self.liveness.heard(src, time.monotonic())
        stats = self.stats
        stats.msgs_recv[src] += 1
        stats.bytes_recv[src] += HEADER_BYTES + nbytes
        if validator.seen(src, device, code, seq):
            stats.duplicates[src] += 1
            if payload is not None:
                self.pool.put(payload)
            return None
        return Message(
            kind,
            src,
            device,
            seq,
            round_,
            vtime,
            (a0, a1, a2, a3),
            payload,
            nbytes,
            payload is not None,
        )

    def _discard(self, src: int, tag: int, pre, drain: bool = True) -> bool:
        """Take back a payload receive posted in advance on ``tag`` (``pre``, or None) that
        a rejected header's payload may have matched. Returns True if that payload is still
        to come; then, with ``drain``, it is drained."""
        pending = True
        if pre is not None:
            req, buf = pre
            try:
                req.Cancel()
                req.Wait(self._status)
                pending = self._status.Is_cancelled()
            except MPI.Exception:  # it matched and failed (e.g. truncated): consumed
                pending = False
            self.pool.put(buf)
        if pending and drain:
            self._drain(src, tag, 1)
        return pending

    def _finish_payload(self, req: MPI.Request, size: int) -> str | None:
        """Wait for one posted payload piece of ``size`` bytes; an error text or None."""
        try:
            if req.Test(self._status):  # (usually here already)
                got = self._status.Get_count(_BYTE)
                return None if got == size else f"payload chunk of {got} bytes, header says {size}"
            if not self._wait(req):
                return f"payload did not arrive within {self.payload_timeout_s} s"
        except MPI.Exception as e:
            if e.Get_error_class() == MPI.ERR_TRUNCATE:
                return "payload longer than its header says"
            raise
        got = self._status.Get_count(_BYTE)
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
            err = self._finish_payload(self.comm.Irecv([piece, _BYTE], src, tag), piece.size)
            if err:
                return err
        return None

    def _drain(self, src: int, tag: int, nchunks: int) -> None:
        """Consume the payload chunks (on ``tag``) of a rejected header so they never match
        anything.

        The real size comes from a matched probe, so a lying header cannot make this
        allocate more than was actually sent. Gives up after 1 s per chunk.
        """
        status = MPI.Status()
        for _ in range(min(nchunks, 1 << 16)):
            deadline = time.monotonic() + 1.0
            while (m := self.comm.Improbe(src, tag, status)) is None:
                if time.monotonic() > deadline:
                    return
                time.sleep(self.poll_min_s)
            m.Recv([np.empty(status.Get_count(_BYTE), np.uint8), _BYTE])

    def close(self) -> None:
        """Cancel the posted receives, then wait for the pending sends except those to dead
        ranks. Never raises nor hangs because a peer died."""
        if self._closed:
            return
        self._closed = True
        self._repost = []
        self._prepost = []
        dead = []
        for i, req in enumerate(self._hreq):
            self._hreq[i] = MPI.REQUEST_NULL
            if req:
                try:
                    req.Cancel()
                    req.Wait()
                except MPI.Exception as e:  # a peer died (ULFM): nothing left to drain from it
                    if is_failure(e):
                        dead.append(self.peers[i])
                    else:
                        log.warning(
                            "rank %d: closing after a communication error: %s", self.rank, e
                        )
                _free(req)
            self._disarm(i)  # (the payload receive posted in advance)
        try:
            if dead:
                self._refresh_failures(dead)
            self.wait_sends()
        except MPI.Exception as e:
            log.warning("rank %d: closing after a communication error: %s", self.rank, e)
        for free in self._hsend.values():
            for entry in free:
                _free(entry[1])
        self._hsend = {}
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
        flush_and_exit(status)
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
