"""A worker's half of SCAFFOLD: correct every local gradient by ``c - c_i``, then upload
the model delta with the change of the device's control variate."""

from __future__ import annotations

import numpy as np

from ...comm import Message
from ..base import LocalJob, Upload, WorkerPlugin
from ..context import WorkerContext
from .kinds import CONTROL, CONTROL_UPDATE
from .variates import client_delta, correction_hook


class ScaffoldWorker(WorkerPlugin):
    """Keeps the server variate of each model version it was sent (CONTROL) and every
    hosted device's own ``c_i`` (zeros until its first task; saved in checkpoints)."""

    message_kinds = (CONTROL,)

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        flat = ctx.flat
        self.numel = int(getattr(flat, "param_numel", flat.numel))  # parameters only
        self.controls: dict[int, np.ndarray] = {}  # model version -> c
        self.ci: dict[int, np.ndarray] = {}  # device -> c_i

    def on_message(self, msg: Message) -> None:
        c = np.array(msg.payload, np.float32)
        self.ctx.release(msg)
        if c.size != self.numel:
            raise ValueError(f"CONTROL of version {msg.round}: {c.size} values, want {self.numel}")
        self.controls[msg.round] = c
        keep = self.ctx.queued_versions() | {max(self.controls)}
        for v in [v for v in self.controls if v not in keep]:
            del self.controls[v]

    def before_train(self, d: int, job: LocalJob) -> None:
        c = self.controls.get(job.version)
        if c is None:
            raise RuntimeError(
                f"device {d}: no SCAFFOLD control variate of model version {job.version}"
            )
        ci = self.ci.get(d)
        correction = c if ci is None else c - ci
        flat = job.flat
        params = [p for _, p in job.model.named_parameters()]
        job.fit_ctx.grad_hooks.append(
            correction_hook(params, flat.offsets[: len(params)], correction)
        )
        job.ctx["scaffold_c"] = c

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        if up.flush:
            return
        d, delta = up.device, up.delta
        c = job.ctx["scaffold_c"]
        dc = client_delta(c, delta[: self.numel], job.fit_ctx.steps, job.fit_task.lr)
        ci = self.ci.get(d)
        self.ci[d] = dc.copy() if ci is None else ci + dc
        up.encode(self.name, CONTROL_UPDATE, np.concatenate([delta, dc]))

    def device_state(self, d: int) -> dict:
        return {"ci": self.ci[d].copy()} if d in self.ci else {}

    def load_device_state(self, d: int, state: dict) -> None:
        if "ci" in state:
            self.ci[d] = np.array(state["ci"], np.float32)
