"""The message kinds of example ordering (wire codes as registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

ORDER = register_kind("ORDER", 7, "down", {DType.INT32}, "any")  # next-epoch order (int32)
# per-example gradients (or sketches) of a task's rows, float32; aux = (rows, width, first, 0)
GRADS = register_kind("GRADS", 10, "up", {DType.FLOAT32}, "any")
