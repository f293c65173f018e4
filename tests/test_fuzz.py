"""Property-based fuzzing of everything that reads hostile input.

Wire: random bytes and random header fields go through ``decode_header``, ``Validator`` and
the loopback receive path (the same decode/validate code as the MPI transport): the only
outcomes allowed are a delivered, self-consistent message or a clean rejection
(``WireError`` / a counted rejection), never another exception, and a forged stream from
one rank never disturbs another rank's messages.

Config: random text, random TOML documents, random nested dicts and random ``--set``
overrides go through the loader: the only outcomes allowed are a valid config (which then
dumps and reloads to itself) or ``ConfigError``.
"""

from __future__ import annotations

import datetime
import math
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgefl.algorithms.gddr.kinds  # noqa: F401 - registers the plugins' kinds
import edgefl.algorithms.ordering.kinds  # noqa: F401
import edgefl.algorithms.ps.kinds  # noqa: F401
import edgefl.server.kinds  # noqa: F401
from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import (
    HEADER_BYTES,
    MAGIC,
    NUMPY_OF,
    SPECS,
    VERSION,
    DType,
    Header,
    Kind,
    Validator,
    WireError,
    all_kinds,
    decode_header,
    encode_header,
    num_chunks,
)
from edgefl.config import config_from_toml, dump_config, iter_fields, load_config
from edgefl.config.schema import SCHEMA
from edgefl.errors import ConfigError

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMEL = 16
_STRUCT = struct.Struct("<IHHiBBHQqdQ4d")  # the documented 80-byte layout

# -- strategies: headers --------------------------------------------------------------------
u8, u16 = st.integers(0, 255), st.integers(0, 0xFFFF)
i32 = st.integers(-(2**31), 2**31 - 1)
u64, i64 = st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1)
any_float = st.floats(allow_nan=True, allow_infinity=True)
kinds = st.one_of(st.sampled_from([int(k) for k in all_kinds()]), u16)
dtypes = st.one_of(st.sampled_from([int(d) for d in DType]), u8)
devices = st.one_of(st.integers(-2, 5), i32)


@st.composite
def header_fields(draw) -> dict:
    """Header fields: mostly plausible (so the validator's deeper checks run), sometimes
    anything the 80 bytes can hold."""
    itemsize = draw(st.sampled_from([0, 1, 2, 4, 8]))
    nbytes = draw(
        st.one_of(
            st.just(NUMEL * 4),
            st.integers(0, 64).map(lambda k: k * max(itemsize, 1)),
            u64,
        )
    )
    return {
        "magic": draw(st.one_of(st.just(MAGIC), st.integers(0, 2**32 - 1))),
        "version": draw(st.one_of(st.just(VERSION), u16)),
        "kind": draw(kinds),
        "device": draw(devices),
        "dtype": draw(dtypes),
        "flags": draw(u8),
        "nchunks": draw(st.one_of(st.just(num_chunks(nbytes, 1 << 30) % 0x10000), u16)),
        "seq": draw(st.one_of(st.integers(0, 5), u64)),
        "round": draw(i64),
        "vtime": draw(any_float),
        "nbytes": nbytes,
        "aux": tuple(draw(st.lists(any_float, min_size=4, max_size=4))),
    }


def pack(f: dict) -> np.ndarray:
    raw = _STRUCT.pack(
        f["magic"],
        f["version"],
        f["kind"],
        f["device"],
        f["dtype"],
        f["flags"],
        f["nchunks"],
        f["seq"],
        f["round"],
        f["vtime"],
        f["nbytes"],
        *f["aux"],
    )
    return np.frombuffer(raw, np.uint8)


@st.composite
def validators(draw) -> tuple[Validator, int]:
    """A receiver (coordinator or worker) in some registration state, and a sender rank."""
    rank = draw(st.integers(0, 3))
    v = Validator(
        rank,
        model_numel=draw(st.sampled_from([0, NUMEL])),
        max_payload_bytes=draw(st.sampled_from([1, 64, 1 << 20, 1 << 34])),
        chunk_bytes=draw(st.sampled_from([1024, 1 << 20, 1 << 30, 2**31 - 1])),
    )
    for r in draw(st.lists(st.integers(1, 3), max_size=3, unique=True)):
        v.hosted[r] = frozenset(draw(st.lists(st.integers(-1, 5), max_size=4)))
    src = draw(st.integers(0, 3).filter(lambda s: s != rank))
    return v, src


