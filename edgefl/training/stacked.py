"""Local training of many devices as one stacked computation (``torch.func``).

The sequential trainer (:func:`edgefl.training.trainer.fit_loop`) runs each device's
mini-batch SGD in its own Python loop: for the few small steps of an edge device the
Python and autograd overhead dominates the arithmetic. :func:`fit_stacked` trains a group
of devices that start from the same model together: their parameters (and SGD momentum)
are stacked along a leading device axis, each step evaluates every device's loss
gradient at once (a ``vmap`` of ``functional_call`` forward, then one backward pass of
the devices' summed losses: a device's parameters reach only its own loss; a chain of
``Linear`` and ``ReLU`` layers under the cross-entropy, the built-in ``logreg`` and ``mlp``
among them, has its gradients written out instead, 1.3x to 1.7x faster:
:mod:`edgefl.training.stacked_affine`), and each device visits its own examples in its own
order, drawn from its own generator exactly as the sequential
trainer draws it (``torch.randperm(n, generator=g)`` per epoch). The devices of one call
hold the same number of examples and use the same batch size, so every step stacks
batches of one shape (group devices by size before calling; see :func:`groups`).

Devices of different sizes (``counts``): with mini-batches (a batch size below every
device's number of examples) one stack holds them all, padded to the largest: each step
takes every device's next batch of its own order, the short last batch of an epoch padded
with masked examples, and a device that has taken all its steps stands still while the
others go on. A device's arithmetic is then the same whatever else is in its stack (its
batches are ``batch_size`` wide, padding and all), so the model does not depend on how the
devices are grouped. Full-batch devices of different sizes stack too when the caller pads
them to one width that depends on each device's own size only (:func:`full_batch_width`):
each step is the whole padded set, masked.

What it covers: models whose forward pass ``torch.func`` can transform (a plain
``nn.LSTM`` runs unrolled step by step: vmap has no rule for the fused kernel), with
float buffers only in BatchNorm layers (each device's running statistics stacked like
its parameters and updated by its own batches, as its model's are one by one; such a
stack holds devices of one size: padding would enter the batch statistics); the
configured loss as ``loss(output, target)`` (a mean); SGD with momentum and weight decay
as ``torch.optim.SGD`` computes it. Numerics: the same arithmetic in another order
(batched matrix products), so the result equals the sequential path within float32
rounding, not bit for bit (``tests/test_stacked.py`` measures the difference); one call
is deterministic on one machine.

Units: sizes in examples; ``lr`` per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
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


def buffers_why_not(model: nn.Module) -> str | None:
    """Why ``model``'s buffers keep it off the stacked path (None: they don't). Float
    buffers are stacked per device only in BatchNorm layers with a ``momentum`` (an
    exponential average, which a device's own steps define); any other module's float
    buffers would be updated in ways the stack cannot split by device."""
    from torch.nn.modules.batchnorm import _BatchNorm

    for name, mod in model.named_modules():
        own = [b for b in mod._buffers.values() if b is not None and b.is_floating_point()]
        if not own:
            continue
        where = f"{type(mod).__name__} {name!r}" if name else type(mod).__name__
        if not isinstance(mod, _BatchNorm):
            return f"the model has float buffers outside BatchNorm ({where})"
        if mod.momentum is None:
            return f"{where} has momentum=None (a cumulative average over the rank's steps)"
    return None


def masks_supported(loss: Callable) -> bool:
    """Whether :func:`fit_stacked` can take a stack of devices of different sizes with
    ``loss`` (it needs each example's loss: the built-in cross-entropy on class logits)."""
    import torch.nn.functional as F

    from .losses import CrossEntropy

    return loss is F.cross_entropy or (isinstance(loss, CrossEntropy) and loss.task != "lm")


FULL_BATCH_QUANTUM = 8  # full-batch stacks: sizes padded to a multiple of this


def full_batch_width(n: int) -> int:
    """The width (examples, padding included) a full-batch device of ``n`` examples trains
    at in a stack of devices of different sizes: ``n`` rounded up to a multiple of 8. A
    function of ``n`` alone, so a device's arithmetic does not depend on its stack; devices
    of one width share a stack."""
    q = FULL_BATCH_QUANTUM
    return -(-int(n) // q) * q


def _masked_ce(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each device's mean cross-entropy over its real examples: ``out`` ``(K, b,
    classes)``, ``y`` and ``mask`` ``(K, b)`` (1 real, 0 padding); 0 for a device with
    none (it stands still this step)."""
    import torch.nn.functional as F

    each = F.cross_entropy(out.transpose(1, 2), y, reduction="none")
    return (each * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _ragged_orders(counts: Sequence[int], bs: int, epochs: int, steps: int,
                   generators: Sequence[torch.Generator]):  # fmt: skip
    """The steps of devices of different sizes: ``(idx, mask, active)`` with ``idx`` and
    ``mask`` ``(T, K, bs)`` (example indices, 1 for a real example) and ``active`` ``(T,
    K)`` (the device takes step ``t``), ``T`` the most steps of any device; each device's
    epochs in its own ``randperm`` order, drawn as the sequential trainer draws them (one
    per epoch begun). Device ``i``'s epoch is ``ceil(n_i / bs)`` batches, its last one
    short and padded; everything but the draws is computed for all devices at once."""
    k = len(counts)
    n = np.array([int(c) for c in counts], dtype=np.int64)
    totals = np.array([plan_steps(epochs, steps, bs, int(c))[1] for c in counts], dtype=np.int64)
    t_max = int(totals.max()) if k else 0
    per_epoch = -(-n // bs)
    begun = -(-totals // per_epoch)  # (epochs each device begins: one draw each)
    perms = [torch.randperm(int(c), generator=g).numpy()
             for c, g, e in zip(counts, generators, begun.tolist(), strict=True)
             for _ in range(e)]  # fmt: skip
    drawn = np.concatenate(perms) if perms else np.zeros(1, dtype=np.int64)
    first = np.cumsum(n * begun) - n * begun  # (where each device's draws start)
    step = np.arange(t_max)[None, :]  # (1, T)
    epoch, batch = step // per_epoch[:, None], step % per_epoch[:, None]  # (K, T)
    within = (batch * bs)[:, :, None] + np.arange(bs)  # (K, T, bs): place in its epoch
    real = (within < n[:, None, None]) & (step < totals[:, None])[:, :, None]
    src = first[:, None, None] + (epoch * n[:, None])[:, :, None] + within
    idx = np.where(real, drawn[np.minimum(src, len(drawn) - 1)], 0)
    idx = torch.from_numpy(np.ascontiguousarray(idx.transpose(1, 0, 2)))
    mask = torch.from_numpy(np.ascontiguousarray(real.transpose(1, 0, 2), dtype=np.float32))
    active = torch.from_numpy(step.T < totals[None, :])
    return idx, mask, active


def _active_prefix(active: torch.Tensor) -> list[int] | None:
    """Per step, how many devices take it, when those are the stack's first ones at every
    step (``active`` ``(T, K)`` of :func:`_ragged_orders`: devices in order of their steps,
    most first); else None."""
    m = active.sum(1)
    first = torch.arange(active.shape[1], device=active.device).unsqueeze(0) < m.unsqueeze(1)
    return m.tolist() if bool(torch.equal(active, first)) else None


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
    counts: Sequence[int] | None = None,
    offsets: Sequence[int] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Train ``K`` devices (``X.shape[0]``; with ``offsets``, ``len(counts)``) from the
    parameters ``start`` (name -> tensor, the
    model's shapes) on their own examples; returns (the trained parameters stacked along a
    leading device axis, each device's mean training loss over its steps, shape ``(K,)``).

    Args:
        model: the architecture (its own parameters are not used or changed).
        start: the start parameters: of the model's shapes (every device starts from them)
            or ``(K, *shape)`` (each device from its own row: a gate's local models).
        X: examples, ``(K, n, ...)``; Y: targets, ``(K, n, ...)``.
        generators: one per device (its task's seeded generator, as the sequential path).
        loss: ``loss(output, target)``, the mean over the batch.
        lr: the step size.
        epochs, steps, batch_size: as :func:`edgefl.training.trainer.fit_loop` (``steps >
            0``: exactly that many steps; ``batch_size`` 0 or ``>= n``: full batch).
        momentum, weight_decay: SGD's, as ``torch.optim.SGD`` applies them (to the
            parameters that require a gradient: a frozen one keeps its start value).
        prox_mu: FedProx's term: ``prox_mu * (w - start)`` added to every gradient (the
            gradient hook :func:`edgefl.algorithms.fedprox.proximal_hook` adds).
        corrections: SCAFFOLD's ``c - c_i`` per device (name -> ``(K, *shape)``), added to
            every gradient (as :func:`edgefl.algorithms.scaffold.correction_hook`).
        counts: each device's number of examples when they differ (the first
            ``counts[i]`` of ``X[i]`` are its own, the rest padding); needs a loss
            :func:`masks_supported` takes, and either mini-batches (``0 < batch_size <
            min(counts)``: every step ``batch_size`` wide with masks, even when the counts
            are equal) or full batches (``batch_size`` 0 or ``>= max(counts)``: every step
            the whole ``n``-wide stack, masked; ``n`` must be every device's
            :func:`full_batch_width`). Either way the same arithmetic for a device in any
            stack.
        offsets: with ``counts`` and mini-batches, the examples packed instead of padded:
            ``X`` and ``Y`` hold every device's examples back to back, ``(N, ...)``,
            device ``i``'s ``counts[i]`` from row ``offsets[i]`` on. Nothing is padded
            (a mini-batch takes each device's rows from there); the same result per
            device as the padded stack.
        buffers: the float buffers (BatchNorm running statistics) each device starts
            from, name -> ``(K, *shape)``, needed exactly when the model has some; updated
            in place by every step's forward pass, as the sequential trainer's steps update
            a model's (not with ``counts``: padding would enter the batch statistics).
            The model's own buffers (its integer counters too) are left alone.

    The per-device terms are added after ``backward()`` and before the step, where the
    sequential path runs the plugins' gradient hooks; the loss reported is the task loss.
    """
    from torch.func import functional_call, vmap

    if offsets is not None:  # (packed: every device's examples back to back)
        if counts is None or len(offsets) != len(counts) or int(Y.shape[0]) != int(X.shape[0]):
            raise ValueError(
                f"fit_stacked: packed examples need counts and offsets of every device and "
                f"targets for each of the {int(X.shape[0])} examples, got "
                f"{None if counts is None else len(counts)} counts, {len(offsets)} offsets and "
                f"{int(Y.shape[0])} targets"
            )
        ends = [int(o) + int(c) for o, c in zip(offsets, counts, strict=True)]
        if any(int(o) < 0 for o in offsets) or max(ends, default=0) > int(X.shape[0]):
            raise ValueError(
                f"fit_stacked: packed devices reach row {max(ends)} of {int(X.shape[0])}"
            )
        k, n = len(counts), max(counts, default=0)
        if batch_size == 0 or batch_size >= n:
            raise ValueError("fit_stacked: packed examples train in mini-batches only")
    else:
        k, n = int(X.shape[0]), int(X.shape[1])
    if len(generators) != k or (offsets is None and tuple(Y.shape[:2]) != (k, n)):
        raise ValueError(
            f"fit_stacked: {k} devices of {n} examples need {k} generators and targets of "
            f"shape ({k}, {n}, ...), got {len(generators)} and {tuple(Y.shape)}"
        )
    why = buffers_why_not(model)
    if why is not None:
        raise ValueError(f"fit_stacked: {why}")
    from ..models.flat import float_buffers

    floats = [name for name, _ in float_buffers(model)]
    if sorted(buffers or {}) != sorted(floats):
        raise ValueError(
            f"fit_stacked: the model's float buffers are {floats or 'none'}, got stacked "
            f"values for {sorted(buffers or {}) or 'none'}"
        )
    if floats and counts is not None:
        raise ValueError("fit_stacked: a model with BatchNorm buffers cannot take padded counts")
    whole = False  # (counts of full-batch devices: each step the whole padded stack)
    if counts is not None:
        lo, hi = min(counts, default=0), max(counts, default=0)
        whole = batch_size == 0 or batch_size >= hi
        if whole and any(full_batch_width(c) != n for c in counts):
            raise ValueError(
                f"fit_stacked: full-batch counts from {lo} to {hi} need the stack padded to "
                f"each one's full_batch_width, got {n} examples per device"
            )
        if len(counts) != k or not (whole or 0 < batch_size < lo) or hi > n:
            raise ValueError(
                f"fit_stacked: counts of {k} devices need 0 < batch_size < every count <= "
                f"{n}, or full batches, got batch_size {batch_size} and counts from {lo} to "
                f"{hi} ({len(counts)} of them)"
            )
        if not masks_supported(loss):
            raise ValueError("fit_stacked: counts need the built-in cross-entropy loss")
    bs, total = plan_steps(epochs, steps, batch_size, n)
    if whole:  # (steps of a full batch: as many for every device, whatever its size)
        bs, total = n, plan_steps(epochs, steps, 0, max(counts))[1]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # (frozen parameters, requires_grad False: torch's SGD leaves them alone, so does a stack)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    own = all(tuple(start[name].shape) == (k, *shapes[name]) for name in start)

    def stacked_start() -> dict[str, torch.Tensor]:
        if own:
            return {name: p.detach().clone() for name, p in start.items()}
        return {name: p.detach().expand(k, *p.shape).clone() for name, p in start.items()}

    if total == 0:
        return stacked_start(), torch.zeros(k)

    affine = None  # (a chain of Linear and ReLU with the cross-entropy: gradients written out)
    if (
        not floats
        and masks_supported(loss)
        and Y.dim() == (1 if offsets is not None else 2)
        and (not Y.is_floating_point())
    ):
        from .stacked_affine import affine_chain, chain_grad, chain_inputs, stack_part

        found = affine_chain(model)
        inputs = None if found is None else chain_inputs(X, found[1], offsets is not None)
        if inputs is not None:
            part = stack_part(found[0], shapes, bs, int(inputs.shape[-1]))
            if k > part:  # (in parts whose steps fit the caches: the same result per device)
                outs = [
                    fit_stacked(
                        model, {name: v[lo : lo + part] for name, v in start.items()} if own
                        else start, *((X, Y) if offsets is not None
                                      else (X[lo : lo + part], Y[lo : lo + part])),
                        generators=generators[lo : lo + part], loss=loss, lr=lr, epochs=epochs,
                        steps=steps, batch_size=batch_size, momentum=momentum,
                        weight_decay=weight_decay, prox_mu=prox_mu,
                        corrections=None if corrections is None
                        else {name: c[lo : lo + part] for name, c in corrections.items()},
                        counts=None if counts is None else counts[lo : lo + part],
                        offsets=None if offsets is None else offsets[lo : lo + part],
                    )
                    for lo in range(0, k, part)
                ]  # fmt: skip
                return (
                    {name: torch.cat([got[name] for got, _ in outs]) for name in outs[0][0]},
                    torch.cat([losses for _, losses in outs]),
                )
            affine, X = chain_grad(found[0]), inputs
    from ..models.per_example import functional_twin

    model = functional_twin(model)  # (plain LSTMs unrolled: vmap has no rule for fused ones)
    if floats:  # (the model's other buffers: copies, so its counters are left alone)
        fixed = {name: b.clone() for name, b in model.named_buffers() if name not in buffers}
        with_buffers = vmap(lambda p, b, xb: functional_call(model, (p, b, fixed), (xb,)))

        def forward(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return with_buffers(p, buffers, xb)
    else:
        forward = vmap(lambda p, xb: functional_call(model, p, (xb,)))
    per_device = _per_device_loss(loss)

    def grad_and_loss(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor,
                      mb: torch.Tensor | None):  # fmt: skip
        # one backward pass of the devices' summed losses: a device's parameters reach
        # only its own loss, so each gets its own gradient (``mb``: the padding's mask)
        p = {name: v.detach().requires_grad_(True) for name, v in params.items()}
        with torch.enable_grad():
            out = forward(p, xb)
            values = per_device(out, yb) if mb is None else _masked_ce(out, yb, mb)
            g = torch.autograd.grad(values.sum(), list(p.values()))
        return dict(zip(p, g, strict=True)), values.detach()

    was_training = model.training
    model.train()  # (as the sequential trainer: batch statistics, running ones updated)
    try:
        params = stacked_start()
        moment: dict[str, torch.Tensor] | None = None  # (SGD's momentum buffers)
        # each device's loss summed step by step (an elementwise sum: the same whatever
        # the stack's size, where a reduction over a (steps, devices) stack is not)
        loss_sum = torch.zeros(k, device=X.device)
        # (each device's rows of X: the stack's row, or its first row in packed examples)
        rows = torch.arange(k) if offsets is None else torch.tensor([int(o) for o in offsets])
        rows = rows.unsqueeze(1)  # (on the CPU, as the draws: torch moves indices to X's device)
        if whole:  # (no draws: full batches visit the examples in order, as one by one)
            mask = torch.arange(n).unsqueeze(0) < torch.tensor(list(counts)).unsqueeze(1)
            mask = mask.to(torch.float32).to(X.device)
            active = torch.ones(total, k, dtype=torch.bool, device=X.device)
            plan = [(None, mask, active[t]) for t in range(total)]
        elif counts is not None:
            idx_all, mask_all, active = _ragged_orders(
                counts, batch_size, epochs, steps, generators
            )
            mask_all, active = mask_all.to(X.device), active.to(X.device)  # (CUDA: on the GPU)
            plan = [(idx_all[t], mask_all[t], active[t]) for t in range(len(active))]
        else:
            plan = [(idx, None, None) for idx in _orders(n, bs, total, generators)]
        whole_t = None  # (the affine path's full batch, feature-major: transposed once)
        # devices of fewer steps are done while others go on: when those still training
        # are the first m of the stack at every step (longest first: the worker stacks
        # them so), only they compute, on views of the stack's first m rows; a device's
        # arithmetic is the same either way
        prefix = _active_prefix(active) if counts is not None and not whole else None
        for t, (idx, mb, act) in enumerate(plan):
            m = k if prefix is None else prefix[t]
            cut = m < k
            P = {name: v[:m] for name, v in params.items()} if cut else params
            r = rows[:m] if cut else rows
            if cut:
                idx, mb, act = idx[:m], mb[:m], None
            full = idx is None or (bs >= n and mb is None)  # (the full batch, in order)
            at = None if full else (r, idx) if offsets is None else (r + idx,)
            yb = Y if full else Y[at]
            if affine is not None:
                if full and whole_t is None:
                    whole_t = X.transpose(1, 2).contiguous()
                xt = whole_t if full else X[at].transpose(1, 2).contiguous()
                g, value = affine(P, xt, yb, mb)
            else:
                g, value = grad_and_loss(P, X if full else X[at], yb, mb)
            if cut:
                loss_sum[:m] += value.detach()
            else:
                loss_sum += value.detach() if act is None else value.detach() * act
            if frozen:
                g = {name: v for name, v in g.items() if name not in frozen}
            with torch.no_grad():
                if prox_mu:
                    s0 = {name: v[:m] for name, v in start.items()} if cut and own else start
                    g = {name: g[name] + prox_mu * (P[name] - s0[name]) for name in g}
                if corrections is not None:
                    g = {name: g[name] + corrections[name][:m] for name in g}
                if weight_decay:
                    g = {name: g[name] + weight_decay * P[name] for name in g}
                still = None if act is None or bool(act.all()) else ~act  # (devices done)
                if momentum:
                    if moment is None and cut:  # (a device's first step: its buffer is g)
                        moment = {name: torch.zeros_like(params[name]) for name in g}
                        for name in moment:
                            moment[name][:m].copy_(g[name])
                    elif moment is None:
                        moment = {name: v.clone() for name, v in g.items()}
                    elif still is None:
                        for name in moment:
                            moment[name][:m].mul_(momentum).add_(g[name])
                    else:
                        for name in moment:
                            new_buf = moment[name] * momentum + g[name]
                            moment[name] = torch.where(
                                _along(still, new_buf), moment[name], new_buf
                            )
                    g = {name: v[:m] for name, v in moment.items()} if cut else moment
                if cut:  # (in place: the stack's rows of the devices done stay as they are)
                    for name in g:
                        P[name].add_(g[name], alpha=-lr)
                    continue
                new = {name: torch.add(params[name], g[name], alpha=-lr) if name in g
                       else params[name] for name in params}  # fmt: skip
                if still is not None:
                    new = {name: torch.where(_along(still, v), params[name], v)
                           for name, v in new.items()}  # fmt: skip
                params = new
        if counts is None:
            return params, loss_sum / len(plan)
        return params, loss_sum / active.sum(0).clamp(min=1).to(loss_sum.dtype)
    finally:
        model.train(was_training)


def probe(model: nn.Module, X: torch.Tensor, Y: torch.Tensor, loss: Callable) -> str | None:
    """Why ``model`` cannot train stacked, found by trying (None: it can): one stacked step
    of two devices on the first (at most 8) of one device's examples ``X``, ``Y``, with
    the model's own start and float buffers. A model whose forward ``torch.func.vmap``
    cannot batch (a custom kernel, an in-place write to an input, a data-dependent
    branch) says so here, before any task, rather than in the middle of a run."""
    from ..models.flat import float_buffers

    m = min(int(len(Y)), 8)
    if m == 0:
        return None
    start = {name: p.detach() for name, p in model.named_parameters()}
    bufs = {name: b.detach().expand(2, *b.shape).clone() for name, b in float_buffers(model)}
    x2 = X[:m].unsqueeze(0).expand(2, *X[:m].shape)
    y2 = Y[:m].unsqueeze(0).expand(2, *Y[:m].shape)
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    try:
        fit_stacked(model, start, x2, y2, generators=gens, loss=loss, lr=0.0, steps=1,
                    buffers=bufs or None)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any failure is the reason to train alone
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"the model cannot train stacked under torch.func.vmap ({type(e).__name__}: {first})"
    return None


def held_out_losses(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    buffers: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Each device's mean cross-entropy on its own held-out examples, its own model: a
    gate's measure of a stack at once, as :func:`edgefl.models.train.evaluate` computes
    it one device at a time (the sum of the examples' losses over their number; eval
    mode: BatchNorm uses each device's running statistics), within float32 rounding.
    Devices are evaluated in groups of one padded width, :func:`full_batch_width` of
    their own count, so a device's loss does not depend on the others in its stack.

    Args:
        model: the architecture (its own parameters and buffers are not used).
        params: each device's parameters, name -> ``(K, *shape)``.
        data: each device's held-out ``(x, y)``, ``y`` class targets ``(h_i,)``.
        buffers: each device's float buffers (name -> ``(K, *shape)``), if the model has.

    Returns ``(K,)`` float32 on the parameters' device (nan for a device without
    held-out examples), or None when the model's output is not class logits (the gate
    then evaluates each device alone).
    """
    import torch.nn.functional as F
    from torch.func import functional_call, vmap

    from ..models.per_example import functional_twin

    net = functional_twin(model)
    dev = next(iter(params.values())).device
    out = torch.full((len(data),), torch.nan, device=dev)
    by_width: dict[int, list[int]] = {}
    for i, (_, y) in enumerate(data):
        if len(y):
            by_width.setdefault(full_batch_width(len(y)), []).append(i)
    if buffers:
        run = vmap(lambda p, b, x: functional_call(net, (p, b), (x,)))
    else:
        run = vmap(lambda p, b, x: functional_call(net, p, (x,)), in_dims=(0, None, 0))
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            for w, rows in by_width.items():
                x0, y0 = data[rows[0]]
                X = torch.zeros((len(rows), w, *x0.shape[1:]), dtype=x0.dtype, device=dev)
                Y = torch.zeros((len(rows), w, *y0.shape[1:]), dtype=y0.dtype, device=dev)
                counts = [len(data[i][1]) for i in rows]
                for j, (i, c) in enumerate(zip(rows, counts, strict=True)):
                    X[j, :c], Y[j, :c] = data[i][0], data[i][1]
                n = torch.tensor(counts, device=dev)
                sel = torch.tensor(rows, device=dev)
                p = {name: v[sel] for name, v in params.items()}
                b = {name: v[sel] for name, v in buffers.items()} if buffers else None
                logits = run(p, b, X)
                if logits.dim() != 3 or Y.dim() != 2:
                    return None
                mask = torch.arange(w, device=dev).unsqueeze(0) < n.unsqueeze(1)
                each = F.cross_entropy(logits.transpose(1, 2), Y, reduction="none")
                out[sel] = (each * mask).sum(1) / n
    finally:
        net.train(was_training)
    return out


def _along(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-device ``flags`` ``(K,)`` shaped to broadcast over ``like`` ``(K, ...)``."""
    return flags.view(-1, *([1] * (like.dim() - 1)))


__all__ = [
    "buffers_why_not",
    "fit_stacked",
    "full_batch_width",
    "groups",
    "held_out_losses",
    "masks_supported",
    "probe",
]
