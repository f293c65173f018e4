"""Rank 0's half of GDDR: decode releases, adapt tau, replay dead devices, flush."""

from __future__ import annotations

import logging

import numpy as np

from ...comm import Message
from ...policies.consistency import Apply
from ..base import CoordinatorPlugin, TaskSpec
from ..context import CoordinatorContext
from .kinds import RESIDUAL

log = logging.getLogger("edgefl.coordinator")


class GDDRCoordinator(CoordinatorPlugin):
    """Every TRAIN carries the current tau (the task argument); a RESIDUAL's released
    values are decoded into a dense update; when a device dies its last residual checkpoint
    is folded back in over the next model changes (weighted like its updates)."""

    update_kinds = (RESIDUAL,)
    flush_always_applies = True

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        from edgefl.algorithms.gddr.replay import ResidualReplay
        from edgefl.algorithms.gddr.tau import make_tau_controller

        super().__init__(ctx, name)
        g = ctx.cfg["gddr"]
        self.decoders: dict = {}
        self.tauc = make_tau_controller(g["adaptive"], g["tau"], g["tau_min"], g["tau_max"])
        self.replay = ResidualReplay(decay=g["replay_decay"], steps=g["replay_steps"])
        self.norms: list[float] = []
        self.stats = {"messages": 0, "values": 0, "replays": [], "replay_errors": []}

    def shape_task(self, d: int, spec: TaskSpec) -> None:
        spec.arg = self.tauc.tau

    def _decoder(self, d: int):
        from edgefl.algorithms.gddr.residual import ReleaseDecoder

        dec = self.decoders.get(d)
        if dec is None:
            c = self.ctx.cfg
            dec = self.decoders[d] = ReleaseDecoder(
                self.ctx.numel, d, c["seed"], alpha=c["gddr"]["alpha"]
            )
        return dec

    def decode(self, d: int, task: int, msg: Message):
        """The dense update of a RESIDUAL message (released values + the update's norm)."""
        dec = self._decoder(d)
        values, norm = msg.payload[:-1], float(msg.payload[-1])
        try:
            dense = dec.decode(dec.last_step + 1, int(msg.aux[3]), values)
        except ValueError as e:
            return None, f"GDDR message of device {d}: {e}", msg
        self.stats["messages"] += 1
        self.stats["values"] += int(values.size)
        self.norms.append(norm)
        return dense, "", msg

    def after_apply(self, ap: Apply, now: float) -> None:
        """Replayed residual mass rides on every model change; then tau adapts."""
        ctx = self.ctx
        lr = np.float32(ctx.cfg["server"]["lr"])
        for amt in self.replay.next_amounts():
            w = ctx.update_weight(amt.device)
            ctx.add_to_model(amt.indices, (lr * w * amt.values).astype(np.float32))
        if self.norms:
            self.tauc.update(self.norms)
            self.norms = []

    def on_device_dead(self, d: int, now: float) -> None:
        """Fold ``d``'s last residual checkpoint back in over the next steps. A missing or
        corrupt checkpoint is logged and the run goes on without it."""
        from edgefl.algorithms.gddr.store import load_residual, residual_checkpoint_name

        from ...errors import CheckpointError

        ctx = self.ctx
        if ctx.out_dir is None or d not in self.decoders:
            return
        path = ctx.out_dir / "checkpoints" / "gddr" / residual_checkpoint_name(d)
        try:
            state = load_residual(path)
            start = self.replay.start(state, self.decoders[d].steps_after(state["last_step"]))
        except (CheckpointError, ValueError) as e:
            log.error("GDDR replay of dead device %d skipped: %s", d, e)
            self.stats["replay_errors"].append({"device": d, "time_s": now, "error": str(e)})
            return
        if start is not None:
            self.stats["replays"].append(
                {"device": d, "time_s": now, "checkpoint_step": start.checkpoint_step,
                 "coordinates": start.coordinates, "total": start.total}
            )  # fmt: skip
            ctx.log_event("replay", now, d, -1)

    def on_device_moved(self, d: int, rank: int, now: float, state: dict) -> None:
        """Re-hosted: the residual checkpoint is folded in here (as for a dead device) and
        the device starts on its new rank with an empty residual (a fresh step count on
        both sides), so checkpointed mass is neither lost nor counted twice."""
        self.on_device_dead(d, now)
        self.decoders.pop(d, None)
        state.pop(self.name, None)
        if self.ctx.out_dir is not None:  # (read by the replay: the new count starts over)
            from edgefl.algorithms.gddr.store import residual_checkpoint_name

            ckpt = self.ctx.out_dir / "checkpoints" / "gddr" / residual_checkpoint_name(d)
            ckpt.unlink(missing_ok=True)

    def flush_devices(self) -> list[int]:
        return sorted(self.decoders)

    def summary(self) -> dict:
        st, size = self.stats, self.ctx.numel
        return {"gddr": {
            "messages": st["messages"],
            "payload_density": st["values"] / (st["messages"] * size) if st["messages"] else None,
            "tau": self.tauc.tau,
            "replays": st["replays"],
            "replay_errors": st["replay_errors"],
        }}  # fmt: skip

    def state_dict(self) -> dict:
        import json

        return {
            "decoders": {str(d): dec.state_dict() for d, dec in sorted(self.decoders.items())},
            "tau": self.tauc.state_dict(),
            "replay": self.replay.state_dict(),
            "norms": np.array(self.norms, np.float64),
            "stats": json.dumps(self.stats),
        }

    def load_state_dict(self, state: dict) -> None:
        import json

        for d, st in state.get("decoders", {}).items():
            self._decoder(int(d)).load_state_dict(st)
        self.tauc.load_state_dict(state["tau"])
        self.replay.load_state_dict(state["replay"])
        self.norms = [float(x) for x in state.get("norms", [])]
        self.stats = json.loads(state["stats"])
