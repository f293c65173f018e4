"""One local epoch in a given example order, recording each example's gradient (CD-GraB).

Pure torch (no MPI): the worker calls :func:`ordered_epoch` with the order the coordinator
sent; mini-batches are consecutive runs of ``batch_size`` examples of that order, each
example's gradient is taken at the model it was visited with (torch.func per-example
gradients), their mean is the SGD step, and the gradients come back in visit order, which
is what PairBalance needs (Cooper et al., NeurIPS 2023).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..training.eager import optimizer_step
from ..training.trainer import as_tensors
from .per_example import PerExampleGrads


def ordered_epoch(
    model: torch.nn.Module,
    dataset: Dataset,
    order: np.ndarray,
    *,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    task: str,
    grads: PerExampleGrads,
    device: str = "cpu",
    on_step: Callable[[int, np.ndarray], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    before_step: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[float, np.ndarray]:
    """Train one epoch visiting ``dataset`` in ``order``.

    Args:
        order: a permutation of ``range(len(dataset))`` (int).
        batch_size: examples per SGD step (0 = the whole epoch in one step).
        lr / momentum / weight_decay: torch SGD coefficients (a fresh optimizer).
        grads: the per-example gradient helper bound to ``model``.
        on_step: called after every step with (the step's first visit position, its
            examples' gradients as float32 rows ``(b, numel)``, a view of the returned
            array), so they can be shipped while the epoch goes on (default None).
        optimizer: the optimizer over ``model.parameters()`` that takes the steps (default
            None: a fresh torch SGD with ``lr``, ``momentum``, ``weight_decay``).
        before_step: called with the model after each step's gradient is set, before the
            step (plugins' gradient corrections: FedProx, SCAFFOLD; default None).

    Returns (mean training loss in nats, float32 array ``(n, numel)`` of the examples'
    gradients in visit order).
    """
    tensors = as_tensors(dataset)
    if tensors is None:
        x_all = torch.stack([dataset[i][0] for i in range(len(dataset))])  # type: ignore[arg-type]
        y_all = torch.stack([torch.as_tensor(dataset[i][1]) for i in range(len(dataset))])  # type: ignore[arg-type]
    else:
        x_all, y_all = tensors
    n = x_all.shape[0]
    order = np.asarray(order)
    if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"order of {order.size} items is not a permutation of {n} examples")
    bs = n if batch_size <= 0 or batch_size >= n else batch_size
    params = list(model.parameters())
    opt = optimizer or torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    out = np.empty((n, grads.numel), np.float32)
    total = 0.0
    model.train()
    idx_all = torch.as_tensor(order, dtype=torch.long)
    for start in range(0, n, bs):
        idx = idx_all[start : start + bs]
        xb = x_all[idx].to(device)
        yb = y_all[idx].to(device)
        g, losses = grads(xb, yb)
        out[start : start + idx.numel()] = g.detach().cpu().numpy()
        if on_step is not None:
            on_step(start, out[start : start + idx.numel()])
        mean = g.mean(dim=0)
        offset = 0
        for p in params:
            k = p.numel()
            p.grad = mean[offset : offset + k].view_as(p).to(p.dtype)
            offset += k
        if before_step is not None:
            before_step(model)
        optimizer_step(opt)
        total += float(losses.sum())
    return total / max(n, 1), out


__all__ = ["ordered_epoch"]
