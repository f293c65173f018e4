"""The wire format: a fixed 80-byte header plus an optional flat numeric payload.

Pure code (numpy only): encoding, decoding and validation of headers are shared by every
transport, so the MPI transport and the in-process loopback reject exactly the same messages.

A message travels as one header message followed by ``nchunks`` payload messages. The payload
is a raw buffer (never pickled); its dtype is a one-byte code in the header.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

MAGIC = 0xED6EF1
VERSION = 1

HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("kind", "<u2"),
        ("device", "<i4"),
        ("dtype", "<u1"),
        ("flags", "<u1"),
        ("nchunks", "<u2"),
        ("seq", "<u8"),
        ("round", "<i8"),
        ("vtime", "<f8"),
        ("nbytes", "<u8"),
        ("aux", "<f8", (4,)),
    ]
)
HEADER_BYTES = HEADER_DTYPE.itemsize  # 80


class Kind(enum.IntEnum):
    """Message kinds. ``up`` = worker -> coordinator, ``down`` = coordinator -> worker."""

    REGISTER = 1  # up: JSON (uint8) describing the devices a rank hosts
    MODEL = 2  # down: the global model (float32, model size), device -1 = whole rank
    TRAIN = 3  # down: run task `round` of `device`; aux = (version, samples D, batch b, flags)
    UPDATE = 4  # up: model delta (float32, model size); aux = (samples, loss, seconds,
    #   local iterations since the device last got the global model)
    STOP = 5  # down: finish; aux[0] = exit status the worker should return
    ERROR = 6  # up: UTF-8 text (uint8) of a fatal worker-side error
    ORDER = 7  # down: next-epoch example order (int32) for `device`
    HEARTBEAT = 8  # both: liveness, no payload
    REPORT = 9  # up: a local iteration ended without a push; aux = (samples, loss, seconds, z)
    GRADS = 10  # up: per-example gradients (or sketches) of a task, float32 (CD-GraB)
    RESIDUAL = 11  # up: GDDR-released values + the update's norm (float32); aux[3] = tau
    SPARSE = 12  # up: a filtered, compressed update (algorithms.ps.compress encoding, uint8)
    RESEND = 13  # down: the SPARSE of (device, round) named a key list rank 0 lacks: resend
    MODEL_KEYS = 14  # down: global model values at the rank's working-set keys (float32)
    WORKSET = 15  # up: the sorted keys `device`'s data touches (int32/int64), sent once
    # sharded server group (ps.servers = S > 0; ranks 1..S are shards, docs/parameter-server.md)
    SHARD_MODEL = 16  # both: keys [aux0, aux1) of model version `round` (float32): rank 0 ->
    #   shard (start/resume), shard -> worker (pull), shard -> rank 0 (after an apply)
    SHARD_PUSH = 17  # both: worker -> shard: keys [aux0, aux1) of the update of (`device`,
    #   task `round`), float32; aux2 = the model version the task started from
    SHARD_PULL = 18  # down: rank 0 -> shard: send your range of version aux1 to rank aux0
    SHARD_APPLY = 19  # down: rank 0 -> shard: aggregate into version `round` the updates
    #   named by the float64 rows (device, task, samples, loss)
    SHARD_STATS = 20  # up: shard -> rank 0 (asked by a HEARTBEAT): float64 (bytes sent,
    #   bytes received, messages sent, messages received, replication bytes sent)
    SHARD_REPLICA = 21  # both: shard -> replica holder (ps.replicas > 1): keys [aux0, aux1)
    #   of model version `round` (float32), the owner's values after it got that version
    SHARD_OWNERS = 22  # both: rank 0 -> shards and workers after a shard failed: the owner
    #   rank of every range (float64), version `round` is current, aux0 = owner-map epoch;
    #   shard -> rank 0: the answer, float64 [1 = holds version `round` of its ranges, 0 not]
    STATE = 23  # both (uint8, runtime.devstate encoding): rank 0 -> worker: {"ask": ...} =
    #   send your devices' plugin state (a checkpoint is being written) or {"load": ...} =
    #   the saved state (resume); worker -> rank 0: its devices' state; device = -1


class DType(enum.IntEnum):
    """One-byte dtype codes of payloads."""

    NONE = 0
    FLOAT32 = 1
    INT32 = 2
    UINT8 = 3
    FLOAT64 = 4
    INT64 = 5
    FLOAT16 = 6


NUMPY_OF = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.INT32: np.dtype("<i4"),
    DType.UINT8: np.dtype("u1"),
    DType.FLOAT64: np.dtype("<f8"),
    DType.INT64: np.dtype("<i8"),
    DType.FLOAT16: np.dtype("<f2"),
}
CODE_OF = {v: k for k, v in NUMPY_OF.items()}
_CODE_OF_CHAR = {v.str: int(k) for k, v in NUMPY_OF.items()}


class WireError(ValueError):
    """A message that must be rejected; the text says why."""


@dataclass(frozen=True)
class KindSpec:
    """What a kind may carry.

    ``payload``: ``"none"`` (no payload), ``"model"`` (exactly the model's size in elements),
    or ``"any"`` (1 element up to the transport's maximum).
    """

    direction: str  # "up", "down" or "both"
    dtypes: frozenset[DType]
    payload: str


SPECS: dict[Kind, KindSpec] = {
    Kind.REGISTER: KindSpec("up", frozenset({DType.UINT8}), "any"),
    Kind.MODEL: KindSpec("down", frozenset({DType.FLOAT32}), "model"),
    Kind.TRAIN: KindSpec("down", frozenset({DType.NONE}), "none"),
    Kind.UPDATE: KindSpec("up", frozenset({DType.FLOAT32}), "model"),
    Kind.STOP: KindSpec("down", frozenset({DType.NONE}), "none"),
    Kind.ERROR: KindSpec("up", frozenset({DType.UINT8}), "any"),
    Kind.ORDER: KindSpec("down", frozenset({DType.INT32}), "any"),
    Kind.HEARTBEAT: KindSpec("both", frozenset({DType.NONE}), "none"),
    Kind.REPORT: KindSpec("up", frozenset({DType.NONE}), "none"),
    Kind.GRADS: KindSpec("up", frozenset({DType.FLOAT32}), "any"),
    Kind.RESIDUAL: KindSpec("up", frozenset({DType.FLOAT32}), "any"),
    Kind.SPARSE: KindSpec("up", frozenset({DType.UINT8}), "any"),
    Kind.RESEND: KindSpec("down", frozenset({DType.NONE}), "none"),
    Kind.MODEL_KEYS: KindSpec("down", frozenset({DType.FLOAT32}), "any"),
    Kind.WORKSET: KindSpec("up", frozenset({DType.INT32, DType.INT64}), "any"),
    Kind.SHARD_MODEL: KindSpec("both", frozenset({DType.FLOAT32}), "any"),
    Kind.SHARD_PUSH: KindSpec("both", frozenset({DType.FLOAT32}), "any"),
    Kind.SHARD_PULL: KindSpec("down", frozenset({DType.NONE}), "none"),
    Kind.SHARD_APPLY: KindSpec("down", frozenset({DType.FLOAT64}), "any"),
    Kind.SHARD_STATS: KindSpec("up", frozenset({DType.FLOAT64}), "any"),
    Kind.SHARD_REPLICA: KindSpec("both", frozenset({DType.FLOAT32}), "any"),
    Kind.SHARD_OWNERS: KindSpec("both", frozenset({DType.FLOAT64}), "any"),
    Kind.STATE: KindSpec("both", frozenset({DType.UINT8}), "any"),
}


@dataclass(slots=True)
class Message:
    """A received (validated) message. ``payload`` is None for kinds without one."""

    kind: Kind
    src: int
    device: int = -1
    seq: int = 0
    round: int = 0
    vtime: float = 0.0
    aux: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    payload: np.ndarray | None = None
    nbytes: int = 0  # payload bytes on the wire
    _pooled: bool = field(default=False, repr=False)


class Header(NamedTuple):
    """A decoded header (see :data:`HEADER_DTYPE` for the layout)."""

    magic: int
    version: int
    kind: int
    device: int
    dtype: int
    flags: int
    nchunks: int
    seq: int
    round: int
    vtime: float
    nbytes: int
    aux: tuple[float, float, float, float]


_STRUCT = struct.Struct("<IHHiBBHQqdQ4d")
assert _STRUCT.size == HEADER_BYTES


def encode_header(
    kind: int,
    device: int,
    seq: int,
    round_: int,
    vtime: float,
    payload: np.ndarray | None,
    aux: tuple[float, ...] = (),
    chunk_bytes: int = 1 << 30,
) -> np.ndarray:
    """Build a header (as an 80-byte uint8 array) for ``payload``.

    ``chunk_bytes`` is the largest payload piece sent as one MPI message (bytes).
    """
    raw = pack_header(kind, device, seq, round_, vtime, payload, aux, chunk_bytes)
    return np.frombuffer(bytearray(raw), np.uint8)


def pack_header(
    kind: int,
    device: int,
    seq: int,
    round_: int,
    vtime: float,
    payload: np.ndarray | None,
    aux: tuple[float, ...] = (),
    chunk_bytes: int = 1 << 30,
) -> bytes:
    """:func:`encode_header` as immutable ``bytes`` (the transports' fast path: MPI sends
    read-only buffers as they are)."""
    code = nbytes = nchunks = 0
    if payload is not None:
        dt = payload.dtype
        c = _FLOAT32_CODE if dt is _FLOAT32 else _CODE_OF_CHAR.get(dt.str)
        if c is None:
            raise WireError(f"unsupported payload dtype {dt}")
        code = c
        nbytes = payload.nbytes
        nchunks = -(-nbytes // chunk_bytes)
        if nchunks > 0xFFFF:
            raise WireError(f"{nbytes} bytes need {nchunks} chunks of {chunk_bytes}; max 65535")
    if len(aux) != 4:
        aux = (*aux, 0.0, 0.0, 0.0, 0.0)[:4]
    return _STRUCT.pack(
        MAGIC, VERSION, kind, device, code, 0, nchunks, seq, round_, vtime, nbytes, *aux
    )


_NO_AUX = (0.0, 0.0, 0.0, 0.0)
_FLOAT32 = NUMPY_OF[DType.FLOAT32]
_FLOAT32_CODE = int(DType.FLOAT32)
_new_header = tuple.__new__


def num_chunks(nbytes: int, chunk_bytes: int) -> int:
    """How many payload messages carry ``nbytes`` bytes at ``chunk_bytes`` each."""
    return 0 if nbytes == 0 else -(-nbytes // chunk_bytes)


# dtype code, nchunks, seq and payload bytes, read before the full decode (see mpi.py)
_PEEK = struct.Struct("<BxHQ16xQ")
_PEEK_OFFSET = 12


def peek_payload(buf: np.ndarray) -> tuple[int, int, int, int]:
    """(dtype code, nchunks, seq, payload bytes) of a raw header, unchecked."""
    return _PEEK.unpack_from(buf, _PEEK_OFFSET)


def decode_header(buf: np.ndarray | bytes, nbytes: int | None = None) -> Header:
    """Decode an 80-byte header; raises WireError on a wrong size, magic or version."""
    if nbytes is not None and nbytes != HEADER_BYTES:
        raise WireError(f"header of {nbytes} bytes, expected {HEADER_BYTES}")
    try:
        v = _STRUCT.unpack_from(buf, 0)
    except struct.error:  # a buffer shorter than a header
        raise WireError(f"header shorter than {HEADER_BYTES} bytes") from None
    h = _new_header(Header, (*v[:11], v[11:]))  # Header(...) without keyword parsing
    if h.magic != MAGIC:
        raise WireError(f"bad magic 0x{h.magic:x}")
    if h.version != VERSION:
        raise WireError(f"wire version {h.version}, expected {VERSION}")
    return h


_KINDS = {int(k): k for k in Kind}
_DTYPES = {int(d): d for d in DType}
# per kind code: (kind, spec, allowed dtype codes as ints); enum hashing is a Python call
_SPEC_OF_CODE = {int(k): (k, s, frozenset(int(d) for d in s.dtypes)) for k, s in SPECS.items()}
_ITEMSIZE = {int(d): t.itemsize for d, t in NUMPY_OF.items()}
# (a STATE names its devices inside the payload; rank 0 checks them against the rank's)
_UNCHECKED_DEVICE_KINDS = frozenset(
    {int(Kind.REGISTER), int(Kind.ERROR), int(Kind.HEARTBEAT), int(Kind.STATE)}
)


class Validator:
    """Checks a decoded header against what the receiver expects.

    Args:
        rank: the receiving rank (0 = coordinator).
        model_numel: number of float32 elements of the model (checked for MODEL/UPDATE);
            0 = not known yet (any length accepted).
        max_payload_bytes: the largest payload accepted for ``"any"`` kinds (bytes).
        chunk_bytes: the sender's chunk size (bytes), to check ``nchunks``.
    """

    def __init__(
        self,
        rank: int,
        model_numel: int = 0,
        max_payload_bytes: int = 1 << 34,
        chunk_bytes: int = 1 << 30,
    ) -> None:
        self.rank = rank
        self.model_numel = model_numel
        self.max_payload_bytes = max_payload_bytes
        self.chunk_bytes = chunk_bytes
        # rank -> device ids it hosts; None = registration not done yet (only REGISTER,
        # ERROR and HEARTBEAT are accepted from a rank before it registered).
        self.hosted: dict[int, frozenset[int]] = {}
        self._last_seq: dict[tuple[int, int, int], int] = {}

    def check(self, src: int, h: Header) -> Kind:
        """Return the message kind, or raise WireError saying why it is rejected."""
        entry = _SPEC_OF_CODE.get(h.kind)
        if entry is None:
            raise WireError(f"unknown kind {h.kind}")
        kind, spec, allowed = entry
        direction = spec.direction
        if direction == "up" and self.rank != 0:
            raise WireError(f"{kind.name} may only be sent to the coordinator")
        if direction == "down" and src != 0:
            raise WireError(f"{kind.name} may only come from the coordinator (rank 0)")
        code = h.dtype
        itemsize = _ITEMSIZE.get(code)
        if itemsize is None and code != DType.NONE:
            raise WireError(f"unknown dtype code {code}")
        nbytes = h.nbytes
        if spec.payload == "none":
            if code != DType.NONE or nbytes:
                raise WireError(f"{kind.name} carries no payload, got {nbytes} bytes")
        else:
            if code not in allowed:
                expected = ",".join(d.name.lower() for d in spec.dtypes)
                got = DType(code).name.lower()
                raise WireError(f"{kind.name} payload dtype {got}, expected {expected}")
            if nbytes == 0 or nbytes % itemsize:
                got = DType(code).name.lower()
                raise WireError(f"{kind.name} payload of {nbytes} bytes for {got}")
            if spec.payload == "model" and self.model_numel:
                if nbytes != self.model_numel * itemsize:
                    raise WireError(
                        f"{kind.name} payload has {nbytes // itemsize} elements, "
                        f"model has {self.model_numel}"
                    )
            if nbytes > self.max_payload_bytes:
                raise WireError(f"{kind.name} payload of {nbytes} bytes exceeds the maximum")
            if h.nchunks != -(-nbytes // self.chunk_bytes):
                raise WireError(f"{h.nchunks} chunks for {nbytes} bytes")
        if self.rank == 0 and src != 0 and h.kind not in _UNCHECKED_DEVICE_KINDS:
            hosted = self.hosted.get(src)
            if hosted is None:
                raise WireError(f"{kind.name} from rank {src} before it registered")
            if h.device not in hosted:
                raise WireError(f"rank {src} does not host device {h.device}")
        return kind

    def is_duplicate(self, src: int, h: Header) -> bool:
        """True when (src, device, kind) already delivered a sequence number >= this one."""
        key = (src, h.device, h.kind)
        seq = h.seq
        if seq <= self._last_seq.get(key, 0):
            return True
        self._last_seq[key] = seq
        return False
