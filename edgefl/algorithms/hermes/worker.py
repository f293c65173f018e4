"""A worker's half of Hermes: each gated device's held-out split and its GUP gate."""

from __future__ import annotations

import math

import torch

from ...models.train import evaluate
from ..base import LocalJob, WorkerPlugin
from ..context import WorkerContext


class HermesWorker(WorkerPlugin):
    """With a gate: a seeded ``hermes.holdout_fraction`` of each device's samples is held
    out; after every local iteration the gate sees the held-out loss and says whether the
    device pushes (at most ``hermes.max_local_iterations`` iterations without a push)."""

    # stacked, each gated device trains from its own local model and the gate reads the
    # held-out losses the stack measured at once (job.holdout_loss)
    stackable = True
    stack_note = (
        "each gated device's stack row starts from its own local model; the gate reads "
        "the held-out losses measured for the whole stack at once"
    )

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        self.gated = ctx.cfg["algorithm"]["gate"] != "always"
        self.gates: dict = {}
        if self.gated:  # (the one split: the worker makes it, fedeval scores on it too)
            ctx.hold_out(float(ctx.cfg["hermes"]["holdout_fraction"]))

    def _gate(self, device: int):
        if device not in self.gates:
            from edgefl.algorithms.hermes.gate import make_gate

            c = self.ctx.cfg
            self.gates[device] = make_gate(c["algorithm"]["gate"], c["hermes"])
        return self.gates[device]

    def before_train(self, d: int, job: LocalJob) -> None:
        if self.gated and job.new_model:
            self._gate(d).on_model_received()

    def gate(self, d: int, job: LocalJob, holdout, iterations: int):
        """(push?, the held-out loss, the gate's score) after one local iteration."""
        if not self.gated:
            return None
        loss = job.holdout_loss
        if loss is None:
            with torch.no_grad():
                loss = evaluate(job.model, holdout, self.ctx.task_kind,
                                device=job.torch_device, loss=self.ctx.loss)[0]  # fmt: skip
        if not math.isfinite(loss):  # pushed as it is: rank 0 quarantines it (the gate's
            return True, loss, 0.0  # window stays clean and the device restarts)
        g = self._gate(d)
        push = g.observe(loss)
        cap = self.ctx.cfg["hermes"]["max_local_iterations"]
        push = push or (cap > 0 and iterations >= cap)
        z = 0.0
        if not push and g.last is not None:
            z = float(getattr(g.last, "score", 0.0) or 0.0)
            z = z if math.isfinite(z) else 0.0
        return push, loss, z

    def device_state(self, d: int) -> dict:
        return {"gate": self.gates[d].state_dict()} if d in self.gates else {}

    def load_device_state(self, d: int, state: dict) -> None:
        if "gate" in state:
            self._gate(d).load_state_dict(state["gate"])
