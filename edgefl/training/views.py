"""Per-parameter views of a flat float32 vector (for gradient hooks; pure torch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def flat_views(
    params: Sequence[torch.Tensor], offsets: Sequence[int], values: np.ndarray
) -> list[torch.Tensor]:
    """``values`` (flat float32, at least the parameters, in flat-layout order) copied to
    the parameters' device once and cut into one view per parameter, shaped like it.

    Args:
        params: the model's trainable parameters, in flat-layout order.
        offsets: each parameter's start in the flat layout (elements).
        values: the flat vector.
    """
    dev = params[0].device if params else torch.device("cpu")
    flat = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(dev)
    return [flat[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets, strict=True)]
