"""The message kinds of parameter-server pushes and pulls (registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

# a filtered, compressed update (.compress encoding, uint8)
SPARSE = register_kind("SPARSE", 12, "up", {DType.UINT8}, "any")
# the SPARSE of (device, round) named a key list rank 0 lacks: resend it with the keys
RESEND = register_kind("RESEND", 13, "down", {DType.NONE}, "none")
# the global model's values at the rank's working-set keys (float32)
MODEL_KEYS = register_kind("MODEL_KEYS", 14, "down", {DType.FLOAT32}, "any")
# the sorted keys a device's data touches (int32/int64), sent once
WORKSET = register_kind("WORKSET", 15, "up", {DType.INT32, DType.INT64}, "any")
