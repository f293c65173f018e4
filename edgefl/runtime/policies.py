"""Build the configured policy objects (and so validate their config before a run)."""

from __future__ import annotations

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
    ps = cfg["ps"]
    if ps["sparse"]:
        if "kkt" in ps["filters"]:
            raise ConfigError(
                "config key 'ps.filters' = ['kkt']: the KKT filter needs the loss gradient of "
                "an L1 sparse model; the runtime supports 'significant' (kkt: edgefl bench ps)"
            )
        if cfg["algorithm"]["residual"] != "none" or cfg["algorithm"]["gate"] != "always":
            raise ConfigError(
                "config key 'ps.sparse' = true: combine it with algorithm.residual = 'none' "
                "and algorithm.gate = 'always'"
            )
        from ..policies.filters import make_filter_chain

        make_filter_chain(ps)
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
