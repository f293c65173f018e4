"""Gradient terms that both trainers understand: the sequential one runs them as gradient
hooks (:attr:`edgefl.training.FitContext.grad_hooks`), the stacked one
(:func:`edgefl.training.stacked.fit_stacked`) reads what they add and adds it to every
device's gradient at once.

A plugin that hooks into local training and wants its devices trained stacked
(``train.vectorize``) adds its gradient terms as these objects instead of opaque
functions: FedProx's proximal term (:class:`ProximalTerm`) and SCAFFOLD's correction
(:class:`ConstantTerm`). Both run after ``backward()`` and before the optimizer step,
in the order they were added.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .views import flat_views


class ProximalTerm:
    """Adds ``mu * (p - anchor_p)`` to each parameter's gradient (the gradient of
    ``mu / 2 * ||w - anchor||^2``).

    Args:
        params: the model's trainable parameters, in flat-layout order.
        offsets: each parameter's start in the flat layout (elements).
        anchor: the flat model to stay near (float32, at least the parameters).
        mu: the coefficient (>= 0).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], offsets: Sequence[int], anchor: np.ndarray, mu: float
    ) -> None:
        self.params, self.mu, self.anchor = list(params), float(mu), anchor
        self.anchors = flat_views(self.params, offsets, anchor)

    def __call__(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p, a in zip(self.params, self.anchors, strict=True):
                if p.grad is not None:
                    p.grad.add_(p - a, alpha=self.mu)


class ConstantTerm:
    """Adds a fixed vector to the parameters' gradients.

    Args:
        params: the model's trainable parameters, in flat-layout order.
        offsets: each parameter's start in the flat layout (elements).
        values: flat float32 over the parameters (SCAFFOLD's ``c - c_i``).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], offsets: Sequence[int], values: np.ndarray
    ) -> None:
        self.params, self.values = list(params), values
        self.parts = flat_views(self.params, offsets, values)

    def __call__(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p, c in zip(self.params, self.parts, strict=True):
                if p.grad is not None:
                    p.grad.add_(c)


__all__ = ["ConstantTerm", "ProximalTerm"]
