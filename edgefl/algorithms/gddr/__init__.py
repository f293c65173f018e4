"""GDDR: per-device residual buffers with delayed, sum-preserving release
(``algorithm.residual = "gddr"``; docs/gddr.md).

- pure modules: the rule (:mod:`.residual`), its tau controllers (:mod:`.tau`), the replay
  of dead devices' residuals (:mod:`.replay`), residual checkpoints (:mod:`.store`);
- :mod:`.coordinator`: decodes RESIDUAL messages, replays a dead device's last residual
  checkpoint, adapts tau, and collects every residual at the end (the flush);
- :mod:`.worker`: each device's residual, its releases (RESIDUAL) and its HDF5 residual
  checkpoints.
"""

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
