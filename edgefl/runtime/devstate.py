"""Per-device plugin state between the worker ranks and rank 0's checkpoints.

Worker halves hold per-device state (a GDDR residual, a gate's loss window, a filter's
held-back mass, a gated device's local model). When rank 0 writes a checkpoint it asks every
live worker rank for it (``STATE`` with payload ``b"?"``); each answers one ``STATE`` with
``{plugin: {device: state}}`` for its devices, encoded here. On resume rank 0 sends each rank
its devices' saved state before any task. Nothing is pickled: a state is flattened with the
checkpoint planner (:mod:`edgefl.ckpt.plan`) into a JSON directory plus raw array bytes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from ..ckpt.plan import Node, plan_state, rebuild_state
from ..comm import Kind
from ..errors import EdgeflError

ASK = np.frombuffer(b"?", np.uint8)  # the request's payload


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
def collect(core: Any) -> dict[str, dict[str, dict]]:
    """Ask every live worker rank for its devices' plugin state: ``{plugin: {device: st}}``
    (empty when no worker half keeps per-device state). Task answers that come in meanwhile
    are kept for the event loop."""
    if not core.worker_state:
        return {}
    t = core.t
    ranks = sorted({v["rank"] for v in core.devices.values()} - set(t.failed))
    for r in ranks:
        t.send(r, Kind.STATE, payload=ASK)
    out: dict[str, dict[str, dict]] = {}
    waiting = set(ranks)
    limit = core.cfg["comm"]["failure_timeout_s"] or core.cfg["comm"]["register_timeout_s"]
    deadline = time.monotonic() + limit
    while waiting:
        waiting -= t.failed
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise EdgeflError(
                f"ranks {sorted(waiting)} sent no device state for the checkpoint within "
                f"{limit:.0f} s"
            )
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
    return out


def restore(core: Any, saved: dict[str, dict[str, dict]]) -> None:
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
        core.t.send(rank, Kind.STATE, payload=encode(state))


# -- worker ranks ---------------------------------------------------------------------------
def answer(worker: Any, msg: Any) -> None:
    """A STATE from rank 0: ``b"?"`` asks for this rank's devices' state; anything else is
    saved state to load (every device's, before its first task)."""
    if msg.payload.size == 1 and msg.payload[0] == ASK[0]:
        state: dict[str, dict] = {}
        for p in worker.plugins:
            devs = {str(d): p.device_state(d) for d in worker.devices}
            devs = {d: s for d, s in devs.items() if s}
            if devs:
                state[p.name] = devs
        worker.t.send(0, Kind.STATE, payload=encode(state))
        return
    try:
        saved = decode(msg.payload)
    except ValueError as e:
        raise EdgeflError(f"rank {worker.rank}: the resumed device state: {e}") from None
    for p in worker.plugins:
        for d, st in saved.get(p.name, {}).items():
            if int(d) not in worker.devices:
                raise EdgeflError(f"rank {worker.rank}: resumed state of device {d} it lacks")
            p.load_device_state(int(d), st)
