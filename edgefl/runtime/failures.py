"""What rank 0 does when a rank or a device dies (called by the coordinator)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..policies.consistency import Decision
from . import rehost

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
    core.log_event("failed", now, -1, -1, rank=rank)
    if core.cfg["fleet"]["on_failure"] != "stop" and devs and core.rehost:
        moved, lost = rehost.move_devices(core, rank, devs, now)
        if moved:
            where = ", ".join(f"{d}->{r}" for d, r in moved.items())
            log.warning("rank %d failed at %.3f s: its devices moved (%s)", rank, now, where)
            print(f"edgefl: rank {rank} failed; devices {devs} re-hosted on ranks "
                  f"{sorted(set(moved.values()))} (device->rank {where}); going on",
                  flush=True)  # fmt: skip
            dec = Decision()
            for d in lost:
                _merge(dec, core.policy.lost(d, now, core.available))
            return dec
    log.warning("rank %d failed at %.3f s: its devices %s are dead", rank, now, devs)
    print(f"edgefl: rank {rank} failed; devices {devs} are dead; going on", flush=True)
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
            _merge(dec, core.policy.lost(d, now, core.available))
        for p in core._dead_hooks:
            p.on_device_dead(d, now)
    if core.cfg["fleet"]["on_failure"] == "stop":
        core.stopped = f"rank {rank} failed (fleet.on_failure = stop)"
        core.exit_status = 3
        core.checkpoint(core.version, core.metrics.rows, time.monotonic() - core._t0, now)
        return Decision()  # stop where the checkpoint stands: nothing more is applied
    return dec


def _merge(dec: Decision, nxt: Decision) -> None:
    """Fold a policy's decision ``nxt`` into ``dec`` (several devices lost at once)."""
    dec.apply = dec.apply or nxt.apply
    dec.dispatch += nxt.dispatch
    dec.dropped += nxt.dropped
    dec.timer = dec.timer or nxt.timer


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


def quarantine(core: Any, d: int, task: int, what: str, msg: Any) -> None:
    """A non-finite loss or update of ``d``: excluded from aggregation (logged, counted in
    summary.json ``quarantined``); after ``fleet.quarantine_after`` in a row the device gets
    no more tasks (:meth:`Coordinator.available`). The run goes on. Returns None (no
    arrival)."""
    q = core.quarantine.setdefault(d, {"updates": 0, "streak": 0, "excluded_at": None})
    q["updates"] += 1
    q["streak"] += 1
    print(f"edgefl: device {d} (rank {msg.src}) task {task}: non-finite {what}; "
          "excluded from aggregation", flush=True)  # fmt: skip
    limit = core.cfg["fleet"]["quarantine_after"]
    if limit and q["streak"] >= limit and q["excluded_at"] is None:
        q["excluded_at"] = core.version
        print(f"edgefl: device {d} quarantined: {q['streak']} non-finite updates in a row "
              "(fleet.quarantine_after); it gets no more tasks", flush=True)  # fmt: skip
    core.log_event("quarantine", core.ev.now, d, task)
    core.t.release(msg)
    return None
