"""Both halves of the client-metrics plugin (worker: send; rank 0: fold into the rows)."""

from __future__ import annotations

import json
import math

import numpy as np

from ...comm import Message
from ...comm.wire import HEADER_BYTES
from ..base import CoordinatorPlugin, LocalJob, WorkerPlugin
from .kinds import CLIENT_METRICS

MAX_METRICS = 64  # names per task (a bigger message is refused)


class ClientMetricsWorker(WorkerPlugin):
    """Sends a task's metrics just before its update (same rank pair: they arrive first)."""

    def send_update(self, d: int, job: LocalJob, delta: np.ndarray) -> bool:
        if job.metrics:
            body = {"samples": int(job.ctx.get("client_samples", 0)), **job.metrics}
            payload = np.frombuffer(json.dumps(body).encode("utf-8"), np.uint8).copy()
            self.core.t.send(0, CLIENT_METRICS, device=d, round=job.task, payload=payload)
        return False  # the update itself is sent by the core or another plugin


def decode(payload: np.ndarray) -> dict[str, float]:
    """The metrics of a CLIENT_METRICS payload; ValueError for anything malformed."""
    try:
        body = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not UTF-8 JSON ({e})") from None
    if not isinstance(body, dict) or len(body) > MAX_METRICS + 1:
        raise ValueError("not an object of at most 64 metrics")
    out = {}
    for k, v in body.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"metric {k!r} is not a number")
        if not math.isfinite(v):
            raise ValueError(f"metric {k!r} is not finite")
        out[k] = float(v)
    return out


class ClientMetricsCoordinator(CoordinatorPlugin):
    """Keeps each device's latest metrics until the row of its update is written."""

    message_kinds = (CLIENT_METRICS,)

    def __init__(self, core, name: str) -> None:
        super().__init__(core, name)
        self.latest: dict[str, dict[str, float]] = {}

    def on_message(self, msg: Message) -> None:
        core, d = self.core, msg.device
        try:
            m = decode(msg.payload)
        except ValueError as e:
            core.t.reject(msg.src, f"CLIENT_METRICS of device {d}: {e}")
            return
        if d not in core.devices:
            core.t.reject(msg.src, f"CLIENT_METRICS of unknown device {d}")
            return
        core.book_up(d, HEADER_BYTES + msg.nbytes)
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
