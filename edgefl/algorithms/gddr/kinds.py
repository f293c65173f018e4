"""The message kind of GDDR (wire code as registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

# the released values + the update's norm (float32); aux = (samples, loss, seconds, tau)
RESIDUAL = register_kind("RESIDUAL", 11, "up", {DType.FLOAT32}, "any")
