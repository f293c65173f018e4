"""A worker's half of GDDR: each device's residual, its releases, its checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...comm import Kind
from ..base import LocalJob, Upload, WorkerPlugin
from ..context import WorkerContext
from .kinds import RESIDUAL


class GDDRWorker(WorkerPlugin):
    """Sends only the released coordinates of each update (+ its norm) as RESIDUAL; the
    residual checkpoint of a due step is written before the message leaves, so a
    coordinator that saw the message can always find it (``gddr.checkpoint_every``)."""

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        self.residuals: dict = {}
        out = ctx.out_dir
        self.ckpt_dir = Path(out) / "checkpoints" / "gddr" if out else None

    def _residual(self, device: int):
        if device not in self.residuals:
            from edgefl.algorithms.gddr.residual import GDDRResidual

            c = self.ctx.cfg
            g = c["gddr"]
            self.residuals[device] = GDDRResidual(
                self.ctx.numel, device, c["seed"], alpha=g["alpha"], tau=g["tau"],
                installments=g["installments"], installment_ratio=g["installment_ratio"],
            )  # fmt: skip
        return self.residuals[device]

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        """A task's update: the released coordinates and the norm (RESIDUAL); the end of
        training: everything the residual still holds, dense (UPDATE)."""
        if up.flush:
            self._flush(up)
            return
        d, delta = up.device, up.delta
        res = self._residual(d)
        if job.spec.arg:
            res.set_tau(job.spec.arg)
        step = res.last_step + 1
        rel = res.step(delta, step)
        payload = np.empty(rel.values.size + 1, np.float32)
        payload[:-1] = rel.values
        payload[-1] = rel.norm
        every = self.ctx.cfg["gddr"]["checkpoint_every"]
        if self.ckpt_dir is not None and every and (step + 1) % every == 0:
            from edgefl.algorithms.gddr.store import residual_checkpoint_name, save_residual

            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            save_residual(self.ckpt_dir / residual_checkpoint_name(d), res.state_dict())
        up.encode(self.name, RESIDUAL, payload, (*up.aux[:3], float(rel.tau)))

    def _flush(self, up: Upload) -> None:
        if up.device in self.residuals:
            held = np.zeros(self.ctx.numel, np.float32)
            held[:] = self.residuals[up.device].flush()
            up.encode(self.name, Kind.UPDATE, held)

    def device_state(self, d: int) -> dict:
        return self.residuals[d].state_dict() if d in self.residuals else {}

    def load_device_state(self, d: int, state: dict) -> None:
        self._residual(d).load_state_dict(state)
