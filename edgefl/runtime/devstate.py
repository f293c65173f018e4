"""Per-device plugin state between the worker ranks and rank 0's checkpoints.

Worker halves hold per-device state (a GDDR residual, a gate's loss window, a filter's
held-back mass, a gated device's local model). When rank 0 writes a checkpoint it asks every
live worker rank for it (``STATE`` ``{"ask": {"before": {device: task}}}``: a device with a
task in flight answers with its state from before that task); each answers one ``STATE``
with ``{plugin: {device: state}}`` for its devices, encoded here. On resume rank 0 sends each
rank its devices' saved state (``{"load": ...}``) before any task. Nothing is pickled: a
state is flattened with the checkpoint planner (:mod:`edgefl.ckpt.plan`) into a JSON
directory plus raw array bytes.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ckpt.plan import Node, plan_state, rebuild_state
from ..comm import Kind
from ..errors import EdgeflError

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator


def encode(state: dict[str, Any]) -> np.ndarray:
    """``state`` (a checkpointable nested dict) as uint8 bytes: 8-byte directory length,
    the JSON directory (names, kind, dtype, shape of every node), then the leaves' bytes."""
    nodes = plan_state(state)
    index, blobs = [], []
    for n in nodes:
        if n.data is None:
            index.append([list(n.names), n.kind, None, None])
        else:
            data = np.asarray(n.data)  # (keeps a 0-d shape; plan leaves are contiguous)
            index.append([list(n.names), n.kind, data.dtype.str, list(data.shape)])
            blobs.append(data.reshape(-1).view(np.uint8))
    head = json.dumps(index).encode("utf-8")
    parts = [np.frombuffer(len(head).to_bytes(8, "little"), np.uint8),
             np.frombuffer(head, np.uint8), *blobs]  # fmt: skip
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def decode(buf: np.ndarray) -> dict[str, Any]:
    """Inverse of :func:`encode`; ValueError for anything malformed."""
    raw = bytes(np.asarray(buf, np.uint8))
    try:
        n = int.from_bytes(raw[:8], "little")
        index = json.loads(raw[8 : 8 + n].decode("utf-8"))
        pos, nodes = 8 + n, []
        for names, kind, dtype, shape in index:
            if dtype is None:
                nodes.append(Node(tuple(names), kind))
                continue
            dt = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if pos + size > len(raw):
                raise ValueError("truncated")
            data = np.frombuffer(raw[pos : pos + size], dt).reshape(shape).copy()
            nodes.append(Node(tuple(names), kind, data))
            pos += size
        if pos != len(raw):
            raise ValueError(f"{len(raw) - pos} bytes left over")
        return rebuild_state(nodes)
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed device state: {e}") from None


# -- rank 0 ---------------------------------------------------------------------------------
def collect(core: Coordinator) -> dict[str, dict[str, dict]]:
    """Ask every live worker rank for its devices' plugin state: ``{plugin: {device: st}}``
    (empty when no worker half keeps per-device state). Task answers that come in meanwhile
    are kept for the event loop."""
    if not core.worker_state:
        return {}
    t = core.t
    ranks = sorted({v["rank"] for v in core.devices.values()} - set(t.failed))
    # a device with a task in flight answers with its state from before that task (the
    # resumed run re-runs the task)
    before = {str(d): int(v[0]) for d, v in core.inflight.items()
              if (d, v[0]) not in core.pushes}  # (a held upload is not re-run)  # fmt: skip
    ask = encode({"ask": {"before": before}})
    for r in ranks:
        t.send(r, Kind.STATE, payload=ask)
    out: dict[str, dict[str, dict]] = {}
    waiting = set(ranks)
    limit = core.cfg["comm"]["failure_timeout_s"] or core.cfg["comm"]["register_timeout_s"]
    deadline = time.monotonic() + limit
    while waiting:
        waiting -= t.failed
        if not waiting:
            break
        if time.monotonic() > deadline:
            if not core.cfg["comm"]["failure_timeout_s"]:
                raise EdgeflError(
                    f"ranks {sorted(waiting)} sent no device state for the checkpoint within "
                    f"{limit:.0f} s"
                )
            # time-outs are on: a rank that cannot answer this is given up on like one that
            # owes an update (its devices move); the checkpoint keeps their earlier state
            for r in sorted(waiting):
                core.watch.give_up(r)
                t.declare_failed(r, f"no device state within {limit:g} s")
            _keep_earlier(core, out, waiting)
            break
        for msg in t.poll(timeout=0.5):
            if msg.kind != Kind.STATE:
                core.ev.keep(msg)
                continue
            try:
                got = decode(msg.payload)
            except ValueError as e:
                raise EdgeflError(f"rank {msg.src}: {e}") from None
            hosted = {d for d, v in core.devices.items() if v["rank"] == msg.src}
            for name, devs in got.items():
                for d, st in devs.items():
                    if int(d) not in hosted:
                        raise EdgeflError(f"rank {msg.src} sent state of device {d} it lacks")
                    out.setdefault(name, {})[str(int(d))] = st
            waiting.discard(msg.src)
            t.release(msg)
        core.ev.failures += t.take_failures()
        if getattr(core, "watch", None) is not None:  # (a rank stuck in a task cannot
            core.watch.tick()  # answer: the task watchdog gives up on it, blame.py)
    return out


