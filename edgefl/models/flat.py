"""One contiguous float32 buffer holding every parameter of a model.

The messaging layer sends and receives model parameters straight from ``FlatParams.host``
(a numpy array), so after construction every ``param.data`` is a view into ``FlatParams.flat``
and in-place optimiser updates show up in the buffer without copying.
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


class FlatParams:
    """All parameters of ``model`` re-pointed into one contiguous float32 buffer.

    On CPU, ``host`` is a numpy float32 array and ``flat`` is ``torch.from_numpy(host)``:
    the same memory, which every parameter's ``.data`` views. On a CUDA device, ``flat`` is a
    device tensor holding all parameters and ``host`` is a (pinned when possible) host staging
    buffer: ``to_host()`` copies flat -> host, ``from_host(arr)`` copies arr -> flat.

    Attributes: ``names`` (parameter names, ``named_parameters`` order, shared parameters
    once), ``shapes``, ``offsets`` (start of each parameter in elements), ``numel`` (elements),
    ``nbytes`` (bytes, 4 per element), ``signature`` (``layout_signature`` of the layout),
    ``device``. Buffers (``model.buffers()``) are not included; the model is moved to
    ``device``. Gradients are separate tensors allocated by autograd.

    Do not call ``model.to(...)``/``.cuda()``/``.float()`` afterwards: that replaces the
    parameter storage and silently breaks the sharing. (On CUDA, cuDNN LSTMs warn once that
    their weights are not one cuDNN chunk; results are correct.)
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
        self.names: list[str] = [n for n, _ in params]
        self.shapes: list[tuple[int, ...]] = [tuple(p.shape) for _, p in params]
        self.offsets: list[int] = []
        total = 0
        for _, p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel: int = total
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
            for (_, p), off, shape in zip(params, self.offsets, self.shapes, strict=True):
                n = p.numel()
                view = self.flat[off : off + n]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(shape)
                p.grad = None

    def to_host(self) -> np.ndarray:
        """Current parameter values as the host numpy buffer (float32, ``numel`` elements).

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
        """Load ``values`` (1-D, ``numel`` float32 elements) into the model's parameters.

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

    def __repr__(self) -> str:
        return (
            f"FlatParams({len(self.names)} tensors, {self.numel} params, "
            f"device={self.device}, signature={self.signature})"
        )
