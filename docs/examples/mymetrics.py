"""A user metric for federated evaluation (docs/evaluation.md, "Your own metrics"):
``evaluation.metrics = ["mymetrics:top2"]`` with docs/examples on PYTHONPATH."""

import torch


def top2(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the target is among the two highest logits (per example)."""
    best = output.topk(2, dim=-1).indices
    return (best == target.unsqueeze(-1)).any(dim=-1).float()
