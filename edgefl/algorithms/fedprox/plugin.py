"""The fedprox plugin: its Plugin class (name, when it is on, its worker half)."""

from __future__ import annotations

from ..base import Plugin
from .config import SECTIONS
from .worker import FedProxWorker


class FedProx(Plugin):
    """``fedprox.enabled = true`` with ``fedprox.mu``: the server side is plain FedAvg."""

    name = "fedprox"
    order = 90
    sections = SECTIONS
    worker = FedProxWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["fedprox"]["enabled"])


__all__ = ["FedProx"]
