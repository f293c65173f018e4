"""One contiguous float32 buffer holding every parameter (and float buffer) of a model.

The messaging layer sends and receives model parameters straight from ``FlatParams.host``
(a numpy array), so after construction every ``param.data`` is a view into ``FlatParams.flat``
and in-place optimiser updates show up in the buffer without copying. The model's persistent
float32 buffers (BatchNorm ``running_mean`` / ``running_var``) follow the parameters in the
same buffer, as views too: BatchNorm updates them in place, so they travel and are averaged
like the parameters (``model.buffers = "local"`` keeps them per device instead, FedBN).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from edgefl.errors import ConfigError


def layout_signature(names: Sequence[str], shapes: Iterable[Sequence[int]]) -> str:
    """Short stable hex digest (16 chars) of parameter names and shapes, in order.

    Two models produce the same signature iff their flat layouts are interchangeable.
    """
    payload = json.dumps(
        [[str(n), [int(d) for d in s]] for n, s in zip(names, shapes, strict=True)],
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def float_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``model`` that travel in the flat vector: persistent floating-point ones
    (those ``state_dict`` holds), ``named_buffers`` order, shared buffers once.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are counters, not statistics: an
    average of them means nothing, so they stay with each model instance. Non-persistent
    buffers (``register_buffer(..., persistent=False)``: masks, caches) are derived from the
    configuration, not learned, and would only make every message bigger. A float buffer
    that is not float32 is a ConfigError naming it.
    """
    out = []
    for name, buf in model.named_buffers():
        if not buf.is_floating_point():
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf in module._non_persistent_buffers_set:
            continue
        if buf.dtype != torch.float32:
            raise ConfigError(
                f"model buffer {name!r}: has dtype {buf.dtype}, edgefl needs float32 "
                "(or an integer buffer, which stays with each model instance)"
            )
        out.append((name, buf))
    return out


