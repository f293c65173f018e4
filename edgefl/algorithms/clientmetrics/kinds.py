"""The message kind of client metrics (wire code as registered with the transport)."""

from __future__ import annotations

from ...comm.wire import DType, register_kind

# one task's client metrics, UTF-8 JSON {"samples": n, "<name>": value, ...}; round = task
CLIENT_METRICS = register_kind("CLIENT_METRICS", 27, "up", {DType.UINT8}, "any")
