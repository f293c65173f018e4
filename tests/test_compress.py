"""Sparse-update encoding: exact round trips, exact byte counts, key caching that never
applies values to the wrong keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.ps.compress import (
    PREFIX_BYTES,
    WIRE_HEADER_BYTES,
    Decoder,
    Encoder,
    KeyCacheMiss,
    MessageError,
    break_even_density,
    check_value_dtype,
    key_hash,
    round_values,
)
from edgefl.errors import ConfigError

DTYPES = ["float32", "float16", "bfloat16"]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_break_even_density_and_format_choice() -> None:
    assert break_even_density("float32") == 0.5  # 4 B dense vs 4 + 4 B per (index, value)
    assert break_even_density("float16") == pytest.approx(1 / 3)  # 2 B vs 4 + 2 B
    assert break_even_density("bfloat16") == pytest.approx(1 / 3)
    enc = Encoder(100)
    for count, fmt in [(49, "indexed"), (50, "indexed"), (51, "dense")]:  # 50 is a tie
        e = enc.encode(np.arange(count), np.ones(count, np.float32))
        assert e.header["format"] == fmt
        assert e.nbytes == PREFIX_BYTES + (8 * count if fmt == "indexed" else 400)
        assert e.wire_bytes == e.nbytes + WIRE_HEADER_BYTES
    enc16 = Encoder(99, "float16")
    assert enc16.encode(np.arange(33), np.ones(33, np.float32)).header["format"] == "indexed"
    assert enc16.encode(np.arange(34), np.ones(34, np.float32)).header["format"] == "dense"
    with pytest.raises(ConfigError, match="'ps.value_dtype' = 'int8'"):
        check_value_dtype("int8")


def test_value_rounding_hand_values() -> None:
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 70000.0, -1e9, np.inf, np.nan], np.float32)
    bf = round_values(x, "bfloat16")
    assert bf[:3].tolist() == [1.0, 1.0, 1 + 2**-6]  # nearest, ties to even (8-bit mantissa)
    assert bf[5] == np.inf and np.isnan(bf[6])
    f16 = round_values(x, "float16")
    assert f16[:3].tolist() == [1.0, 1 + 2**-8, 1 + 3 * 2**-8]  # exact in float16
    assert f16[3] == 65504.0 and f16[4] == -65504.0  # saturated, not inf
    assert f16[5] == np.inf and np.isnan(f16[6])
    y = np.random.default_rng(0).normal(0, 100, 1000).astype(np.float32)
    assert np.array_equal(round_values(y, "float16"), y.astype(np.float16).astype(np.float32))
    assert np.array_equal(round_values(y, "float32"), y)
    # idempotent: rounding rounded values changes nothing
    for dt in DTYPES:
        r = round_values(y, dt)
        assert np.array_equal(_bits(round_values(r, dt)), _bits(r))


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 300),
    st.sampled_from(DTYPES),
    st.booleans(),
    st.data(),
)
def test_encode_decode_round_trip(space: int, dtype: str, cache: bool, data) -> None:
    enc, dec = Encoder(space, dtype, key_cache=cache), Decoder(space)
    base = np.array(sorted(data.draw(st.sets(st.integers(0, space - 1), max_size=space))), int)
    if cache and base.size:
        dec.decode(enc.encode_keys(base))  # the working set, as a pull request caches it
    for _ in range(3):
        keys = np.array(
            sorted(data.draw(st.sets(st.sampled_from(base)) if base.size else st.just(set()))), int
        )
        vals = np.array(
            data.draw(
                st.lists(
                    st.floats(width=32, allow_nan=False, allow_infinity=False),
                    min_size=keys.size,
                    max_size=keys.size,
                )
            ),
            np.float32,
        )
        e = enc.encode(keys, vals, base=base, remember=data.draw(st.booleans()))
        got = dec.decode(e.payload.copy())
        want = round_values(vals, dtype)
        if e.header["format"] == "dense":
            dense = np.zeros(space, np.float32)
            dense[keys] = want
            assert got.keys is None and np.array_equal(_bits(got.to_dense()), _bits(dense))
        else:
            assert np.array_equal(got.keys, keys)
            assert np.array_equal(_bits(got.values), _bits(want))
        # never larger than the best format without key caching
        sizes = enc.sizes(keys.size)
        assert e.nbytes == e.payload.nbytes <= min(sizes["dense"], sizes["indexed"])


def test_exact_sizes_of_every_format() -> None:
    n = 1000
    ws = np.arange(0, 1000, 4)  # 250 keys
    enc, dec = Encoder(n, "float16", key_cache=True), Decoder(n)
    req = enc.encode_keys(ws)
    assert req.header["format"] == "indexed" and req.nbytes == PREFIX_BYTES + 4 * 250
    dec.decode(req)
    req2 = enc.encode_keys(ws)
    assert req2.header["format"] == "cached" and req2.nbytes == PREFIX_BYTES
    assert np.array_equal(dec.decode(req2).keys, ws)
    full = enc.encode(ws, np.ones(250, np.float32))
    assert full.header["format"] == "cached" and full.nbytes == PREFIX_BYTES + 2 * 250
    sub = ws[::5]  # 50 of 250: bitmap 32 B + 100 B values < 6 * 50 B indexed
    m = enc.encode(sub, np.ones(50, np.float32), base=ws, remember=False)
    assert m.header["format"] == "mask" and m.nbytes == PREFIX_BYTES + 32 + 2 * 50
    assert np.array_equal(dec.decode(m).keys, sub)
    tiny = enc.encode(ws[:3], np.ones(3, np.float32), base=ws, remember=False)
    assert tiny.header["format"] == "indexed" and tiny.nbytes == PREFIX_BYTES + 6 * 3
    rep = Encoder(n).encode_values(np.arange(7, dtype=np.float32))
    assert rep.nbytes == PREFIX_BYTES + 28
    assert Decoder(n).decode(rep).values.tolist() == list(range(7))


def _setup(capacity: int = 4):
    n = 500
    ws = np.arange(3, 500, 7)
    enc, dec = Encoder(n, key_cache=True, cache_entries=capacity), Decoder(n, capacity)
    vals = np.linspace(-1, 1, ws.size).astype(np.float32)
    return n, ws, enc, dec, vals


def _send(enc: Encoder, dec: Decoder, keys, vals, base=None):
    """Deliver one push, resolving a cache miss the way the runtime will: the receiver
    reports the hash, the sender forgets it and sends the keys in full."""
    e = enc.encode(keys, vals, base=base)
    try:
        return dec.decode(e), e, False
    except KeyCacheMiss as miss:
        enc.forget(miss.key_hash)
        e2 = enc.encode(keys, vals, base=base)
        assert e2.header["format"] == "indexed"
        return dec.decode(e2), e2, True


def test_stale_hash_after_receiver_restart_is_detected_and_resolved() -> None:
    _, ws, enc, dec, vals = _setup()
    _send(enc, dec, ws, vals)
    got, e, missed = _send(enc, dec, ws, vals * 2)
    assert e.header["format"] == "cached" and not missed
    dec.reset_cache()  # the receiver restarted
    with pytest.raises(KeyCacheMiss):
        dec.decode(enc.encode(ws, vals))
    got, e, missed = _send(enc, dec, ws, vals * 3)
    assert missed and np.array_equal(got.keys, ws) and np.array_equal(got.values, vals * 3)
    got, e, missed = _send(enc, dec, ws, vals)  # and caching works again
    assert e.header["format"] == "cached" and not missed


def test_lost_message_and_eviction_never_apply_values_to_wrong_keys() -> None:
    n, ws, enc, dec, vals = _setup(capacity=2)
    enc.encode(ws, vals)  # lost in transit: the sender thinks the receiver has ws
    got, _, missed = _send(enc, dec, ws, vals)
    assert missed and np.array_equal(got.keys, ws)
    # the receiver keeps fewer lists than the sender believes (capacity mismatch)
    small = Decoder(n, 1)
    lists = [np.arange(i, n, 11) for i in range(3)]
    enc2 = Encoder(n, key_cache=True, cache_entries=8)
    for k in lists:
        small.decode(enc2.encode(k, np.ones(k.size, np.float32)))
    misses = 0
    for k in lists:  # each is either found or reported missing: never mixed up
        got, _, missed = _send(enc2, small, k, np.full(k.size, 5.0, np.float32))
        assert np.array_equal(got.keys, k) and np.all(got.values == 5.0)
        misses += missed
    assert misses == 3  # the one-entry receiver always held the previous list only
    # a mask over an evicted base list is a miss too
    n, ws, enc, dec, vals = _setup(capacity=1)
    dec.decode(enc.encode_keys(ws))
    other = np.arange(0, n, 2)
    dec.decode(enc.encode_keys(other))  # evicts ws on both sides
    e = enc.encode(ws[::2], vals[::2], base=ws)
    assert e.header["format"] != "mask"


def test_wrong_hash_is_detected() -> None:
    n, ws, enc, dec, vals = _setup()
    dec.decode(enc.encode(ws, vals))
    e = enc.encode(ws, vals)
    assert e.header["format"] == "cached"
    bad = e.payload.copy()
    bad[16] ^= 0xFF  # corrupt a byte of the hash
    with pytest.raises(KeyCacheMiss):
        dec.decode(bad)
    # a cached list of another length under the same hash (e.g. a bug) is refused
    dec.cache.put(key_hash(ws, n), ws[:-1])
    with pytest.raises(KeyCacheMiss, match="keys"):
        dec.decode(e)
    # a full list whose hash does not match is corrupt, and nothing is cached
    fresh_enc, fresh_dec = Encoder(n, key_cache=True), Decoder(n)
    full = fresh_enc.encode(ws, vals)
    bad = full.payload.copy()
    bad[PREFIX_BYTES] ^= 1  # first key changes
    with pytest.raises(MessageError, match="hash"):
        fresh_dec.decode(bad)
    assert len(fresh_dec.cache) == 0


def test_malformed_messages_are_rejected() -> None:
    enc, dec = Encoder(50), Decoder(50)
    e = enc.encode([1, 2], np.ones(2, np.float32))
    with pytest.raises(MessageError, match="body"):
        dec.decode(e.payload[:-1].copy())
    with pytest.raises(MessageError, match="key space"):
        Decoder(51).decode(e)
    with pytest.raises(MessageError, match="prefix"):
        dec.decode(np.zeros(5, np.uint8))
    swapped = e.payload.copy()
    swapped[PREFIX_BYTES : PREFIX_BYTES + 8] = np.frombuffer(
        np.array([2, 1], "<i4").tobytes(), np.uint8
    )
    with pytest.raises(MessageError, match="sorted"):
        dec.decode(swapped)
    with pytest.raises(ValueError):
        enc.encode([3, 1], np.ones(2, np.float32))
    with pytest.raises(ValueError):
        enc.encode([1, 2], np.ones(3, np.float32))


def test_bench_pipeline_sparse_pushes_are_lossless() -> None:
    """End to end (the ``edgefl bench ps`` loop, tiny): working-set pulls and index/value or
    key-cached pushes give bit-identical training to dense messages, with fewer bytes."""
    from edgefl.bench import ps
    from edgefl.data.clicks import ClicksFederated
    from edgefl.policies.keyrange import ParamLayout

    args = {"features": 3000, "samples_per_device": 100, "nnz_per_example": 6}
    data = ClicksFederated(args, 4, seed=0)
    layout = ParamLayout.from_shapes(["weight", "bias"], [(3000,), (1,)])
    devices = ps.build_devices(data, layout)
    cfg = {"rounds": 3, "local_steps": 2, "local_lr": 1.0, "l1": 1e-3}
    cfg |= {"sig_threshold": 1e-3, "kkt_margin": 0.0}
    rows = {
        v.name: ps.run_variant(v, data, devices, cfg)
        for v in [
            ps.Variant("dense", "dense"),
            ps.Variant("index/value", "indexed"),
            ps.Variant("key-caching", "cached"),
            ps.Variant("combined", "cached", ["kkt", "significant"], "bfloat16"),
        ]
    }
    dense = rows["dense"]
    for name in ("index/value", "key-caching"):
        assert rows[name]["final_objective"] == dense["final_objective"]
    assert dense["bytes_up"] > rows["index/value"]["bytes_up"] > rows["key-caching"]["bytes_up"]
    assert rows["combined"]["bytes_up"] < rows["key-caching"]["bytes_up"]
    assert abs(rows["combined"]["final_objective"] / dense["final_objective"] - 1) < 0.01
    # dense bytes by hand: 3 rounds x 4 devices x (prefix + 4 B x 3001 keys + wire header)
    assert dense["bytes_up"] == 12 * (PREFIX_BYTES + 4 * 3001 + WIRE_HEADER_BYTES)
