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

# flags bit 0 (MPI transport): the payload, one float32 chunk, travels on the channel's next
# model tag (see edgefl.comm.mpi), where the receiver may have posted its receive in advance
FLAG_POSTED = 1


class Kind(enum.IntEnum):
    """The core's message kinds. ``up`` = worker -> coordinator, ``down`` = coordinator ->
    worker. Plugins and server backends register their own (:func:`register_kind`)."""

    REGISTER = 1  # up: JSON (uint8) describing the devices a rank hosts
    MODEL = 2  # down: the global model (float32, model size), device -1 = whole rank
    TRAIN = 3  # down: run task `round` of `device`; aux = (version, samples D, batch b, flags)
    UPDATE = 4  # up: model delta (float32, model size); aux = (samples, loss, seconds,
    #   local iterations since the device last got the global model)
    STOP = 5  # down: finish; aux[0] = exit status the worker should return
    ERROR = 6  # up: UTF-8 text (uint8) of a fatal worker-side error
    HEARTBEAT = 8  # both: liveness, no payload
    REPORT = 9  # up: a local iteration ended without a push; aux = (samples, loss, seconds, z)
    STATE = 23  # both (uint8, runtime.devstate encoding): rank 0 -> worker: {"ask": ...} =
    #   send your devices' plugin state (a checkpoint is being written) or {"load": ...} =
    #   the saved state (resume); worker -> rank 0: its devices' state; device = -1
    HOST = 28  # down (uint8, runtime.devstate encoding): host `device` from now on (its rank
    #   died): {"state": {plugin: its state from rank 0's latest checkpoint}}
    BUNDLE = 29  # both (uint8): header-only messages sent as one, their headers back to back
    #   (the MPI transport's; unpacked on arrival, never delivered as such)


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
_CODE_OF_CHAR = {v.str: int(k) for k, v in NUMPY_OF.items()}
CODE_OF_DTYPE_STR = _CODE_OF_CHAR  # numpy ``dtype.str`` -> payload dtype code


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
    Kind.HEARTBEAT: KindSpec("both", frozenset({DType.NONE}), "none"),
    Kind.REPORT: KindSpec("up", frozenset({DType.NONE}), "none"),
    Kind.STATE: KindSpec("both", frozenset({DType.UINT8}), "any"),
    Kind.HOST: KindSpec("down", frozenset({DType.UINT8}), "any"),
    Kind.BUNDLE: KindSpec("both", frozenset({DType.UINT8}), "any"),
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
HEADER_STRUCT = _STRUCT  # the layout as a struct.Struct (the MPI transport packs in place)


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


_KINDS: dict[int, Kind | MessageKind] = {int(k): k for k in Kind}
_DTYPES = {int(d): d for d in DType}


def _spec_entry(kind, spec: KindSpec) -> tuple:
    """What :meth:`Validator.check` reads per kind code, as plain values: (kind, spec,
    allowed dtype codes as ints, 1 = up / -1 = down / 0 = both, payload rule)."""
    way = {"up": 1, "down": -1}.get(spec.direction, 0)
    return kind, spec, frozenset(int(d) for d in spec.dtypes), way, spec.payload


# per kind code (enum hashing is a Python call, attribute reads cost on every message)
_SPEC_OF_CODE = {int(k): _spec_entry(k, s) for k, s in SPECS.items()}


class MessageKind(int):
    """A message kind registered by a plugin or a server backend: an int code with a name
    (like a :class:`Kind` member)."""

    name: str

    def __new__(cls, code: int, name: str) -> MessageKind:
        obj = int.__new__(cls, code)
        obj.name = name
        return obj

    def __repr__(self) -> str:
        return f"<MessageKind.{self.name}: {int(self)}>"


def register_kind(
    name: str, code: int, direction: str, dtypes: set[DType], payload: str
) -> MessageKind:
    """Register a plugin's message kind (wire code ``code``, 1..65535, unique) with what it
    may carry (see :class:`KindSpec`); returns it. Registering the same name and code again
    returns the registered kind; a code or name taken by another kind is a ValueError."""
    if direction not in ("up", "down", "both") or payload not in ("none", "model", "any"):
        raise ValueError(f"message kind {name}: bad direction {direction!r} or payload {payload!r}")
    old = _KINDS.get(int(code))
    if old is not None:
        if old.name == name:
            return old  # type: ignore[return-value]
        raise ValueError(f"message kind code {code} of {name} is taken by {old.name}")
    if any(k.name == name for k in _KINDS.values()):
        raise ValueError(f"message kind name {name} is taken")
    kind = MessageKind(int(code), name)
    spec = KindSpec(direction, frozenset(dtypes), payload)
    SPECS[kind] = spec  # type: ignore[index]
    _KINDS[int(code)] = kind
    _SPEC_OF_CODE[int(code)] = _spec_entry(kind, spec)
    return kind


def all_kinds() -> list[Kind | MessageKind]:
    """Every kind known now: the core's and the registered ones, by code."""
    return [k for _, k in sorted(_KINDS.items())]


def kind_of(code: int) -> Kind | MessageKind:
    """The kind of wire code ``code`` (KeyError if unknown)."""
    return _KINDS[int(code)]


_ITEMSIZE = {int(d): t.itemsize for d, t in NUMPY_OF.items()}
# (a STATE names its devices inside the payload; rank 0 checks them against the rank's)
_UNCHECKED_DEVICE_KINDS = frozenset(
    {int(Kind.REGISTER), int(Kind.ERROR), int(Kind.HEARTBEAT), int(Kind.STATE), int(Kind.BUNDLE)}
)  # (a BUNDLE's messages are checked each, device included)


