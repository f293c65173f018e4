"""Client metrics: the numbers a ``train.client`` returns besides samples and loss
(``FitResult.metrics``) reach rank 0 and the metrics rows.

Each metric goes into the row of the model version its update went into, per device
(``devices/<id>/client/<name>``) and as the mean weighted by the samples the client
reported (``client/<name>``). Only pushed updates carry them (a gated device's local
iterations without a push report no metrics).

One module holds the whole plugin: the CLIENT_METRICS kind and its checked codec, rank 0's
half, the worker half and the plugin class.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import numpy as np

from ..comm.wire import HEADER_BYTES, DType, register_kind
from .base import CoordinatorPlugin, LocalJob, Plugin, Upload, WorkerPlugin
from .context import CoordinatorContext

if TYPE_CHECKING:  # (annotations only)
    from ..comm import Message

# one task's client metrics, UTF-8 JSON {"samples": n, "<name>": value, ...}; round = task
CLIENT_METRICS = register_kind("CLIENT_METRICS", 27, "up", {DType.UINT8}, "any")

MAX_METRICS = 64  # names per task (a bigger message is refused)


# -- the payload (pure) ---------------------------------------------------------------------
def encode_metrics(samples: int, metrics: dict[str, float]) -> np.ndarray:
    """UTF-8 JSON ``{"samples": n, <name>: value, ...}`` as uint8."""
    body = {"samples": int(samples), **metrics}
    return np.frombuffer(json.dumps(body).encode("utf-8"), np.uint8).copy()


def decode_metrics(payload: np.ndarray) -> dict[str, float]:
    """The metrics of a CLIENT_METRICS payload; ValueError for anything malformed."""
    try:
        body = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not UTF-8 JSON ({e})") from None
    if not isinstance(body, dict) or len(body) - ("samples" in body) > MAX_METRICS:
        raise ValueError(f"not an object of at most {MAX_METRICS} metrics")
    out = {}
    for k, v in body.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"metric {k!r} is not a number")
        if not math.isfinite(v):
            raise ValueError(f"metric {k!r} is not finite")
        out[k] = float(v)
    return out


# -- rank 0 ---------------------------------------------------------------------------------
class ClientMetricsCoordinator(CoordinatorPlugin):
    """Keeps each device's latest metrics until the row of its update is written."""

    message_kinds = (CLIENT_METRICS,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        self.latest: dict[str, dict[str, float]] = {}

    def on_message(self, msg: Message) -> None:
        ctx, d = self.ctx, msg.device
        try:
            m = decode_metrics(msg.payload)
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


# -- a worker -------------------------------------------------------------------------------
class ClientMetricsWorker(WorkerPlugin):
    """Sends a task's metrics just before its update (same rank pair: they arrive first)."""

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        if job is not None and job.metrics:  # (the update itself goes out after it)
            payload = encode_metrics(job.ctx.get("client_samples", 0), job.metrics)
            self.ctx.send(0, CLIENT_METRICS, device=up.device, round=up.task, payload=payload)


# -- the plugin -----------------------------------------------------------------------------
class ClientMetrics(Plugin):
    """``train.client`` set: the client's metrics go to the metrics rows."""

    name = "client_metrics"
    order = 30  # its metrics go out before a plugin encodes the update
    coordinator = ClientMetricsCoordinator
    worker = ClientMetricsWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["train"]["client"])


__all__ = [
    "CLIENT_METRICS",
    "MAX_METRICS",
    "ClientMetrics",
    "ClientMetricsCoordinator",
    "ClientMetricsWorker",
    "decode_metrics",
    "encode_metrics",
]