def assert_consistent(v: Validator, src: int, h: Header, kind: Kind) -> None:
    """What the validator accepted obeys every rule of the wire contract."""
    spec = SPECS[kind]
    assert int(kind) == h.kind
    if spec.direction == "up":
        assert v.rank == 0
    if spec.direction == "down":
        assert src == 0
    code = DType(h.dtype)
    if spec.payload == "none":
        assert code == DType.NONE and h.nbytes == 0
    else:
        assert code in spec.dtypes
        item = NUMPY_OF[code].itemsize
        assert 0 < h.nbytes <= v.max_payload_bytes and h.nbytes % item == 0
        assert h.nchunks == num_chunks(h.nbytes, v.chunk_bytes)
        if spec.payload == "model" and v.model_numel:
            assert h.nbytes == v.model_numel * item
    if v.rank == 0 and src != 0 and kind not in (Kind.REGISTER, Kind.ERROR, Kind.HEARTBEAT):
        assert h.device in v.hosted[src]


# -- wire: decoder and validator ------------------------------------------------------------
@FUZZ
@given(st.binary(min_size=0, max_size=2 * HEADER_BYTES))
def test_decode_header_accepts_or_raises_wire_error_on_any_bytes(data):
    for call in (
        lambda: decode_header(data),
        lambda: decode_header(np.frombuffer(data, np.uint8)),
        lambda: decode_header(data, len(data)),
    ):
        try:
            h = call()
        except WireError:
            continue
        assert len(data) >= HEADER_BYTES and h.magic == MAGIC and h.version == VERSION


@FUZZ
@given(header_fields(), validators())
def test_validator_accepts_consistent_headers_or_raises_wire_error(fields, vs):
    v, src = vs
    raw = pack(fields)
    try:
        h = decode_header(raw, raw.size)
    except WireError:
        assert fields["magic"] != MAGIC or fields["version"] != VERSION
        return
    assert h.seq == fields["seq"] and h.nbytes == fields["nbytes"]
    try:
        kind = v.check(src, h)
    except WireError as e:
        assert str(e)  # every rejection says why
        return
    assert_consistent(v, src, h, kind)


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(1, 2), st.integers(-1, 2), kinds, st.one_of(st.integers(0, 6), u64)),
        max_size=40,
    )
)
def test_duplicate_detection_matches_a_model(stream):
    """A (src, device, kind) message is new exactly when its seq exceeds every seq seen."""
    v = Validator(0)
    seen: dict[tuple, int] = {}
    for src, device, kind, seq in stream:
        h = decode_header(encode_header(kind, device, seq, 0, 0.0, None))
        dup = v.is_duplicate(src, h)
        key = (src, device, kind)
        assert dup == (seq <= seen.get(key, 0))
        if not dup:
            seen[key] = seq


# -- wire: the receive path end to end (loopback) ------------------------------------------------
def coordinator_and_workers():
    fabric = Fabric(3)
    v0 = Validator(0, model_numel=NUMEL)
    v0.hosted[1] = frozenset({0, 1})
    v0.hosted[2] = frozenset({2})
    coord = LoopbackTransport(fabric, 0, v0)
    w1 = LoopbackTransport(fabric, 1, Validator(1, model_numel=NUMEL))
    w2 = LoopbackTransport(fabric, 2, Validator(2, model_numel=NUMEL))
    return fabric, coord, w1, w2


payload_bytes = st.one_of(
    st.none(), st.binary(max_size=3 * NUMEL * 4), st.just(bytes(NUMEL * 4)), st.just(b"")
)


