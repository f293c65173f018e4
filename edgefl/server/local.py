"""The default server backend: rank 0 holds the global model and applies every change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm.wire import HEADER_BYTES
from ..policies.consistency import Apply, Decision

if TYPE_CHECKING:  # (annotations only)
    from ..runtime.coordinator import Coordinator


class LocalServer:
    """Rank 0 aggregates (``algorithm.aggregation``) and steps the server optimizer.

    The hooks below are what the core asks every backend; :class:`~edgefl.server.sharded.
    ShardedServer` answers them for a sharded server group.
    """

    servers = 0  # server ranks after rank 0
    first_worker = 1  # the lowest worker rank
    remote_updates = False  # updates reach rank 0 (not only their headers)

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        self.agg_buf = np.empty_like(core.global_model)

    def register(self, rank: int, info: dict) -> bool:
        """A REGISTER from ``rank``: True if it is a server rank (handled here)."""
        return False

    def start(self) -> None:
        """The event loop is about to start (fresh run or resume)."""

    def send_model(self, rank: int) -> bool:
        return False  # the core sends MODEL itself

    def down_bytes(self, d: int) -> int | None:
        return None

    def upload_header_bytes(self) -> int:
        """Header bytes of one upload (before the model's values)."""
        return HEADER_BYTES

    def update_bytes(self, msg: Any) -> int:
        """Bytes an update moved up (headers included)."""
        return HEADER_BYTES + msg.nbytes

    def apply(self, ap: Apply, now: float) -> bool:
        """Make the model change ``ap``; False if it could not be made (nothing changed)."""
        core = self.core
        g = core.global_model
        arr = ap.arrivals
        if ap.mode == "aggregate":  # (arrivals are what aggregators combine)
            core.server_opt.step(g, core.aggregator.aggregate(arr, out=self.agg_buf))
        elif ap.mode == "terms":
            acc = np.zeros(g.size, np.float64)
            for a, c in zip(arr, ap.coefs):
                acc += c * a.delta
            core.server_opt.step(g, acc.astype(np.float32))
        else:  # mix
            a, alpha = arr[0], np.float32(ap.coefs[0])
            base = core.bases[a.base_version]
            g *= np.float32(1.0) - alpha
            g += alpha * (base + a.delta)
        return True

    def rerun(self, dec: Decision) -> Decision:
        """The decision to carry out after an apply (a sharded group may re-run a round)."""
        return dec

    def after_row(self, wall: float, now: float) -> None:
        """A metrics row (and maybe a checkpoint) of the new version is being written."""

    def rank_failed(self, rank: int, now: float) -> Decision | None:
        """A server rank failed: the decision; None if ``rank`` is not a server rank."""
        return None

    def finish(self) -> None:
        """Training is over (before the summary)."""

    def summary(self) -> dict | None:
        return None
