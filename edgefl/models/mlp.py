"""``mlp``: flatten + fully connected hidden layers with ReLU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgefl.models._common import (
    check_info,
    flat_features,
    int_list,
    merge_args,
    require_classification,
)

DEFAULTS: dict[str, Any] = {"hidden": [64]}


class MLP(nn.Module):
    """Multi-layer perceptron; ``hidden`` lists the width of each hidden layer."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, num_classes) for input of shape (B, *input_shape)."""
        if not x.is_floating_point():
            x = x.float()
        return self.net(x.flatten(1))


def build(info: Any, args: dict[str, Any] | None = None) -> nn.Module:
    """Build ``mlp`` for ``info``. args: ``hidden`` (list of widths, default [64])."""
    shape, classes, task, _ = check_info(info)
    a = merge_args("mlp", args, DEFAULTS)
    hidden = int_list("mlp", "hidden", a["hidden"])
    require_classification("mlp", task)
    return MLP(flat_features(shape), hidden, classes)
