"""The end of training: collect what the devices' plugins still hold back, and waiting
for one task's answer with a deadline (called by the coordinator)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ..comm import Kind, Message
from ..comm.taskflags import FLUSH
from ..errors import EdgeflError
from ..policies.consistency import Apply, Arrival
from .events import ARRIVE

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator


def flush(core: Coordinator) -> None:
    """End of training: every live device whose plugin holds mass back (a residual, a
    filter) sends it; it is applied with the devices' FedAvg weights, so nothing
    produced is lost. Updates of tasks still out count too."""
    flushing = [(p, d) for p in core.plugins for d in p.flush_devices()]
    if not flushing or core.interrupted:
        return  # (an interrupted run is resumed later: it holds on to its residuals)
    now = core.ev.now
    got: list[Arrival] = []
    if core.virtual:
        out = [(e[2], e[3]) for e in core.ev.heap if e[1] == ARRIVE]
    else:
        out = sorted(core.ev.expected)
    for key, msg in sorted(core.pushes.items()):
        got += final_arrival(core, key, msg, now)
    core.pushes.clear()
    for key in sorted(out):
        got += final_arrival(core, key, core.wait_for(key), now)
    for d in list(core.inflight):
        core.task_done(d)
    for p, d in flushing:
        if d in core.failed:
            continue
        task = core.next_task(d)
        core.send_task(d, task, (float(core.version), 0.0, 0.0, float(FLUSH)))
        arr = final_arrival(core, (d, task), core.wait_for((d, task)), now)
        if arr:
            p.on_flushed(d, arr[0])
        got += arr
    always = any(p.flush_always_applies for p, _ in flushing)
    if got and not always and not any(a.delta.any() for a in got):
        # nothing was held back: no extra model version (so a lossless run ends with
        # the model a plain run ends with, server prox included)
        for a in got:
            core.t.release(a.msg)
        got = []
    if got:
        core.log_event("flush", now, -1, -1, devices=len(got))
        core.apply(Apply("terms", got, [core.policy.weight(a.device) for a in got]), now)


def wait_for(core: Coordinator, key: tuple[int, int], limit_s: float | None = None) -> Message:
    """The answer to task ``key`` = (device, task), waiting for it. Raises EdgeflError
    after ``limit_s`` seconds (default ``comm.failure_timeout_s``; 0 = no limit) or
    when the device's rank fails meanwhile."""
    limit = core.cfg["comm"]["failure_timeout_s"] if limit_s is None else limit_s
    deadline = time.monotonic() + limit if limit else math.inf
    rank = core.devices[key[0]]["rank"]
    while key not in core.ev.stash:
        if rank in core.t.failed or rank in core.ev.failures:
            raise EdgeflError(f"rank {rank} failed before device {key[0]} answered")
        if time.monotonic() > deadline:
            raise EdgeflError(
                f"device {key[0]} (rank {rank}) did not answer task {key[1]} within "
                f"{limit:.0f} s (comm.failure_timeout_s)"
            )
        core.ev.take(timeout=1.0)
    return core.ev.stash.pop(key)


def final_arrival(
    core: Coordinator, key: tuple[int, int], msg: Message, now: float
) -> list[Arrival]:
    """A message collected at the end (the flush): as an Arrival, or none."""
    d = key[0]
    if msg.kind == Kind.REPORT:
        return []
    delta, bad, msg = core.decode(d, key[1], msg)
    if bad:
        core.t.reject(msg.src, bad)
        core.t.release(msg)
        return []
    a = Arrival(d, key[1], core.version, core.devices[d]["samples"], 0.0, delta, now)
    a.msg = msg
    a.seconds = 0.0
    return [a]
