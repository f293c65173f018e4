"""Hermes (Basani et al., HiPC 2024; docs/hermes.md): significance-gated pushes
(``algorithm.gate = "hermes"``, HermesGUP), dynamic data allocation toward the median
iteration time (``algorithm.allocation = "hermes"``), loss-weighted aggregation
(``algorithm.aggregation = "loss-weighted" | "loss-softmax"``), and the WI / API-call
metrics every run reports under ``summary.json`` ``hermes``.

- pure modules: the gate (:mod:`.gate`), the allocator (:mod:`.allocation`), the
  loss-weighted aggregators (:mod:`.loss_weighted`), the metrics (:mod:`.metrics`);
- :mod:`.coordinator` and :mod:`.worker`: the two halves.
"""

from __future__ import annotations

from ...errors import ConfigError
from ..base import Plugin
from .coordinator import HermesCoordinator
from .worker import HermesWorker


class Hermes(Plugin):
    """Always on: its metrics are every run's; its gate, allocation and loss-weighted
    aggregation act when the config selects them."""

    name = "hermes"
    coordinator = HermesCoordinator
    worker = HermesWorker
    summary_keys = {"hermes": None}

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        from edgefl.algorithms.hermes.allocation import make_allocator
        from edgefl.algorithms.hermes.gate import make_gate

        if cfg["algorithm"]["gate"] == "hermes" and not cfg["hermes"]["wait_for_model"]:
            raise ConfigError(
                "config key 'hermes.wait_for_model' = false: not supported yet (a device "
                "waits for the new global model after each push)"
            )
        make_gate(cfg["algorithm"]["gate"], cfg["hermes"])
        a = cfg["algorithm"]
        make_allocator(a["allocation"], cfg["allocation"], cfg["train"]["local_epochs"])


__all__ = ["Hermes"]
