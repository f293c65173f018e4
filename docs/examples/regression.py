"""A regression task with a user loss, Adam, and a user client class
(docs/custom-data-and-models.md, "Your own training").

Run from the repository root:

    PYTHONPATH=docs/examples edgefl simulate docs/examples/regression.toml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from edgefl.data import DataInfo
from edgefl.training import FitResult


def houses(num_devices: int, seed: int, features: int = 8, per_device: int = 100):
    """Price = x . w + 3 + noise; each device (a town) has its own feature shift, so the
    split is non-IID. Targets are float32 of shape (n, 1): task "regression"."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g)

    def make(n: int, shift: float):
        x = torch.randn(n, features, generator=g) + shift
        y = x @ w + 3.0 + 0.1 * torch.randn(n, generator=g)
        return x, y.unsqueeze(1)

    train = [make(per_device, 0.2 * k) for k in range(num_devices)]
    return train, make(500, 0.0), DataInfo((features,), 1, "regression")


def huber(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss: Huber (smooth L1), mean over the batch; tensor ops only (vmap-safe)."""
    return F.smooth_l1_loss(output, target)  # mean over the batch


class ClippedClient:
    """A client that clips each step's gradient norm to 1 and reports its mean absolute
    error as a metric. Uses the context's generator (reproducible shuffles), optimizer
    (train.optimizer) and objective / before_step (so FedProx and SCAFFOLD still apply)."""

    def fit(self, model, dataset, task, ctx) -> FitResult:
        loader = DataLoader(
            dataset, batch_size=task.batch_size or len(dataset), shuffle=True,
            generator=ctx.generator,
        )  # fmt: skip
        opt = ctx.make_optimizer(model.parameters(), task.lr)  # train.optimizer = "adam"
        seen, loss_sum, err_sum = 0, 0.0, 0.0
        for _ in range(task.epochs):
            for x, y in loader:
                x, y = x.to(ctx.torch_device), y.to(ctx.torch_device)
                opt.zero_grad()
                out = model(x)
                loss = ctx.objective(model, out, y)  # train.loss + penalties
                loss.backward()
                ctx.before_step(model)  # plugins' corrections
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                seen += len(y)
                loss_sum += float(loss.detach()) * len(y)
                err_sum += float((out.detach() - y).abs().sum())
        return FitResult(seen, loss_sum / max(seen, 1), {"mae": err_sum / max(seen, 1)})
