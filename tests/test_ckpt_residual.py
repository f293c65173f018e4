"""GDDR residual checkpoints: round trip, damage detection, atomic replacement."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

import edgefl.ckpt.store as store
from edgefl.algorithms.gddr.residual import GDDRResidual
from edgefl.algorithms.gddr.store import (
    check_checkpoint_every,
    load_residual,
    residual_checkpoint_name,
    residual_checksum,
    save_residual,
    should_checkpoint,
)
from edgefl.ckpt.store import save_checkpoint
from edgefl.errors import CheckpointError, ConfigError


def trained(size=5000, steps=13, installments=2):
    rng = np.random.default_rng(0)
    r = GDDRResidual(size, 7, 99, alpha=0.6, tau=5, installments=installments)
    for t in range(steps):
        if t == 6:
            r.set_tau(3)
        r.step(rng.standard_normal(size).astype(np.float32), t)
    return r, rng


def test_round_trip_and_identical_continuation(tmp_path):
    r, rng = trained()
    p = tmp_path / residual_checkpoint_name(7)
    save_residual(p, r.state_dict())
    state = load_residual(p)
    ref = r.state_dict()
    assert state.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == state[key].dtype
            assert value.tobytes() == state[key].tobytes(), key
        else:
            assert state[key] == value and type(state[key]) is type(value), key
    restored = GDDRResidual.from_state_dict(state)
    for t in range(13, 25):
        g = rng.standard_normal(r.size).astype(np.float32)
        a, b = r.step(g, t), restored.step(g, t)
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
    assert [q.name for q in tmp_path.iterdir()] == ["gddr-residual-000007.h5"]


def test_missing_file(tmp_path):
    p = tmp_path / "gddr-residual-000001.h5"
    with pytest.raises(CheckpointError, match=r"gddr-residual-000001.h5': no such file"):
        load_residual(p)


def test_truncated_file(tmp_path):
    r, _ = trained()
    p = tmp_path / "res.h5"
    save_residual(p, r.state_dict())
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size // 2)
    with pytest.raises(CheckpointError) as e:
        load_residual(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_flipped_byte_in_residual_values(tmp_path):
    r, _ = trained()
    p = tmp_path / "res.h5"
    state = r.state_dict()
    save_residual(p, state)
    raw = bytearray(p.read_bytes())
    at = raw.find(state["residual"][100:120].tobytes())
    assert at > 0
    raw[at + 5] ^= 0x10
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"res.h5': corrupt \(SHA-256"):  # (file digest)
        load_residual(p)


def test_inconsistent_parts_fail_the_checksum(tmp_path):
    # every dataset intact (own crc32s fine), but the residual does not match the checksum
    r, _ = trained()
    state = r.state_dict()
    checksum = residual_checksum(state)
    state["residual"] = state["residual"] + 1.0
    p = tmp_path / "res.h5"
    save_checkpoint(p, {"kind": "gddr-residual", "checksum": checksum, "state": state})
    with pytest.raises(CheckpointError, match=r"res.h5': checksum mismatch"):
        load_residual(p)


def test_foreign_or_malformed_file(tmp_path):
    p = tmp_path / "other.h5"
    save_checkpoint(p, {"round": 3})
    with pytest.raises(CheckpointError, match="other.h5': not a GDDR residual checkpoint"):
        load_residual(p)
    r, _ = trained(size=10)
    bad = r.state_dict()
    bad["due"] = bad["due"][:5]
    save_checkpoint(p, {"kind": "gddr-residual", "checksum": 0, "state": bad})
    with pytest.raises(CheckpointError, match=r"other.h5': malformed state \(GDDR state 'due'"):
        load_residual(p)
    p.write_bytes(b"garbage" * 50)
    with pytest.raises(CheckpointError, match="other.h5': not an HDF5 file"):
        load_residual(p)


def test_malformed_state_is_not_written(tmp_path):
    with pytest.raises(ValueError, match="GDDR state format"):
        save_residual(tmp_path / "x.h5", {"format": "nope"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_mid_write_keeps_previous(tmp_path, monkeypatch, exc):
    p = tmp_path / residual_checkpoint_name(7)
    old, _ = trained(steps=5)
    save_residual(p, old.state_dict())
    before = p.read_bytes()
    new, _ = trained(steps=9)
    calls = []
    real = store._write_leaf

    def flaky(parent, name, node):
        calls.append(name)
        if len(calls) == 6:
            raise exc
        real(parent, name, node)

    monkeypatch.setattr(store, "_write_leaf", flaky)
    # an I/O-like failure is one line (CheckpointError); an interrupt stays what it is
    want = CheckpointError if isinstance(exc, RuntimeError) else type(exc)
    with pytest.raises(want):
        save_residual(p, new.state_dict())
    assert len(calls) == 6
    assert p.read_bytes() == before
    assert load_residual(p)["last_step"] == 4  # the previous checkpoint, intact
    assert sorted(os.listdir(tmp_path)) == [p.name]  # no temporary file left


def test_crash_before_rename_leaves_previous_readable(tmp_path, monkeypatch):
    p = tmp_path / "res.h5"
    old, _ = trained(steps=5)
    save_residual(p, old.state_dict())

    def crash(src, dst):  # the process dies between the fsync and the rename
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.os, "replace", crash)
    new, _ = trained(steps=9)
    with pytest.raises(CheckpointError, match="cannot write"):
        save_residual(p, new.state_dict())
    monkeypatch.undo()
    # a stale temporary file from a killed writer does not disturb readers either
    (tmp_path / ".res.h5.tmp-12345").write_bytes(b"half a file")
    assert load_residual(p)["last_step"] == 4
    with h5py.File(p, "r") as f:
        assert bool(f.attrs["complete"])


def test_schedule_helpers():
    assert residual_checkpoint_name(12) == "gddr-residual-000012.h5"
    with pytest.raises(ValueError):
        residual_checkpoint_name(-1)
    assert [s for s in range(1, 13) if should_checkpoint(s, 4)] == [4, 8, 12]
    assert not any(should_checkpoint(s, 0) for s in range(10))
    assert not should_checkpoint(0, 3)
    assert check_checkpoint_every(5) == 5
    with pytest.raises(ConfigError, match=r"'gddr.checkpoint_every' = -1: must be an integer"):
        check_checkpoint_every(-1)
