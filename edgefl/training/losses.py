"""Training losses: the built-in ones and a user's ``module:function``.

The loss contract (what every loss, built-in or user, must meet):

- ``loss(output, target)`` returns the **mean** loss over the batch as a scalar tensor
  (nats per sample for the built-in losses; per token for ``lm``), differentiable in the
  model's parameters;
- it must be valid on a batch of one and written with tensor operations only (no
  ``.item()``, no Python branches on tensor values), because CD-GraB takes per-example
  gradients by calling it on single examples under ``torch.func.vmap``;
- the evaluation of a held-out or test split (Hermes' gate, the test loss) weights each
  batch's mean by its number of examples, so a mean reduction is what makes those sums exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..specs import import_spec

#: the loss ``train.loss = "auto"`` picks for each task of the data source
AUTO = {
    "classification": "cross-entropy",
    "lm": "cross-entropy",
    "regression": "mse",
    "binary": "bce-with-logits",
}


class Loss:
    """A training loss: ``loss(output, target)`` (mean, scalar tensor) and
    ``loss.total(output, target)`` (sum over the batch and the number of terms summed, for
    exact evaluation over many batches).

    Args:
        name: the config value it came from.
        fn: the mean loss.
        task: the data source's task (``classification``, ``lm``, ``regression``, ``binary``).
    """

    def __init__(self, name: str, fn: Callable, task: str) -> None:
        self.name = name
        self.fn = fn
        self.task = task

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(output, target)

    def total(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(sum of the per-example losses, number of examples) of one batch."""
        n = int(target.shape[0]) if target.dim() else 1
        return self.fn(output, target) * n, n

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(number of correct predictions, number of predictions) of one batch, or
        (nan, 0) when the task has no accuracy (regression)."""
        if self.task == "binary":
            pred = (output.reshape(target.shape[0], -1)[:, 0] > 0).to(target.dtype)
            return (pred == target.reshape(-1)).sum(), int(target.shape[0])
        if self.task in ("classification", "lm"):
            logits = output.reshape(-1, output.shape[-1])
            y = target.reshape(-1)
            return (logits.argmax(dim=-1) == y).sum(), int(y.numel())
        return torch.tensor(float("nan")), 0


class CrossEntropy(Loss):
    """Mean cross-entropy on class logits; for ``lm`` logits (B, T, V) and targets (B, T)
    are flattened (the mean is per token)."""

    def __init__(self, task: str) -> None:
        super().__init__("cross-entropy", self._mean, task)

    def _mean(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task == "lm":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)

    def total(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.task == "lm":
            output = output.reshape(-1, output.shape[-1])
            target = target.reshape(-1)
        return F.cross_entropy(output, target, reduction="sum"), int(target.numel())


def _bce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy on one logit per example: output (B,) or (B, 1), target 0/1."""
    return F.binary_cross_entropy_with_logits(
        output.reshape(target.shape[0]) if target.dim() else output.reshape(()),
        target.to(output.dtype),
    )


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (mean over examples and output dimensions)."""
    return F.mse_loss(output.reshape(target.shape), target.to(output.dtype))


def resolve_loss(spec: str, task: str) -> Loss:
    """The loss config value ``spec`` (``train.loss``) names for data of ``task``."""
    name = AUTO.get(task, "cross-entropy") if spec == "auto" else spec
    if name == "cross-entropy":
        if task not in ("classification", "lm"):
            raise ConfigError(
                f"config key 'train.loss' = {spec!r}: cross-entropy needs class labels, "
                f"the data's task is {task!r} (use mse or bce-with-logits)"
            )
        return CrossEntropy(task)
    if name == "bce-with-logits":
        return Loss(name, _bce, task)
    if name == "mse":
        return Loss(name, _mse, task)
    if ":" not in name:
        raise ConfigError(
            f"config key 'train.loss': {spec!r} is not auto, cross-entropy, bce-with-logits, "
            "mse or 'package.module:function'"
        )
    return Loss(name, import_spec(name, "train.loss"), task)
