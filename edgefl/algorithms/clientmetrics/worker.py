"""A worker's half of client metrics: send a task's metrics just before its update."""

from __future__ import annotations

from ..base import LocalJob, Upload, WorkerPlugin
from .codec import encode
from .kinds import CLIENT_METRICS


class ClientMetricsWorker(WorkerPlugin):
    """Sends a task's metrics just before its update (same rank pair: they arrive first)."""

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        if job is not None and job.metrics:  # (the update itself goes out after it)
            payload = encode(job.ctx.get("client_samples", 0), job.metrics)
            self.ctx.send(0, CLIENT_METRICS, device=up.device, round=up.task, payload=payload)
