"""Parameter-server pushes and pulls (Li et al., OSDI 2014; docs/parameter-server.md):
filtered, compressed updates (``ps.sparse``, ``ps.filters``: significantly-modified, KKT,
error feedback; index/value or dense encodings, fp16/bf16 values, key caching with RESEND)
and working-set pulls (``ps.pull = "working-set"``: MODEL_KEYS down, WORKSET up).

- pure modules: :mod:`.compress`, :mod:`.filters`, :mod:`.workset`; key ranges and layouts
  in :mod:`edgefl.policies.keyrange`;
- :mod:`.coordinator` and :mod:`.worker`: the two halves. (The sharded server group is a
  server backend: :mod:`edgefl.server.sharded`.)
"""

from __future__ import annotations

from ...errors import ConfigError
from ..base import Plugin
from .coordinator import PSCoordinator
from .filters import make_ps_filter_chain
from .worker import PSWorker
from .workset import WORKING_SET_MODELS, working_set_pulls


class ParameterServer(Plugin):
    """On with ``ps.sparse = true`` or ``ps.pull = "working-set"``."""

    name = "ps"
    coordinator = PSCoordinator
    worker = PSWorker
    summary_keys = {"ps": None, "sparse_resends": 0}

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["ps"]["sparse"]) or cfg["ps"]["pull"] != "full"

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """Filters need sparse pushes, the KKT filter needs ``server.l1 > 0``, working-set
        pulls need ``train.weight_decay = 0``."""
        check_ps(cfg)


def check_ps(cfg: dict) -> None:
    """The ``[ps]`` push/pull options (see :class:`ParameterServer`); run for every config
    (a filter without sparse pushes is an error even though the plugin is then off)."""
    ps = cfg["ps"]
    if ps["filters"] and not ps["sparse"]:
        raise ConfigError(
            f"config key 'ps.filters' = {list(ps['filters'])!r}: filters act on sparse pushes; "
            "set ps.sparse = true"
        )
    if "kkt" in ps["filters"] and not cfg["server"]["l1"] > 0:
        raise ConfigError(
            f"config key 'ps.filters' = {list(ps['filters'])!r}: the kkt filter tests against "
            f"server.l1 = {cfg['server']['l1']!r}; set server.l1 > 0 (the L1 prox threshold)"
        )
    if ps["sparse"]:
        if cfg["algorithm"]["residual"] != "none" or cfg["algorithm"]["gate"] != "always":
            raise ConfigError(
                "config key 'ps.sparse' = true: combine it with algorithm.residual = 'none' "
                "and algorithm.gate = 'always'"
            )
        make_ps_filter_chain(cfg)
    if ps["pull"] == "working-set" and cfg["train"]["weight_decay"] > 0:
        raise ConfigError(
            f"config key 'ps.pull' = 'working-set': needs train.weight_decay = 0 (got "
            f"{cfg['train']['weight_decay']!r}); weight decay moves weights outside a device's "
            "working set, which it does not pull"
        )
    if ps["debug_bad_working_set"] != "none" and not working_set_pulls(cfg):
        raise ConfigError(
            f"config key 'ps.debug_bad_working_set' = {ps['debug_bad_working_set']!r}: needs "
            f"ps.pull = 'working-set' and model.name in {WORKING_SET_MODELS} (got "
            f"{ps['pull']!r}, {cfg['model']['name']!r})"
        )


__all__ = ["ParameterServer", "check_ps", "make_ps_filter_chain", "working_set_pulls"]
