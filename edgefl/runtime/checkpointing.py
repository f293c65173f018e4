"""What rank 0 puts into a checkpoint and takes back out on resume.

A checkpoint holds the core's state (model, counters, metrics, the consistency policy, the
aggregator and the server optimizer), every coordinator plugin's ``state_dict()`` under
``plugins/<name>``, and every worker half's per-device state under
``plugins/<name>/devices/<id>`` (collected from the worker ranks with a STATE exchange,
:mod:`edgefl.runtime.devstate`). Writing is atomic (:func:`edgefl.ckpt.save_checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..ckpt import checkpoint_name, save_checkpoint
from ..config import config_from_toml
from ..errors import CheckpointError
from . import devstate
from .state import RESUME_MUST_MATCH, checkpoint_state


def save(core: Any, round_: int, rows: list[dict], wall: float, now: float) -> Path:
    """Write checkpoint ``round_`` of coordinator ``core``; returns its path."""
    path = core.out_dir / "checkpoints" / checkpoint_name(round_)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(
        core.cfg, round_, core.task.flat, core.global_model, core.devices, rows, wall
    )
    state["clock"] = {
        "mode": "virtual" if core.virtual else "wall",
        "time_s": float(now),
        "reference_s_per_sample": float(core.ref_s),
        "policy": json.dumps(core.policy.state_dict()),
        "tasks": json.dumps({str(d): n for d, n in core.tasks.items()}),
        "staleness": json.dumps({str(k): v for k, v in core.staleness.items()}),
    }
    state["server_optimizer"] = core.server_opt.state_dict()
    state["aggregation"] = {"state": _aggregator_state(core.aggregator)}
    plugins: dict[str, dict] = {p.name: {"state": p.state_dict()} for p in core.plugins}
    for name, devs in devstate.collect(core).items():
        plugins.setdefault(name, {"state": {}})["devices"] = devs
    state["plugins"] = plugins
    save_checkpoint(path, state)
    return path


def _aggregator_state(agg: Any) -> dict:
    fn = getattr(agg, "state_dict", None)
    return fn() if fn is not None else {}


def restore(core: Any, st: dict) -> None:
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
    core.policy.load_state_dict(json.loads(c["policy"]))
    for d, n in json.loads(c["tasks"]).items():
        if int(d) in core.tasks:
            core.tasks[int(d)] = int(n)
    core.staleness = {int(k): int(v) for k, v in json.loads(c["staleness"]).items()}
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
    devstate.restore(core, {n: v.get("devices", {}) for n, v in saved.items()})
