"""Per-example and per-microbatch gradients of the training loss (pure torch, no MPI).

The ordering policies (``edgefl.algorithms.ordering.orderers``) need one gradient per ordered unit:
an example, or a microbatch of consecutive examples. :class:`PerExampleGrads` computes them
with ``torch.func``: ``vmap(grad_and_value(loss))`` over the unit axis, where ``loss`` runs
the model through ``functional_call`` with the training loss (``train.loss``; by default
mean cross-entropy per example, per token for ``"lm"``). Rows come back flattened in the
flat-parameter order of :class:`edgefl.models.flat.FlatParams` (``named_parameters()``
order, tied parameters once), float32, on the device of the model's parameters.

``nn.LSTM``: vmap has no batching rule for the fused LSTM kernel, so torch falls back to a
slow per-example loop inside vmap. For a plain ``nn.LSTM`` (unidirectional, no projection,
no dropout between layers while training, called without an initial state) this module
instead runs an equivalent step-by-step LSTM made of ordinary batched ops (gate order
i, f, g, o as in torch), about 2x faster here. It runs on a shallow copy of the model that
shares the parameters and buffers, so the caller's model is never modified. Other LSTM
configurations keep torch's own forward.

If vmap fails for a model (for example a custom layer with in-place ops on its inputs, or
batch norm in training mode), ``method="auto"`` falls back, once and for the lifetime of the
object, to a Python loop of single-example ``torch.autograd.grad`` calls (correct, slower);
:attr:`PerExampleGrads.method` then reads ``"loop"``.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from edgefl.errors import ConfigError
from edgefl.models.train import TASKS
from edgefl.training.losses import resolve_loss

METHODS = ("auto", "vmap", "loop")


def _unrolled_lstm_forward(self: nn.LSTM, x: torch.Tensor, hx: Any = None) -> Any:
    """Step-by-step LSTM over ordinary ops (vmap-friendly); same maths as ``nn.LSTM``."""
    if hx is not None:
        return type(self).forward(self, x, hx)
    batched = x.dim() == 3
    seq = x if batched else x.unsqueeze(0 if self.batch_first else 1)
    if not self.batch_first:
        seq = seq.transpose(0, 1)  # (B, T, F)
    b, t = seq.shape[0], seq.shape[1]
    h_last, c_last = [], []
    for layer in range(self.num_layers):
        w_ih = getattr(self, f"weight_ih_l{layer}")
        w_hh = getattr(self, f"weight_hh_l{layer}")
        pre = seq @ w_ih.T
        if self.bias:
            pre = pre + (getattr(self, f"bias_ih_l{layer}") + getattr(self, f"bias_hh_l{layer}"))
        hidden = w_hh.shape[1]
        h = seq.new_zeros(b, hidden)
        c = seq.new_zeros(b, hidden)
        outs = []
        for step in range(t):
            i, f, g, o = (pre[:, step] + h @ w_hh.T).chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        seq = torch.stack(outs, dim=1)
        h_last.append(h)
        c_last.append(c)
    out = seq if self.batch_first else seq.transpose(0, 1)
    hn, cn = torch.stack(h_last), torch.stack(c_last)
    if not batched:
        out = out.squeeze(0 if self.batch_first else 1)
        hn, cn = hn.squeeze(1), cn.squeeze(1)
    return out, (hn, cn)


def _plain_lstm(mod: nn.Module) -> bool:
    return (
        type(mod) is nn.LSTM
        and not mod.bidirectional
        and mod.proj_size == 0
        and (mod.dropout == 0 or mod.num_layers == 1)
    )


def functional_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` sharing its parameters and buffers (the same names), plain LSTMs
    unrolled so that ``torch.func.vmap`` can batch them; ``model`` itself when it has
    none. Also the stacked trainer's (:mod:`edgefl.training.stacked`)."""
    if not any(_plain_lstm(m) for m in model.modules()):
        return model
    memo: dict[int, Any] = {id(p): p for p in model.parameters()}
    memo.update({id(b): b for b in model.buffers()})
    twin = copy.deepcopy(model, memo)
    for mod in twin.modules():
        if _plain_lstm(mod):
            mod.forward = types.MethodType(_unrolled_lstm_forward, mod)  # type: ignore[method-assign]
    return twin


