"""The control-variate arithmetic of SCAFFOLD (pure numpy/torch, no MPI)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...training.views import flat_views


def correction_hook(
    params: Sequence[torch.Tensor], offsets: Sequence[int], correction: np.ndarray
) -> Callable[[torch.nn.Module], None]:
    """A gradient hook adding ``correction`` (``c - c_i``, flat float32 over the
    parameters) to the parameters' gradients."""
    parts = flat_views(params, offsets, correction)

    def hook(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for p, c in zip(params, parts, strict=True):
                if p.grad is not None:
                    p.grad.add_(c)

    return hook


def client_delta(c: np.ndarray, delta: np.ndarray, steps: int, lr: float) -> np.ndarray:
    """``dc_i = c_i+ - c_i = -c - delta / (K lr)`` (option II; ``delta = y_i - x`` over the
    parameters), float32; zeros when no step was taken."""
    if steps <= 0 or lr <= 0:
        return np.zeros_like(c)
    scale = np.float32(1.0 / (steps * lr))
    return (-c - delta * scale).astype(np.float32)


def server_step(c: np.ndarray, deltas: dict[int, np.ndarray], devices: int) -> None:
    """``c += sum(dc_i) / N`` in place, summing in device order (deterministic)."""
    if not deltas:
        return
    total = np.zeros_like(c)
    for d in sorted(deltas):
        total += deltas[d]
    c += total / np.float32(devices)
