"""Optimizer steps without loading ``torch._dynamo``.

``torch.optim`` loads the compiler stack (``torch._dynamo``, sympy included) the first time an
optimizer is built or stepped: its ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` are wrapped to be skipped by ``torch.compile``, and ``Optimizer.step``
marks a graph break. A process that never compiles pays for it anyway: about 1.1 CPU seconds
and 66 MiB on the development machine, once per rank, which on a many-rank job on a
small box is a visible part of the whole command (see docs/performance.md).

Neither function changes what is computed. :func:`defer_dynamo` makes those wrapped methods
call the method itself until ``torch._dynamo`` is loaded (by the user's own
``torch.compile``, say) and torch's own wrapper from then on. :func:`optimizer_step` runs
the step a plain ``SGD``/``Adam``/``AdamW`` would run, under ``torch.no_grad()`` as
``step()`` does, whenever nothing could tell the difference (no step hooks, no profiler,
no compilation, no per-instance ``step`` such as an LR scheduler's counter), and calls
``optimizer.step()`` otherwise; :func:`zero_grad` likewise. tests/test_eager_optim.py
checks them bit for bit against torch's own methods.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch.optim import optimizer as _torch_optimizer

_PLAIN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_DEFERRED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_raw_steps: dict[type, Callable | None] = {}
_installed = False


def _unwrapped_step(cls: type) -> Callable | None:
    """``cls.step`` without torch's profiling/hook wrapper and its grad-mode wrapper (both
    ``functools.wraps``; AdamW inherits Adam's), or None if it is not wrapped that way."""
    if cls not in _raw_steps:
        wrapped = getattr(cls, "step", None)
        fn = inspect.unwrap(wrapped) if callable(wrapped) else None
        plain = fn is not wrapped and getattr(fn, "__name__", "") == "step"
        _raw_steps[cls] = fn if plain else None
    return _raw_steps[cls]


def defer_dynamo() -> int:
    """Let ``torch.optim.Optimizer``'s compile-skipping wrappers load ``torch._dynamo`` only
    once it has been loaded anyway. Idempotent; returns how many methods it deferred (0 on
    a torch whose wrappers look different: then nothing is changed)."""
    global _installed
    if _installed:
        return 0
    _installed = True
    n = 0
    for name in _DEFERRED:
        inner = torch.optim.Optimizer.__dict__.get(name)
        code = getattr(inner, "__code__", None)
        if code is None or code.co_freevars != ("fn", "recursive") or not inner.__closure__:
            continue
        cells = dict(zip(code.co_freevars, inner.__closure__, strict=True))
        fn, recursive = cells["fn"].cell_contents, cells["recursive"].cell_contents
        if getattr(fn, "__dynamo_disable", None) is not None:
            continue  # torch._dynamo has wrapped it already
        setattr(fn, "__dynamo_disable", _deferred(fn, recursive))
        n += 1
    return n


def _deferred(fn: Callable, recursive: bool) -> Callable:
    """``fn`` itself while ``torch._dynamo`` is not loaded (nothing can be compiling then);
    ``torch._dynamo.disable(fn)``, as torch would use, once it is."""

    def call(*args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        real = dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, "__dynamo_disable", real)
        return real(*args, **kwargs)

    return call


def _plain(optimizer: torch.optim.Optimizer, method: str) -> bool:
    """Whether ``optimizer.<method>()`` is torch's own, for a plain SGD/Adam/AdamW, with
    nothing that could observe the wrappers (no profiler, no compilation)."""
    return (
        type(optimizer) in _PLAIN
        and method not in optimizer.__dict__
        and not torch.compiler.is_compiling()
        and not torch.autograd.profiler._is_profiler_enabled
    )


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` (the gradients become None), without the
    profiler label torch wraps it in for a plain SGD, Adam or AdamW: a tenth of a small
    model's training step."""
    if not _plain(optimizer, "zero_grad"):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, computed the same way, without loading ``torch._dynamo`` for a
    plain SGD, Adam or AdamW."""
    cls = type(optimizer)
    if (
        _plain(optimizer, "step")
        and not optimizer.defaults.get("differentiable", False)
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and not _torch_optimizer._global_optimizer_pre_hooks
        and not _torch_optimizer._global_optimizer_post_hooks
    ):
        raw = _unwrapped_step(cls)
        if raw is not None:
            with torch.no_grad():
                raw(optimizer)
            return
    optimizer.step()


__all__ = ["defer_dynamo", "optimizer_step", "zero_grad"]
