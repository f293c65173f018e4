"""A worker's half of FedProx: the proximal term on every local step."""

from __future__ import annotations

from ..base import LocalJob, WorkerPlugin
from .proximal import proximal_hook


class FedProxWorker(WorkerPlugin):
    """Adds ``mu * (w - w_start)`` to the gradients of every step of every task (the
    anchor is the global model the task started from; for a gated device, the global model
    its local iterations started from). The reported training loss is the task loss without
    the proximal term."""

    def before_train(self, d: int, job: LocalJob) -> None:
        if job.fit_ctx is None:
            return
        ctx = self.ctx
        flat = job.flat
        anchor = job.start if job.start is not None else flat.to_host().copy()
        params = [p for _, p in job.model.named_parameters()]
        mu = float(ctx.cfg["fedprox"]["mu"])
        job.fit_ctx.grad_hooks.append(
            proximal_hook(params, flat.offsets[: len(params)], anchor, mu)
        )
