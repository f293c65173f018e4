"""What rank 0 does when a rank or a device dies (called by the coordinator)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..policies.consistency import Decision

log = logging.getLogger("edgefl.coordinator")


def rank_failed(core: Any, rank: int, now: float) -> Decision:
    """A rank died (ULFM or time-out): a server rank goes to the backend; a worker's
    devices are dead from ``now``, their tasks lost. Returns the policy's decision."""
    handled = core.server.rank_failed(rank, now)
    if handled is not None:
        return handled
    if rank == 0 or rank not in core.workers:
        return Decision()
    core.failed_ranks[rank] = now
    core.t_failure = time.monotonic()
    devs = [d for d, v in sorted(core.devices.items()) if v["rank"] == rank]
    log.warning("rank %d failed at %.3f s: its devices %s are dead", rank, now, devs)
    print(f"edgefl: rank {rank} failed; devices {devs} are dead; going on", flush=True)
    core.log_event("failed", now, -1, -1, rank=rank)
    dec = Decision()
    for d in devs:
        if d in core.failed:
            continue
        core.failed[d] = now
        if d in core.inflight:
            task = core.inflight[d][0]
            core.ev.cancel(d, task)
            core.pushes.pop((d, task), None)
            core.task_done(d)
            core.lost_tasks += 1
            nxt = core.policy.lost(d, now, core.available)
            dec.apply = dec.apply or nxt.apply
            dec.dispatch += nxt.dispatch
            dec.dropped += nxt.dropped
            dec.timer = dec.timer or nxt.timer
        for p in core._dead_hooks:
            p.on_device_dead(d, now)
    if core.cfg["fleet"]["on_failure"] == "stop":
        core.stopped = f"rank {rank} failed (fleet.on_failure = stop)"
        core.exit_status = 3
        core.checkpoint(core.version, core.metrics.rows, time.monotonic() - core._t0, now)
        return Decision()  # stop where the checkpoint stands: nothing more is applied
    return dec


def dead(core: Any, d: int, now: float) -> bool:
    """Has device ``d`` died (crashed) by ``now``? (virtual clock: from its profile)"""
    if d in core.failed:
        return True
    if core.virtual:
        crash = core.profiles[d].failure.crash_time(core.cfg["seed"], d)
        if crash <= now:
            core.failed[d] = crash
            return True
    return False