class FlatParams:
    """All parameters of ``model``, then its float buffers, re-pointed into one contiguous
    float32 buffer.

    On CPU, ``host`` is a numpy float32 array and ``flat`` is ``torch.from_numpy(host)``:
    the same memory, which every parameter's ``.data`` views. On a CUDA device, ``flat`` is a
    device tensor holding all parameters and ``host`` is a (pinned when possible) host staging
    buffer: ``to_host()`` copies flat -> host, ``from_host(arr)`` copies arr -> flat.

    Attributes: ``names`` (parameter names, ``named_parameters`` order, shared parameters
    once, then the names of the :func:`float_buffers`), ``shapes``, ``offsets`` (start of each
    tensor in elements), ``numel`` (elements, parameters and buffers), ``nbytes`` (bytes, 4 per
    element), ``signature`` (``layout_signature`` of the layout), ``device``;
    ``param_numel`` (elements of the parameters: they come first, ``[0, param_numel)``),
    ``buffer_names`` and ``buffer_slice`` (``slice(param_numel, numel)``, empty for a model
    without float buffers, whose layout and signature are exactly the parameters'). Integer
    buffers stay in the model, untouched. The model is moved to ``device``. Gradients are
    separate tensors allocated by autograd (parameters only).

    Do not call ``model.to(...)``/``.cuda()``/``.float()`` afterwards, nor assign a new
    tensor to a buffer attribute (``self.running_mean = ...``): that replaces the storage and
    silently breaks the sharing (in-place updates, ``copy_``, ``load_state_dict`` are fine).
    (On CUDA, cuDNN LSTMs warn once that their weights are not one cuDNN chunk; results are
    correct.)
    """

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        model.to(self.device)
        params = list(model.named_parameters())
        if not params:
            raise ConfigError(f"model {type(model).__name__}: has no parameters to train")
        for name, p in params:
            if p.dtype != torch.float32:
                raise ConfigError(
                    f"model parameter {name!r}: has dtype {p.dtype}, edgefl needs float32"
                )
            if not p.requires_grad:
                raise ConfigError(
                    f"model parameter {name!r}: does not require grad (frozen parameters "
                    "are not supported; register it as a buffer instead)"
                )
        buffers = float_buffers(model)
        tensors = params + buffers
        self.names: list[str] = [n for n, _ in tensors]
        self.shapes: list[tuple[int, ...]] = [tuple(t.shape) for _, t in tensors]
        self.buffer_names: list[str] = [n for n, _ in buffers]
        self.offsets: list[int] = []
        total = 0
        for i, (_, t) in enumerate(tensors):
            if i == len(params):
                self.param_numel: int = total
            self.offsets.append(total)
            total += t.numel()
        if not buffers:
            self.param_numel = total
        self.numel: int = total
        self.buffer_slice: slice = slice(self.param_numel, total)
        self.nbytes: int = total * 4
        self.signature: str = layout_signature(self.names, self.shapes)

        self._host_t: torch.Tensor | None = None
        if self.device.type == "cpu":
            self.host: np.ndarray = np.empty(total, dtype=np.float32)
            self.flat: torch.Tensor = torch.from_numpy(self.host)
        else:
            self.flat = torch.empty(total, dtype=torch.float32, device=self.device)
            try:
                self._host_t = torch.empty(total, dtype=torch.float32, pin_memory=True)
            except RuntimeError:  # pinning unavailable: a pageable buffer still works
                self._host_t = torch.empty(total, dtype=torch.float32)
            self.host = self._host_t.numpy()

        with torch.no_grad():
            for (_, t), off, shape in zip(tensors, self.offsets, self.shapes, strict=True):
                n = t.numel()
                view = self.flat[off : off + n]
                view.copy_(t.detach().reshape(-1))
                t.data = view.view(shape)  # (the same tensor object: the module keeps it)
                t.grad = None

    def to_host(self) -> np.ndarray:
        """Current parameter (and float buffer) values as the host numpy buffer (float32,
        ``numel`` elements).

        On CPU this is ``host`` itself (no copy); on CUDA flat is copied into ``host`` first.
        The returned array is reused: copy it if you need a snapshot.
        """
        if self._host_t is not None:
            self._host_t.copy_(self.flat)
        return self.host

    def snapshot(self) -> np.ndarray:
        """A fresh copy of the current parameter values (float32, ``numel`` elements)."""
        return self.to_host().copy()

    def from_host(self, values: np.ndarray) -> None:
        """Load ``values`` (1-D, ``numel`` float32 elements) into the model's parameters and
        float buffers.

        Raises ValueError naming both sizes if ``values`` has the wrong size or is not 1-D.
        """
        arr = np.asarray(values)
        if arr.ndim != 1 or arr.size != self.numel:
            raise ValueError(
                f"FlatParams.from_host: got {arr.size} values (shape {arr.shape}), "
                f"model has {self.numel} parameters"
            )
        if self._host_t is None:
            if arr is not self.host:
                np.copyto(self.host, arr, casting="same_kind")
            return
        if arr is not self.host:
            np.copyto(self.host, arr, casting="same_kind")
        self.flat.copy_(self._host_t)

    def buffer_values(self) -> np.ndarray:
        """A fresh copy of the float buffers' current values (float32, the ``buffer_slice``
        elements; empty for a model without float buffers)."""
        return self.flat[self.buffer_slice].detach().cpu().numpy().copy()

    def load_buffers(self, values: np.ndarray) -> None:
        """Write ``values`` (1-D float32, ``numel - param_numel`` elements) into the model's
        float buffers; the parameters are untouched. ValueError on a wrong size."""
        arr = np.asarray(values, dtype=np.float32)
        n = self.numel - self.param_numel
        if arr.ndim != 1 or arr.size != n:
            raise ValueError(
                f"FlatParams.load_buffers: got {arr.size} values (shape {arr.shape}), "
                f"model has {n} buffer elements"
            )
        with torch.no_grad():
            self.flat[self.buffer_slice].copy_(torch.from_numpy(arr))

    def __repr__(self) -> str:
        bufs = f", {self.numel - self.param_numel} buffer elements" if self.buffer_names else ""
        return (
            f"FlatParams({len(self.names)} tensors, {self.param_numel} params{bufs}, "
            f"device={self.device}, signature={self.signature})"
        )
