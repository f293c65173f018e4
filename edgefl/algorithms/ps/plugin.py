"""The ps plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ..base import Plugin, Requirement, above, has, not_one_of, one_of
from .config import SECTIONS
from .coordinator import PSCoordinator
from .filters import make_ps_filter_chain
from .worker import PSWorker
from .workset import WORKING_SET_MODELS, working_set_pulls


class ParameterServer(Plugin):
    """On with ``ps.sparse = true`` or ``ps.pull = "working-set"``."""

    name = "ps"
    order = 70
    sections = SECTIONS
    coordinator = PSCoordinator
    worker = PSWorker
    summary_keys = {"ps": None, "sparse_resends": 0}
    requires = (
        Requirement(
            "ps.filters", not_one_of([]), "ps.sparse", one_of(True),
            "filters act on sparse pushes (they choose the entries a SPARSE message carries)",
        ),
        Requirement(
            "ps.filters", has("kkt"), "server.l1", above(0),
            "the kkt filter holds back the entries the L1 prox at the server would keep at "
            "zero (|gradient| <= server.l1 at a zero weight), so it needs that threshold",
        ),
        Requirement(
            "ps.sparse", one_of(True), "algorithm.residual", one_of("none"),
            "GDDR sends every update as its own RESIDUAL message (the released part), so "
            "no sparse push would be made",
        ),
        Requirement(
            "ps.pull", one_of("working-set"), "train.weight_decay", one_of(0.0),
            "weight decay moves weights outside a device's working set, which it does not "
            "pull",
        ),
        Requirement(
            "ps.debug_bad_working_set", not_one_of("none"), "ps.pull", one_of("working-set"),
            "the hook corrupts the WORKSET message, which only working-set pulls send",
        ),
        Requirement(
            "ps.debug_bad_working_set", not_one_of("none"), "model.name",
            one_of(*WORKING_SET_MODELS),
            "only the listed models' workers compute a working set (any other model pulls "
            "every key)",
        ),
    )  # fmt: skip

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["ps"]["sparse"]) or cfg["ps"]["pull"] != "full"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """The filter chain's options (what the push/pull options need of the other keys
        is in :attr:`requires`)."""
        check_ps(cfg)


def check_ps(cfg: dict) -> None:
    """The ``[ps]`` push/pull options: :attr:`ParameterServer.requires` (checked for every
    config: a filter without sparse pushes is an error even though the plugin is then off)
    and the filter chain's options."""
    from .. import check_requirements

    check_requirements(cfg, [(ParameterServer.name, r) for r in ParameterServer.requires])
    if cfg["ps"]["sparse"]:
        make_ps_filter_chain(cfg)


__all__ = ["ParameterServer", "check_ps", "make_ps_filter_chain", "working_set_pulls"]
