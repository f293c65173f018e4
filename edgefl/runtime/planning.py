"""Planning tasks on the virtual clock: when a task's model arrives, its computation ends,
its upload arrives (or the device goes offline or dies first); on the wall clock, booking
the compute time each update measured. Called by the coordinator; the intervals go into
its :class:`edgefl.sim.timeline.Timeline`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..algorithms.base import TaskSpec
from ..comm import Message
from ..comm.wire import HEADER_BYTES
from ..sim.clock import plan_task
from .events import ARRIVE, LOST, PUSH

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def plan(core: Coordinator, d: int, task: int, now: float, spec: TaskSpec, download: bool) -> bool:
    """Plan an iteration on the virtual clock (no-op on the wall clock); False if it
    is lost (the device goes offline or dies first: nothing is sent). The planned
    arrival (virtual seconds) is left in ``core.planned_arrival``."""
    if not core.virtual:
        core.ev.schedule(0.0, ARRIVE, d, task)
        return True
    up = core.server.upload_header_bytes() + core.global_model.nbytes
    plan = plan_task(
        core.profiles[d], core.cfg["seed"], d, task, now, core.down_bytes(d), up,
        work(core, d, spec), core.ref_s, download=download, upload=not core.gated,
    )  # fmt: skip
    for state, a, b in plan.intervals():
        core.timeline.add(d, state, a, b)
    core.iter_time[d] = plan.compute_end - plan.model_at
    if plan.lost:
        core.ev.schedule(plan.lost_at, LOST, d, task)
        return False
    core.ev.schedule(plan.arrive, ARRIVE, d, task)
    core.planned_arrival = plan.arrive
    return True


def observed(core: Coordinator, d: int, dispatched: float, arrived: float, seconds: float) -> None:
    """Wall clock: device ``d``'s update, dispatched at ``dispatched`` and taken in at
    ``arrived`` (seconds since the start of the run), measured ``seconds`` of compute (the
    worker's ``aux[2]``). Books the compute interval ending at the arrival (never before
    the dispatch); the rest of the task's time (transfers, its turn on a rank shared with
    other devices) stays *waiting*. No-op on the virtual clock (planned by :func:`plan`)."""
    if core.virtual:
        return
    start = max(dispatched, arrived - max(seconds, 0.0))
    core.timeline.add(d, "compute", start, arrived)


def plan_push(core: Coordinator, d: int, task: int, now: float, msg: Message) -> None:
    """A gated device pushes at ``now``: its update arrives after the upload."""
    prof = core.profiles[d]
    arrive = now + prof.up_s(HEADER_BYTES + msg.nbytes)
    seed = core.cfg["seed"]
    cut = min(prof.failure.crash_time(seed, d), prof.availability.online_until(now, seed, d))
    core.timeline.add(d, "upload", now, min(arrive, cut))
    if cut < arrive:
        core.t.release(msg)
        core.ev.schedule(cut, LOST, d, task)
        return
    core.pushes[(d, task)] = msg
    core.ev.schedule(arrive, PUSH, d, task)


def work(core: Coordinator, d: int, spec: TaskSpec) -> int:
    """Training samples one iteration of device ``d`` processes."""
    c = core.cfg["train"]
    n = min(core.n_train[d], spec.samples or core.n_train[d])
    batch = spec.batch or c["batch_size"]
    if c["local_steps"]:
        return c["local_steps"] * (batch or n)
    return c["local_epochs"] * n


def calibrate(core: Coordinator) -> float:
    """Measure this machine's seconds per training sample once (sim.reference_s_per_sample
    = 0); the figure goes into the checkpoints and summary.json."""
    import copy

    from ..sim.profiles import calibrate_reference

    c = core.cfg["train"]
    ref = calibrate_reference(
        copy.deepcopy(core.task.model), core.task.data.train(0),
        batch_size=c["batch_size"] or 32, steps=50, task=core.task.data.info.task,
        lr=c["lr"],
    )  # fmt: skip
    log.warning("sim.reference_s_per_sample calibrated on this machine: %.3g s", ref)
    return ref
