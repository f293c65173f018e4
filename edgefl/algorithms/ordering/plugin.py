"""The ordering plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ..base import Plugin, Requirement, not_one_of, one_of
from .config import SECTIONS
from .coordinator import OrderingCoordinator
from .orderers import make_cfg_orderer
from .worker import OrderingWorker


class Ordering(Plugin):
    """``algorithm.ordering`` = ``rr`` | ``id-grab`` | ``id-grab-bal`` | ``cd-grab``."""

    name = "ordering"
    order = 80
    sections = SECTIONS
    coordinator = OrderingCoordinator
    worker = OrderingWorker
    summary_keys = {"ordering": None}

    # one synchronous epoch per round on every device, in the order rank 0 balanced from
    # every device's gradients of the round before
    requires = tuple(
        Requirement("algorithm.ordering", not_one_of("none"), key, one_of(want), why)
        for key, want, why in (
            ("algorithm.consistency", "bsp", "the next orders are balanced from every "
             "device's gradients of the round (one synchronous epoch per round on every "
             "device); an asynchronous policy has no round to balance"),
            ("server.participation", 1.0, "the orders are balanced over every device's "
             "gradients of the round; a device sampled out would leave its rows missing"),
            ("train.local_epochs", 1, "an order covers one epoch and the next order is "
             "balanced from that epoch's gradients"),
            ("train.local_steps", 0, "a task must run its whole epoch in the order (a step "
             "limit would cut it short)"),
            ("algorithm.gate", "always", "a gated device runs a varying number of local "
             "iterations per push, not one epoch per round"),
            ("algorithm.allocation", "fixed", "an order is a permutation of the device's "
             "training split, whose size Hermes allocation changes between rounds"),
            ("train.client", "", "the ordered epoch is the plugin's own loop (it takes every "
             "example's gradient as it visits it, with train.loss and train.optimizer); a "
             "user client would not be called"),
        )
    )  # fmt: skip

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["algorithm"]["ordering"] != "none"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """The orderer's own options (``ordering.*``); what ordering needs of the other
        keys is in :attr:`requires`."""
        make_cfg_orderer(cfg)


__all__ = ["Ordering", "make_cfg_orderer"]
