"""edgefl.training.blas: the stacked step's batched products through numpy's BLAS."""

from __future__ import annotations

import torch

from edgefl.training.blas import bmm


def _stack(k: int, n: int, m: int, seed: int) -> torch.Tensor:
    return torch.randn(k, n, m, generator=torch.Generator().manual_seed(seed))


def test_the_product_equals_torchs_within_rounding_transposed_views_included():
    a, b = _stack(9, 10, 20, 1), _stack(9, 20, 33, 2)
    for x, y in ((a, b), (b.transpose(1, 2), a.transpose(1, 2))):
        got, want = bmm(x, y), torch.bmm(x, y)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    d = bmm(a.double(), b.double())
    assert d.dtype == torch.float64
    assert torch.allclose(d, torch.bmm(a.double(), b.double()), rtol=1e-12, atol=1e-12)


def test_a_devices_product_is_bit_for_bit_the_same_in_any_stack():
    a, b = _stack(40, 64, 60, 3), _stack(40, 60, 32, 4)
    whole = bmm(a, b)
    for idx in ([7], [7, 8, 9], list(range(0, 40, 3)), [39, 7]):
        part = bmm(a[idx], b[idx])
        assert torch.equal(part, whole[idx])


def test_what_numpy_cannot_take_goes_to_torch():
    """Half precision and tensors autograd records: torch's bmm (gradients flow)."""
    a, b = _stack(3, 4, 5, 5), _stack(3, 5, 6, 6)
    h = bmm(a.bfloat16(), b.bfloat16())
    assert h.dtype == torch.bfloat16
    w = a.clone().requires_grad_(True)
    out = bmm(w, b)
    assert out.requires_grad
    out.sum().backward()
    assert torch.allclose(w.grad, b.sum(2).unsqueeze(1).expand_as(w))
    with torch.no_grad():
        assert not bmm(w, b).requires_grad
