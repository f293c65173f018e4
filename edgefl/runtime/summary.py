"""Rank 0's records: one metrics row per model version, and the run's summary.json."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..algorithms import summary_defaults
from ..comm.wire import HEADER_BYTES
from ..models.train import evaluate
from . import divergence
from .output import summary_table
from .rundir import read_run_id

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def new_period() -> dict:
    """Counters of traffic and iterations since the last metrics row."""
    return {"bytes_up": 0, "bytes_down": 0, "msgs_up": 0, "msgs_down": 0, "iterations": 0}


def round_row(core: Coordinator, arr: list, now: float, evaluate_now: bool = True) -> dict:
    """The metrics row of the version ``core`` just made from arrivals ``arr``; evaluates
    the global model on the test set when due (``run.eval_every``, ``run.eval_every_s``;
    ``evaluate_now`` False: ``test_loss`` and ``test_accuracy`` are None, in their place in
    the row, for :func:`evaluate_into` to fill)."""
    cfg = core.cfg
    r = core.version
    row: dict = {"round": r, "time_s": now, "participants": len(arr), "updates": len(arr)}
    n = sum(a.samples for a in arr)
    row["train_loss"] = float(sum(a.loss * a.samples for a in arr) / max(n, 1))
    row["staleness"] = float(np.mean([r - 1 - a.base_version for a in arr])) if arr else 0.0
    every_s = cfg["run"]["eval_every_s"]
    bucket = int(now // every_s) if every_s > 0 else 0
    if (
        r % cfg["run"]["eval_every"] == 0
        or r >= cfg["run"]["rounds"]
        or (every_s > 0 and bucket > core.eval_bucket)
    ):
        core.eval_bucket = bucket
        row["test_loss"] = row["test_accuracy"] = None
        if evaluate_now:
            evaluate_into(core, row)
    row.update(core.period)
    return row


def evaluate_into(core: Coordinator, row: dict) -> None:
    """The global model's test loss and accuracy, into ``row``."""
    with torch.no_grad():
        loss, acc = evaluate(core.task.model, core.test_set, core.task.data.info.task,
                             loss=core.loss)  # fmt: skip
    # (regression has no accuracy: None)
    row["test_loss"], row["test_accuracy"] = loss, (acc if math.isfinite(acc) else None)


def finish(core: Coordinator, rows: list[dict], rounds_done: int, wall: float, end: float) -> None:
    """Print the summary table and the final accuracy; write summary.json and the model."""
    # (the rows without their per-device entries, which nothing here reads: parsed one at
    # a time from output.Rows, the whole run's would be every device's dicts again)
    rows = [{k: v for k, v in r.items() if k != "devices"} for r in rows]
    stats = core.t.stats
    for d, frac in core.timeline.idle.items():
        core.devices[d]["idle_fraction"] = frac
    agg = core.aggregator
    info = {
        "rounds_done": rounds_done,
        "workers": len(core.workers),
        "clock": "virtual" if core.virtual else "wall",
        "time_s": end,
        "idle_fraction": core.timeline.idle_fraction(),
        "consistency": core.policy.name,
        "gate": core.cfg["algorithm"]["gate"],
        "allocation": core.cfg["algorithm"]["allocation"],
        "dp_epsilon": agg.epsilon() if hasattr(agg, "epsilon") else None,
        "stacked_tasks": core.stacked_tasks,
        **summary_defaults(),
    }
    if hasattr(agg, "summary"):  # (DP: the accounted event, adjacency and library)
        info.update(agg.summary())
    defaults = set(summary_defaults())
    for src in (*core.plugins, core.server):
        for key, value in (src.summary() or {}).items():
            if key in info and key not in defaults:
                log.warning("plugin summary key %r is the runtime's own: left out", key)
                continue
            info[key] = value
    info.update({
        "reference_s_per_sample": core.ref_s,
        "lost_tasks": core.lost_tasks,
        "failed_devices": {str(d): t for d, t in sorted(core.failed.items())},
        "failed_ranks": {str(r): t for r, t in sorted(core.failed_ranks.items())},
        "rehosted": core.rehosted,  # devices moved off dead ranks (fleet.rehost)
        "reruns": core.reruns,
        "quarantined": {str(d): q for d, q in sorted(core.quarantine.items())},
        "task_timeouts": core.tasks_owed.timeouts if hasattr(core, "tasks_owed") else [],
        "recovery_s": core.recovery_s,
        "progress_after_failure_unix": core.progress_after_failure_unix,
        "staleness_hist": {str(k): v for k, v in sorted(core.staleness.items())},
        "wall_time_s": wall,
        "stopped": core.stopped,
        "rejected": sum(stats.rejected.values()),
        "duplicates": sum(stats.duplicates.values()),
        "numerics": core.numerics,  # rank 0's kernels, BLAS, threads (edgefl/kernels.py)
        "numerics_differ": core.numerics_differ,  # ranks whose numerics are not rank 0's
    })  # fmt: skip
    core.trackers.close()
    print(summary_table(rows, core.devices, info), flush=True)
    evals = [r for r in rows if r.get("test_loss") is not None]
    final_acc = evals[-1]["test_accuracy"] if evals else None
    best = best_row(rows)
    print(
        f"final accuracy: {final_acc:.4f}" if final_acc is not None else "final accuracy: -",
        flush=True,
    )
    if core.out_dir is None:
        return
    out = {
        "run_id": read_run_id(core.out_dir),  # the run directory's identity (rundir.py)
        **info,
        "final_accuracy": final_acc,
        "final_test_loss": evals[-1]["test_loss"] if evals else None,
        "best_accuracy": best["test_accuracy"] if best else None,
        "best_round": best["round"] if best else None,
        "diverged": core.diverged,
        "model_sha256": model_sha256(core.global_model),
        "devices": {str(d): v for d, v in sorted(core.devices.items())},
        "wire": {
            "bytes_sent": sum(stats.bytes_sent.values()),
            "bytes_recv": sum(stats.bytes_recv.values()),
            "msgs_sent": sum(stats.msgs_sent.values()),
            "msgs_recv": sum(stats.msgs_recv.values()),
        },
    }
    write_json(core.out_dir / "summary.json", out)
    torch.save(core.task.model.state_dict(), core.out_dir / "final_model.pt")


