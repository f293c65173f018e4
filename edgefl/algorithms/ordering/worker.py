"""A worker's half of example ordering: train one epoch in rank 0's order, ship the rows."""

from __future__ import annotations

import numpy as np

from ...comm import Message
from ..base import LocalJob, WorkerPlugin
from ..context import WorkerContext
from .kinds import GRADS, ORDER


class OrderingWorker(WorkerPlugin):
    """Keeps every device's current order (ORDER) and runs its epoch in that order,
    sending the examples' gradients (or sketches; per unit) in visit order (GRADS)."""

    message_kinds = (ORDER,)
    stack_note = (
        "owns `train`: each epoch visits the coordinator's order and sends per-example "
        "gradients, one device at a time"
    )

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        from .orderers import make_cfg_orderer

        super().__init__(ctx, name)
        self.orderer = make_cfg_orderer(ctx.cfg)  # used for its sketch only
        self.orders: dict[int, np.ndarray] = {}
        self.pe: dict[str, object] = {}

    def on_message(self, msg: Message) -> None:
        self.orders[msg.device] = np.array(msg.payload, np.int64)
        self.ctx.release(msg)

    def train(self, d: int, job: LocalJob) -> float:
        from ...models.ordered import ordered_epoch
        from ...models.per_example import PerExampleGrads

        order = self.orders.get(d)
        if order is None:
            raise RuntimeError(f"device {d}: no example order received before task {job.task}")
        o, ds, dev, cfg = self.orderer, job.dataset, job.torch_device, self.ctx.cfg
        n = len(ds)
        ex_order = o.example_order(order, n) if o.num_units(n) != n else order
        if dev not in self.pe:
            self.pe[dev] = PerExampleGrads(job.model, self.ctx.task_kind, loss=self.ctx.loss)
        c = cfg["train"]
        # streamed: each step's rows go to rank 0 at once (example units only: a microbatch's
        # gradient is known when all its examples were visited)
        stream = o.needs_grads and cfg["ordering"]["ship"] == "step" and o.num_units(n) == n

        def ship(first: int, rows: np.ndarray) -> None:
            self._send_grads(d, job.task, first, rows)

        loss, g = ordered_epoch(
            job.model, ds, ex_order, batch_size=c["batch_size"], lr=job.fit_task.lr,
            momentum=c["momentum"], weight_decay=c["weight_decay"],
            task=self.ctx.task_kind, grads=self.pe[dev], device=dev,
            on_step=ship if stream else None,
            optimizer=self.ctx.make_optimizer(list(job.model.parameters()), job.fit_task.lr),
            before_step=job.fit_ctx.before_step,
        )  # fmt: skip
        if o.needs_grads and not stream:
            if o.num_units(n) != n:  # microbatch units: the mean gradient of each unit
                mb = cfg["ordering"]["microbatch"]
                pos = np.empty(n, np.int64)
                pos[ex_order] = np.arange(n)
                rows = []
                for u in order:
                    members = np.arange(u * mb, min((u + 1) * mb, n))
                    rows.append(g[pos[members]].mean(axis=0))
                g = np.stack(rows).astype(np.float32)
            self._send_grads(d, job.task, 0, g)
        return loss

    def _send_grads(self, device: int, task: int, first: int, rows: np.ndarray) -> None:
        """One GRADS message: ``rows`` (units ``first ..`` of the epoch, visit order),
        projected by the orderer's sketch; aux = (rows, width, first, 0)."""
        g = np.ascontiguousarray(self.orderer.project(rows), dtype=np.float32)
        self.ctx.send(
            0, GRADS, device=device, round=task,
            aux=(float(g.shape[0]), float(g.shape[1]), float(first), 0.0), payload=g.reshape(-1),
        )  # fmt: skip