class _Hosted(dict):
    """``Validator.hosted``: a dict that tells its validator when it changes (the validator
    remembers the headers it accepted, which depend on it). Values are kept as frozensets,
    so they cannot change behind its back."""

    def __init__(self, owner: Validator, items=()) -> None:
        super().__init__()
        self._owner = owner
        self.update(items)

    def __setitem__(self, key: int, devices) -> None:
        super().__setitem__(key, None if devices is None else frozenset(devices))
        self._owner._accepted.clear()

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self._owner._accepted.clear()

    def update(self, *args, **kw) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key: int, default=frozenset()):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: int, *default):
        self._owner._accepted.clear()
        return super().pop(key, *default)

    def popitem(self):
        self._owner._accepted.clear()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._owner._accepted.clear()

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # (a plain dict when copied or pickled)
        return (dict, (dict(self),))


class Validator:
    """Checks a decoded header against what the receiver expects.

    Args:
        rank: the receiving rank (0 = coordinator).
        model_numel: number of float32 elements of the model (checked for MODEL/UPDATE);
            0 = not known yet (any length accepted).
        max_payload_bytes: the largest payload accepted for ``"any"`` kinds (bytes).
        chunk_bytes: the sender's chunk size (bytes), to check ``nchunks``.

    Headers accepted are remembered by the fields the checks read (a message stream repeats
    the same few), and recognised at the cost of one dict lookup; setting any attribute or
    changing :attr:`hosted` forgets them all, as the checks depend on those.
    """

    def __init__(
        self,
        rank: int,
        model_numel: int = 0,
        max_payload_bytes: int = 1 << 34,
        chunk_bytes: int = 1 << 30,
    ) -> None:
        # (src, kind code, device, dtype code, nchunks, nbytes) -> kind, of accepted headers
        self._accepted: dict[tuple[int, int, int, int, int, int], Kind | MessageKind] = {}
        self.rank = rank
        self.model_numel = model_numel
        self.max_payload_bytes = max_payload_bytes
        self.chunk_bytes = chunk_bytes
        # rank -> device ids it hosts; None = registration not done yet (only REGISTER,
        # ERROR and HEARTBEAT are accepted from a rank before it registered).
        self.hosted: dict[int, frozenset[int]] = {}
        self._last_seq: dict[tuple[int, int, int], int] = {}

    def __setattr__(self, name: str, value) -> None:
        if name == "hosted":
            value = _Hosted(self, value)
        object.__setattr__(self, name, value)
        self._accepted.clear()

    def check(self, src: int, h: Header) -> Kind:
        """Return the message kind, or raise WireError saying why it is rejected."""
        return self.check_fields(src, h.kind, h.device, h.dtype, h.nchunks, h.nbytes)

    def check_fields(
        self, src: int, code: int, device: int, dtype: int, nchunks: int, nbytes: int
    ) -> Kind:
        """:meth:`check` on the header fields it reads (kind code, device, dtype code,
        nchunks, nbytes), for a transport that decoded them itself."""
        key = (src, code, device, dtype, nchunks, nbytes)
        kind = self._accepted.get(key)
        if kind is None:
            kind = self._check(src, code, device, dtype, nchunks, nbytes)
            if len(self._accepted) >= 4096:
                self._accepted.clear()
            self._accepted[key] = kind
        return kind

    def _check(
        self, src: int, code: int, device: int, dtype: int, nchunks: int, nbytes: int
    ) -> Kind:
        entry = _SPEC_OF_CODE.get(code)
        if entry is None:
            raise WireError(f"unknown kind {code}")
        kind, spec, allowed, way, payload = entry
        if way:
            if way > 0:
                if self.rank != 0:
                    raise WireError(f"{kind.name} may only be sent to the coordinator")
            elif src != 0:
                raise WireError(f"{kind.name} may only come from the coordinator (rank 0)")
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is None and dtype != DType.NONE:
            raise WireError(f"unknown dtype code {dtype}")
        if payload == "none":
            if dtype != DType.NONE or nbytes:
                raise WireError(f"{kind.name} carries no payload, got {nbytes} bytes")
        else:
            if dtype not in allowed:
                expected = ",".join(d.name.lower() for d in spec.dtypes)
                got = DType(dtype).name.lower()
                raise WireError(f"{kind.name} payload dtype {got}, expected {expected}")
            if nbytes == 0 or nbytes % itemsize:
                got = DType(dtype).name.lower()
                raise WireError(f"{kind.name} payload of {nbytes} bytes for {got}")
            if payload == "model" and self.model_numel:
                if nbytes != self.model_numel * itemsize:
                    raise WireError(
                        f"{kind.name} payload has {nbytes // itemsize} elements, "
                        f"model has {self.model_numel}"
                    )
            if nbytes > self.max_payload_bytes:
                raise WireError(f"{kind.name} payload of {nbytes} bytes exceeds the maximum")
            if nchunks != -(-nbytes // self.chunk_bytes):
                raise WireError(f"{nchunks} chunks for {nbytes} bytes")
        if self.rank == 0 and src != 0 and code not in _UNCHECKED_DEVICE_KINDS:
            hosted = self.hosted.get(src)
            if hosted is None:
                raise WireError(f"{kind.name} from rank {src} before it registered")
            if device not in hosted:
                raise WireError(f"rank {src} does not host device {device}")
        return kind

    def is_duplicate(self, src: int, h: Header) -> bool:
        """True when (src, device, kind) already delivered a sequence number >= this one."""
        return self.seen(src, h.device, h.kind, h.seq)

    def seen(self, src: int, device: int, code: int, seq: int) -> bool:
        """:meth:`is_duplicate` on the header fields it reads (device, kind code, seq)."""
        key = (src, device, code)
        if seq <= self._last_seq.get(key, 0):
            return True
        self._last_seq[key] = seq
        return False
