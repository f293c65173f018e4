"""update_stats: a worked example of an edgefl algorithm plugin that only watches.

Walk-through: docs/write-your-own-algorithm.md. Load it with this folder on ``PYTHONPATH``
(every MPI rank imports it)::

    PYTHONPATH=$PWD/docs/examples edgefl simulate \\
        --set 'algorithm.plugins=["update_stats:UpdateStats"]' \\
        --set algorithm.plugin_args.update_stats.warn_norm=0.5

- coordinator half (rank 0): the L2 norm of every update applied to the model, per device
  (count, last, largest) and overall (count, mean, smallest, largest), and how many updates
  had a norm above ``algorithm.plugin_args.update_stats.warn_norm`` (default 1.0). Reported
  in ``summary.json`` under ``"update_stats"``; the counters are saved in every checkpoint
  (``state_dict``) and come back on ``--resume``.
- worker half (every worker rank): each device's number of local tasks, kept as per-device
  state (``device_state``, saved in every checkpoint under
  ``plugins/update_stats/devices/<id>``), and a small entry in the rank's REGISTER message.

It never changes an update, a task or the model: a run with it ends with the same
``model_sha256`` as the same run without it.
"""

from __future__ import annotations

import math

import numpy as np

from edgefl.algorithms import CoordinatorPlugin, Plugin, WorkerPlugin
from edgefl.errors import ConfigError

NAME = "update_stats"
DEFAULTS = {"warn_norm": 1.0}


def options(cfg: dict) -> dict:
    """This plugin's options: ``algorithm.plugin_args.update_stats`` over the defaults."""
    return {**DEFAULTS, **cfg["algorithm"]["plugin_args"].get(NAME, {})}


class UpdateStatsCoordinator(CoordinatorPlugin):
    """Rank 0: norms of the applied updates (read only)."""

    def __init__(self, ctx, name: str) -> None:
        super().__init__(ctx, name)
        self.warn_norm = float(options(ctx.cfg)["warn_norm"])
        self.updates = 0  # updates applied
        self.over = 0  # ... whose norm was above warn_norm
        self.sum_norm = 0.0
        self.min_norm = math.inf
        self.max_norm = 0.0
        # device id (a str: checkpoint keys are strings) -> its counters
        self.devices: dict[str, dict] = {}

    def after_apply(self, ap, now: float) -> None:
        # After the server step and the version count: ``ap.arrivals`` are the updates this
        # model change used, with their dense deltas (float32). Any mode (aggregate, terms,
        # FedAsync's mix). Read them; never write to them. ``now``: the run's clock (s).
        for a in ap.arrivals:
            if a.delta is None:  # (not at rank 0; check_config refuses ps.servers > 0)
                continue
            norm = float(np.linalg.norm(a.delta.astype(np.float64)))
            over = norm > self.warn_norm
            self.updates += 1
            self.over += over
            self.sum_norm += norm
            self.min_norm = min(self.min_norm, norm)
            self.max_norm = max(self.max_norm, norm)
            dev = self.devices.setdefault(
                str(a.device), {"updates": 0, "over": 0, "last_norm": 0.0, "max_norm": 0.0}
            )
            dev["updates"] += 1
            dev["over"] += over
            dev["last_norm"] = norm
            dev["max_norm"] = max(dev["max_norm"], norm)

    def summary(self) -> dict:
        # merged into summary.json at the top level: nest it under the plugin's name
        return {
            self.name: {
                "warn_norm": self.warn_norm,
                "updates": self.updates,
                "over_warn_norm": self.over,
                "mean_norm": self.sum_norm / self.updates if self.updates else None,
                "min_norm": self.min_norm if self.updates else None,
                "max_norm": self.max_norm if self.updates else None,
                "devices": {d: dict(v) for d, v in sorted(self.devices.items(), key=_by_id)},
            }
        }

    def state_dict(self) -> dict:
        # saved in every checkpoint under plugins/update_stats/state: str keys; leaves are
        # numbers, str, bool, None, lists of those, or numpy arrays (no tuples, no int keys)
        return {
            "updates": self.updates,
            "over": self.over,
            "sum_norm": self.sum_norm,
            "min_norm": self.min_norm,
            "max_norm": self.max_norm,
            "devices": {d: dict(v) for d, v in self.devices.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        self.over = int(state["over"])
        self.sum_norm = float(state["sum_norm"])
        self.min_norm = float(state["min_norm"])
        self.max_norm = float(state["max_norm"])
        self.devices = {d: dict(v) for d, v in state.get("devices", {}).items()}


class UpdateStatsWorker(WorkerPlugin):
    """A worker rank: local tasks per device (checkpointed per device)."""

    def __init__(self, ctx, name: str) -> None:
        super().__init__(ctx, name)
        # keyed by device as tasks come: a device re-hosted onto this rank after a rank
        # died (before any checkpoint of its state) is counted from its first task here
        self.tasks: dict[int, int] = {}

    def on_register(self, info: dict) -> None:
        # one JSON-able entry in this rank's REGISTER message, under the plugin's name; the
        # coordinator half can read it as ``self.ctx.rank_info[rank][name]``
        info[self.name] = {"devices": len(self.ctx.devices), "format": 1}

    def before_train(self, d: int, job) -> None:
        self.tasks[d] = self.tasks.get(d, 0) + 1  # every training task (not the flush)

    def device_state(self, d: int) -> dict:
        return {"tasks": self.tasks.get(d, 0)}

    def load_device_state(self, d: int, state: dict) -> None:
        self.tasks[d] = int(state["tasks"])


class UpdateStats(Plugin):
    """``algorithm.plugins = ["update_stats:UpdateStats"]``."""

    name = NAME
    coordinator = UpdateStatsCoordinator
    worker = UpdateStatsWorker

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        key = f"algorithm.plugin_args.{NAME}"
        args = cfg["algorithm"]["plugin_args"].get(NAME, {})
        if not isinstance(args, dict):
            raise ConfigError(f"config key '{key}': must be a table")
        for k in args:
            if k not in DEFAULTS:
                raise ConfigError(f"config key '{key}.{k}': unknown option (known: warn_norm)")
        w = options(cfg)["warn_norm"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise ConfigError(f"config key '{key}.warn_norm' = {w!r}: must be a number > 0")
        if cfg["ps"]["servers"] > 0:
            raise ConfigError(
                f"config key 'ps.servers' = {cfg['ps']['servers']}: not supported by plugin "
                f"'{NAME}' (the updates go to the server shards, not to rank 0)"
            )


def _by_id(item: tuple[str, dict]) -> int:
    return int(item[0])


__all__ = ["UpdateStats"]