@FUZZ
@given(st.lists(st.tuples(header_fields(), payload_bytes), min_size=1, max_size=6))
def test_forged_stream_is_rejected_cleanly_and_does_not_disturb_other_ranks(forged):
    fabric, coord, w1, w2 = coordinator_and_workers()
    good = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    w2.send(0, Kind.UPDATE, device=2, round=3, aux=(5, 0.5), payload=good)
    for fields, data in forged:
        fabric.inject(1, 0, pack(fields), data)
    w2.send(0, Kind.UPDATE, device=2, round=4, payload=good * 2)
    msgs = coord.poll()  # must not raise
    from_2 = [m for m in msgs if m.src == 2]
    assert [m.round for m in from_2] == [3, 4]
    np.testing.assert_array_equal(from_2[0].payload, good)
    np.testing.assert_array_equal(from_2[1].payload, good * 2)
    from_1 = [m for m in msgs if m.src == 1]
    for m in from_1:  # anything delivered from the forger is self-consistent
        assert m.kind in (Kind.REGISTER, Kind.UPDATE, Kind.ERROR, Kind.HEARTBEAT)
        if m.kind == Kind.UPDATE:
            assert m.device in (0, 1)
            assert m.payload.dtype == np.float32 and m.payload.size == NUMEL
        elif m.payload is not None:
            assert m.payload.nbytes == m.nbytes > 0
    st_ = coord.stats
    assert len(from_1) + st_.rejected[1] + st_.duplicates[1] == len(forged)
    assert st_.rejected[2] == 0 and st_.duplicates[2] == 0


@FUZZ
@given(st.lists(st.tuples(header_fields(), payload_bytes), min_size=1, max_size=6))
def test_worker_rejects_forged_coordinator_messages_cleanly(forged):
    fabric, _, w1, _ = coordinator_and_workers()
    for fields, data in forged:
        fabric.inject(0, 1, pack(fields), data)  # "from the coordinator"
        fabric.inject(2, 1, pack(fields), data)  # from a peer worker: never valid down-traffic
    msgs = w1.poll()
    for m in msgs:
        assert m.src == 0 or m.kind == Kind.HEARTBEAT
        if m.kind == Kind.MODEL:
            assert m.payload.dtype == np.float32 and m.payload.size == NUMEL
        if m.kind in (Kind.TRAIN, Kind.STOP, Kind.HEARTBEAT):
            assert m.payload is None
    assert len(msgs) + sum(w1.stats.rejected.values()) + sum(
        w1.stats.duplicates.values()
    ) == 2 * len(forged)


# -- config loader ------------------------------------------------------------------------------
FIELDS = dict(iter_fields())
SECTIONS = [k for k, v in SCHEMA.items() if isinstance(v, dict)]
LEAVES = sorted({p.rsplit(".", 1)[-1] for p in FIELDS})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.integers(-(2**70), 2**70),
    st.integers(10**300, 10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "cpu", "cuda:0", "cuda:\u00b2", "mlp", "synthetic", "bsp", "\u0661"]),
    st.sampled_from(["mean", "sample-weighted", "duplicate", "bad-kind", "lines"]),
    st.dates(),
    st.datetimes(),
    st.times(),
    st.binary(max_size=4),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-1, 9)), inner, max_size=4),
    ),
    max_leaves=12,
)
keys = st.one_of(st.sampled_from(SECTIONS + LEAVES + ["0", "1", ""]), st.text(max_size=8))


@st.composite
def schema_shaped_docs(draw) -> dict:
    """Nested dicts that mostly follow the schema's sections and keys, with random values
    and the odd unknown key, so the loader's type, range and cross checks all run."""
    doc: dict = {}
    for _ in range(draw(st.integers(0, 6))):
        path = draw(st.sampled_from(sorted(FIELDS)))
        parts = path.split(".")
        node = doc
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            node[parts[-1]] = draw(values)
    if draw(st.booleans()):
        doc[draw(keys)] = draw(values)
    return doc


def write(tmp_path, text: str):
    p = tmp_path / "fuzz.toml"
    p.write_text(text, encoding="utf-8")
    return p


def load_or_error(**kwargs) -> dict | None:
    try:
        cfg = load_config(**kwargs)
    except ConfigError as e:
        assert str(e)
        return None
    return cfg


def assert_round_trips(cfg: dict) -> None:
    """A valid config dumps to TOML that loads back to the same config."""
    assert config_from_toml(dump_config(cfg)) == cfg


@FUZZ
@given(st.one_of(schema_shaped_docs(), st.dictionaries(keys, values, max_size=5)))
def test_random_nested_dicts_give_a_config_or_config_error(doc):
    cfg = load_or_error(doc=doc)
    if cfg is not None:
        assert_round_trips(cfg)


