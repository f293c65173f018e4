"""``lstm``: next-token language model (Embedding -> LSTM -> Linear over the vocabulary)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgefl.errors import ConfigError
from edgefl.models._common import check_info, merge_args, positive_int

DEFAULTS: dict[str, Any] = {"embed": 32, "hidden": 64, "layers": 1}


class LSTMLanguageModel(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab). No dropout, so no train/eval difference."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, T, vocab) for int64 token ids of shape (B, T)."""
        out, _ = self.lstm(self.embed(x.long()))
        return self.head(out)


def build(info: Any, args: dict[str, Any] | None = None) -> nn.Module:
    """Build ``lstm`` for ``info`` (task 'lm', vocab = num_classes).

    args: ``embed`` (embedding width, default 32), ``hidden`` (LSTM width, default 64),
    ``layers`` (stacked LSTM layers, default 1).
    """
    shape, classes, task, dtype = check_info(info)
    a = merge_args("lstm", args, DEFAULTS)
    embed = positive_int("lstm", "embed", a["embed"])
    hidden = positive_int("lstm", "hidden", a["hidden"])
    layers = positive_int("lstm", "layers", a["layers"])
    if task != "lm":
        raise ConfigError(
            f"model.name 'lstm': is a language model and needs task 'lm' "
            f"(dataset has task {task!r} with {dtype} inputs)"
        )
    if dtype != "int64":
        raise ConfigError(f"model.name 'lstm': needs int64 token inputs, dataset gives {dtype}")
    if len(shape) != 1:
        raise ConfigError(
            f"model.name 'lstm': needs token sequences of shape (T,), got input_shape {shape}"
        )
    return LSTMLanguageModel(classes, embed, hidden, layers)
