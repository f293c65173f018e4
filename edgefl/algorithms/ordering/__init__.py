"""Example ordering: CD-GraB, D-RR and ID-GraB (``algorithm.ordering``; docs/ordering.md).

- :mod:`.orderers`: the pure balancing (PairBalance, sketches, the streamed epoch);
- :mod:`.coordinator`: rank 0 balances the devices' gradient rows as they arrive and sends
  every device its next-epoch order (ORDER);
- :mod:`.worker`: a device trains one epoch in the order it got and ships its per-example
  gradients (GRADS).
"""

from __future__ import annotations

from ...errors import ConfigError
from ..base import Plugin
from .coordinator import OrderingCoordinator
from .orderers import make_cfg_orderer
from .worker import OrderingWorker


class Ordering(Plugin):
    """``algorithm.ordering`` = ``rr`` | ``id-grab`` | ``id-grab-bal`` | ``cd-grab``."""

    name = "ordering"
    coordinator = OrderingCoordinator
    worker = OrderingWorker
    summary_keys = {"ordering": None}

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["algorithm"]["ordering"] != "none"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """Example ordering needs synchronous epochs: one epoch per task, every device, BSP."""
        make_cfg_orderer(cfg)
        need = {
            "algorithm.consistency": (cfg["algorithm"]["consistency"], "bsp"),
            "server.participation": (cfg["server"]["participation"], 1.0),
            "train.local_epochs": (cfg["train"]["local_epochs"], 1),
            "train.local_steps": (cfg["train"]["local_steps"], 0),
            "algorithm.gate": (cfg["algorithm"]["gate"], "always"),
            "algorithm.allocation": (cfg["algorithm"]["allocation"], "fixed"),
        }
        for key, (got, want) in need.items():
            if got != want:
                raise ConfigError(
                    f"config key '{key}' = {got!r}: algorithm.ordering = "
                    f"{cfg['algorithm']['ordering']!r} needs {want!r} (one synchronous epoch "
                    "per round on every device)"
                )


__all__ = ["Ordering", "make_cfg_orderer"]