def best_row(rows: list[dict]) -> dict | None:
    """The row of the highest test accuracy (the earliest of equal ones); None when no row
    has one (never evaluated, or regression)."""
    evals = [r for r in rows if r.get("test_accuracy") is not None]
    return max(evals, key=lambda r: r["test_accuracy"]) if evals else None


def model_sha256(arr: np.ndarray) -> str:
    """SHA-256 (hex) of a flat model's raw float32 bytes (summary.json ``model_sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:  # (streamed: json.dumps with an indent
        json.dump(obj, f, indent=1, default=float)  # joins a string per token, 30 MB for
        f.write("\n")  # the summary of 10,000 devices; the same bytes)
    os.replace(tmp, path)


def record_row(core: Coordinator, arr: list, now: float) -> None:
    """Append the new version's metrics row, show progress, decide an early stop, and write
    the checkpoint when one is due."""
    finish_row(core, begin_row(core, arr, now), now)


def begin_row(core: Coordinator, arr: list, now: float, evaluate_now: bool = True) -> dict:
    """The new version's metrics row up to its test-set evaluation (``evaluate_now``
    False: left to :func:`finish_row`) and its wall time (the row keeps its keys' order);
    the counters of the period it closes start again."""
    row = round_row(core, arr, now, evaluate_now)
    if core.gated:  # the pushes (major updates) this version applied
        row["major_updates"] = sorted(a.device for a in arr)
    core.period = new_period()
    row["wall_time_s"] = None  # (finish_row)
    row["devices"] = {
        str(a.device): {"bytes_up": HEADER_BYTES + a.msg.nbytes, "msgs_up": 1,
                        "time_s": a.seconds}
        for a in arr
    }  # fmt: skip
    return row


def finish_row(core: Coordinator, row: dict, now: float, deferred: bool = False) -> None:
    """The rest of :func:`record_row` for ``row`` of :func:`begin_row`: the evaluation if
    it was left, the row written and shown, an early stop, the checkpoint. ``deferred``:
    the next version's tasks are already out (:meth:`Coordinator.apply`), so a stop
    signal that came meanwhile stops the run at the next version instead of this one."""
    cfg = core.cfg
    r = row["round"]
    if "test_loss" in row and row["test_loss"] is None:
        evaluate_into(core, row)
    row["wall_time_s"] = time.monotonic() - core._t0
    for p in core.plugins:
        p.on_row(row)
    core.metrics.append(row)
    core.trackers.log(row)  # output.trackers: csv, tensorboard, mlflow
    core.progress.update(row)
    target = cfg["run"]["target_accuracy"]
    stop_at = cfg["debug"]["stop_after_round"]
    divergence.check_row(core, row)
    if core.stopped:
        pass  # (diverged: the guard said so)
    elif target > 0 and (row.get("test_accuracy") or 0.0) >= target:
        core.stopped = f"target accuracy {target} reached at round {r}"
    elif stop_at and r == stop_at and r < cfg["run"]["rounds"]:
        core.stopped = f"debug.stop_after_round = {stop_at}"
        core.interrupted = True
    elif (getattr(core, "stop_request", None) is not None and r < cfg["run"]["rounds"]
          and not deferred):  # fmt: skip
        core.interrupt("a resume goes on exactly from there")  # (a stop signal)
    core.server.after_row(row["wall_time_s"], now)
    every = cfg["run"]["checkpoint_every"]
    final = r >= cfg["run"]["rounds"] or bool(core.stopped)
    if core.out_dir is not None and ((every and r % every == 0) or final):
        core.checkpoint(r, core.metrics.rows, row["wall_time_s"], now)
