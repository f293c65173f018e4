"""Encoding of sparse updates: dense vs (index, value), low-precision values, key caching.

Pure numpy, no MPI. An :class:`Encoder` (sender) turns ``(keys, values)`` into an
:class:`Encoded` message: one flat ``uint8`` payload (what travels, as the payload of one wire
message) plus a small ``header`` dict mirroring its fixed fields for logs and checks. A
:class:`Decoder` (receiver) turns the payload back into exactly the keys and (rounded) values
that were encoded. ``Encoded.nbytes`` is the payload size in bytes, counted exactly;
``Encoded.wire_bytes`` adds the runtime's fixed 80-byte message header.

Payload layout (little-endian): a 32-byte prefix ``format u8, value code u8, flags u16,
count u32, space u64, key hash 16 bytes`` followed by the body of the format:

========  ==============================================  ==============================
format    body                                            bytes of the body (c values)
========  ==============================================  ==============================
dense     values of every key ``0 .. space - 1``          ``v * space``
indexed   int32 keys, then values                         ``(4 + v) * c``
cached    values for the cached key list named by hash    ``v * c``
mask      bitmap over a cached base list, then values     ``ceil(m / 8) + v * c``
values    values only, keys known from context (a reply)  ``v * c``
========  ==============================================  ==============================

``v`` is the value size: 4 bytes (float32) or 2 (float16, bfloat16); ``m`` the length of the
cached base list (e.g. the device's working set). Keys-only messages (pull requests) are
``indexed``/``cached`` with value code 0 and no values.

**Break-even density.** With float32 values an (index, value) entry costs 8 bytes and a
dense entry 4, so the indexed form is smaller when fewer than ``4 / 8 = 1/2`` of the keys are
sent; in general below ``v / (4 + v)`` (1/3 for 16-bit values): see :func:`break_even_density`.
A bitmap over a cached base list of ``m`` keys costs ``m / 8`` bytes against ``4 c`` for the
indices, so it wins when more than 1/32 of the base is sent. The encoder computes the exact
size of every allowed format and sends the smallest, so no threshold needs tuning.

**Key caching** (Li et al., OSDI 2014, section 5.2). Sender and receiver each keep an LRU
cache ``hash -> key list`` of the same capacity (``cache_entries``). A key list sent in full
with the ``remember`` flag carries its 16-byte BLAKE2b hash (over the key space size and the
int32 keys); the receiver recomputes the hash, rejects the message on a mismatch, and caches
the list. Later the sender names an unchanged list by its hash only (``cached``), or a subset
of it by a bitmap (``mask``). If the receiver does not hold that hash (it restarted, evicted
it, a message was lost, the hash was corrupted) or the cached list's length disagrees with the
message, :meth:`Decoder.decode` raises :class:`KeyCacheMiss` and applies nothing; the runtime
answers with a request for the full list, the sender calls :meth:`Encoder.forget` and encodes
again, which sends the list in full. Values are never applied to keys the receiver only guesses
(a 128-bit hash collision, probability about ``n^2 / 2^129`` for ``n`` lists, aside).

**Low-precision values.** ``float16`` saturates finite values to +-65504 before rounding to
nearest-even (so a large entry never turns into inf); ``bfloat16`` keeps the top 16 bits of
the float32 after rounding to nearest-even (saturating at its largest finite value); NaN and
inf pass through. :func:`round_values` returns exactly what a receiver will decode, so a
filter can keep the rounding error in its residual (see :mod:`edgefl.algorithms.ps.filters`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...policies.keyrange import KEY_DTYPE, check_keys

VALUE_DTYPES = ("float32", "float16", "bfloat16")
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
INDEX_BYTES = 4  # int32 keys on the wire
HASH_BYTES = 16
WIRE_HEADER_BYTES = 80  # edgefl.comm.wire.HEADER_BYTES: every message's fixed header
MAX_SPACE = 2**31 - 1  # int32 keys

FORMATS = ("dense", "indexed", "cached", "mask", "values")
_FMT_CODE = {f: i for i, f in enumerate(FORMATS)}
_VCODE = {None: 0, "float32": 1, "float16": 2, "bfloat16": 3}
_VNAME = {c: n for n, c in _VCODE.items()}
_FLAG_REMEMBER = 1

_PREFIX = struct.Struct("<BBHIQ16s")
PREFIX_BYTES = _PREFIX.size  # 32

_F16_MAX = float(np.finfo(np.float16).max)  # 65504
_BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16


class MessageError(ValueError):
    """A payload that must be rejected (bad size, format, keys or hash); nothing is applied."""


class KeyCacheMiss(MessageError):
    """The receiver does not hold the key list named by ``key_hash`` (or holds one of another
    length): it must ask the sender for the full list. Nothing was applied."""

    def __init__(self, key_hash: bytes, why: str) -> None:
        super().__init__(f"key cache miss for hash {key_hash.hex()}: {why}; resend the keys")
        self.key_hash = key_hash


def check_value_dtype(name: Any, key: str = "ps.value_dtype") -> str:
    """Return ``name`` if it is a supported value dtype, else raise ConfigError naming ``key``."""
    if name not in VALUE_DTYPES:
        raise ConfigError(
            f"config key {key!r} = {name!r}: must be one of {', '.join(VALUE_DTYPES)}"
        )
    return str(name)


def break_even_density(value_dtype: str = "float32") -> float:
    """Share of keys below which (index, value) pairs are smaller than a dense vector.

    Dense costs ``v`` bytes per key of the space, indexed ``4 + v`` per sent key, so the
    break-even density is ``v / (4 + v)``: 0.5 for float32, 1/3 for float16/bfloat16.
    """
    v = VALUE_BYTES[check_value_dtype(value_dtype)]
    return v / (INDEX_BYTES + v)


def key_hash(keys: np.ndarray, space: int) -> bytes:
    """16-byte BLAKE2b digest of a key list (as int32) within a key space of ``space`` keys."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(struct.pack("<Q", int(space)))
    h.update(np.ascontiguousarray(keys, dtype="<i4").tobytes())
    return h.digest()


