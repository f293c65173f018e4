"""The fedeval plugin: its Plugin class (name, when it is on, its config check, its halves)."""

from __future__ import annotations

from ...errors import ConfigError
from ..base import Plugin
from .config import SECTIONS
from .coordinator import FedEvalCoordinator
from .metrics import load_metrics
from .worker import FedEvalWorker


class FederatedEvaluation(Plugin):
    """``evaluation.every = K > 0``: every K global versions each device evaluates the
    global model on its own held-out split (docs/evaluation.md)."""

    name = "fedeval"
    order = 110
    sections = SECTIONS
    coordinator = FedEvalCoordinator
    worker = FedEvalWorker
    summary_keys = {"fed_eval": None}

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["evaluation"]["every"] > 0

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """``evaluation.holdout`` in (0, 1) and every ``evaluation.metrics`` importable and
        callable (one-line ConfigError naming the key)."""
        h = cfg["evaluation"]["holdout"]
        if not 0.0 < h < 1.0:
            raise ConfigError(f"config key 'evaluation.holdout' = {h!r}: must be in (0, 1)")
        load_metrics(cfg["evaluation"]["metrics"])


__all__ = ["FederatedEvaluation"]
