"""The dp plugin: client-level differential privacy's place in the registry (its ``[dp]``
config section). DP-FedAvg itself is a choice of the aggregation axis (:mod:`.dpfedavg`,
built by the runtime's policies), so the plugin has no halves."""

from __future__ import annotations

from ..base import Plugin
from .config import SECTIONS


class DP(Plugin):
    """``dp.enabled = true``: DP-FedAvg (clipping, Gaussian noise, dp-accounting); runs
    nothing during a job (the aggregator does)."""

    name = "dp"
    order = 35
    sections = SECTIONS

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["dp"]["enabled"])


__all__ = ["DP"]
