"""A checkpoint write that fails (issue 25, F10): a full disk is one line naming the file,
why, about how many bytes it needs and how many are free, and what is kept; the temporary
file is removed and the older checkpoints stay good. Before: rc 2, but with an h5py
traceback (``RuntimeError: Slist already enabled?``)."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_edgefl

from edgefl.ckpt import checkpoint_name, load_checkpoint, save_checkpoint, store
from edgefl.errors import CheckpointError

STATE = {"round": 1, "w": np.arange(50_000, dtype=np.float32), "note": "x"}


def _full_disk(*_args, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def _hdf5_close_after_full_disk(*_args, **_kw):
    """What h5py raised in F10: a RuntimeError while closing, after HDF5's OSError (the
    errno inside its text)."""
    try:
        raise OSError(
            "Can't synchronously write data (file write failed: time = ..., filename = "
            "'x.h5', file descriptor = 5, errno = 28, error message = 'No space left on "
            "device', buf = 0x0, total write size = 553472)"
        )
    except OSError:
        raise RuntimeError("Slist already enabled?") from None


@pytest.mark.parametrize("fail", [_full_disk, _hdf5_close_after_full_disk])
def test_a_failed_write_is_one_line_and_keeps_the_older_ones(tmp_path, monkeypatch, fail):
    old = tmp_path / checkpoint_name(1)
    save_checkpoint(old, STATE)
    target = tmp_path / checkpoint_name(2)
    monkeypatch.setattr(store, "_write_nodes", fail)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(target, {**STATE, "round": 2})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"checkpoint '{target}': cannot write (No space left on device, errno 28)"
    )
    need = max(STATE["w"].nbytes, old.stat().st_size)
    assert f"it needs about {need / 1024:.1f} KiB" in msg
    assert " free in " in msg
    assert "the older checkpoints are kept (1, newest ckpt-000001.h5)" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # temporary file removed
    assert load_checkpoint(old)["round"] == 1


def test_a_failed_rewrite_keeps_the_file_it_would_replace(tmp_path, monkeypatch):
    target = tmp_path / checkpoint_name(3)
    save_checkpoint(target, STATE)
    raw = target.read_bytes()
    monkeypatch.setattr(store, "_write_nodes", _full_disk)
    with pytest.raises(CheckpointError, match="'ckpt-000003.h5' is kept as it was; no older"):
        save_checkpoint(target, {**STATE, "round": 3})
    assert target.read_bytes() == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_other_errors_are_not_swallowed(tmp_path, monkeypatch):
    """Only I/O failures become the one line; a bug keeps its traceback."""

    def bug(*_a, **_k):
        raise KeyError("bug")

    monkeypatch.setattr(store, "_write_nodes", bug)
    with pytest.raises(KeyError):
        save_checkpoint(tmp_path / checkpoint_name(1), STATE)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- a real full disk


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs (needs root, or CAP_SYS_ADMIN); skipped where mount is not permitted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None or sys.platform != "linux":
        pytest.skip("no mount(8) here")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"mount is not permitted here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.mpi
def test_a_job_on_a_full_disk_ends_with_one_line(tiny_disk, launcher):
    run = tiny_disk / "run"
    sets = [
        "fleet.devices=4",
        "model.args.hidden=[512]",  # (about 200 KiB a checkpoint: the disk fills at one)
        "fleet.device=cpu",
        "sim.reference_s_per_sample=0.0001",
        "output.progress=quiet",
        "run.checkpoint_every=1",
    ]
    args = ["simulate", "--out", str(run), "--rounds", "30"]
    for s in sets:
        args += ["--set", s]
    proc = run_edgefl(*args, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith(f"edgefl: error: checkpoint '{run / 'checkpoints'}/ckpt-"), line
    assert "cannot write (No space left on device, errno 28)" in line
    assert "it needs about " in line and " free in " in line
    assert "the older checkpoints are kept (" in line
    ckpts = run / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names and all(n.startswith("ckpt-") and n.endswith(".h5") for n in names), names
    assert f"newest {names[-1]})" in line
    newest = Path(ckpts / names[-1])
    assert load_checkpoint(newest)["round"] == len(names)  # the older ones are intact
    assert (run / "exit_status").read_text() == "2\n"
