"""The message kinds of SCAFFOLD (wire codes as registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

# the server control variate c of model version ``round`` (float32, one per parameter)
CONTROL = register_kind("CONTROL", 25, "down", {DType.FLOAT32}, "any")
# a device's update: [model delta (model size), dc_i (one per parameter)], float32
CONTROL_UPDATE = register_kind("CONTROL_UPDATE", 26, "up", {DType.FLOAT32}, "any")
