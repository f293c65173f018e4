"""What rank 0 puts into a checkpoint and takes back out on resume.

A checkpoint holds the core's state (model, counters, metrics, the consistency policy, the
aggregator, the server optimizer, the timeline's busy intervals), every coordinator
plugin's ``state_dict()`` under ``plugins/<name>``, and every worker half's per-device
state under ``plugins/<name>/devices/<id>`` (collected from the worker ranks with a STATE
exchange, :mod:`edgefl.runtime.devstate`). Writing is atomic (:func:`edgefl.ckpt.save_checkpoint`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ckpt import checkpoint_name, save_checkpoint
from ..config import config_from_toml
from ..errors import CheckpointError
from ..kernels import mismatch_line
from . import devstate
from .rundir import run_identity
from .state import RESUME_MUST_MATCH, checkpoint_state

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def save(core: Coordinator, round_: int, rows: list[dict], wall: float, now: float) -> Path:
    """Write checkpoint ``round_`` of coordinator ``core``; returns its path."""
    path = core.out_dir / "checkpoints" / checkpoint_name(round_)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(
        core.cfg, round_, core.task.flat, core.global_model, core.devices, rows, wall
    )
    state["numerics"] = json.dumps(core.numerics)  # (a resume elsewhere warns: restore)
    state.update(run_identity(core.out_dir))  # the run directory's id (F4: rundir.py)
    state["clock"] = {
        "mode": "virtual" if core.virtual else "wall",
        "time_s": float(now),
        "reference_s_per_sample": float(core.ref_s),
        "policy": json.dumps(core.policy.state_dict()),
        "tasks": json.dumps({str(d): n for d, n in core.tasks.items()}),
        "staleness": json.dumps({str(k): v for k, v in core.staleness.items()}),
        "lost_tasks": int(core.lost_tasks),
        "quarantine": json.dumps({str(d): q for d, q in core.quarantine.items()}),
        "control_messages": int(core.control_msgs),
    }
    state["server_optimizer"] = core.server_opt.state_dict()
    state["aggregation"] = {"state": _aggregator_state(core.aggregator)}
    state["timeline"] = core.timeline.state_dict()  # (timeline.csv covers the whole run)
    plugins: dict[str, dict] = {p.name: {"state": p.state_dict()} for p in core.plugins}
    core.device_states = _with_lost(core, devstate.collect(core))  # (kept: re-hosting)
    for name, devs in core.device_states.items():
        plugins.setdefault(name, {"state": {}})["devices"] = devs
    state["plugins"] = plugins
    flight = _flight(core)
    if flight is not None:
        state["flight"] = flight
    save_checkpoint(path, state)
    core.stop_checkpointed = bool(core.stopped)  # (the run's end writes one otherwise)
    return path


def _with_lost(core: Coordinator, fresh: dict) -> dict:
    """The devices' state just collected, and for devices whose rank is gone (they could
    not move: no rank left, ``fleet.on_failure = "stop"``, no re-hosting) their state of
    the previous checkpoint, so a resume still has it."""
    gone = core.t.failed
    if not gone:
        return fresh
    for name, per in (getattr(core, "device_states", None) or {}).items():
        for d, st in per.items():
            if int(d) in core.devices and core.devices[int(d)]["rank"] in gone:
                fresh.setdefault(name, {}).setdefault(d, st)
    return fresh


def _aggregator_state(agg: Any) -> dict:
    fn = getattr(agg, "state_dict", None)
    return fn() if fn is not None else {}


def restore(core: Coordinator, st: dict) -> None:
    """Continue coordinator ``core`` (registered and set up) from checkpoint ``st``."""
    old = config_from_toml(st["config_toml"], "checkpoint config")
    for key in RESUME_MUST_MATCH:
        a, b = old, core.cfg
        for part in key.split("."):
            a, b = a[part], b[part]
        if a != b:
            raise CheckpointError(
                f"checkpoint config differs from this run's at '{key}': {a!r} vs {b!r}"
            )
    if st["model"]["signature"] != core.task.signature:
        raise CheckpointError("checkpoint holds a model of a different layout")
    if not np.isfinite(st["model"]["flat"]).all():
        raise CheckpointError(_diverged(core, int(st["round"])))
    line = mismatch_line(
        "the checkpoint was written", json.loads(st.get("numerics", "{}")), core.numerics
    )
    if line:
        log.warning("%s", line)
    core.global_model[:] = st["model"]["flat"]
    core.start_round = int(st["round"])
    core.wall_offset = float(st["wall_time_s"])
    core.history = [json.loads(x) for x in st["metrics_jsonl"]]
    for d, v in st["devices"].items():
        if int(d) in core.devices:
            for k in ("rounds", "bytes_up", "bytes_down", "msgs_up", "msgs_down", "time_s",
                      "requests", "iterations"):  # fmt: skip
                core.devices[int(d)][k] = v.get(k, 0)
    c = st["clock"]
    core.start_time = float(c.get("time_s", 0.0))
    # the busy intervals so far; with tasks in flight (taken at an apply) they go on as planned
    core.timeline.load_state_dict(st.get("timeline"), core.start_time, "flight" in st)
    core.policy.load_state_dict(json.loads(c["policy"]))
    for d, n in json.loads(c["tasks"]).items():
        if int(d) in core.tasks:
            core.tasks[int(d)] = int(n)
    core.staleness = {int(k): int(v) for k, v in json.loads(c["staleness"]).items()}
    core.lost_tasks = int(c.get("lost_tasks", 0))
    core.quarantine = {int(d): q for d, q in json.loads(c.get("quarantine", "{}")).items()}
    # (older checkpoints kept the count in Hermes' state)
    old_count = st.get("plugins", {}).get("hermes", {}).get("state", {}).get("control_messages", 0)
    core.control_msgs = int(c.get("control_messages", old_count))
    _another_chance(core)
    core.server_opt.load_state_dict(st["server_optimizer"])
    agg = st.get("aggregation", {}).get("state")
    if agg and hasattr(core.aggregator, "load_state_dict"):
        core.aggregator.load_state_dict(agg)
    saved = st.get("plugins")
    if saved is None:
        raise CheckpointError(
            "checkpoint has no plugin state (written by an older edgefl); it cannot be resumed "
            "exactly: start the run again"
        )
    for p in core.plugins:
        if p.name not in saved:
            raise CheckpointError(
                f"checkpoint has no state for plugin '{p.name}': it was written by a run "
                "without it (compare algorithm.* and algorithm.plugins with the checkpoint's "
                "config)"
            )
        p.load_state_dict(saved[p.name].get("state", {}))
    core.device_states = {n: v["devices"] for n, v in saved.items() if v.get("devices")}
    devstate.restore(core, core.device_states)
    core.flight_state = st.get("flight")  # (put back when the event loop starts)
    if core.flight_state is None:  # not taken at an apply: the tasks out then restart
        core.policy.forget_tasks()
    core.flight_policy = c["policy"]


def _diverged(core: Coordinator, round_: int) -> str:
    """Why a checkpoint of a diverged run cannot be resumed, and which one can."""
    from ..ckpt import checkpoint_name

    text = (f"the checkpoint of round {round_} holds a non-finite model (the run diverged "
            "there; resumed, it could only stop again)")  # fmt: skip
    folder = core.out_dir / "checkpoints" if core.out_dir is not None else None
    earlier = []
    if folder is not None and folder.is_dir():
        earlier = [p for r in range(round_ - 1, -1, -1)
                   if (p := folder / checkpoint_name(r)).is_file()][:1]  # fmt: skip
    if earlier:
        return f"{text}: resume from an earlier checkpoint, e.g. {earlier[0]}"
    return f"{text}: resume from an earlier checkpoint (run.checkpoint_every) or start again"


def _another_chance(core: Coordinator) -> None:
    """A run that stopped because every device was quarantined (a NaN loss everywhere, say),
    or ``run.divergence_share`` of them for non-finite updates (the divergence guard), could
    only stop again from its checkpoint: resumed, those devices get another chance."""
    q, devices = core.quarantine, core.devices
    out = [d for d in devices if q.get(d, {}).get("excluded_at") is not None]
    if not devices or not out:
        return
    if len(out) < len(devices):  # (only the guard's stop: devices hung are left out)
        out = [d for d in out if "reason" not in q[d]]
        if len(out) < float(core.cfg["run"]["divergence_share"]) * len(devices):
            return
    for d in out:
        q[d]["excluded_at"] = None
        q[d]["streak"] = 0
        q[d].pop("reason", None)
    many = "all" if len(out) == len(devices) else f"{len(out)} of"
    print(f"edgefl: {many} {len(devices)} devices were quarantined when the run stopped; "
          "the resumed run gives them another chance", flush=True)  # fmt: skip


# -- tasks in flight ------------------------------------------------------------------------
def _flight(core: Coordinator) -> dict | None:
    """What is under way when a checkpoint of a new model version is written (inside the
    apply): the decision still to carry out, the tasks in flight (their TRAINs, the model
    versions they started from), the clock's pending events, the gated uploads held here and
    the policy's buffered updates. None when the checkpoint is not taken at an apply (then a
    resume restarts the tasks, as it always did)."""
    dec = core.pending
    if dec is None:
        return None
    fl: dict[str, Any] = {
        "pending": json.dumps({"dispatch": list(dec.dispatch), "dropped": list(dec.dropped),
                               "timer": list(dec.timer) if dec.timer else None}),
        "inflight": json.dumps({str(d): list(v) for d, v in core.inflight.items()}),
        "sent": json.dumps({str(d): [t, *a] for d, (t, a) in core.sent.items()
                            if d in core.inflight}),
        "online_pending": sorted(int(d) for d in core.online_pending),
        "refresh": sorted(int(d) for d, v in core.refresh.items() if v),
        "iter_time": json.dumps({str(d): s for d, s in core.iter_time.items()}),
        "failed": json.dumps({str(d): s for d, s in core.failed.items()}),
        "bases": {str(v): np.array(m) for v, m in core.bases.items()},
    }  # fmt: skip
    if core.virtual:
        fl["heap"] = np.array(core.ev.heap, np.float64).reshape(-1, 6)
        fl["heap_n"] = int(core.ev.n)
    fl["pushes"] = {f"{d}:{t}": _message_state(m) for (d, t), m in core.pushes.items()}
    buf = getattr(core.policy, "buffer", None) or []
    fl["buffered"] = {
        f"{a.device}:{a.task}": {"delta": np.array(a.delta, np.float32), "seconds": a.seconds,
                                 "nbytes": int(a.msg.nbytes), "src": int(a.msg.src)}
        for a in (x[0] if isinstance(x, tuple) else x for x in buf)
    }  # fmt: skip
    return fl


def _message_state(m: Any) -> dict:
    return {"kind": int(m.kind), "src": int(m.src), "device": int(m.device), "seq": int(m.seq),
            "round": int(m.round), "aux": [float(x) for x in m.aux], "nbytes": int(m.nbytes),
            "payload": np.array(m.payload) if m.payload is not None else None}  # fmt: skip


def resume_flight(core: Coordinator) -> Any:
    """A resume whose checkpoint was taken at an apply: put the tasks in flight back (their
    clock events as they were, their TRAINs sent again with the model version each started
    from) and return the decision the interrupted run was carrying out; None otherwise
    (the policy then starts afresh)."""
    from ..comm import Kind
    from ..comm.taskflags import CONTINUE, REFRESH, unpack_flags
    from ..comm.wire import Message, kind_of
    from ..policies.consistency import Decision

    fl = getattr(core, "flight_state", None)
    if not fl:
        return None
    core.inflight = {int(d): (int(v[0]), int(v[1]), float(v[2]))
                     for d, v in json.loads(fl["inflight"]).items()}  # fmt: skip
    sent = {int(d): (int(v[0]), tuple(float(x) for x in v[1:]))
            for d, v in json.loads(fl["sent"]).items()}  # fmt: skip
    core.online_pending = {int(d) for d in fl["online_pending"]}
    core.refresh = {int(d): True for d in fl["refresh"]}
    core.iter_time = {int(d): float(s) for d, s in json.loads(fl["iter_time"]).items()}
    core.failed = {int(d): float(s) for d, s in json.loads(fl["failed"]).items()}
    core.bases = {int(v): np.array(m, np.float32) for v, m in fl["bases"].items()}
    core.base_refs = {}
    for _task, base, _t0 in core.inflight.values():
        core.base_refs[base] = core.base_refs.get(base, 0) + 1
    for key, m in fl["pushes"].items():
        d, t = (int(x) for x in key.split(":"))
        core.pushes[(d, t)] = Message(kind_of(m["kind"]), m["src"], m["device"], m["seq"],
                                      m["round"], 0.0, tuple(m["aux"]), m["payload"],
                                      m["nbytes"])  # fmt: skip
    _restore_buffer(core, fl.get("buffered", {}))
    if core.virtual:
        import heapq

        heap = [(float(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]))
                for r in np.asarray(fl["heap"]).reshape(-1, 6)]  # fmt: skip
        heapq.heapify(heap)
        core.ev.heap, core.ev.n = heap, int(fl["heap_n"])
        waiting = {(e[2], e[3]) for e in heap if e[1] == 0}  # (ARRIVE)
    else:
        waiting = {(d, v[0]) for d, v in sent.items()}
        core.ev.expected |= waiting
    # per rank in ascending model version: each version's MODEL just before the TRAINs that
    # start from it (a worker keeps the newest version it holds and those its queued tasks
    # name, so no version is dropped before its TRAIN arrives)
    again = []
    for d in sorted(core.inflight):
        task, aux = sent.get(d, (None, ()))
        if (d, task) not in waiting:
            continue  # lost on the way (nothing was sent) or its upload is held here
        flags, _arg = unpack_flags(int(aux[3]))
        fresh = not (flags & CONTINUE and not flags & REFRESH)  # starts from model aux[0]
        again.append((core.devices[d]["rank"], int(aux[0]), d, task, aux, fresh))
    models_sent: set[tuple[int, int]] = set()
    for rank, version, d, task, aux, fresh in sorted(again):
        if fresh and (rank, version) not in models_sent:
            core.t.send(rank, Kind.MODEL, round=version, payload=core.bases[version])
            models_sent.add((rank, version))
        core.send_task(d, task, aux)
    p = json.loads(fl["pending"])
    timer = tuple(p["timer"]) if p["timer"] else None
    return Decision(dispatch=list(p["dispatch"]), dropped=list(p["dropped"]), timer=timer)


def _restore_buffer(core: Coordinator, buffered: dict) -> None:
    """The policy's buffered updates (FedBuff), with their deltas."""
    if not buffered or not hasattr(core.policy, "buffered_tasks"):
        return
    from ..comm import Kind
    from ..comm.wire import Message

    deltas = {tuple(int(x) for x in k.split(":")): np.array(v["delta"], np.float32)
              for k, v in buffered.items()}  # fmt: skip
    core.policy.load_state_dict(json.loads(core.flight_policy), deltas=deltas)
    for a, _s in core.policy.buffer:
        v = buffered[f"{a.device}:{a.task}"]
        a.seconds = float(v["seconds"])
        a.msg = Message(Kind.UPDATE, int(v["src"]), a.device, nbytes=int(v["nbytes"]))
