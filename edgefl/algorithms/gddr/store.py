"""GDDR residual checkpoints: one device's residual state in one HDF5 file, atomically.

Every ``gddr.checkpoint_every`` steps each device writes its residual state
(:meth:`edgefl.algorithms.gddr.residual.GDDRResidual.state_dict`: values, installment buckets, due
steps, step counter, tau) to ``gddr-residual-<device:06d>.h5`` in the run's checkpoint
folder, replacing the previous one. After a device dies the coordinator reads it
(:func:`load_residual`) and replays it (``edgefl.algorithms.gddr.replay``).

Storage reuses :func:`edgefl.ckpt.store.save_checkpoint` (temporary file in the same folder,
flush, fsync, ``os.replace``, directory fsync; a crc32 per dataset and a commit marker). On top
of that the file holds a checksum over the whole residual state (crc32 of its scalars and
arrays in a fixed order), so a file whose parts are individually intact but do not belong
together is rejected too. Any missing, truncated, corrupt or foreign file raises
:class:`edgefl.errors.CheckpointError` with a one-line message naming the file; the runtime
logs it and goes on without that residual.

The format of the residual state itself (:data:`STATE_FORMAT`, its keys and dtypes,
:func:`check_state`) is defined here, at the bottom of the layering, so that the checkpoint
needs nothing from :mod:`edgefl.policies`: :mod:`edgefl.algorithms.gddr.residual` (which produces
the state) and :mod:`edgefl.algorithms.gddr.replay` import it from this module.
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

#: kind tag stored in the file
KIND = "gddr-residual"

# ------------------------------------------------------------------------------ state format

#: version tag of a residual state (:meth:`.residual.GDDRResidual.state_dict`).
STATE_FORMAT = "gddr-residual/1"
#: ``derive_seed`` stream constant of the GDDR withhold masks ("GDDR" in ASCII); a state
#: records it, so a state drawn with other masks is rejected.
MASK_STREAM = 0x47444452
#: value of ``due`` for a coordinate that is not held.
NOT_HELD = -1
#: the state's arrays (in checksum order) and their dtypes; each has one entry per coordinate.
STATE_ARRAYS: dict[str, type[np.generic]] = {
    "residual": np.float64,
    "bucket": np.float64,
    "bucket_left": np.int8,
    "due": np.int32,
}
#: the state's scalars (besides ``format``).
STATE_SCALARS: tuple[str, ...] = (
    "size",
    "device",
    "run_seed",
    "mask_stream",
    "alpha",
    "tau",
    "installments",
    "installment_ratio",
    "last_step",
    "produced_steps",
)


def check_state(state: dict[str, Any]) -> None:
    """ValueError (one line) unless ``state`` is a well-formed residual state
    (:meth:`edgefl.algorithms.gddr.residual.GDDRResidual.state_dict`)."""
    if not isinstance(state, dict):
        raise ValueError(f"GDDR state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"GDDR state format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    missing = [k for k in (*STATE_SCALARS, *STATE_ARRAYS) if k not in state]
    if missing:
        raise ValueError(f"GDDR state lacks {', '.join(missing)}")
    if int(state["mask_stream"]) != MASK_STREAM:
        raise ValueError(f"GDDR state mask_stream {state['mask_stream']!r} != {MASK_STREAM}")
    size = int(state["size"])
    for key, dtype in STATE_ARRAYS.items():
        arr = np.asarray(state[key])
        if arr.shape != (size,) or arr.dtype != dtype:
            raise ValueError(
                f"GDDR state '{key}' is {arr.dtype}{list(arr.shape)}, "
                f"expected {np.dtype(dtype)}[{size}]"
            )
    if not np.isfinite(state["residual"]).all() or not np.isfinite(state["bucket"]).all():
        raise ValueError("GDDR state holds non-finite values")
    left = np.asarray(state["bucket_left"])
    if left.size and (left.min() < 0 or left.max() > int(state["installments"])):
        raise ValueError("GDDR state 'bucket_left' outside 0..installments")
    due = np.asarray(state["due"])
    if due.size and due.min() < NOT_HELD:
        raise ValueError("GDDR state 'due' holds values below -1")


# ------------------------------------------------------------------------------ files


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
        if k not in STATE_ARRAYS
    }
    crc = zlib.crc32(json.dumps(scalars, sort_keys=True).encode("utf-8"))
    for key in STATE_ARRAYS:
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
