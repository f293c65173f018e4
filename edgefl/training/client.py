"""The client hook: one method that trains a device's task (``train.client``).

A client is a class with a ``fit`` method (instantiated once per worker rank, with no
arguments) or a plain function with the same signature::

    def fit(model, dataset, task: FitTask, ctx: FitContext) -> FitResult | dict

``model`` already holds the task's start model (the global model, or a gated device's own
local model) on ``ctx.torch_device``; the client trains it in place. ``dataset`` is the
device's training split for this task (a seeded subset when the Hermes allocator asked for
fewer samples). The return value is a :class:`FitResult` or a dict with at least
``samples`` (examples processed, int) and ``loss`` (mean training loss, float); any other
numeric entries are the client's metrics.

For plugins that change the objective (FedProx, SCAFFOLD) to work with a user client, the
client computes its loss with ``ctx.objective(model, output, target)`` and calls
``ctx.before_step(model)`` between ``backward()`` and ``optimizer.step()``; the built-in
trainer does both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .losses import Loss


@dataclass
class FitTask:
    """What one task asks of the client.

    Args:
        epochs: local epochs (``train.local_epochs``), used when ``steps`` is 0.
        steps: local mini-batch steps (``train.local_steps``; 0 = use epochs).
        batch_size: examples per step (0 = full batch); a plugin (Hermes allocation) may
            have set it for this task.
        lr: this task's learning rate (``train.lr`` after ``train.lr_schedule``).
        samples: the sample budget the coordinator gave this task (0 = all of the device's
            training split); ``dataset`` already holds that many examples.
        order: the example order to visit (indices into ``dataset``), from the ordering
            plugin, or None (shuffle with ``ctx.generator``).
        round: the global model version the task starts from (0-based).
    """

    epochs: int
    steps: int
    batch_size: int
    lr: float
    samples: int = 0
    order: np.ndarray | None = None
    round: int = 0


@dataclass
class FitContext:
    """Where and with what the client trains.

    Args:
        device: the logical device id.
        task: the device's task number (0, 1, ... for each of its tasks).
        round: the global model version the task starts from.
        generator: a torch.Generator seeded from (run seed, device, task): use it for every
            random draw so runs are reproducible.
        torch_device: e.g. ``"cpu"`` or ``"cuda:0"``.
        loss: the configured loss (``train.loss``): ``loss(output, target)`` is the mean.
        make_optimizer: ``make_optimizer(params, lr)`` builds the configured optimizer.
        start: the start model as a flat float32 array (read-only), or None.
        penalties: functions ``model -> scalar tensor`` that plugins add to the loss
            (FedProx's proximal term).
        grad_hooks: functions ``model -> None`` that plugins run on the gradients after
            ``backward()``, before the step (SCAFFOLD's correction).
        steps: optimizer steps taken so far (``before_step`` counts them).
        extra: anything plugins want to hand to a user client.
    """

    device: int
    task: int
    round: int
    generator: torch.Generator
    torch_device: str
    loss: Loss
    make_optimizer: Callable[..., torch.optim.Optimizer]
    start: np.ndarray | None = None
    penalties: list[Callable[[torch.nn.Module], torch.Tensor]] = field(default_factory=list)
    grad_hooks: list[Callable[[torch.nn.Module], None]] = field(default_factory=list)
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def objective(
        self, model: torch.nn.Module, output: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        """The loss to minimise: the configured loss plus every plugin's penalty."""
        loss = self.loss(output, target)
        for p in self.penalties:
            loss = loss + p(model)
        return loss

    def before_step(self, model: torch.nn.Module) -> None:
        """Run the plugins' gradient hooks (after ``backward()``, before the step)."""
        for h in self.grad_hooks:
            h(model)
        self.steps += 1


@dataclass
class FitResult:
    """What a client returns: ``samples`` (examples processed), ``loss`` (mean training
    loss, in the loss's units), ``metrics`` (other numbers, by name)."""

    samples: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


class Client:
    """Base class of a training client (subclassing it is optional: any class with ``fit``
    or any function with ``fit``'s signature works)."""

    def fit(self, model: torch.nn.Module, dataset: Any, task: FitTask, ctx: FitContext):
        """Train ``model`` in place on ``dataset``; return a :class:`FitResult`."""
        raise NotImplementedError