def _to_bf16_bits(v: np.ndarray) -> np.ndarray:
    f = np.ascontiguousarray(v, dtype=np.float32)
    bf_max = np.array(_BF16_MAX_BITS << 16, np.uint32).view(np.float32)
    finite = np.isfinite(f)
    f = np.where(finite, np.clip(f, -bf_max, bf_max), f).astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        sign = ((u >> 16) & 0x8000).astype(np.uint16)
        rounded[nan] = sign[nan] | 0x7FC0
    return rounded


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def value_bytes_of(values: np.ndarray, value_dtype: str) -> bytes:
    """The wire bytes of float32 ``values`` in ``value_dtype`` (little-endian)."""
    v = np.asarray(values, dtype=np.float32)
    if value_dtype == "float32":
        return v.astype("<f4", copy=False).tobytes()
    if value_dtype == "float16":
        sat = np.where(np.isfinite(v), np.clip(v, -_F16_MAX, _F16_MAX), v)
        return sat.astype("<f2").tobytes()
    if value_dtype == "bfloat16":
        return _to_bf16_bits(v).astype("<u2").tobytes()
    raise ValueError(f"unknown value dtype {value_dtype!r}")


def values_from_bytes(buf: np.ndarray, value_dtype: str, count: int) -> np.ndarray:
    """Decode ``count`` values of ``value_dtype`` from a uint8 buffer to float32 (a copy)."""
    if value_dtype == "float32":
        return np.frombuffer(buf, "<f4", count).astype(np.float32)
    if value_dtype == "float16":
        return np.frombuffer(buf, "<f2", count).astype(np.float32)
    if value_dtype == "bfloat16":
        return _from_bf16_bits(np.frombuffer(buf, "<u2", count))
    raise ValueError(f"unknown value dtype {value_dtype!r}")


def round_values(values: np.ndarray, value_dtype: str) -> np.ndarray:
    """Exactly the float32 values a receiver decodes after sending ``values`` as ``value_dtype``."""
    check_value_dtype(value_dtype)
    v = np.asarray(values, dtype=np.float32).reshape(-1)
    if value_dtype == "float32":
        return v.copy()
    raw = np.frombuffer(value_bytes_of(v, value_dtype), np.uint8)
    return values_from_bytes(raw, value_dtype, v.size).reshape(np.shape(values))


@dataclass
class Encoded:
    """One encoded message.

    Attributes:
        header: ``format``, ``value_dtype`` (None for keys-only), ``count`` (values or keys
            carried), ``space``, ``key_hash`` (hex, "" when none), ``remember``.
        payload: the flat uint8 buffer that travels.
    """

    header: dict[str, Any]
    payload: np.ndarray

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (exact)."""
        return int(self.payload.nbytes)

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: the payload plus the runtime's 80-byte message header."""
        return self.nbytes + WIRE_HEADER_BYTES


