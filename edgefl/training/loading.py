"""Loading the client ``train.client`` names, and checking what its ``fit`` returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..specs import import_spec
from .client import FitResult
from .trainer import DefaultClient


def load_client(spec: str) -> Callable[..., Any]:
    """The ``fit`` callable ``train.client`` names ("" = the built-in trainer)."""
    if not spec:
        return DefaultClient().fit
    obj = import_spec(spec, "train.client")
    if isinstance(obj, type):
        try:
            inst = obj()
        except Exception as e:  # a client class that cannot be built: one line
            raise ConfigError(
                f"config key 'train.client': {spec!r}() failed: {type(e).__name__}: {e}"
            ) from None
        fit = getattr(inst, "fit", None)
        if not callable(fit):
            raise ConfigError(f"config key 'train.client': class {spec!r} has no fit method")
        return fit
    return obj


def check_result(got: Any, spec: str, device: int) -> FitResult:
    """A client's return value as a FitResult; ConfigError naming the client and device."""
    where = f"train.client {spec or 'built-in'!r} on device {device}"
    if isinstance(got, FitResult):
        res = got
    elif isinstance(got, dict) and "samples" in got and "loss" in got:
        extra = {k: v for k, v in got.items() if k not in ("samples", "loss", "metrics")}
        extra.update(got.get("metrics") or {})
        res = FitResult(got["samples"], got["loss"], extra)
    else:
        raise ConfigError(
            f"{where}: fit returned {type(got).__name__}; return a FitResult or a dict with "
            "'samples' and 'loss'"
        )
    try:
        samples, loss = int(res.samples), float(res.loss)
        metrics = {str(k): float(v) for k, v in (res.metrics or {}).items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: fit returned a non-numeric value ({e})") from None
    if samples < 0:
        raise ConfigError(f"{where}: fit returned samples = {samples} (< 0)")
    if not all(math.isfinite(v) for v in metrics.values()):
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        raise ConfigError(f"{where}: metric(s) {', '.join(bad)} are not finite")
    return FitResult(samples, loss, metrics)


def check_training(cfg: dict, task: Any) -> None:
    """Before any rank starts: the loss, the optimizer and the client of ``cfg`` load, the
    model runs forward on two training examples of device 0 and the loss accepts its
    output (a one-line ConfigError naming the key otherwise). ``task``: what
    :func:`edgefl.runtime.state.build_task` returns.
    """
    import torch

    from .losses import resolve_loss
    from .optim import check_optimizer

    tr = cfg["train"]
    loss = resolve_loss(tr["loss"], task.data.info.task)
    check_optimizer(tr)
    load_client(tr["client"])
    ds = task.data.train(0)
    if len(ds) == 0:
        return
    items = [ds[i] for i in range(min(2, len(ds)))]
    x = torch.stack([torch.as_tensor(a[0]) for a in items])
    y = torch.stack([torch.as_tensor(a[1]) for a in items])
    try:
        with torch.no_grad():
            out = task.model(x)
    except Exception as e:  # the model cannot run on the data: one line
        raise ConfigError(
            f"config key 'model.name' = {cfg['model']['name']!r}: forward fails on two "
            f"training examples {tuple(x.shape)} of device 0: {type(e).__name__}: {e}"
        ) from None
    try:
        with torch.no_grad():
            value = loss(out, y)
        if value.dim() != 0:
            raise ValueError(f"returned shape {tuple(value.shape)}, not a scalar (the mean)")
    except Exception as e:  # the loss does not fit the model or the data: one line
        raise ConfigError(
            f"config key 'train.loss' = {tr['loss']!r} ({loss.name}): fails on the model's "
            f"output {tuple(out.shape)} and targets {tuple(y.shape)} {y.dtype} of device 0: "
            f"{type(e).__name__}: {e}"
        ) from None
