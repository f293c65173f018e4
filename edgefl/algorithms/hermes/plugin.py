"""The hermes plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ..base import Plugin, Requirement, not_one_of, one_of
from .config import SECTIONS
from .coordinator import HermesCoordinator
from .worker import HermesWorker


class Hermes(Plugin):
    """Always on: its metrics are every run's; its gate, allocation and loss-weighted
    aggregation act when the config selects them."""

    name = "hermes"
    order = 50
    sections = SECTIONS
    coordinator = HermesCoordinator
    worker = HermesWorker
    summary_keys = {"hermes": None}
    requires = (
        Requirement(
            "algorithm.gate", one_of("hermes"), "hermes.wait_for_model", one_of(True),
            "a gated device waits for the new global model after each push (going on "
            "training without it is not built)",
        ),
        Requirement(
            "algorithm.aggregation", one_of("loss-weighted", "loss-softmax"),
            "algorithm.consistency", not_one_of("fedasync"),
            "FedAsync mixes each arriving model in (x <- (1 - a) x + a x_new) without an "
            "aggregation step, so the loss weights would never be used",
        ),
    )  # fmt: skip

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        from edgefl.algorithms.hermes.allocation import make_allocator
        from edgefl.algorithms.hermes.gate import make_gate

        make_gate(cfg["algorithm"]["gate"], cfg["hermes"])
        a = cfg["algorithm"]
        make_allocator(a["allocation"], cfg["allocation"], cfg["train"]["local_epochs"])


__all__ = ["Hermes"]