class PerExampleGrads:
    """Per-unit gradients of ``loss_fn(model(x), y, task)`` at the model's current parameters.

    Args:
        model: any edgefl model (built-in or custom ``nn.Module``); read, never modified.
        task: the data's task (``"classification"``, ``"lm"``, ``"regression"``,
            ``"binary"``), which picks the default loss.
        loss: the training loss, ``loss(output, target)`` mean over a batch (default: the
            one ``train.loss = "auto"`` picks for ``task``); it must meet the loss contract
            of :mod:`edgefl.training.losses` (valid under ``torch.func.vmap``).
        method: ``"auto"`` (vmap, falling back to a loop if vmap fails; default),
            ``"vmap"`` (vmap only, errors propagate) or ``"loop"``.
        chunk_size: passed to ``torch.func.vmap``: at most this many units per vectorised
            call, bounding memory (default None = all at once).

    Attributes: ``names`` (parameter names, flat order), ``numel`` (total parameters),
    ``method`` (the method in use).
    """

    def __init__(
        self,
        model: nn.Module,
        task: str,
        *,
        method: str = "auto",
        chunk_size: int | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"PerExampleGrads: method must be one of {METHODS}, got {method!r}")
        if task not in TASKS:
            raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
        self.loss_fn = loss if loss is not None else resolve_loss("auto", task)
        self.model = model
        self.task = task
        self.method = method
        self.chunk_size = chunk_size
        self.names = [n for n, _ in model.named_parameters()]
        self.numel = sum(p.numel() for p in model.parameters())
        self._twin = functional_twin(model) if method != "loop" else model
        self._vg = vmap(
            grad_and_value(self._unit_loss),
            in_dims=(None, 0, 0),
            randomness="different",
            chunk_size=chunk_size,
        )

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def _unit_loss(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        # x, y: one unit (a microbatch, with its own leading batch axis)
        return self.loss_fn(functional_call(self._twin, params, (x,)), y)

    def _flatten(self, grads: dict[str, torch.Tensor], units: int) -> torch.Tensor:
        return torch.cat([grads[n].reshape(units, -1) for n in self.names], dim=1).float()

    def _vmapped(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grads, losses = self._vg(self._params(), x, y)
        return self._flatten(grads, x.shape[0]), losses.detach().float()

    def _looped(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = [p for _, p in self.model.named_parameters()]
        rows, losses = [], []
        for i in range(x.shape[0]):
            loss = self.loss_fn(self.model(x[i]), y[i])
            gs = torch.autograd.grad(loss, params, allow_unused=True)
            rows.append(
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).reshape(-1)
                        for g, p in zip(gs, params)
                    ]
                )
            )
            losses.append(loss.detach())
        if not rows:
            dev = params[0].device
            return torch.zeros(0, self.numel, device=dev), torch.zeros(0, device=dev)
        return torch.stack(rows).float(), torch.stack(losses).float()

    def _units(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients and losses of units given as (U, unit_batch, ...) tensors."""
        if self.method == "loop" or x.shape[0] == 0:
            return self._looped(x, y)
        if self.method == "vmap":
            return self._vmapped(x, y)
        try:
            return self._vmapped(x, y)
        except Exception:  # vmap cannot handle this model: fall back for good
            self.method = "loop"
            self._twin = self.model
            return self._looped(x, y)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example gradients ``(B, numel)`` float32 and losses ``(B,)`` (nats; per token
        for "lm") of the examples ``x[i], y[i]``."""
        return self._units(x.unsqueeze(1), y.unsqueeze(1))

    def microbatches(
        self, x: torch.Tensor, y: torch.Tensor, microbatch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients ``(ceil(B / microbatch), numel)`` and losses of the mean loss over each
        run of ``microbatch`` consecutive examples (the last run may be shorter)."""
        if microbatch < 1:
            raise ValueError(f"microbatch must be >= 1, got {microbatch}")
        b = x.shape[0]
        full = b // microbatch
        parts_g, parts_l = [], []
        if full:
            cut = full * microbatch
            g, loss = self._units(
                x[:cut].reshape(full, microbatch, *x.shape[1:]),
                y[:cut].reshape(full, microbatch, *y.shape[1:]),
            )
            parts_g.append(g)
            parts_l.append(loss)
        if b > full * microbatch:
            g, loss = self._looped(x[full * microbatch :][None], y[full * microbatch :][None])
            parts_g.append(g)
            parts_l.append(loss)
        if not parts_g:
            return self._looped(x[:0], y[:0])
        return torch.cat(parts_g), torch.cat(parts_l)


def per_example_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str
) -> torch.Tensor:
    """Per-example gradients ``(B, numel)`` float32 in FlatParams order (one-off helper)."""
    return PerExampleGrads(model, task)(x, y)[0]


def per_microbatch_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str, microbatch: int
) -> torch.Tensor:
    """Per-microbatch gradients ``(ceil(B / microbatch), numel)`` float32 (one-off helper)."""
    return PerExampleGrads(model, task).microbatches(x, y, microbatch)[0]
