"""The built-in trainer: mini-batch training with the configured loss and optimizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from .client import FitContext, FitResult, FitTask
from .eager import optimizer_step, zero_grad


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


def ordered_batches(
    dataset: Dataset, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(x, y)`` batches of ``batch_size`` rows in order, without a DataLoader (which draws
    a seed from torch's global random stream): slices of a TensorDataset (or Subset of one)
    in memory, or the same batches read from a test set on disk
    (:class:`edgefl.data.spill.SpilledTensors`); None for any other dataset."""
    from ..data.spill import SpilledTensors

    if isinstance(dataset, SpilledTensors):
        return dataset.batches(batch_size)
    tensors = as_tensors(dataset)
    if tensors is None:
        return None
    X, Y = tensors
    return ((X[i : i + batch_size], Y[i : i + batch_size]) for i in range(0, len(X), batch_size))


def plan_steps(epochs: int, steps: int, batch_size: int, n: int) -> tuple[int, int]:
    """(batch size, optimizer steps) of a task on ``n`` examples: ``steps`` when above 0,
    else ``epochs`` passes; ``batch_size`` 0 or ``>= n`` is the full batch; (0, 0) when
    ``n`` is 0 or there is nothing to do."""
    if n == 0 or (steps == 0 and epochs == 0):
        return 0, 0
    bs = n if batch_size == 0 or batch_size >= n else batch_size
    return bs, steps if steps > 0 else epochs * -(-n // bs)


def fit_loop(
    model: nn.Module,
    dataset: Dataset,
    *,
    epochs: int,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    optimizer: torch.optim.Optimizer,
    ctx: FitContext,
    device: str | torch.device = "cpu",
    order: np.ndarray | None = None,
) -> tuple[float, int]:
    """Train ``model`` in place; returns (mean loss over the steps taken, samples processed).

    If ``steps > 0`` exactly ``steps`` mini-batch steps are taken, cycling through epochs
    (the last batch of an epoch may be short); otherwise ``epochs`` full passes. Each epoch
    visits the examples in a fresh ``torch.randperm(n, generator=generator)`` order, or in
    ``order`` when given; ``batch_size`` 0 means full batch (no shuffle needed). Every step
    minimises ``ctx.objective`` and runs ``ctx.before_step`` between backward and step.
    The loss is 0.0 with 0 samples if no step was taken. The model is left in train mode.
    """
    if steps < 0 or epochs < 0:
        raise ValueError(f"steps and epochs must be >= 0, got steps={steps}, epochs={epochs}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    n = len(dataset)  # type: ignore[arg-type]
    bs, total_steps = plan_steps(epochs, steps, batch_size, n)
    if total_steps == 0:
        return 0.0, 0
    model.train()
    losses: list[torch.Tensor] = []
    samples = 0
    for xb, yb in batches(dataset, n, bs, total_steps, generator, device, order):
        zero_grad(optimizer)
        loss = ctx.objective(model, model(xb), yb)
        loss.backward()
        ctx.before_step(model)
        optimizer_step(optimizer)
        losses.append(loss.detach())
        samples += yb.shape[0]
    if not losses:
        return 0.0, 0
    return torch.stack(losses).mean().item(), samples


def batches(
    dataset: Dataset,
    n: int,
    bs: int,
    total_steps: int,
    generator: torch.Generator,
    device: str | torch.device,
    order: np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``total_steps`` mini-batches of ``bs`` examples on ``device``: a TensorDataset (or a
    Subset of one) is indexed directly, any other dataset goes through a DataLoader that
    visits the same examples in the same order."""
    tensors = as_tensors(dataset)
    if tensors is not None:
        X, Y = tensors[0].to(device), tensors[1].to(device)
    taken = 0
    while taken < total_steps:
        if order is not None:
            perm = torch.as_tensor(np.asarray(order), dtype=torch.long)
        elif bs >= n:
            perm = None
        else:
            perm = torch.randperm(n, generator=generator)
        if tensors is not None:
            if perm is None:
                chunks: Any = ((X, Y) for _ in range(total_steps - taken))
            else:
                p = perm.to(X.device)
                chunks = ((X.index_select(0, i), Y.index_select(0, i)) for i in p.split(bs))
        else:
            sampler = list(range(n)) if perm is None else perm.tolist()
            chunks = (
                (xb.to(device, non_blocking=True), yb.to(device, non_blocking=True))
                for xb, yb in DataLoader(dataset, batch_size=bs, sampler=sampler)
            )
        for xb, yb in chunks:
            if taken == total_steps:
                return
            yield xb, yb
            taken += 1


class DefaultClient:
    """The built-in client: :func:`fit_loop` with the configured loss and optimizer (a
    fresh optimizer each task, so no optimizer state carries over between rounds)."""

    def fit(self, model: nn.Module, dataset: Any, task: FitTask, ctx: FitContext) -> FitResult:
        params = [p for p in model.parameters() if p.requires_grad]
        loss, samples = fit_loop(
            model, dataset, epochs=task.epochs, steps=task.steps, batch_size=task.batch_size,
            generator=ctx.generator, optimizer=ctx.make_optimizer(params, task.lr), ctx=ctx,
            device=ctx.torch_device, order=task.order,
        )  # fmt: skip
        return FitResult(samples, loss)