def _keep_earlier(core: Coordinator, out: dict, ranks: set[int]) -> None:
    """Fill in the devices of ``ranks`` (given up on) from the previous checkpoint's state."""
    devs = {str(d) for d, v in core.devices.items() if v["rank"] in ranks}
    for name, per in (getattr(core, "device_states", None) or {}).items():
        for d, st in per.items():
            if d in devs:
                out.setdefault(name, {})[d] = st


def restore(core: Coordinator, saved: dict[str, dict[str, dict]]) -> None:
    """Send every worker rank its devices' saved plugin state (resume)."""
    if not core.worker_state:
        return
    by_rank: dict[int, dict[str, dict]] = {}
    for name, devs in saved.items():
        for d, st in devs.items():
            if int(d) in core.devices:
                rank = core.devices[int(d)]["rank"]
                by_rank.setdefault(rank, {}).setdefault(name, {})[str(d)] = st
    for rank, state in sorted(by_rank.items()):
        core.t.send(rank, Kind.STATE, payload=encode({"load": state}))


# -- worker ranks ---------------------------------------------------------------------------
RUNTIME = "runtime"  # the worker core's own per-device state (a gated device's local model)


def snapshot(worker: Any, d: int) -> np.ndarray:
    """Device ``d``'s state now, encoded (taken when a task starts: its "before" state)."""
    state = device_state(worker, d)
    return encode(state) if state else _EMPTY  # (most devices, most tasks: no state)


_EMPTY = encode({})
_EMPTY.setflags(write=False)


def device_state(worker: Any, d: int) -> dict[str, dict]:
    """``{plugin: state}`` of device ``d`` (plugins without state left out)."""
    out = {p.name: p.device_state(d) for p in worker.plugins}
    out[RUNTIME] = worker.local_state_dict(d)
    return {k: v for k, v in out.items() if v}


def answer(worker: Any, msg: Any) -> None:
    """A STATE from rank 0: ``{"ask": {"before": {device: task}}}`` asks for this rank's
    devices' state (a device whose task ``before[d]`` already started answers with the
    state it had when it started it); ``{"load": {plugin: {device: state}}}`` is saved
    state to load (a resume, before any task)."""
    try:
        got = decode(msg.payload)
    except ValueError as e:
        raise EdgeflError(f"rank {worker.rank}: STATE from rank 0: {e}") from None
    if "ask" in got:
        before = {int(d): int(t) for d, t in got["ask"].get("before", {}).items()}
        state: dict[str, dict] = {}
        for d in worker.devices:
            snap = worker.snapshots.get(d)
            if d in before and snap is not None and snap[0] == before[d]:
                per = decode(snap[1])
            else:
                per = device_state(worker, d)
            for name, st in per.items():
                state.setdefault(name, {})[str(d)] = st
        worker.t.send(0, Kind.STATE, payload=encode(state))
        return
    saved = got.get("load", {})
    halves = {p.name: p for p in worker.plugins}
    for name, devs in saved.items():
        for d, st in devs.items():
            if int(d) not in worker.devices:
                raise EdgeflError(f"rank {worker.rank}: resumed state of device {d} it lacks")
            if name == RUNTIME:
                worker.load_local_state(int(d), st)
            elif name in halves:
                halves[name].load_device_state(int(d), st)
