"""Build the configured policy objects (and so validate their config before a run)."""

from __future__ import annotations

import numpy as np

from ..policies.aggregation import Aggregator, make_aggregator


def make_update_aggregator(cfg: dict, num_devices: int) -> Aggregator:
    """The aggregator named by ``algorithm.aggregation`` with its options."""
    name = cfg["algorithm"]["aggregation"]
    if cfg["dp"]["enabled"]:
        from ..policies.dp import DPFedAvg

        return DPFedAvg.from_config(cfg)
    if name in ("loss-weighted", "loss-softmax"):
        from ..policies.loss_weighted import make_loss_aggregator

        return make_loss_aggregator(name, cfg["hermes"])
    return make_aggregator(name, expected_updates=num_devices, **cfg["robust"])


def check_policies(cfg: dict) -> None:
    """Construct every configured policy once, so bad parameters fail with a one-line
    ConfigError naming the key before any MPI rank starts."""
    from ..errors import ConfigError
    from ..policies.allocation import make_allocator
    from ..policies.consistency import make_consistency
    from ..policies.gate import make_gate

    n = cfg["fleet"]["devices"]
    if cfg["algorithm"]["gate"] == "hermes" and not cfg["hermes"]["wait_for_model"]:
        raise ConfigError(
            "config key 'hermes.wait_for_model' = false: not supported yet (a device waits "
            "for the new global model after each push)"
        )
    make_update_aggregator(cfg, n)
    check_ordering(cfg)
    check_ps(cfg)
    check_shards(cfg)
    make_gate(cfg["algorithm"]["gate"], cfg["hermes"])
    make_allocator(cfg["algorithm"]["allocation"], cfg["allocation"], cfg["train"]["local_epochs"])
    make_consistency(cfg, {d: 1 for d in range(n)})
    if cfg["algorithm"]["residual"] == "gddr":
        from ..policies.residual import GDDRResidual

        g = cfg["gddr"]
        GDDRResidual(
            1, 0, cfg["seed"], alpha=g["alpha"], tau=g["tau"], installments=g["installments"],
            installment_ratio=g["installment_ratio"],
        )  # fmt: skip


def check_ps(cfg: dict) -> None:
    """Parameter-server options (``[ps]``): filters need sparse pushes, the KKT filter needs
    ``server.l1 > 0``, working-set pulls need ``train.weight_decay = 0``."""
    from ..errors import ConfigError

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


# What a sharded server group (``ps.servers > 0``) supports: config key -> (allowed values,
# what to say). Everything else is rank-0-only machinery (not built for shards yet).
SHARD_NEEDS: dict[str, tuple[tuple, str]] = {
    "algorithm.consistency": (("bsp",), "'bsp'"),
    "algorithm.aggregation": (("sample-weighted", "mean"), "'sample-weighted' or 'mean'"),
    "algorithm.gate": (("always",), "'always'"),
    "algorithm.residual": (("none",), "'none'"),
    "algorithm.ordering": (("none",), "'none'"),
    "robust.norm_bound": ((0.0, 0), "0"),
    "robust.norm_bound_relative": ((0.0, 0), "0"),
    "dp.enabled": ((False,), "false"),
    "ps.sparse": ((False,), "false"),
    "ps.pull": (("full",), "'full'"),
    "server.optimizer": (("sgd",), "'sgd'"),
    "server.l1": ((0.0, 0), "0"),
}


