"""The proximal gradient term of FedProx (pure torch, no MPI)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...training.views import flat_views


def proximal_hook(
    params: Sequence[torch.Tensor], offsets: Sequence[int], anchor: np.ndarray, mu: float
) -> Callable[[torch.nn.Module], None]:
    """A gradient hook adding ``mu * (p - anchor_p)`` to each parameter's gradient.

    Args:
        params: the model's trainable parameters, in flat-layout order.
        offsets: each parameter's start in the flat layout (elements).
        anchor: the flat model the task started from (float32, at least the parameters).
        mu: the proximal coefficient (>= 0).
    """
    anchors = flat_views(params, offsets, anchor)

    def hook(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p, a in zip(params, anchors, strict=True):
                if p.grad is not None:
                    p.grad.add_(p - a, alpha=mu)

    return hook
