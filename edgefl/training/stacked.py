"""Local training of many devices as one stacked computation (``torch.func``).

The sequential trainer (:func:`edgefl.training.trainer.fit_loop`) runs each device's
mini-batch SGD in its own Python loop: for the few small steps of an edge device the
Python and autograd overhead dominates the arithmetic. :func:`fit_stacked` trains a group
of devices that start from the same model together: their parameters (and SGD momentum)
are stacked along a leading device axis, each step evaluates every device's loss
gradient at once (a ``vmap`` of ``functional_call`` forward, then one backward pass of
the devices' summed losses: a device's parameters reach only its own loss), and each
device visits its
own examples in its own order, drawn from its own generator exactly as the sequential
trainer draws it (``torch.randperm(n, generator=g)`` per epoch). The devices of one call
hold the same number of examples and use the same batch size, so every step stacks
batches of one shape (group devices by size before calling; see :func:`groups`).

What it covers: models whose forward pass ``torch.func`` can transform, without buffers
(no BatchNorm yet); the configured loss as ``loss(output, target)`` (a mean); SGD with
momentum and weight decay as ``torch.optim.SGD`` computes it. Numerics: the same
arithmetic in another order (batched matrix products), so the result equals the
sequential path within float32 rounding, not bit for bit (``tests/test_stacked.py``
measures the difference); one call is deterministic on one machine.

Units: sizes in examples; ``lr`` per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .trainer import plan_steps


def groups(sizes: Sequence[int]) -> dict[int, list[int]]:
    """The positions of ``sizes`` by size: ``{n: [i, ...]}`` (devices with the same number
    of examples train in one stack)."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        out.setdefault(int(n), []).append(i)
    return out


def _per_device_loss(loss: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(outputs (K, b, ...), targets (K, b, ...)) -> (K,)``: each device's mean loss. The
    built-in cross-entropy on class logits is computed on the whole stack with the classes
    on dim 1 (``log_softmax`` over a short last dimension is several times slower); any
    other loss per device (``vmap``)."""
    import torch.nn.functional as F
    from torch.func import vmap

    from .losses import CrossEntropy

    if loss is F.cross_entropy or (isinstance(loss, CrossEntropy) and loss.task != "lm"):

        def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if out.dim() != 3:  # (not (K, b, classes): as the loss itself computes it)
                return vmap(F.cross_entropy)(out, y)
            return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)

        return ce
    return vmap(loss)


def _orders(n: int, bs: int, total: int, generators: Sequence[torch.Generator]):
    """Per step, the stacked example indices of every device: ``(devices, batch)`` long
    tensors, each device's epochs in its own ``randperm`` order (full batch: no draw)."""
    k = len(generators)
    if bs >= n:
        whole = torch.arange(n).expand(k, n)
        return [whole] * total
    steps_per_epoch = -(-n // bs)
    out: list[torch.Tensor] = []
    while len(out) < total:
        perms = torch.stack([torch.randperm(n, generator=g) for g in generators])
        for s in range(steps_per_epoch):
            if len(out) == total:
                break
            out.append(perms[:, s * bs : (s + 1) * bs])
    return out


def fit_stacked(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    X: torch.Tensor,
    Y: torch.Tensor,
    *,
    generators: Sequence[torch.Generator],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    lr: float,
    epochs: int = 1,
    steps: int = 0,
    batch_size: int = 0,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    prox_mu: float = 0.0,
    corrections: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Train ``K = X.shape[0]`` devices from the parameters ``start`` (name -> tensor, the
    model's shapes) on their own examples; returns (the trained parameters stacked along a
    leading device axis, each device's mean training loss over its steps, shape ``(K,)``).

    Args:
        model: the architecture (its own parameters are not used or changed).
        start: the start parameters (every device starts from them).
        X: examples, ``(K, n, ...)``; Y: targets, ``(K, n, ...)``.
        generators: one per device (its task's seeded generator, as the sequential path).
        loss: ``loss(output, target)``, the mean over the batch.
        lr: the step size.
        epochs, steps, batch_size: as :func:`edgefl.training.trainer.fit_loop` (``steps >
            0``: exactly that many steps; ``batch_size`` 0 or ``>= n``: full batch).
        momentum, weight_decay: SGD's, as ``torch.optim.SGD`` applies them.
        prox_mu: FedProx's term: ``prox_mu * (w - start)`` added to every gradient (the
            gradient hook :func:`edgefl.algorithms.fedprox.proximal_hook` adds).
        corrections: SCAFFOLD's ``c - c_i`` per device (name -> ``(K, *shape)``), added to
            every gradient (as :func:`edgefl.algorithms.scaffold.correction_hook`).

    The per-device terms are added after ``backward()`` and before the step, where the
    sequential path runs the plugins' gradient hooks; the loss reported is the task loss.
    """
    from torch.func import functional_call, vmap

    k, n = int(X.shape[0]), int(X.shape[1])
    if len(generators) != k or int(Y.shape[0]) != k or int(Y.shape[1]) != n:
        raise ValueError(
            f"fit_stacked: {k} devices of {n} examples need {k} generators and targets of "
            f"shape ({k}, {n}, ...), got {len(generators)} and {tuple(Y.shape)}"
        )
    if any(True for _ in model.buffers()):
        raise ValueError("fit_stacked: models with buffers (BatchNorm) are not supported yet")
    bs, total = plan_steps(epochs, steps, batch_size, n)
    if total == 0:
        return {name: p.expand(k, *p.shape).clone() for name, p in start.items()}, torch.zeros(k)

    forward = vmap(lambda p, xb: functional_call(model, p, (xb,)))
    per_device = _per_device_loss(loss)

    def grad_and_loss(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor):
        # one backward pass of the devices' summed losses: a device's parameters reach
        # only its own loss, so each gets its own gradient
        p = {name: v.detach().requires_grad_(True) for name, v in params.items()}
        with torch.enable_grad():
            values = per_device(forward(p, xb), yb)
            g = torch.autograd.grad(values.sum(), list(p.values()))
        return dict(zip(p, g, strict=True)), values.detach()

    params = {name: p.detach().expand(k, *p.shape).clone() for name, p in start.items()}
    bufs: dict[str, torch.Tensor] | None = None
    losses = []
    rows = torch.arange(k).unsqueeze(1)
    for idx in _orders(n, bs, total, generators):
        xb, yb = (X, Y) if bs >= n else (X[rows, idx], Y[rows, idx])  # (full batch: as is)
        g, value = grad_and_loss(params, xb, yb)
        losses.append(value)
        with torch.no_grad():
            if prox_mu:
                g = {name: g[name] + prox_mu * (params[name] - start[name]) for name in g}
            if corrections is not None:
                g = {name: g[name] + corrections[name] for name in g}
            if weight_decay:
                g = {name: g[name] + weight_decay * params[name] for name in params}
            if momentum:
                if bufs is None:
                    bufs = {name: v.clone() for name, v in g.items()}
                else:
                    for name in bufs:
                        bufs[name].mul_(momentum).add_(g[name])
                g = bufs
            params = {name: params[name] - lr * g[name] for name in params}
    return params, torch.stack(losses).mean(0)


__all__ = ["fit_stacked", "groups"]
