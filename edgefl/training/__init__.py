"""Local training: the client hook, losses, optimizers and learning-rate schedules.

Pure torch (no MPI). A worker rank trains each device's task through a *client*
(:class:`Client`): the built-in :class:`DefaultClient`, or the user's class or function named
in ``train.client``. Losses (``train.loss``), optimizers (``train.optimizer``) and the
per-round learning rate (``train.lr_schedule``) are chosen in config and handed to the
client in its :class:`FitContext`. docs/custom-data-and-models.md shows how to write one.
"""

from __future__ import annotations

from .client import Client, FitContext, FitResult, FitTask
from .loading import check_result, check_training, load_client
from .losses import Loss, resolve_loss
from .optim import lr_at, make_optimizer
from .trainer import DefaultClient, fit_loop

__all__ = [
    "Client",
    "DefaultClient",
    "FitContext",
    "FitResult",
    "FitTask",
    "Loss",
    "check_result",
    "check_training",
    "fit_loop",
    "load_client",
    "lr_at",
    "make_optimizer",
    "resolve_loss",
]
