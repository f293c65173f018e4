"""The divergence guard: a run whose model diverged stops with its own exit status and one
line saying what happened and the likely cause, instead of training on at chance accuracy.

Three signs, checked by rank 0 as they appear:

- the global model became non-finite (every later update would be rejected: the run always
  stops there, whatever ``run.on_divergence`` says);
- the global test loss of an evaluated version is non-finite;
- ``run.divergence_share`` of the fleet's devices (default half) is quarantined for
  non-finite updates (``fleet.quarantine_after`` in a row). Devices quarantined for hanging
  or killing their host (:mod:`edgefl.runtime.blame`) do not count: that is no divergence.

With ``run.on_divergence = "stop"`` (the default) the run stops there (exit status
:data:`DIVERGED`, the checkpoint of where it stopped, summary.json ``stopped``); with
``"continue"`` it prints the line once and goes on. Either way summary.json ``diverged``
records the first sign (``{"version", "reason", "cause"}``; null when none was seen).
Pure bookkeeping on the coordinator object: no MPI here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

#: exit status of a run stopped by the guard (edgefl.launcher.DIVERGED)
DIVERGED = 4


def likely_cause(cfg: dict) -> str:
    """The config's most likely reason for a divergence, in a few words: the local step
    (the learning rate, with momentum or the optimizer named), a client hook, and the
    server step when it is more than plain averaging."""
    t, s = cfg["train"], cfg["server"]
    if t["client"]:
        cause = (f"the client hook train.client = '{t['client']}' produced non-finite "
                 f"values, or its learning rate (train.lr = {t['lr']:g}) is too large")  # fmt: skip
    else:
        step = f"train.lr = {t['lr']:g}"
        if t["optimizer"] == "sgd" and t["momentum"] > 0:
            step += f" with train.momentum = {t['momentum']:g}"
        elif t["optimizer"] != "sgd":
            step += f" with train.optimizer = '{t['optimizer']}'"
        cause = f"local steps too large for this model ({step}): lower train.lr"
    if s["lr"] > 1.0 or s["optimizer"] != "sgd":
        cause += (f", or the server step (server.optimizer = '{s['optimizer']}', "
                  f"server.lr = {s['lr']:g})")  # fmt: skip
    return cause


def nonfinite_quarantined(core: Coordinator) -> int:
    """How many devices are quarantined for non-finite updates (not for hangs: those
    entries carry a ``reason``)."""
    return sum(
        1
        for q in core.quarantine.values()
        if q.get("excluded_at") is not None and "reason" not in q
    )


def check_quarantine(core: Coordinator) -> None:
    """After a device was quarantined: has ``run.divergence_share`` of the fleet been?"""
    share = float(core.cfg["run"]["divergence_share"])
    n, total = nonfinite_quarantined(core), len(core.devices)
    if share <= 0 or not total or n < share * total:
        return
    diverged(core, f"{n} of {total} devices were quarantined for non-finite updates "
                   f"(run.divergence_share = {share:g})")  # fmt: skip


def check_row(core: Coordinator, row: dict) -> None:
    """After a metrics row: a non-finite global test loss is a divergence."""
    loss = row.get("test_loss")
    if loss is not None and not math.isfinite(loss):
        diverged(core, f"the global test loss is {loss} at version {row['round']}")


def model_nonfinite(core: Coordinator) -> None:
    """The global model itself became non-finite: the run stops in any case."""
    diverged(core, f"the global model became non-finite at version {core.version}", force=True)


def diverged(core: Coordinator, reason: str, force: bool = False) -> None:
    """Record the first sign of divergence; stop the run unless ``run.on_divergence`` is
    ``"continue"`` (``force``: stop anyway)."""
    if core.stopped:
        return
    stop = force or core.cfg["run"]["on_divergence"] == "stop"
    first = core.diverged is None
    if first:
        cause = likely_cause(core.cfg)
        core.diverged = {"version": core.version, "reason": reason, "cause": cause}
        more = "the run stops" if stop else "going on (run.on_divergence = continue)"
        print(f"edgefl: the run diverged: {reason}; likely cause: {cause}; {more}", flush=True)
    if stop:
        core.stopped = f"diverged: {reason}"
        core.exit_status = DIVERGED
