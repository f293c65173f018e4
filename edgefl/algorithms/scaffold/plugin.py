"""The scaffold plugin: its Plugin class (name, when it is on, what it requires, its halves)."""

from __future__ import annotations

from ..base import Plugin, Requirement, one_of
from .config import SECTIONS
from .coordinator import ScaffoldCoordinator
from .worker import ScaffoldWorker


class Scaffold(Plugin):
    """``scaffold.enabled = true``: SCAFFOLD's control variates (option II)."""

    name = "scaffold"
    order = 100
    sections = SECTIONS
    coordinator = ScaffoldCoordinator
    worker = ScaffoldWorker
    summary_keys = {"scaffold": None}

    requires = tuple(
        Requirement("scaffold.enabled", one_of(True), key, allowed, why)
        for key, allowed, why in (
            ("algorithm.consistency", one_of("bsp"), "the server variate steps once per "
             "synchronous round with the round's control-variate changes"),
            ("algorithm.gate", one_of("always"), "a device's variate changes with every "
             "task it uploads; a gated device trains several tasks per upload"),
            ("algorithm.residual", one_of("none"), "the variate change is computed from "
             "the whole local change, which a residual buffer would withhold in part"),
            ("ps.sparse", one_of(False), "SCAFFOLD sends its own update kind (model delta "
             "and variate change together), which the sparse push filters do not encode"),
            ("ps.servers", one_of(0), "the server variate lives on rank 0"),
            ("ps.pull", one_of("full"), "the server variate goes with every full model "
             "download, which working-set pulls replace"),
            ("fedprox.enabled", one_of(False), "SCAFFOLD and FedProx are alternative "
             "corrections of client drift"),
        )
    )  # fmt: skip

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["scaffold"]["enabled"])


__all__ = ["Scaffold"]
