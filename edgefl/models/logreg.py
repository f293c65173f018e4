"""``logreg``: multinomial logistic regression (flatten + one Linear layer)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgefl.models._common import check_info, flat_features, merge_args, require_classification

DEFAULTS: dict[str, Any] = {}


class LogReg(nn.Module):
    """Flatten each sample and map it to class logits with a single affine layer."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, num_classes) for input of shape (B, *input_shape)."""
        if not x.is_floating_point():
            x = x.float()
        return self.linear(x.flatten(1))


def build(info: Any, args: dict[str, Any] | None = None) -> nn.Module:
    """Build ``logreg`` for ``info`` (no arguments accepted)."""
    shape, classes, task, _ = check_info(info)
    merge_args("logreg", args, DEFAULTS)
    require_classification("logreg", task)
    return LogReg(flat_features(shape), classes)
