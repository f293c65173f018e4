"""Pure (no MPI) training and evaluation helpers called by the runtime.

Fast path: a ``TensorDataset`` (or a ``Subset`` of one) is indexed directly with index
tensors; any other ``Dataset`` goes through a ``DataLoader`` that visits samples in the same
order. Both paths draw shuffles as ``torch.randperm(n, generator=generator)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from edgefl.errors import ConfigError


def loss_fn(logits: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Mean cross-entropy (nats per sample, or per token for ``task == "lm"``).

    For "lm", logits (B, T, V) and targets (B, T) are flattened to (B*T, V) and (B*T,).
    """
    if task == "lm":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    if task == "classification":
        return F.cross_entropy(logits, y)
    raise ConfigError(f"task: expected 'classification' or 'lm', got {task!r}")


def as_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(X, Y) for a TensorDataset or (nested) Subset of one; None for other datasets."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0], dataset.tensors[1]
    if isinstance(dataset, Subset):
        inner = as_tensors(dataset.dataset)
        if inner is not None:
            idx = torch.as_tensor(dataset.indices, dtype=torch.long)
            return inner[0][idx], inner[1][idx]
    return None


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
) -> tuple[float, float]:
    """Mean cross-entropy loss (nats) and accuracy (fraction in [0, 1]) of ``model``.

    For "lm" both are per token. ``batch_size`` 0 evaluates in one batch. Returns
    (nan, nan) for an empty dataset. The model's train/eval mode is restored afterwards.
    """
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        return math.nan, math.nan
    bs = _batches(batch_size, n)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    try:
        tensors = as_tensors(dataset)
        if tensors is not None:
            X, Y = tensors
            batches: Iterator = ((X[i : i + bs], Y[i : i + bs]) for i in range(0, n, bs))
        else:
            batches = iter(DataLoader(dataset, batch_size=bs, shuffle=False))
        for xb, yb in batches:
            xb = xb.to(device, non_blocking=True)
            yb = yb.to(device, non_blocking=True)
            logits = model(xb)
            if task == "lm":
                logits = logits.reshape(-1, logits.shape[-1])
                yb = yb.reshape(-1)
            elif task != "classification":
                raise ConfigError(f"task: expected 'classification' or 'lm', got {task!r}")
            loss_sum += F.cross_entropy(logits, yb, reduction="sum")
            correct += (logits.argmax(dim=-1) == yb).sum()
            count += yb.numel()
    finally:
        model.train(was_training)
    if count == 0:
        return math.nan, math.nan
    return loss_sum.item() / count, correct.item() / count


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
) -> tuple[float, int]:
    """Run plain SGD on ``dataset`` and return (mean training loss, samples processed).

    If ``steps > 0`` exactly ``steps`` mini-batch steps are taken, cycling through freshly
    shuffled epochs (the last batch of an epoch may be short); otherwise ``epochs`` full
    passes. ``batch_size`` 0 means full batch (no shuffle needed). ``lr`` is the step size,
    ``momentum`` and ``weight_decay`` are the torch SGD coefficients; a fresh optimizer is
    made each call, so no state carries over. The loss is the mean over the steps taken (nats
    per sample, per token for "lm"); 0.0 with 0 samples if no step was taken. Samples are
    counted per sequence for "lm". The model is left in train mode.
    """
    if steps < 0 or epochs < 0:
        raise ValueError(f"steps and epochs must be >= 0, got steps={steps}, epochs={epochs}")
    if task not in ("classification", "lm"):
        raise ConfigError(f"task: expected 'classification' or 'lm', got {task!r}")
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0 or (steps == 0 and epochs == 0):
        return 0.0, 0
    bs = _batches(batch_size, n)
    per_epoch = -(-n // bs)
    total_steps = steps if steps > 0 else epochs * per_epoch

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    losses: list[torch.Tensor] = []
    samples = 0

    tensors = as_tensors(dataset)
    if tensors is not None:
        X = tensors[0].to(device)
        Y = tensors[1].to(device)
        batches = _tensor_batches(X, Y, n, bs, total_steps, generator)
    else:
        batches = _loader_batches(dataset, n, bs, total_steps, generator, device)

    for xb, yb in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb, task)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        samples += yb.shape[0]
    if not losses:
        return 0.0, 0
    return torch.stack(losses).mean().item(), samples


def _tensor_batches(
    X: torch.Tensor,
    Y: torch.Tensor,
    n: int,
    bs: int,
    total_steps: int,
    generator: torch.Generator,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches by direct indexing; a new permutation at the start of every epoch."""
    if bs >= n:
        for _ in range(total_steps):
            yield X, Y
        return
    dev = X.device
    taken = 0
    while taken < total_steps:
        perm = torch.randperm(n, generator=generator).to(dev)
        for idx in perm.split(bs):
            if taken == total_steps:
                return
            yield X.index_select(0, idx), Y.index_select(0, idx)
            taken += 1


def _loader_batches(
    dataset: Dataset,
    n: int,
    bs: int,
    total_steps: int,
    generator: torch.Generator,
    device: str | torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Same visiting order as ``_tensor_batches``, through a DataLoader for generic datasets."""
    taken = 0
    while taken < total_steps:
        order = list(range(n)) if bs >= n else torch.randperm(n, generator=generator).tolist()
        for xb, yb in DataLoader(dataset, batch_size=bs, sampler=order):
            if taken == total_steps:
                return
            yield xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            taken += 1