def _toml_literal(draw) -> str:
    return draw(
        st.one_of(
            st.integers(-(2**70), 2**70).map(str),
            st.sampled_from(
                [
                    "nan",
                    "inf",
                    "-inf",
                    "1e400",
                    "0.5",
                    "-0.0",
                    "true",
                    "1979-05-27",
                    "1979-05-27T07:32:00Z",
                    "07:32:00",
                    "0x1F",
                    "0o17",
                    "1_000",
                    "99999999999999999999999999",
                    "9" * 5000,  # beyond Python's int-to-str limit: tomllib raises ValueError
                    '"cuda:\u00b2"',
                    '"\u00b2"',
                    '"mean"',
                    '"krum"',
                    "[]",
                    "[1, 2.5]",
                    '["bad-kind", "duplicate"]',
                    "{}",
                    '{"0" = "cpu"}',
                    '{"\u00b2" = "cpu"}',
                    "{a = {b = 1}}",
                    "[[1], [2]]",
                ]
            ),
            st.text(max_size=10).map(lambda s: '"' + s.replace("\\", "").replace('"', "") + '"'),
        )
    )


@st.composite
def toml_documents(draw) -> str:
    """TOML-ish text assembled from schema keys, tables and literals (often valid TOML,
    sometimes not), plus random junk lines."""
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        choice = draw(st.integers(0, 5))
        if choice == 0:
            lines.append(f"[{draw(st.sampled_from(SECTIONS + ['data.args', 'nope']))}]")
        elif choice == 5:
            lines.append(draw(st.text(max_size=20)))
        else:
            key = draw(st.one_of(st.sampled_from(LEAVES + sorted(FIELDS)), st.text(max_size=5)))
            lines.append(f"{key} = {_toml_literal(draw)}")
    return "\n".join(lines)


@FUZZ
@given(st.one_of(st.text(max_size=200), toml_documents()))
def test_random_toml_text_gives_a_config_or_config_error(text):
    try:
        cfg = config_from_toml(text)
    except ConfigError as e:
        assert str(e)
        return
    assert_round_trips(cfg)


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.text(max_size=30),
            st.builds(
                lambda k, v: f"{k}={v}",
                st.one_of(st.sampled_from(sorted(FIELDS)), keys),
                st.one_of(
                    st.text(max_size=12),
                    st.integers().map(str),
                    st.sampled_from(["1e400", "9" * 5000]),
                ),
            ),
            st.builds(
                lambda k, v: f"{k}={v}",
                st.sampled_from(
                    ["data.args.x", "data.args.x.y", "model.args", "fleet.device_map.0"]
                ),
                st.sampled_from(["1", "{a=1}", "[1,", "cpu", '"cuda:\u00b2"', "1979-05-27"]),
            ),
        ),
        max_size=4,
    )
)
def test_random_overrides_give_a_config_or_config_error(overrides):
    cfg = load_or_error(overrides=overrides)
    # (known, reported: `--set model.args={...}` replaces the whole table, while a file's
    # [model.args] is merged over the built-in defaults, so such a config reloads with the
    # defaults added; the round trip is checked for every other override)
    whole_args = any(o.split("=", 1)[0].strip() in ("data.args", "model.args") for o in overrides)
    if cfg is not None and not whole_args:
        assert_round_trips(cfg)


def test_known_loader_crashes_stay_fixed(tmp_path):
    """Cases fuzzing found: each must be a ConfigError, not OverflowError/ValueError."""
    huge = "seed = " + "9" * 5000
    for call in (
        lambda: config_from_toml(huge),
        lambda: load_config(write(tmp_path, huge)),
        lambda: load_config(overrides=["seed=" + "9" * 5000]),
    ):
        try:
            call()
        except ConfigError as e:
            assert "seed" in str(e) or "invalid TOML" in str(e)
        else:
            raise AssertionError("accepted a 5000-digit seed")
    for doc in (
        {"train": {"lr": 10**400}},  # int too large for a float field
        {"fleet": {"device_map": {"\u00b2": "cpu"}}},  # a digit str.isdigit() accepts
        {"fleet": {"device": "cuda:\u00b2"}},
    ):
        assert load_or_error(doc=doc) is None, doc
    assert load_or_error(doc={"train": {"lr": 10**20}})["train"]["lr"] == 1e20
    assert load_or_error(doc={"fleet": {"devices": 4, "device_map": {"3": "cpu"}}}) is not None
    assert not math.isnan(load_or_error(doc={"train": {"lr": 0.5}})["train"]["lr"])
    assert load_or_error(doc={"run": {"out": datetime.date(2020, 1, 1)}}) is None
