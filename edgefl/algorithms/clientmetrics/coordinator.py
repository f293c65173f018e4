"""Rank 0's half of client metrics: fold each device's metrics into the row of its update."""

from __future__ import annotations

from ...comm import Message
from ...comm.wire import HEADER_BYTES
from ..base import CoordinatorPlugin
from ..context import CoordinatorContext
from .codec import decode
from .kinds import CLIENT_METRICS


class ClientMetricsCoordinator(CoordinatorPlugin):
    """Keeps each device's latest metrics until the row of its update is written."""

    message_kinds = (CLIENT_METRICS,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        self.latest: dict[str, dict[str, float]] = {}

    def on_message(self, msg: Message) -> None:
        ctx, d = self.ctx, msg.device
        try:
            m = decode(msg.payload)
        except ValueError as e:
            ctx.reject(msg.src, f"CLIENT_METRICS of device {d}: {e}")
            return
        if d not in ctx.devices:
            ctx.reject(msg.src, f"CLIENT_METRICS of unknown device {d}")
            return
        ctx.book_up(d, HEADER_BYTES + msg.nbytes)
        self.latest[str(d)] = m

    def on_row(self, row: dict) -> None:
        per = {d: self.latest.pop(d) for d in row.get("devices", {}) if d in self.latest}
        if not per:
            return
        for d, m in per.items():
            row["devices"][d]["client"] = {k: v for k, v in m.items() if k != "samples"}
        names = sorted({k for m in per.values() for k in m if k != "samples"})
        mean = {}
        for k in names:
            have = [m for m in per.values() if k in m]
            w = [m.get("samples", 0.0) for m in have]
            if sum(w) > 0:
                mean[k] = sum(m[k] * wi for m, wi in zip(have, w)) / sum(w)
            else:
                mean[k] = sum(m[k] for m in have) / len(have)
        row["client"] = mean
