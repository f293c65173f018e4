"""What a model with float buffers cannot run with, checked before any rank starts (pure).

The checks need the model (does it have persistent float buffers?), so they cannot be
declared as :class:`~edgefl.algorithms.base.Requirement` data; :func:`check_buffers` builds
the model only when the config sets one of the keys below.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError

_NOT_WEIGHTS = "running statistics are not weights"


def conflicts(cfg: dict) -> list[tuple[str, Any, str]]:
    """(config key, its value, why) of every setting of ``cfg`` that float buffers cannot
    run with under its ``model.buffers`` mode (empty: nothing to check)."""
    local = cfg["model"]["buffers"] == "local"
    out: list[tuple[str, Any, str]] = []
    if cfg["dp"]["enabled"]:
        why = (
            "DP-FedAvg adds Gaussian noise to every coordinate of the mean update, so the "
            "global running statistics would move"
            + ("" if local else " at random and a running variance can turn negative")
        )
        out.append(("dp.enabled", True, why))
    if cfg["server"]["l1"] > 0:
        why = f"the L1 prox shrinks every coordinate towards 0 and {_NOT_WEIGHTS}"
        out.append(("server.l1", cfg["server"]["l1"], why))
    if cfg["algorithm"]["ordering"] != "none":
        why = (
            "example ordering needs per-example gradients, which batch statistics "
            "(BatchNorm couples the examples of a batch) do not define"
        )
        out.append(("algorithm.ordering", cfg["algorithm"]["ordering"], why))
    if not local and cfg["server"]["optimizer"] != "sgd":
        why = (
            "a momentum or adaptive step moves the federated running statistics past the "
            "devices' mean (a running variance can turn negative); use model.buffers = "
            "'local', where their updates are zero"
        )
        out.append(("server.optimizer", cfg["server"]["optimizer"], why))
    return out


def buffer_names_of(cfg: dict) -> list[str]:
    """Names of the float buffers the flat vector of ``cfg``'s model holds (builds the
    model on the CPU, with the data source's info)."""
    import torch

    from ...data import load_federated
    from ...models import build_model
    from ...models.flat import float_buffers

    data = load_federated(
        cfg["data"]["source"], dict(cfg["data"]["args"]), cfg["fleet"]["devices"], cfg["seed"]
    )
    with torch.no_grad():
        model = build_model(
            cfg["model"]["name"], data.info, dict(cfg["model"]["args"]), cfg["seed"]
        )
    return [n for n, _ in float_buffers(model)]


def check_buffers(cfg: dict, names: list[str] | None = None) -> None:
    """Raise the one-line ConfigError of the first setting of ``cfg`` that the model's float
    buffers cannot run with (``names``: the buffer names, None = build the model to see)."""
    found = conflicts(cfg)
    if not found:
        return
    names = buffer_names_of(cfg) if names is None else names
    if not names:
        return
    key, value, why = found[0]
    shown = "true" if value is True else repr(value)
    more = f", ... ({len(names)} in all)" if len(names) > 2 else ""
    raise ConfigError(
        f"config key '{key}' = {shown}: cannot run with model.buffers = "
        f"'{cfg['model']['buffers']}' and a model with float buffers "
        f"({', '.join(names[:2])}{more}) because {why}"
    )


__all__ = ["buffer_names_of", "check_buffers", "conflicts"]
