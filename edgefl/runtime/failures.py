"""What rank 0 does when a rank or a device dies (called by the coordinator)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..policies.consistency import Decision
from . import divergence, rehost

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def rank_failed(core: Coordinator, rank: int, now: float) -> Decision:
    """A rank died (ULFM or time-out): a server rank goes to the backend; a worker's
    devices move to the surviving ranks (re-hosting) or are dead from ``now``, their tasks
    lost. A task that was running on two ranks that failed quarantines its device
    (:mod:`edgefl.runtime.blame`). Returns the policy's decision."""
    handled = core.server.rank_failed(rank, now)
    if handled is not None:
        return handled
    if rank == 0 or rank not in core.workers or rank in core.failed_ranks:
        return Decision()
    record(core, rank, now)
    devs = [d for d, v in sorted(core.devices.items()) if v["rank"] == rank]
    dec = Decision()
    blame = getattr(core, "tasks_owed", None)
    poison = blame.rank_lost(rank) if blame is not None else {}
    for d, (task, why) in sorted(poison.items()):
        _merge(dec, exclude(core, d, task, why, now))
    stop = core.cfg["fleet"]["on_failure"] == "stop"
    if not stop:  # ranks killed together: those the library already knows dead get nothing
        core.t.refresh_failures()
    if not stop and not rehost.survivors(core, rank):
        return no_rank_left(core, now)
    if not stop and devs and core.rehost:
        moved, lost = rehost.move_devices(core, rank, devs, now)
        if moved:
            where = ", ".join(f"{d}->{r}" for d, r in moved.items())
            log.warning("rank %d failed at %.3f s: its devices moved (%s)", rank, now, where)
            gone = "".join(f"; device {d} quarantined ({why})" for d, (_t, why) in
                           sorted(poison.items()))  # fmt: skip
            print(f"edgefl: rank {rank} failed{gone}; devices {devs} re-hosted on ranks "
                  f"{sorted(set(moved.values()))} (device->rank {where}); going on",
                  flush=True)  # fmt: skip
            for d in lost:
                _merge(dec, core.policy.lost(d, now, core.available))
            return dec
    log.warning("rank %d failed at %.3f s: its devices %s are dead", rank, now, devs)
    print(f"edgefl: rank {rank} failed; devices {devs} are dead; going on", flush=True)
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
        for p in core.dead_hooks:
            p.on_device_dead(d, now)
    if stop:
        core.stopped = f"rank {rank} failed (fleet.on_failure = stop)"
        core.exit_status = 3
        return Decision()  # stop here: nothing more is applied (the run's end checkpoints)
    return dec


def record(core: Coordinator, rank: int, now: float) -> None:
    """Book worker ``rank`` as failed at ``now`` (summary.json ``failed_ranks``, a
    ``failed`` event)."""
    core.failed_ranks[rank] = now
    core.t_failure = time.monotonic()
    core.log_event("failed", now, -1, -1, rank=rank)


def no_rank_left(core: Coordinator, now: float) -> Decision:
    """Every worker rank has failed: record them all, say so in one line, stop (status 3;
    the run's end writes the checkpoint a resume continues from)."""
    gone = sorted(r for r in core.workers if r in core.t.failed or r in core.failed_ranks)
    for r in gone:
        if r not in core.failed_ranks:
            record(core, r, now)
    for d, v in sorted(core.devices.items()):
        if v["rank"] in gone and d not in core.failed:
            core.failed[d] = now
    ranks = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {gone}"
    log.warning("every worker rank failed (%s) at %.3f s", gone, now)
    print(f"edgefl: {ranks} failed; no worker rank is left: the run stops", flush=True)
    core.stopped = f"no worker rank is left ({ranks} failed)"
    core.exit_status = 3
    return Decision()


def late(core: Coordinator) -> None:
    """As the run ends (after its last round or an early stop): ranks found dead since the
    event loop's last event, or while the workers were told to stop, go into
    ``failed_ranks`` and events.jsonl too; nothing moves any more."""
    found = list(core.ev.failures) + core.t.take_failures()
    core.ev.failures = []
    for r in sorted(set(found)):
        if r == 0 or r not in core.workers or r in core.failed_ranks:
            continue
        now = core.ev.now
        record(core, r, now)
        core.tasks_owed.forget(r)
        print(f"edgefl: rank {r} failed as the run ended; nothing to move", flush=True)


def exclude(core: Coordinator, d: int, task: int, why: str, now: float) -> Decision:
    """Quarantine device ``d`` for ``why`` (its task ``task`` hung or killed its host
    twice): it gets no more tasks, its task in flight is dropped (not run again). Returns
    the policy's decision on the lost task."""
    q = core.quarantine.setdefault(d, {"updates": 0, "streak": 0, "excluded_at": None})
    if q["excluded_at"] is None:
        q["excluded_at"] = core.version
    q["reason"] = why
    print(f"edgefl: device {d} quarantined: {why}; it gets no more tasks", flush=True)
    core.log_event("quarantine", now, d, task, reason=why)
    if d not in core.inflight or core.inflight[d][0] != task:
        return Decision()
    core.ev.cancel(d, task)
    core.pushes.pop((d, task), None)
    core.task_done(d)
    core.lost_tasks += 1
    core.log_event("lost", now, d, task)
    return core.policy.lost(d, now, core.available)


def _merge(dec: Decision, nxt: Decision) -> None:
    """Fold a policy's decision ``nxt`` into ``dec`` (several devices lost at once)."""
    dec.apply = dec.apply or nxt.apply
    dec.dispatch += nxt.dispatch
    dec.dropped += nxt.dropped
    dec.timer = dec.timer or nxt.timer


def dead(core: Coordinator, d: int, now: float) -> bool:
    """Has device ``d`` died (crashed) by ``now``? (virtual clock: from its profile)"""
    if d in core.failed:
        return True
    if core.virtual:
        crash = core.profiles[d].failure.crash_time(core.cfg["seed"], d)
        if crash <= now:
            core.failed[d] = crash
            return True
    return False


def quarantine(core: Coordinator, d: int, task: int, what: str, msg: Any) -> None:
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
        divergence.check_quarantine(core)
    core.log_event("quarantine", core.ev.now, d, task)
    core.t.release(msg)
    return None
