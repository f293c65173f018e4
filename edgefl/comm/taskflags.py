"""The TRAIN message's task flags: named constants both sides of the wire agree on.

A TRAIN's ``aux`` is ``(version, samples, batch, flags)``; ``flags`` packs the task flags
below in its low byte and a plugin argument (:attr:`edgefl.algorithms.base.TaskSpec.arg`)
from bit :data:`ARG_SHIFT` up.
"""

from __future__ import annotations

CONTINUE = 1  # the device goes on from its own local model (a gated task: no download)
FLUSH = 4  # end of training: send what the device still holds back
REFRESH = 8  # with CONTINUE: first adopt model `version` (the gate's broadcast)
# a re-run of a task whose host failed while it may have been running (edgefl/runtime/blame.py):
# the worker sends what it holds first, says when it starts (STARTED) and answers at once
ISOLATE = 16
ARG_SHIFT = 8  # flags >> ARG_SHIFT is the plugin argument (TaskSpec.arg)
ARG_MAX = 2**23  # (the flags travel as a float64: exact far beyond this)


def pack_flags(flags: int, arg: int) -> int:
    """TRAIN flags word: ``flags`` (low byte) and the plugin argument ``arg``."""
    if not 0 <= arg < ARG_MAX:
        raise ValueError(f"task argument {arg} outside [0, {ARG_MAX})")
    return (flags & 0xFF) | (arg << ARG_SHIFT)


def unpack_flags(word: int) -> tuple[int, int]:
    """Inverse of :func:`pack_flags`: ``(flags, arg)``."""
    return word & 0xFF, word >> ARG_SHIFT
