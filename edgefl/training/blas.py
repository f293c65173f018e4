"""The batched matrix products of the written-out stacked step, on the CPU through numpy's
BLAS (OpenBLAS in numpy's wheels).

Why: a stack's products are many small ones, ``(devices, out, in) @ (devices, in,
batch)`` with ``in``, ``out`` and ``batch`` in the tens to hundreds. Under portable kernels
(``run.kernels``, edgefl/kernels.py) torch's ``bmm`` runs them through MKL's
``COMPATIBLE`` code path, the one MKL documents as vendor-independent, which is SSE2 code:
for these shapes 2x to 3x slower than MKL's own AVX2/AVX-512 path. numpy hands each
device's product to OpenBLAS, whose kernels portable mode pins to its ``Haswell`` set
(``OPENBLAS_CORETYPE``: AVX2 with FMA, the set OpenBLAS also runs on AMD Zen), so the
products are portable and run at AVX2 speed. ``edgefl bench stacked`` shows what it gives
(docs/performance.md).

Numerics: numpy multiplies each device's two matrices with one BLAS call of their own
shapes, so a device's product does not depend on the other devices in its stack, its
position there, or the stack's size (``tests/test_stacked_affine.py`` checks it bit for
bit). Against torch's ``bmm`` it adds in another order: equal within float32 rounding.

Anything numpy can't take the same way (a GPU tensor, half precision, a tensor autograd
records) goes to ``torch.bmm``.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for stacks ``a`` ``(K, n, m)`` and ``b`` ``(K, m, p)``: ``(K, n, p)``, a new
    tensor. Transposed views are taken as they are (BLAS reads them transposed, no copy)."""
    if (
        a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dtype in _NUMPY_DTYPES
        and a.dtype == b.dtype
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    ):
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
    return torch.bmm(a, b)


__all__ = ["bmm"]
