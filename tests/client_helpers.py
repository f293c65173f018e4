"""User code for tests/test_client_hook.py (importable by MPI ranks: PYTHONPATH=tests).

A regression data source, a binary one (single-logit labels), a user loss, a user
optimizer and a user client class, written the way docs/custom-data-and-models.md shows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from edgefl.data import DataInfo
from edgefl.training import FitResult


def regression(num_devices: int, seed: int, dim: int = 5, per_device: int = 64):
    """y = x . w + 0.5 + noise; each device's inputs shifted differently (non-IID)."""
    g = torch.Generator().manual_seed(1000 + seed)
    w = torch.randn(dim, generator=g)

    def make(n: int, shift: float):
        x = torch.randn(n, dim, generator=g) + shift
        y = x @ w + 0.5 + 0.05 * torch.randn(n, generator=g)
        return x, y.unsqueeze(1)

    train = [make(per_device, 0.3 * d) for d in range(num_devices)]
    return train, make(256, 0.0), DataInfo((dim,), 1, "regression")


def binary(num_devices: int, seed: int, dim: int = 6, per_device: int = 80):
    """Labels 0/1 from a linear rule with a margin; one logit per example."""
    g = torch.Generator().manual_seed(2000 + seed)
    w = torch.randn(dim, generator=g)

    def make(n: int):
        x = torch.randn(n, dim, generator=g)
        return x, (x @ w > 0).float()

    train = [make(per_device) for _ in range(num_devices)]
    return train, make(400), DataInfo((dim,), 1, "binary")


def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user loss: 0.5 * mean squared error (mean over the batch, vmap-safe)."""
    return 0.5 * F.mse_loss(output, target)


def plain_sgd(params, lr: float, train: dict) -> torch.optim.Optimizer:
    """A user optimizer factory: SGD without momentum whatever train.momentum says."""
    return torch.optim.SGD(params, lr=lr)


class RegressionClient:
    """A user client: its own loop over shuffled mini-batches (the context's generator),
    the configured optimizer, the objective and step hooks of the context."""

    def fit(self, model, dataset, task, ctx) -> FitResult:
        bs = task.batch_size or len(dataset)
        loader = DataLoader(dataset, batch_size=bs, shuffle=True, generator=ctx.generator)
        opt = ctx.make_optimizer(model.parameters(), task.lr)
        total, seen, abs_err = 0.0, 0, 0.0
        model.train()
        for _ in range(task.epochs):
            for xb, yb in loader:
                xb, yb = xb.to(ctx.torch_device), yb.to(ctx.torch_device)
                opt.zero_grad()
                out = model(xb)
                loss = ctx.objective(model, out, yb)
                loss.backward()
                ctx.before_step(model)
                opt.step()
                total += float(loss.detach()) * len(yb)
                abs_err += float((out.detach() - yb).abs().sum())
                seen += len(yb)
        return FitResult(seen, total / max(seen, 1), {"mae": abs_err / max(seen, 1)})


def bad_client(model, dataset, task, ctx):
    """Returns something that is not a result."""
    return 42


class BrokenNet(torch.nn.Module):
    """A model whose forward always fails (caught before launch)."""

    def __init__(self, info):
        super().__init__()
        self.lin = torch.nn.Linear(5, 1)

    def forward(self, x):
        raise RuntimeError("no forward today")
