"""A custom edgefl model for the concentric-rings plug-in (datasets/custom_plugin.py).

Used by docs/examples/rings.toml as ``model.name = "rings_model:RingNet"`` with this folder
on PYTHONPATH. edgefl calls ``RingNet(**model.args)`` and adds ``info=<DataInfo>`` because
``__init__`` has a parameter named ``info``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RingNet(nn.Module):
    """Small classifier that also sees each point's distance from the origin.

    Args:
        info: the dataset's DataInfo (passed by edgefl): ``input_shape`` and ``num_classes``.
        hidden: width of the two hidden layers.
    """

    def __init__(self, info, hidden: int = 32) -> None:
        super().__init__()
        features = math.prod(info.input_shape)
        self.net = nn.Sequential(
            nn.Linear(features + 1, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, info.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) for points x of shape (B, 2)."""
        x = x.flatten(1)
        radius = x.norm(dim=1, keepdim=True)
        return self.net(torch.cat([x, radius], dim=1))
