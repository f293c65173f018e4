"""User metrics for tests/test_fedeval.py (named as 'fedeval_helpers:<name>')."""

from __future__ import annotations

import torch

NOT_CALLABLE = 3


def top2(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the target is among the two highest logits, else 0.0 (per example)."""
    best = output.topk(2, dim=-1).indices
    return (best == target.unsqueeze(-1)).any(dim=-1).float()


def margin(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The target's logit minus the mean logit (per example)."""
    return output.gather(-1, target.unsqueeze(-1)).squeeze(-1) - output.mean(dim=-1)


def whole_batch(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Breaks the contract: one value for the whole batch."""
    return output.mean().reshape(1, 1).expand(2, 3)
