"""Pure (no MPI) training and evaluation helpers called by the runtime.

Fast path: a ``TensorDataset`` (or a ``Subset`` of one) is indexed directly with index
tensors; any other ``Dataset`` goes through a ``DataLoader`` that visits samples in the same
order. Both paths draw shuffles as ``torch.randperm(n, generator=generator)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from edgefl.data.base import TASKS
from edgefl.errors import ConfigError
from edgefl.training.losses import Loss, resolve_loss
from edgefl.training.trainer import ordered_batches


def loss_fn(logits: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Mean loss of the ``train.loss = "auto"`` choice for ``task`` (cross-entropy in nats
    per sample, or per token for "lm"; mse for regression; bce-with-logits for binary).

    For "lm", logits (B, T, V) and targets (B, T) are flattened to (B*T, V) and (B*T,).
    """
    if task not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    return resolve_loss("auto", task)(logits, y)


def _batches(batch_size: int, n: int) -> int:
    """Effective batch size: 0 (or anything >= n) means the full dataset."""
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return n if batch_size == 0 or batch_size >= n else batch_size


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    task: str,
    batch_size: int = 1024,
    device: str | torch.device = "cpu",
    loss: Loss | None = None,
) -> tuple[float, float]:
    """Mean loss and accuracy (fraction in [0, 1]; nan for regression) of ``model``.

    ``loss`` is the training loss (:func:`edgefl.training.resolve_loss`; default the one
    ``train.loss = "auto"`` picks for ``task``): the mean loss is its per-example sum over
    the dataset divided by the number of terms (per token for "lm"). ``batch_size`` 0
    evaluates in one batch. Returns (nan, nan) for an empty dataset. The model's train/eval
    mode is restored afterwards.
    """
    loss = loss if loss is not None else resolve_loss("auto", task)
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        return math.nan, math.nan
    bs = _batches(batch_size, n)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    predicted = 0
    try:
        batches: Iterator | None = ordered_batches(dataset, bs)  # (in memory or on disk)
        if batches is None:
            batches = iter(DataLoader(dataset, batch_size=bs, shuffle=False))
        for xb, yb in batches:
            xb = xb.to(device, non_blocking=True)
            yb = yb.to(device, non_blocking=True)
            out = model(xb)
            total, k = loss.total(out, yb)
            loss_sum += total
            count += k
            right, m = loss.correct(out, yb)
            if m:
                correct += right
                predicted += m
    finally:
        model.train(was_training)
    if count == 0:
        return math.nan, math.nan
    return loss_sum.item() / count, (correct.item() / predicted if predicted else math.nan)


def local_train(
    model: nn.Module,
    dataset: Dataset,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    generator: torch.Generator,
    task: str,
    device: str | torch.device = "cpu",
    loss: Loss | None = None,
) -> tuple[float, int]:
    """Run plain SGD on ``dataset`` and return (mean training loss, samples processed).

    The built-in trainer (:func:`edgefl.training.fit_loop`) with torch SGD and ``loss``
    (default: the loss ``train.loss = "auto"`` picks for ``task``). If ``steps > 0``
    exactly ``steps`` mini-batch steps are taken, cycling through freshly shuffled epochs
    (the last batch of an epoch may be short); otherwise ``epochs`` full passes.
    ``batch_size`` 0 means full batch. ``lr`` is the step size, ``momentum`` and
    ``weight_decay`` the torch SGD coefficients; a fresh optimizer is made each call. The
    loss is the mean over the steps taken; 0.0 with 0 samples if no step was taken.
    """
    from ..training.client import FitContext
    from ..training.trainer import fit_loop

    if steps < 0 or epochs < 0:
        raise ValueError(f"steps and epochs must be >= 0, got steps={steps}, epochs={epochs}")
    if task not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    loss = loss if loss is not None else resolve_loss("auto", task)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    ctx = FitContext(-1, 0, 0, generator, str(device), loss, torch.optim.SGD)
    return fit_loop(
        model, dataset, epochs=epochs, steps=steps, batch_size=batch_size,
        generator=generator, optimizer=opt, ctx=ctx, device=device,
    )  # fmt: skip
