"""A worker's half of client metrics: send a task's metrics just before its update."""

from __future__ import annotations

import numpy as np

from ..base import LocalJob, WorkerPlugin
from .codec import encode
from .kinds import CLIENT_METRICS


class ClientMetricsWorker(WorkerPlugin):
    """Sends a task's metrics just before its update (same rank pair: they arrive first)."""

    def send_update(self, d: int, job: LocalJob, delta: np.ndarray) -> bool:
        if job.metrics:
            payload = encode(job.ctx.get("client_samples", 0), job.metrics)
            self.ctx.send(0, CLIENT_METRICS, device=d, round=job.task, payload=payload)
        return False  # the update itself is sent by the core or another plugin
