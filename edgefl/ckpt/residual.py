"""GDDR residual checkpoints: one device's residual state in one HDF5 file, atomically.

Every ``gddr.checkpoint_every`` steps each device writes its residual state
(:meth:`edgefl.policies.residual.GDDRResidual.state_dict`: values, installment buckets, due
steps, step counter, tau) to ``gddr-residual-<device:06d>.h5`` in the run's checkpoint
folder, replacing the previous one. After a device dies the coordinator reads it
(:func:`load_residual`) and replays it (``edgefl.policies.replay``).

Storage reuses :func:`edgefl.ckpt.store.save_checkpoint` (temporary file in the same folder,
flush, fsync, ``os.replace``, directory fsync; a crc32 per dataset and a commit marker). On top
of that the file holds a checksum over the whole residual state (crc32 of its scalars and
arrays in a fixed order), so a file whose parts are individually intact but do not belong
together is rejected too. Any missing, truncated, corrupt or foreign file raises
:class:`edgefl.errors.CheckpointError` with a one-line message naming the file; the runtime
logs it and goes on without that residual.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.ckpt.store import load_checkpoint, save_checkpoint
from edgefl.errors import CheckpointError, ConfigError
from edgefl.policies.residual import check_state

#: kind tag stored in the file
KIND = "gddr-residual"
_ARRAYS = ("residual", "bucket", "bucket_left", "due")


def residual_checkpoint_name(device: int) -> str:
    """File name of a device's residual checkpoint: ``gddr-residual-<device:06d>.h5``."""
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    return f"gddr-residual-{int(device):06d}.h5"


def check_checkpoint_every(every: int) -> int:
    """``gddr.checkpoint_every``: device steps between residual checkpoints (0 = never)."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 0:
        raise ConfigError(
            f"config key 'gddr.checkpoint_every' = {every!r}: must be an integer >= 0 (0 = never)"
        )
    return int(every)


def should_checkpoint(steps_done: int, every: int) -> bool:
    """True when a device that has completed ``steps_done`` steps writes its residual."""
    every = check_checkpoint_every(every)
    return every > 0 and steps_done > 0 and steps_done % every == 0


def residual_checksum(state: dict[str, Any]) -> int:
    """crc32 over a residual state: its scalars (canonical JSON) then its arrays, in order."""
    scalars = {
        k: (v.item() if isinstance(v, np.generic) else v)
        for k, v in sorted(state.items())
        if k not in _ARRAYS
    }
    crc = zlib.crc32(json.dumps(scalars, sort_keys=True).encode("utf-8"))
    for key in _ARRAYS:
        arr = np.ascontiguousarray(state[key])
        crc = zlib.crc32(arr.dtype.str.encode("ascii"), crc)
        crc = zlib.crc32(arr.reshape(-1).view(np.uint8), crc)
    return crc & 0xFFFFFFFF


def save_residual(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Atomically write a residual state (``GDDRResidual.state_dict()``) to ``path``.

    ValueError if ``state`` is malformed (nothing is written); CheckpointError on I/O failure
    (the previous file, if any, is left untouched).
    """
    check_state(state)
    save_checkpoint(
        path, {"kind": KIND, "checksum": residual_checksum(state), "state": dict(state)}
    )


def load_residual(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a residual checkpoint; returns the state dict.

    CheckpointError (one line, naming the file) if it is missing, not HDF5, truncated, lacks
    the commit marker, fails a crc32, is not a residual checkpoint, or fails the checksum.
    """
    p = Path(path)
    raw = load_checkpoint(p)  # CheckpointError names the file already
    if raw.get("kind") != KIND or not isinstance(raw.get("state"), dict):
        raise CheckpointError(f"residual checkpoint '{p}': not a GDDR residual checkpoint")
    state = raw["state"]
    try:
        check_state(state)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"residual checkpoint '{p}': malformed state ({exc})") from None
    stored = raw.get("checksum")
    actual = residual_checksum(state)
    if not isinstance(stored, int) or stored != actual:
        raise CheckpointError(
            f"residual checkpoint '{p}': checksum mismatch (stored {stored!r}, computed {actual})"
        )
    return state
