"""The message kind of federated evaluation (wire code as registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

# one device's evaluation of one global version: UTF-8 JSON (uint8)
# {"version", "device", "samples", "loss", "accuracy", <metric>: value, ...}; round = version
FED_EVAL = register_kind("FED_EVAL", 24, "up", {DType.UINT8}, "any")
# rank 0 asks a device to evaluate global version ``round`` (evaluation.final), no payload
EVAL_ASK = register_kind("EVAL_ASK", 30, "down", {DType.NONE}, "none")
