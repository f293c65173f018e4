"""Re-hosting: when a worker rank dies, rank 0 moves its devices to surviving ranks.

Under ``edgefl simulate`` a device is logical: its data is a pure function of the config
and seed, so any rank can rebuild it. When rank ``r`` dies (ULFM, or declared dead after
``comm.failure_timeout_s`` of silence), rank 0

1. picks a new host for each of ``r``'s devices: the surviving worker rank hosting the
   fewest devices, ties to the lowest rank (deterministic, so a rerun moves the same way);
2. sends it ``HOST`` with the device's per-device plugin state from the latest checkpoint
   (rank 0 keeps it in memory after every checkpoint; none before the first). The runtime's
   own local model of a gated device is not restored: the device restarts from the global
   model (its re-run task, or else its next local iteration, adopts it: a plain
   continuation would name a local model the new rank never had). Coordinator plugins
   see the move first (``on_device_moved``) and may change what goes: GDDR folds the
   checkpointed residual back in at rank 0 and starts the device with an empty residual,
   so no checkpointed mass is counted twice;
3. re-sends the task the device had in flight (same task number, same TRAIN, preceded by
   the model version it starts from), unless its answer already arrived. A task that may
   have been what the rank was running when it failed goes *isolated*
   (:mod:`edgefl.runtime.blame`): if its new rank fails in it too, its device is
   quarantined instead of moving on again (its task is then dropped, not re-run).

Under the virtual clock the task keeps the arrival time it was planned with: a real rank
death does not exist on the simulated clock, so the event order, and under BSP without
per-device state the final model, are those of a run without the death. A task whose
start model is no longer held (no run directory) is lost instead and the policy
re-dispatches the device from the current model.

``fleet.rehost`` (``auto``: on under the virtual clock, off under ``edgefl run``, where a
device is its rank) turns it off; ``ps.servers > 0`` and working-set pulls keep the old
behaviour (the devices die with the rank) because their per-rank state cannot move.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..comm import Kind
from ..comm.taskflags import CONTINUE, ISOLATE, REFRESH, pack_flags, unpack_flags
from .devstate import RUNTIME, encode
from .registration import rehost_numerics

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def enabled(cfg: dict) -> bool:
    """Does ``fleet.rehost`` ask for re-hosting in this run?"""
    mode = cfg["fleet"]["rehost"]
    if mode == "auto":
        return cfg["sim"]["clock"] == "virtual"
    return mode == "on"


def supported(core: Coordinator) -> bool:
    """Can this run move devices between ranks? (A warning says why not.)"""
    why = unsupported(core)
    if why:
        log.warning("fleet.rehost: devices cannot move between ranks here: %s", why)
    return not why


def unsupported(core: Coordinator) -> str:
    """Why this run cannot move devices between ranks ("" when it can)."""
    if core.server.servers:
        return "ps.servers > 0 (the devices' pulls are per rank)"
    ps = core.plugin("ps")
    if ps is not None and getattr(ps, "ws_rank", None):
        return "working-set pulls (ps.working_set) are computed per rank"
    return ""


def choose_host(hosted: dict[int, int], survivors: list[int]) -> int:
    """The surviving rank hosting the fewest devices (``hosted``: rank -> count), ties to
    the lowest rank."""
    return min(survivors, key=lambda r: (hosted.get(r, 0), r))


def survivors(core: Coordinator, dead_rank: int) -> list[int]:
    """Worker ranks still alive (not failed, not the one dying now)."""
    gone = set(core.t.failed) | set(core.failed_ranks) | {dead_rank}
    return [r for r in core.workers if r not in gone]


def move_devices(
    core: Coordinator, rank: int, devs: list[int], now: float
) -> tuple[dict[int, int], list[int]]:
    """Move ``devs`` of dead ``rank`` to surviving ranks. Returns (device -> new rank, the
    devices whose task in flight was lost instead of re-run: the caller tells the policy).
    Nothing moves when no worker rank survives."""
    alive = survivors(core, rank)
    if not alive:
        return {}, []
    hosted: dict[int, int] = {}
    for v in core.devices.values():
        if v["rank"] in alive:
            hosted[v["rank"]] = hosted.get(v["rank"], 0) + 1
    moved: dict[int, int] = {}
    for d in devs:
        new = choose_host(hosted, alive)
        hosted[new] = hosted.get(new, 0) + 1
        moved[d] = new
        _host(core, d, rank, new, now)
    lost = [d for d in devs if not _rerun(core, d, now)]
    return moved, lost


def _host(core: Coordinator, d: int, old: int, new: int, now: float) -> None:
    """Tell ``new`` to host ``d`` from now on, with its latest checkpointed state."""
    saved = getattr(core, "device_states", None) or {}
    state = {name: devs[str(d)] for name, devs in saved.items() if str(d) in devs}
    state.pop(RUNTIME, None)  # (a gated device's local model: it restarts from the global)
    if core.gated:  # (its next local iteration adopts the global model: nothing to go on
        core.refresh[d] = True  # from on the new rank, unless _rerun starts it there)
    for p in core.plugins:
        p.on_device_moved(d, new, now, state)
    rehost_numerics(core, d, old, new)
    dev = core.devices[d]
    dev["rank"] = new
    v = core.t.validator
    v.hosted[new] = frozenset({*v.hosted.get(new, ()), d})
    body = {"state": state}  # (the new rank picks the torch device by its own GPUs)
    core.t.send(new, Kind.HOST, device=d, payload=encode(body))
    core.rehosted.append({"device": d, "from": old, "to": new, "time_s": now})
    core.log_event("rehost", now, d, -1, rank=new)


def _rerun(core: Coordinator, d: int, now: float) -> bool:
    """Send ``d``'s task in flight again, to its new rank (see the module docstring).
    False when the task is lost instead (its start model is no longer held)."""
    if d not in core.inflight:
        return True
    task, base, t0 = core.inflight[d]
    if (d, task) in core.pushes or (d, task) in core.ev.stash:
        return True  # its answer is already here
    sent = core.sent.get(d)
    if sent is None or sent[0] != task:
        return True
    aux = list(sent[1])
    flags, arg = unpack_flags(int(aux[3]))
    blame = getattr(core, "tasks_owed", None)
    if blame is not None and blame.isolated(d, task):  # it may have been what failed
        flags |= ISOLATE
        aux[3] = float(pack_flags(flags, arg))
    if flags & CONTINUE and not flags & REFRESH:
        # a gated device's local model died with the rank: go on from the current model
        flags |= REFRESH
        aux[0], aux[3] = float(core.version), float(pack_flags(flags, arg))
        if base in core.base_refs:
            core.base_refs[base] -= 1
        base = core.version
        core.hold_base()
        core.inflight[d] = (task, base, t0)
    version = int(aux[0])
    rank = core.devices[d]["rank"]
    if not flags & CONTINUE or flags & REFRESH:
        if version == core.version:
            core.model_to_rank(rank, wait=True)  # (nothing if the rank holds it already)
        elif version in core.bases:
            core.t.send(rank, Kind.MODEL, round=version, payload=core.bases[version])
        else:
            log.warning("device %d: task %d cannot be re-run (model version %d is gone); "
                        "it is lost", d, task, version)  # fmt: skip
            core.ev.cancel(d, task)
            core.task_done(d)
            core.lost_tasks += 1
            return False
    core.reruns += 1
    core.log_event("rerun", now, d, task, rank=rank)
    core.refresh.pop(d, None)  # (the re-run starts it from a global model on its new rank)
    core.send_task(d, task, tuple(aux), now)
    return True
