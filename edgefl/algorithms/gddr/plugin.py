"""The gddr plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ..base import Plugin
from .config import SECTIONS
from .coordinator import GDDRCoordinator
from .worker import GDDRWorker


class GDDR(Plugin):
    """``algorithm.residual = "gddr"`` with the ``[gddr]`` options."""

    name = "gddr"
    order = 60
    sections = SECTIONS
    coordinator = GDDRCoordinator
    worker = GDDRWorker
    summary_keys = {"gddr": None}

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["algorithm"]["residual"] == "gddr"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """What either half would refuse, before any rank starts: the residual's options
        (worker), the replay's and the adaptive tau's (rank 0)."""
        from edgefl.algorithms.gddr.replay import check_replay
        from edgefl.algorithms.gddr.residual import GDDRResidual
        from edgefl.algorithms.gddr.tau import make_tau_controller

        g = cfg["gddr"]
        GDDRResidual(
            1, 0, cfg["seed"], alpha=g["alpha"], tau=g["tau"], installments=g["installments"],
            installment_ratio=g["installment_ratio"],
        )  # fmt: skip
        check_replay(g["replay_decay"], g["replay_steps"])
        make_tau_controller(g["adaptive"], g["tau"], g["tau_min"], g["tau_max"])


__all__ = ["GDDR"]
