"""Rank 0's half of SCAFFOLD: send the server variate with each model, split each update
into the model delta and the device's ``dc_i``, step ``c`` with the round."""

from __future__ import annotations

import numpy as np

from ...comm import Message
from ...policies.consistency import Apply
from ..base import CoordinatorPlugin, Download
from ..context import CoordinatorContext
from .kinds import CONTROL, CONTROL_UPDATE
from .variates import server_step


class ScaffoldCoordinator(CoordinatorPlugin):
    """The server control variate ``c`` (zeros at the start; in checkpoints)."""

    update_kinds = (CONTROL_UPDATE,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        flat = ctx.flat
        self.numel = int(getattr(flat, "param_numel", flat.numel))
        self.c = np.zeros(self.numel, np.float32)
        self.pending: dict[int, np.ndarray] = {}  # device -> dc_i of its accepted update

    def on_start(self) -> None:
        if self.ctx.resuming:  # tasks in flight are sent again without a model send
            for rank in sorted({v["rank"] for v in self.ctx.devices.values()}):
                self._send_control(rank)

    def send_model(self, down: Download) -> None:
        """The variate of the current version goes before the model."""
        self._send_control(down.rank)

    def _send_control(self, rank: int) -> None:
        self.ctx.send(rank, CONTROL, round=self.ctx.version, payload=self.c.copy())

    def down_bytes(self, d: int) -> int | None:
        from ...comm.wire import HEADER_BYTES

        return 3 * HEADER_BYTES + 4 * self.ctx.numel + self.c.nbytes

    def decode(self, d: int, task: int, msg: Message):
        n = self.ctx.numel
        if msg.payload.size != n + self.numel:
            why = f"SCAFFOLD update of device {d}: {msg.payload.size} values, want {n + self.numel}"
            return None, why, msg
        dc = np.array(msg.payload[n:], np.float32)
        if not np.isfinite(dc).all():
            return None, f"SCAFFOLD update of device {d}: non-finite control variate", msg
        self.pending[d] = dc
        return np.array(msg.payload[:n], np.float32), "", msg

    def after_apply(self, ap: Apply, now: float) -> None:
        used = {
            a.device: self.pending.pop(a.device) for a in ap.arrivals if a.device in self.pending
        }
        server_step(self.c, used, len(self.ctx.devices))

    def summary(self) -> dict:
        return {"scaffold": {"control_norm": float(np.linalg.norm(self.c))}}

    def state_dict(self) -> dict:
        st = {"c": self.c.copy()}
        st.update({f"pending_{d}": v.copy() for d, v in self.pending.items()})
        return st

    def load_state_dict(self, state: dict) -> None:
        self.c = np.array(state["c"], np.float32)
        self.pending = {
            int(k.split("_", 1)[1]): np.array(v, np.float32)
            for k, v in state.items()
            if k.startswith("pending_")
        }