@dataclass
class Decoded:
    """What a receiver got: ``keys`` (int64 ascending; None = all keys, or the keys of the
    request a ``values`` reply answers) and ``values`` (float32; None for keys-only)."""

    format: str
    keys: np.ndarray | None
    values: np.ndarray | None
    space: int
    key_hash: bytes = field(default=b"", repr=False)

    def to_dense(self) -> np.ndarray:
        """The values as a dense float32 vector of ``space`` elements (zero elsewhere)."""
        if self.values is None:
            raise ValueError("keys-only message has no values")
        if self.keys is None:
            if self.values.size != self.space:
                raise ValueError("values reply has no keys; it cannot be made dense")
            return self.values.copy()
        out = np.zeros(self.space, np.float32)
        out[self.keys] = self.values
        return out


class KeyCache:
    """An LRU map ``hash -> key list`` holding at most ``capacity`` lists.

    Args:
        capacity: most lists kept (>= 1); the least recently used is dropped first.
    """

    def __init__(self, capacity: int = 16) -> None:
        if capacity < 1:
            raise ValueError(f"KeyCache capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._d: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)

    def get(self, h: bytes) -> np.ndarray | None:
        """The list for ``h`` (marked most recently used), or None."""
        keys = self._d.get(h)
        if keys is not None:
            self._d.move_to_end(h)
        return keys

    def put(self, h: bytes, keys: np.ndarray) -> None:
        """Store ``keys`` under ``h`` (most recently used), evicting the oldest beyond capacity."""
        self._d[h] = keys
        self._d.move_to_end(h)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def discard(self, h: bytes) -> None:
        """Forget ``h`` if held."""
        self._d.pop(h, None)

    def clear(self) -> None:
        """Forget everything."""
        self._d.clear()

    def state_dict(self) -> dict[str, Any]:
        """The lists and their hashes, least recently used first (for checkpoints)."""
        hs = list(self._d)
        return {
            "hashes": np.frombuffer(b"".join(hs), np.uint8).reshape(-1, HASH_BYTES).copy(),
            "lists": {str(i): np.array(self._d[h]) for i, h in enumerate(hs)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (replacing what is held)."""
        self._d.clear()
        for i, h in enumerate(np.asarray(state["hashes"], np.uint8).reshape(-1, HASH_BYTES)):
            self._d[bytes(h)] = np.array(state["lists"][str(i)])


def _check_space(space: int) -> int:
    if isinstance(space, bool) or not isinstance(space, int | np.integer):
        raise ValueError(f"key space must be an int, got {space!r}")
    if not 1 <= int(space) <= MAX_SPACE:
        raise ValueError(f"key space {space}: must be 1 .. {MAX_SPACE} (int32 keys)")
    return int(space)


class Encoder:
    """Sender side: encodes sparse updates, pull requests and replies for one peer.

    Args:
        space: key space size (model ``numel``, 1 .. 2**31 - 1).
        value_dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` (``ps.value_dtype``).
        key_cache: use key caching (``cached``/``mask`` formats); default False.
        cache_entries: LRU capacity of the key cache, same as the peer decoder's; default 16.
        allow_dense: allow the ``dense`` format; default True.
        allow_indexed: allow the ``indexed`` format; default True. (With both False only
            cached lists can be sent; used to measure a single format.)
    """

    def __init__(
        self,
        space: int,
        value_dtype: str = "float32",
        key_cache: bool = False,
        cache_entries: int = 16,
        allow_dense: bool = True,
        allow_indexed: bool = True,
    ) -> None:
        self.space = _check_space(space)
        self.value_dtype = check_value_dtype(value_dtype)
        self.vbytes = VALUE_BYTES[self.value_dtype]
        self.key_cache = bool(key_cache)
        self.cache = KeyCache(cache_entries)
        self.allow_dense = bool(allow_dense)
        self.allow_indexed = bool(allow_indexed)

    # -- sizes -----------------------------------------------------------------------------
    def sizes(self, count: int, base_len: int | None = None) -> dict[str, int]:
        """Payload bytes of each format for ``count`` values (``base_len``: cached base size)."""
        v = self.vbytes
        out = {"dense": PREFIX_BYTES + v * self.space, "indexed": PREFIX_BYTES + (4 + v) * count}
        out["cached"] = PREFIX_BYTES + v * count
        if base_len is not None:
            out["mask"] = PREFIX_BYTES + -(-base_len // 8) + v * count
        return out

    # -- cache control ---------------------------------------------------------------------
    def forget(self, h: bytes) -> None:
        """The peer reported a miss for ``h``: drop it so the next encode sends keys in full."""
        self.cache.discard(h)

    def reset_cache(self) -> None:
        """Forget every cached list (e.g. after the peer restarted)."""
        self.cache.clear()

    # -- encoding --------------------------------------------------------------------------
    def encode(
        self,
        keys: Any,
        values: np.ndarray,
        base: Any | None = None,
        remember: bool = True,
    ) -> Encoded:
        """Encode ``values`` (float32) at sorted unique ``keys`` in the smallest allowed format.

        Args:
            keys: sorted unique keys in ``0 .. space - 1``.
            values: one float32 value per key.
            base: optional sorted key list, a superset of ``keys``, that the peer may hold in
                its cache (e.g. the device's working set, cached by its pull requests); with
                key caching on, a subset of it is sent as a bitmap (``mask``).
            remember: with key caching on, ask the peer to cache ``keys`` when they are sent
                in full (default True; pass False for lists that change every round).
        """
        k = check_keys(keys, self.space)
        v = np.asarray(values, dtype=np.float32).reshape(-1)
        if v.size != k.size:
            raise ValueError(f"encode: {k.size} keys but {v.size} values")
        c = int(k.size)
        h = b""
        candidates: dict[str, int] = {}
        base_keys = None
        base_h = b""
        if self.key_cache:
            h = key_hash(k, self.space)
            if h in self.cache:
                candidates["cached"] = PREFIX_BYTES + self.vbytes * c
            if base is not None:
                b = check_keys(base, self.space, "base")
                base_h = key_hash(b, self.space)
                if base_h in self.cache and _is_subset(k, b):
                    base_keys = b
                    candidates["mask"] = self.sizes(c, int(b.size))["mask"]
        if self.allow_indexed:
            candidates["indexed"] = PREFIX_BYTES + (4 + self.vbytes) * c
        if self.allow_dense:
            candidates["dense"] = PREFIX_BYTES + self.vbytes * self.space
        if not candidates:
            raise ValueError("encode: no format allowed for these keys (enable indexed)")
        # smallest payload; ties go to the earlier format in this order
        order = ("cached", "mask", "indexed", "dense")
        fmt = min(candidates, key=lambda f: (candidates[f], order.index(f)))
        vbytes = b"" if fmt == "dense" else value_bytes_of(v, self.value_dtype)
        if fmt == "dense":
            dense = np.zeros(self.space, np.float32)
            dense[k] = v
            body = value_bytes_of(dense, self.value_dtype)
            enc = self._pack("dense", self.space, b"", False, body)
        elif fmt == "indexed":
            rem = self.key_cache and remember
            if rem:
                self.cache.put(h, k)
            enc = self._pack(
                "indexed", c, h if rem else b"", rem, k.astype("<i4").tobytes() + vbytes
            )
        elif fmt == "cached":
            self.cache.get(h)  # mark most recently used, as the decoder will
            enc = self._pack("cached", c, h, False, vbytes)
        else:
            assert base_keys is not None
            self.cache.get(base_h)
            bits = np.isin(base_keys, k, assume_unique=True)
            enc = self._pack("mask", c, base_h, False, np.packbits(bits).tobytes() + vbytes)
        assert enc.nbytes == candidates[fmt], (fmt, enc.nbytes, candidates[fmt])
        return enc

    def encode_keys(self, keys: Any, remember: bool = True) -> Encoded:
        """A keys-only message (a pull request): ``indexed``, or ``cached`` when the peer holds
        the list. With key caching on and ``remember``, the peer caches a fully sent list."""
        k = check_keys(keys, self.space)
        if self.key_cache:
            h = key_hash(k, self.space)
            if self.cache.get(h) is not None:
                return self._pack("cached", int(k.size), h, False, b"", keys_only=True)
            if remember:
                self.cache.put(h, k)
                body = k.astype("<i4").tobytes()
                return self._pack("indexed", int(k.size), h, True, body, keys_only=True)
        body = k.astype("<i4").tobytes()
        return self._pack("indexed", int(k.size), b"", False, body, keys_only=True)

    def encode_values(self, values: np.ndarray) -> Encoded:
        """A ``values`` reply: values only, for keys the peer named in its request."""
        v = np.asarray(values, dtype=np.float32).reshape(-1)
        return self._pack("values", int(v.size), b"", False, value_bytes_of(v, self.value_dtype))

    def _pack(
        self, fmt: str, count: int, h: bytes, remember: bool, body: bytes, keys_only: bool = False
    ) -> Encoded:
        vname = None if keys_only else self.value_dtype
        prefix = _PREFIX.pack(
            _FMT_CODE[fmt],
            _VCODE[vname],
            _FLAG_REMEMBER if remember else 0,
            count,
            self.space,
            h.ljust(HASH_BYTES, b"\0"),
        )
        payload = np.frombuffer(prefix + body, np.uint8).copy()
        header = {
            "format": fmt,
            "value_dtype": vname,
            "count": count,
            "space": self.space,
            "key_hash": h.hex(),
            "remember": remember,
        }
        return Encoded(header, payload)


def _is_subset(keys: np.ndarray, base: np.ndarray) -> bool:
    if keys.size == 0:
        return True
    pos = np.searchsorted(base, keys)
    return bool(np.all(pos < base.size)) and bool(
        np.array_equal(base[np.minimum(pos, base.size - 1)], keys)
    )


class Decoder:
    """Receiver side: decodes what one peer's :class:`Encoder` sent.

    Args:
        space: key space size; must match the sender's.
        cache_entries: LRU capacity of the key cache, same as the sender's; default 16.
    """

    def __init__(self, space: int, cache_entries: int = 16) -> None:
        self.space = _check_space(space)
        self.cache = KeyCache(cache_entries)

    def reset_cache(self) -> None:
        """Forget every cached list (what a restarted receiver looks like)."""
        self.cache.clear()

    def decode(self, message: Encoded | np.ndarray) -> Decoded:
        """Decode a payload (or an :class:`Encoded`). Raises :class:`KeyCacheMiss` when it names a
        key list this receiver does not hold, :class:`MessageError` when malformed; in both cases
        nothing is cached or applied."""
        buf = message.payload if isinstance(message, Encoded) else np.asarray(message)
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise MessageError(f"payload must be 1-D uint8, got {buf.dtype} {buf.shape}")
        if buf.size < PREFIX_BYTES:
            raise MessageError(f"payload of {buf.size} bytes is shorter than the prefix")
        fcode, vcode, flags, count, space, hraw = _PREFIX.unpack_from(bytes(buf[:PREFIX_BYTES]))
        if fcode >= len(FORMATS):
            raise MessageError(f"unknown format code {fcode}")
        if vcode not in _VNAME:
            raise MessageError(f"unknown value code {vcode}")
        if space != self.space:
            raise MessageError(f"key space {space} in message, receiver has {self.space}")
        fmt, vname = FORMATS[fcode], _VNAME[vcode]
        v = VALUE_BYTES[vname] if vname else 0
        body = buf[PREFIX_BYTES:]

        def need(n: int) -> None:
            if body.size != n:
                raise MessageError(
                    f"{fmt} message of {count} entries: body {body.size} B, want {n}"
                )

        if fmt == "dense":
            if vname is None or count != space:
                raise MessageError("dense message must carry a value for every key")
            need(v * space)
            return Decoded(fmt, None, values_from_bytes(body, vname, space), space)
        if fmt == "values":
            if vname is None:
                raise MessageError("values message without a value dtype")
            need(v * count)
            return Decoded(fmt, None, values_from_bytes(body, vname, count), space)
        if fmt == "indexed":
            need((4 + v) * count)
            keys = np.frombuffer(body, "<i4", count).astype(KEY_DTYPE)
            try:
                keys = check_keys(keys, space, "message keys")
            except ValueError as e:
                raise MessageError(str(e)) from None
            vals = values_from_bytes(body[4 * count :], vname, count) if vname else None
            h = b""
            if flags & _FLAG_REMEMBER:
                h = key_hash(keys, space)
                if h != hraw:
                    raise MessageError("key list does not match its hash (corrupt message)")
                self.cache.put(h, keys)
            return Decoded(fmt, keys, vals, space, h)
        # cached / mask name a list by hash
        base = self.cache.get(hraw)
        if base is None:
            raise KeyCacheMiss(hraw, "hash not in the receiver's cache")
        if fmt == "cached":
            if base.size != count:
                raise KeyCacheMiss(hraw, f"cached list has {base.size} keys, message {count}")
            need(v * count)
            vals = values_from_bytes(body, vname, count) if vname else None
            return Decoded(fmt, base.copy(), vals, space, hraw)
        nbits = -(-base.size // 8)
        if vname is None:
            raise MessageError("mask message without a value dtype")
        need(nbits + v * count)
        bits = np.unpackbits(body[:nbits], count=base.size).astype(bool)
        if int(bits.sum()) != count or np.unpackbits(body[:nbits])[base.size :].any():
            raise KeyCacheMiss(hraw, "bitmap does not match the cached list")
        return Decoded(fmt, base[bits], values_from_bytes(body[nbits:], vname, count), space, hraw)
