"""``cnn``: a small convolutional classifier for image-shaped input (C,H,W) or (H,W)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgefl.errors import ConfigError
from edgefl.models._common import check_info, int_list, merge_args, require_classification

DEFAULTS: dict[str, Any] = {"channels": [16, 32], "batchnorm": False}

POOLED = 2  # side length (pixels) of the adaptive average pool before the classifier


class SmallCNN(nn.Module):
    """Conv3x3+ReLU blocks (2x2 max-pool between blocks while the image is >= 4 px per side),
    adaptive average pool to 2x2, then one Linear layer to the class logits.

    With ``batchnorm`` every block is Conv3x3 (no bias) + BatchNorm2d + ReLU: the model then
    has float buffers (running mean and variance per channel), which ``model.buffers``
    federates or keeps per device.
    """

    def __init__(
        self,
        in_channels: int,
        height: int,
        width: int,
        channels: list[int],
        num_classes: int,
        add_channel: bool = False,
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in, h, w = in_channels, height, width
        for i, c_out in enumerate(channels):
            if batchnorm:
                layers += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
                           nn.BatchNorm2d(c_out), nn.ReLU()]  # fmt: skip
            else:
                layers += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]
            if i < len(channels) - 1 and min(h, w) >= 4:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c_in = c_out
        layers.append(nn.AdaptiveAvgPool2d(POOLED))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in * POOLED * POOLED, num_classes)
        self.add_channel = add_channel  # input is (B, H, W): insert the channel axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) for input (B, C, H, W), or (B, H, W) if built for 2-D input."""
        if not x.is_floating_point():
            x = x.float()
        if self.add_channel:
            x = x.unsqueeze(1)
        return self.head(self.features(x).flatten(1))


def build(info: Any, args: dict[str, Any] | None = None) -> nn.Module:
    """Build ``cnn`` for ``info``. args: ``channels`` (conv widths, default [16, 32]),
    ``batchnorm`` (BatchNorm2d after every convolution, default false)."""
    shape, classes, task, _ = check_info(info)
    a = merge_args("cnn", args, DEFAULTS)
    channels = int_list("cnn", "channels", a["channels"], min_len=1)
    if not isinstance(a["batchnorm"], bool):
        raise ConfigError(f"model.args.batchnorm: expected true or false, got {a['batchnorm']!r}")
    require_classification("cnn", task)
    if len(shape) == 2:
        c, h, w = 1, shape[0], shape[1]
    elif len(shape) == 3:
        c, h, w = shape
    else:
        raise ConfigError(
            f"model.name 'cnn': needs image-shaped input (C,H,W) or (H,W), got input_shape {shape}"
        )
    return SmallCNN(
        c, h, w, channels, classes, add_channel=len(shape) == 2, batchnorm=a["batchnorm"]
    )