def check_shards(cfg: dict, ranks: int | None = None) -> None:
    """``ps.servers = S > 0`` (a sharded server group): only BSP with a weighted-mean
    aggregation and a plain SGD server step is supported (the shards aggregate their key
    ranges elementwise); ``ranks`` (MPI ranks of the job, None = not known yet) must leave
    at least one worker rank after rank 0 and the S shards. ``ps.replicas = k`` must be
    1 <= k <= S (k = 1 without shards)."""
    from ..errors import ConfigError

    servers = cfg["ps"]["servers"]
    k = cfg["ps"].get("replicas", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > max(servers, 1):
        most = f"<= ps.servers = {servers}" if servers > 0 else "1 with ps.servers = 0"
        raise ConfigError(f"config key 'ps.replicas' = {k!r}: must be an integer >= 1 and {most}")
    if servers <= 0:
        return
    bad = []
    for key, (allowed, say) in SHARD_NEEDS.items():
        a, b = key.split(".")
        got = cfg[a][b]
        if got not in allowed:
            bad.append(f"{key} = {got!r} (needs {say})")
    if bad:
        raise ConfigError(
            f"config key 'ps.servers' = {servers}: not supported yet with " + "; ".join(bad)
        )
    if ranks is not None and ranks < servers + 2:
        raise ConfigError(
            f"config key 'ps.servers' = {servers}: needs at least {servers + 2} MPI ranks "
            f"(coordinator + {servers} shards + 1 worker), got {ranks}"
        )


def make_ps_filter_chain(cfg: dict, quantize=None, exempt=None):
    """A device's filter chain (``ps.filters``); the KKT filter's threshold is ``server.l1``
    (delta units: the worker scales its gradients by ``train.lr`` x local steps)."""
    from ..policies.filters import make_filter_chain

    return make_filter_chain({**cfg["ps"], "l1": cfg["server"]["l1"]}, quantize, exempt)


# Models whose working set the worker computes (``ps.pull = "working-set"``): a linear layer
# over input features. Any other model's working set is every key (it pulls the full model).
WORKING_SET_MODELS = ("logreg",)


def working_set_pulls(cfg: dict) -> bool:
    """Does rank 0 send workers only the values at their devices' working sets?"""
    return cfg["ps"]["pull"] == "working-set" and cfg["model"]["name"] in WORKING_SET_MODELS


def device_working_set(layout, dataset) -> np.ndarray:
    """Sorted int64 keys a ``logreg`` device's data can touch: the ``linear.weight`` columns
    of the features that are nonzero in any of its examples, plus ``linear.bias``
    (:func:`edgefl.policies.keyrange.linear_working_set`).

    Args:
        layout: the model's :class:`~edgefl.policies.keyrange.ParamLayout`.
        dataset: the device's training examples: ``clicks`` examples (a ``csr`` matrix) or
            any dataset of ``(x, y)`` pairs (x flattened as ``logreg`` does).
    """
    import torch

    from ..data.base import dataset_tensors
    from ..policies.keyrange import csr_columns, linear_working_set

    csr = getattr(dataset, "csr", None)
    if csr is not None:
        cols = csr_columns(csr)
    else:
        x = dataset_tensors(dataset, "working set")[0]
        x = x.reshape(x.shape[0], -1)
        cols = torch.nonzero((x != 0).any(dim=0)).reshape(-1).numpy().astype(np.int64)
    return linear_working_set(layout, "linear.weight", cols, dense=["linear.bias"]).keys


def make_update_filter(cfg: dict, numel: int):
    """The norm-bound / finiteness filter of ``[robust]`` (None when no bound is set)."""
    from ..policies.robust import UpdateFilter

    r = cfg["robust"]
    if not (r["norm_bound"] or r["norm_bound_relative"]):
        return None
    return UpdateFilter.from_options(numel=numel, **r)


def make_cfg_orderer(cfg: dict):
    """The example orderer of ``algorithm.ordering`` (None for "none")."""
    name = cfg["algorithm"]["ordering"]
    if name == "none":
        return None
    from ..policies.ordering import make_orderer

    o = cfg["ordering"]
    return make_orderer(
        name, cfg["seed"], o["sketch_dim"], o["unit"], o["microbatch"], o["sketch_kind"]
    )


def check_ordering(cfg: dict) -> None:
    """Example ordering needs synchronous epochs: one epoch per task, every device, BSP."""
    from ..errors import ConfigError

    if cfg["algorithm"]["ordering"] == "none":
        return
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
                f"{cfg['algorithm']['ordering']!r} needs {want!r} (one synchronous epoch per "
                "round on every device)"
            )
