"""Local optimizers (``train.optimizer``) and the per-round learning rate
(``train.lr_schedule``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from ..errors import ConfigError
from ..specs import import_spec

OPTIMIZERS = ("sgd", "adam", "adamw")


def check_optimizer(train: dict) -> None:
    """Refuse a bad ``train.optimizer`` or Adam betas before any rank starts."""
    name = train["optimizer"]
    if name not in OPTIMIZERS:
        if ":" not in name:
            raise ConfigError(
                f"config key 'train.optimizer': {name!r} is not sgd, adam, adamw or "
                "'package.module:function'"
            )
        import_spec(name, "train.optimizer")
    for key in ("beta1", "beta2"):
        if not 0.0 <= train[key] < 1.0:
            raise ConfigError(f"config key 'train.{key}' = {train[key]}: must be in [0, 1)")


def optimizer_factory(
    train: dict,
) -> Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]:
    """``make(params, lr)`` building the optimizer ``train.optimizer`` names (fresh per task,
    so no optimizer state carries over between rounds)."""
    name = train["optimizer"]
    wd = train["weight_decay"]
    if name == "sgd":
        mom = train["momentum"]
        return lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=mom, weight_decay=wd)
    betas = (train["beta1"], train["beta2"])
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW

        def adam(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
            params = list(params)
            return cls(params, lr=lr, betas=betas, weight_decay=wd, fused=_fused(params))

        return adam
    user = import_spec(name, "train.optimizer")

    def make(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
        opt = user(list(params), lr, dict(train))
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"config key 'train.optimizer': {name!r} returned {type(opt).__name__}, "
                "not a torch.optim.Optimizer"
            )
        return opt

    return make


def _fused(params: list[torch.Tensor]) -> bool | None:
    """Adam/AdamW on the CPU take torch's fused kernel (``fused=True``): the same one on
    every x86-64 CPU. The default single-tensor step computes ``sqrt`` with MKL's vector
    math (VML), whose code path, and so the rounding, is chosen by CPU vendor and model
    even under ``MKL_CBWR=COMPATIBLE``: the same Adam job trained different models on an
    AMD EPYC and on an Intel Xeon (docs/reproducibility.md). The fused kernel computes the
    correctly rounded square root with torch's own vectorised code. Other devices keep
    torch's default (None)."""
    if params and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        return True
    return None


def make_optimizer(train: dict, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimizer of config section ``train`` over ``params`` with step size ``lr``."""
    return optimizer_factory(train)(params, lr)


def lr_at(train: dict, rounds: int, round_: int) -> float:
    """The learning rate of a task starting from global model version ``round_`` (0-based:
    the first round's tasks start from version 0) in a run of ``rounds`` rounds."""
    lr, kind, gamma = train["lr"], train["lr_schedule"], train["lr_gamma"]
    if kind == "constant":
        return lr
    if kind == "step":
        return lr * gamma ** (round_ // train["lr_step_rounds"])
    if kind == "exponential":
        return lr * gamma**round_
    if kind == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * min(round_, rounds) / max(rounds, 1)))
    raise ConfigError(f"config key 'train.lr_schedule': unknown schedule {kind!r}")
