"""Atomic HDF5 checkpoints.

``state`` is a nested dict with str keys (any string, e.g. ``"device/17"``) whose leaves are
numpy arrays or scalars of a numeric dtype, Python int/float/bool/str/bytes, None, or lists
(of str, or more generally of JSON scalars); nested dicts become HDF5 groups. Loading returns
equal values of the same types; arrays keep dtype and shape bit-exactly. Planning (state <->
typed nodes, ``edgefl.ckpt.plan``) is separate from storage (``edgefl.ckpt.store``), the
commit trailer every file ends with (a SHA-256 checked before HDF5 parses it,
``edgefl.ckpt.seal``) and the resume schema of a run's checkpoints (``edgefl.ckpt.schema``).
"""

from edgefl.ckpt.describe import describe_checkpoint
from edgefl.ckpt.schema import check_run_state
from edgefl.ckpt.store import (
    FORMAT_VERSION,
    checkpoint_name,
    is_complete,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "check_run_state",
    "checkpoint_name",
    "describe_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
]
