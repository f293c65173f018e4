"""FedProx (Li et al., MLSys 2020): a proximal term keeps local training near the global model.

One module holds the whole algorithm: its config section, the proximal gradient hook, the
worker half and the plugin class (the server side is plain FedAvg: no coordinator half).
Written only against the plugin API (:mod:`edgefl.algorithms.base`) and the client hook
(:mod:`edgefl.training`): the worker half adds ``mu * (w - w_global)`` to every gradient,
the gradient of ``mu / 2 * ||w - w_global||^2``, through ``FitContext.grad_hooks``.
torch is imported where a task needs it (the registry reads :data:`SECTIONS` without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..config.fields import field
from .base import LocalJob, Plugin, WorkerPlugin

if TYPE_CHECKING:  # (annotations only)
    import torch

    from ..training.gradterms import ProximalTerm

#: the ``[fedprox]`` config section (docs/configuration.md)
SECTIONS = {
    "fedprox": {
        "enabled": field(
            False, "bool", "FedProx: add the proximal term mu/2 ||w - w_global||^2 locally."
        ),
        "mu": field(
            0.01,
            "float",
            "Proximal coefficient mu (0 = FedAvg, bit for bit); Li et al. use 0.001 to 1.",
            min=0.0,
        ),
    },
}


def proximal_hook(
    params: Sequence[torch.Tensor], offsets: Sequence[int], anchor: np.ndarray, mu: float
) -> ProximalTerm:
    """A gradient hook adding ``mu * (p - anchor_p)`` to each parameter's gradient.

    Args:
        params: the model's trainable parameters, in flat-layout order.
        offsets: each parameter's start in the flat layout (elements).
        anchor: the flat model the task started from (float32, at least the parameters).
        mu: the proximal coefficient (>= 0).
    """
    from ..training.gradterms import ProximalTerm

    return ProximalTerm(params, offsets, anchor, mu)


class FedProxWorker(WorkerPlugin):
    """Adds ``mu * (w - w_start)`` to the gradients of every step of every task (the
    anchor is the global model the task started from; for a gated device, the global model
    its local iterations started from). The reported training loss is the task loss without
    the proximal term."""

    stackable = True
    stack_note = "the proximal term is a per-device gradient term (`ProximalTerm`)"

    def before_train(self, d: int, job: LocalJob) -> None:
        if job.fit_ctx is None:
            return
        flat = job.flat
        anchor = job.start if job.start is not None else flat.to_host().copy()
        params = [p for _, p in job.model.named_parameters()]
        mu = float(self.ctx.cfg["fedprox"]["mu"])
        job.fit_ctx.grad_hooks.append(
            proximal_hook(params, flat.offsets[: len(params)], anchor, mu)
        )


class FedProx(Plugin):
    """``fedprox.enabled = true`` with ``fedprox.mu``: the server side is plain FedAvg."""

    name = "fedprox"
    order = 90
    sections = SECTIONS
    worker = FedProxWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["fedprox"]["enabled"])


__all__ = ["SECTIONS", "FedProx", "FedProxWorker", "proximal_hook"]
