"""The stacked step of affine chains, written out: gradients without autograd.

:func:`edgefl.training.stacked.fit_stacked` computes a stack's gradients with ``vmap``
and one backward pass. For the models most edge jobs train, a chain of ``nn.Linear``
layers with ``ReLU`` between them and the cross-entropy on top (the built-in ``logreg``
and ``mlp``, a plain ``nn.Linear``, an ``nn.Sequential`` of ``Flatten``/``Linear``/
``ReLU``), the gradient has a short closed form, and computing it directly skips the
graph's bookkeeping and lets every batched matrix product run in its fastest layout:

- activations are kept feature-major, ``(devices, features, batch)``: a layer is one
  batched product of the weights ``(devices, out, in)`` with them (plus the bias), the
  logits come out with the classes on dim 1, where the cross-entropy and the softmax are
  fastest; the products go through numpy's BLAS on the CPU (:mod:`.blas`: portable and
  2x to 3x faster than torch's ``bmm`` under portable kernels);
- the logits' gradient is ``(softmax - onehot) * mask / count`` (``count`` each device's
  examples in the step, ``mask`` 0 for padding), computed by the kernel autograd runs for
  ``log_softmax``'s backward; the weights' is ``g @ a^T``, the bias's the sum of ``g``
  over the batch, and a ReLU passes ``g`` where its output is positive.

The same arithmetic in another order, so it equals the autograd path and the sequential
trainer within float32 rounding (``tests/test_stacked.py``). Every operation is batched
along the device axis, so a device's result does not depend on the others in its stack.
Only kernels whose per-row arithmetic was checked not to depend on the stack's size are
used (``torch.softmax`` over dim 1 does depend on it, so the softmax comes from
``log_softmax``'s backward kernel), and no ``torch.exp`` (MKL's vector math, which differs
between CPU vendors under portable kernels).

Measured with ``edgefl bench stacked`` (docs/performance.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .blas import bmm

#: (weight name, bias name or None) of each Linear layer, input to output
Chain = list[tuple[str, str | None]]


def affine_chain(model: nn.Module) -> tuple[Chain, bool] | None:
    """The layers of ``model`` if it is a chain of Linear layers with ReLU between them,
    and whether it flattens each example and casts it to float first; None if it is
    anything else (its own forward, another activation, dropout, buffers, a hook ...).

    Recognised: ``nn.Linear``; ``nn.Sequential`` of an optional leading ``nn.Flatten()``
    then ``Linear`` layers separated by one ``ReLU`` each; the built-in ``logreg`` and
    ``mlp`` models (exactly those classes: a subclass may have its own forward)."""
    from ..models.logreg import LogReg
    from ..models.mlp import MLP

    if _hooked(model):
        return None
    if type(model) is LogReg:
        return _linears(model.linear, "linear."), True
    if type(model) is MLP:
        chain = _sequential(model.net, "net.")
        return None if chain is None else (chain, True)
    if type(model) is nn.Linear:
        return _linears(model, ""), False
    if type(model) is nn.Sequential:
        mods = list(model)
        flat = bool(mods) and type(mods[0]) is nn.Flatten
        if flat and (mods[0].start_dim, mods[0].end_dim) != (1, -1):
            return None
        chain = _sequential(model, "", skip=1 if flat else 0)
        return None if chain is None else (chain, flat)
    return None


def _hooked(model: nn.Module) -> bool:
    """Whether a hook would run in ``model``'s forward or backward (its own or global):
    the written-out step would skip it."""
    from torch.nn.modules import module as m

    if (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
            or m._global_backward_pre_hooks):  # fmt: skip
        return True
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(mod, kind, None) for mod in model.modules() for kind in kinds)


def _linears(lin: nn.Linear, prefix: str) -> Chain:
    return [(prefix + "weight", None if lin.bias is None else prefix + "bias")]


def _sequential(seq: nn.Sequential, prefix: str, skip: int = 0) -> Chain | None:
    """Linear (ReLU Linear)* from position ``skip`` of ``seq``, or None."""
    chain: Chain = []
    mods = list(seq.named_children())[skip:]
    for i, (name, mod) in enumerate(mods):
        want = nn.Linear if i % 2 == 0 else nn.ReLU
        if type(mod) is not want:
            return None
        if want is nn.Linear:
            chain += _linears(mod, f"{prefix}{name}.")
    if not mods or len(mods) % 2 == 0:  # (empty, or ending in a ReLU)
        return None
    return chain


#: float32 values one step of a stack touches at most (8 MiB): what the caches hold
STEP_FLOATS = 1 << 21


def stack_part(chain: Chain, shapes: dict[str, tuple[int, ...]], width: int,
               features: int) -> int:  # fmt: skip
    """How many devices :func:`chain_grad` takes a step of at once, at most: those whose
    step fits :data:`STEP_FLOATS` (each: the batch of ``width`` examples of ``features``
    inputs twice, its activations and their gradients, its parameters three times), at
    least 1. Larger stacks train in parts of this many devices, one after the other: a
    device's result is the same (it does not depend on the others in its stack), and the
    steps are 1.3x to 1.5x faster per device than in stacks 4x as large, where they spill
    out of the caches (docs/performance.md)."""
    params = sum(math.prod(shapes[w]) + (shapes[w][0] if b else 0) for w, b in chain)
    outs = sum(shapes[w][0] for w, _ in chain)
    per_device = max(1, width) * (2 * features + 4 * outs) + 3 * params
    return max(1, STEP_FLOATS // per_device)


def chain_inputs(X: torch.Tensor, flattens: bool, packed: bool = False) -> torch.Tensor | None:
    """A stack's examples ``(K, n, ...)`` as the chain's first layer takes them, ``(K, n,
    features)`` float (the model's own flatten and cast), or None when they can't be
    (a plain Linear given anything but float vectors). ``packed``: the examples of all
    devices back to back, ``(N, ...)`` -> ``(N, features)``."""
    lead = X.shape[:1] if packed else X.shape[:2]
    if flattens:
        X = X.reshape(*lead, -1)
        return X if X.is_floating_point() else X.float()
    return X if X.dim() == len(lead) + 1 and X.is_floating_point() else None


def chain_grad(chain: Chain) -> Callable:
    """``grad(params, xT, y, mask) -> (grads, losses)``: the gradient of each device's
    mean cross-entropy with respect to its parameters, and that loss, for a stack.

    ``params`` name -> ``(K, *shape)``; ``xT`` the batch feature-major, ``(K, features,
    b)``; ``y`` class targets ``(K, b)``; ``mask`` ``(K, b)`` (1 a real example, 0
    padding) or None (all real). A device without a real example has loss 0 and gradient
    0 (it stands still), as :func:`edgefl.training.stacked.fit_stacked`'s masked loss."""
    import torch.nn.functional as F

    last = len(chain) - 1

    def grad(params: dict[str, torch.Tensor], xT: torch.Tensor, y: torch.Tensor,
             mask: torch.Tensor | None):  # fmt: skip
        acts = [xT]
        a = xT
        for i, (w, b) in enumerate(chain):
            a = bmm(params[w], a)
            if b is not None:
                a += params[b].unsqueeze(2)
            if i < last:
                a = a.clamp_min(0.0)  # (ReLU)
                acts.append(a)
        # the cross-entropy and its gradient as autograd computes them (log_softmax over
        # the classes and its backward kernel: a device's values whatever its stack)
        logp = F.log_softmax(a, dim=1)
        at = y.unsqueeze(1)
        each = -logp.gather(1, at).squeeze(1)  # (K, b)
        if mask is None:
            losses = each.mean(1)
            weight = torch.full(at.shape, -1.0 / y.shape[1], dtype=a.dtype, device=a.device)
        else:
            count = mask.sum(1).clamp(min=1.0)
            losses = (each * mask).sum(1) / count
            weight = -(mask / count.unsqueeze(1)).unsqueeze(1)
        g = torch._log_softmax_backward_data(
            torch.zeros_like(logp).scatter_(1, at, weight), logp, 1, logp.dtype
        )
        grads: dict[str, torch.Tensor] = {}
        for i in range(last, -1, -1):
            w, b = chain[i]
            grads[w] = bmm(g, acts[i].transpose(1, 2))
            if b is not None:
                grads[b] = g.sum(2)
            if i:
                g = bmm(params[w].transpose(1, 2), g)
                g.mul_(acts[i] > 0)
        return grads, losses

    return grad


__all__ = ["STEP_FLOATS", "affine_chain", "chain_grad", "chain_inputs", "stack_part"]
