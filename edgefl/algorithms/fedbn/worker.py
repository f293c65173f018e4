"""FedBN's worker half: every device keeps its own float buffer values (pure numpy + torch).

The flat vector's buffer entries (:attr:`~edgefl.models.flat.FlatParams.buffer_slice`) hold
the BatchNorm running statistics. Before each task of a device its own values are written
into the model (a device's first task: the initial model's, which are also the global
model's, since no update ever changes them); after the task they are stored for the device
and zeroed in its update, so aggregation, compression and residuals see no change there.
They are stored after every local iteration (``after_train``), so a gated device (Hermes),
which keeps its local model between pushes, continues or refreshes from them too.
"""

from __future__ import annotations

import numpy as np

from ..base import LocalJob, Upload, WorkerPlugin
from ..context import WorkerContext


class FedBNWorker(WorkerPlugin):
    """Per-device buffer values: ``{device: float32 array}`` (the flat buffer entries)."""

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        flat = ctx.flat
        self.sl: slice = flat.buffer_slice
        # the initial values, taken before the rank's warm-up step touches the model
        self.initial: np.ndarray = flat.buffer_values()
        self.values: dict[int, np.ndarray] = {}

    def _flat(self, job: LocalJob):
        return job.flat

    def _keep(self, d: int, job: LocalJob) -> None:
        self.values[d] = self._flat(job).buffer_values()

    def before_train(self, d: int, job: LocalJob) -> None:
        self._flat(job).load_buffers(self.values.get(d, self.initial))

    def after_train(self, d: int, job: LocalJob) -> None:
        self._keep(d, job)

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        up.delta[self.sl] = 0.0  # (a dense transform: the update goes on down the chain)

    def device_state(self, d: int) -> dict:
        return {"buffers": self.values[d].copy()} if d in self.values else {}

    def load_device_state(self, d: int, state: dict) -> None:
        if "buffers" in state:
            arr = np.array(state["buffers"], np.float32).reshape(-1)
            if arr.size != self.initial.size:
                raise ValueError(
                    f"device {d}: saved model buffers have {arr.size} values, the model "
                    f"{self.initial.size}"
                )
            self.values[d] = arr


__all__ = ["FedBNWorker"]
