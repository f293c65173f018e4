"""Rank 0's half of example ordering: balance the rows as they arrive, send the orders."""

from __future__ import annotations

import math
import time

import numpy as np

from ...comm import Message
from ...policies.consistency import Apply
from ..base import CoordinatorPlugin
from ..context import CoordinatorContext
from .kinds import GRADS, ORDER


class OrderingCoordinator(CoordinatorPlugin):
    """Opens an :class:`~.orderers.EpochStream` per epoch, feeds it every GRADS message
    (rows ``first .. first + n - 1`` of a device's epoch, aux = (n, width, first, 0)) and,
    after the round's apply, sends every device its next-epoch order (ORDER)."""

    message_kinds = (GRADS,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        from .orderers import make_cfg_orderer

        super().__init__(ctx, name)
        self.orderer = make_cfg_orderer(ctx.cfg)
        self.stream = None  # the open epoch
        self.before = None  # orderer state at the epoch's start (ordering.save_debug)
        self.seconds = 0.0  # all balancing (stream adds + finish), seconds
        self.wait_seconds = 0.0  # the part the rounds waited for (last add + finish)
        self.last_add_s = 0.0  # seconds of the newest EpochStream.add

    def on_start(self) -> None:
        o = self.orderer
        if o.orders:  # resumed: the checkpoint's current orders
            self._send_orders(o.orders)
        else:
            ctx = self.ctx
            sizes = [o.num_units(ctx.train_size(d)) for d in sorted(ctx.devices)]
            self._send_orders(o.initial_orders(sizes))

    def _send_orders(self, orders: list[np.ndarray]) -> None:
        """Every device's order for the orderer's current epoch; opens the epoch's stream."""
        ctx = self.ctx
        self.current = dict(zip(sorted(ctx.devices), orders))
        for d, o in zip(sorted(ctx.devices), orders):
            ctx.send(
                ctx.devices[d]["rank"], ORDER, device=d, round=self.orderer.epoch,
                payload=np.ascontiguousarray(o, np.int32),
            )  # fmt: skip
        cfg = ctx.cfg["ordering"]
        self.stream = self.orderer.begin_epoch(sketched=cfg["sketch_dim"] > 0)
        self.before = self.orderer.state_dict() if cfg["save_debug"] else None

    def on_message(self, msg: Message) -> None:
        """One GRADS. One that does not fit (not the device's task in flight, rows out of
        sequence, bad shape or values) is rejected and the device gets a D-RR order next
        epoch (its rows of this epoch are incomplete)."""
        ctx, d, st = self.ctx, msg.device, self.stream
        if st is None or d not in ctx.devices:
            ctx.reject(msg.src, f"GRADS of device {d}: no ordering epoch open")
            return
        w = sorted(ctx.devices).index(d)
        if w in st.moved:
            return  # re-run after a move: its rows of this epoch are given up (see below)
        task = ctx.busy.get(d, (None,))[0]
        head = msg.aux[:3]
        if len(head) < 3 or not all(math.isfinite(x) and x == int(x) for x in head):
            ctx.reject(msg.src, f"GRADS of device {d}: header {tuple(head)} is not 3 counts")
            if w not in st.missing:
                st.drop(w)
            return
        n, width, first = int(head[0]), int(head[1]), int(head[2])
        if msg.round != task:
            why = f"for task {msg.round}, device {d} is running task {task}"
        elif n * width != msg.payload.size or n < 1:
            why = f"{msg.payload.size} values are not {n} rows of {width}"
        elif first != st.count[w]:
            why = f"rows from {first}, expected from {st.count[w]}"
        else:
            why = None
            t0 = time.perf_counter()
            try:
                st.add(w, msg.payload.reshape(n, width))
            except ValueError as e:
                why = str(e)
            # the newest add: if it carried the round's last rows, the epoch waited for it
            self.last_add_s = time.perf_counter() - t0
        if why is not None:
            ctx.reject(msg.src, f"GRADS of device {d}: {why}")
            if w not in st.missing:
                st.drop(w)

    def on_device_moved(self, d: int, rank: int, now: float, state: dict) -> None:
        """Re-hosted: the new rank gets the device's order of this epoch. Rows the old rank
        already sent cannot be taken back from the running sum, so a device that sent some
        is dropped from the epoch (D-RR order next epoch); one that sent none re-runs as
        if nothing happened."""
        order = getattr(self, "current", {}).get(d)
        if order is None:
            return
        self.ctx.send(rank, ORDER, device=d, round=self.orderer.epoch,
                         payload=np.ascontiguousarray(order, np.int32))  # fmt: skip
        st = self.stream
        w = sorted(self.ctx.devices).index(d)
        if st is not None and st.count[w] > 0 and w not in st.missing:
            st.drop(w)
            st.moved.add(w)

    def after_apply(self, ap: Apply, now: float) -> None:
        """Close the epoch's stream (devices without an update this round, or with rows
        missing, get a D-RR order) and send every device its next order."""
        if ap.mode != "aggregate":
            return
        ctx, st = self.ctx, self.stream
        got = {a.device for a in ap.arrivals}
        for w, d in enumerate(sorted(ctx.devices)):
            if d not in got and w not in st.missing:
                st.drop(w)
        used = [u.copy() for u in st.used]
        t0 = time.perf_counter()
        orders = st.finish()
        # what the epoch waited for: the decisions the last rows to arrive made possible (all
        # of an epoch's with ordering.ship = epoch, one step's when streamed) and finish()
        self.wait_seconds += self.last_add_s + time.perf_counter() - t0
        self.last_add_s = 0.0
        self.seconds += st.seconds
        if self.before is not None and ctx.out_dir is not None:
            self._save_debug(st, used, orders)
        self._send_orders(orders)

    def _save_debug(self, st, used, orders) -> None:
        from .orderers import save_epoch_debug

        o = self.orderer
        grads = [
            None if w in st.missing or not o.needs_grads else st.buf[w]
            for w in range(len(st.sizes))
        ]
        folder = self.ctx.out_dir / "ordering"
        folder.mkdir(exist_ok=True)
        path = folder / f"epoch-{o.epoch - 1:05d}.npz"
        sketched = self.ctx.cfg["ordering"]["sketch_dim"] > 0
        save_epoch_debug(path, self.before, grads, used, orders, sketched=sketched)

    def summary(self) -> dict:
        o = self.orderer
        return {"ordering": {"name": o.name, "epochs": o.epoch, "seconds": self.seconds,
                             "wait_seconds": self.wait_seconds}}  # fmt: skip

    def state_dict(self) -> dict:
        return {"orderer": self.orderer.state_dict(), "seconds": self.seconds,
                "wait_seconds": self.wait_seconds}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.orderer.load_state_dict(state["orderer"])
        self.seconds = float(state.get("seconds", 0.0))
        self.wait_seconds = float(state.get("wait_seconds", 0.0))
