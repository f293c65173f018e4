"""The gddr plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ..base import Plugin
from .coordinator import GDDRCoordinator
from .worker import GDDRWorker


class GDDR(Plugin):
    """``algorithm.residual = "gddr"`` with the ``[gddr]`` options."""

    name = "gddr"
    coordinator = GDDRCoordinator
    worker = GDDRWorker
    summary_keys = {"gddr": None}

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["algorithm"]["residual"] == "gddr"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        from edgefl.algorithms.gddr.residual import GDDRResidual

        g = cfg["gddr"]
        GDDRResidual(
            1, 0, cfg["seed"], alpha=g["alpha"], tau=g["tau"], installments=g["installments"],
            installment_ratio=g["installment_ratio"],
        )  # fmt: skip


__all__ = ["GDDR"]
