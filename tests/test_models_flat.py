"""FlatParams: one contiguous float32 buffer shared with the model's parameters."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgefl.errors import ConfigError
from edgefl.models import FlatParams, build_model, layout_signature

IMG = SimpleNamespace(
    input_shape=(1, 8, 8), num_classes=10, task="classification", input_dtype="float32"
)
SEQ = SimpleNamespace(input_shape=(6,), num_classes=20, task="lm", input_dtype="int64")


def test_layout_consistent():
    model = build_model("cnn", IMG, {}, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp = FlatParams(model)
    assert fp.names == list(before)
    assert fp.shapes == [tuple(t.shape) for t in before.values()]
    sizes = [int(np.prod(s)) for s in fp.shapes]
    assert fp.offsets == list(np.cumsum([0] + sizes[:-1]))
    assert fp.numel == sum(sizes) and fp.nbytes == 4 * fp.numel
    assert fp.host.dtype == np.float32 and fp.host.shape == (fp.numel,)
    for (name, p), off, n in zip(model.named_parameters(), fp.offsets, sizes, strict=True):
        assert torch.equal(p.detach(), before[name])  # values preserved by re-pointing
        assert np.array_equal(fp.host[off : off + n], before[name].numpy().reshape(-1))
        assert p.data_ptr() == fp.flat.data_ptr() + 4 * off
    assert fp.to_host() is fp.host
    assert fp.signature == layout_signature(fp.names, fp.shapes)


def test_layout_signature():
    a = layout_signature(["w", "b"], [(2, 3), (3,)])
    assert a == layout_signature(["w", "b"], [[2, 3], [3]]) and len(a) == 16
    assert a != layout_signature(["w", "b"], [(3, 2), (3,)])
    assert a != layout_signature(["b", "w"], [(3,), (2, 3)])


def test_host_write_changes_output():
    model = build_model("mlp", IMG, {}, seed=0)
    fp = FlatParams(model)
    x = torch.randn(4, 1, 8, 8)
    y0 = model(x).detach().clone()
    fp.host[:] = 0.0
    assert torch.equal(model(x), torch.zeros(4, 10))
    values = np.random.default_rng(0).standard_normal(fp.numel).astype(np.float32)
    fp.from_host(values)
    assert np.array_equal(fp.host, values)
    assert not torch.equal(model(x).detach(), y0)


def test_lstm_shares_memory():
    model = build_model("lstm", SEQ, {"hidden": 8, "embed": 4}, seed=0)
    fp = FlatParams(model)
    x = torch.randint(0, 20, (2, 6))
    y0 = model(x).detach().clone()
    fp.host *= 2.0
    assert not torch.allclose(model(x).detach(), y0)


def test_optimizer_step_updates_host_in_place():
    model = build_model("cnn", IMG, {}, seed=0)
    fp = FlatParams(model)
    ptr = fp.host.ctypes.data
    before = fp.host.copy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(
            model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))
        )
        loss.backward()
        opt.step()
    assert fp.host.ctypes.data == ptr
    assert not np.array_equal(fp.host, before)
    assert np.array_equal(
        fp.host, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    )
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_from_host_size_mismatch():
    fp = FlatParams(build_model("logreg", IMG, {}, seed=0))
    with pytest.raises(ValueError, match=f"got {fp.numel - 1} values.*has {fp.numel}"):
        fp.from_host(np.zeros(fp.numel - 1, np.float32))
    with pytest.raises(ValueError, match="shape"):
        fp.from_host(np.zeros((1, fp.numel), np.float32))
    fp.from_host(np.ones(fp.numel, np.float64))  # same-kind cast is accepted
    assert (fp.host == 1.0).all()


def test_rejects_non_float32_and_frozen():
    with pytest.raises(ConfigError, match="float64"):
        FlatParams(torch.nn.Linear(2, 2).double())
    frozen = torch.nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ConfigError, match="'bias'.*does not require grad"):
        FlatParams(frozen)


def test_tied_parameters_counted_once():
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    )
    model[1].weight = model[0].weight
    fp = FlatParams(model)
    assert fp.numel == 9 and fp.names == ["0.weight"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip():
    model = build_model("cnn", IMG, {}, seed=0)
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
    fp = FlatParams(model, device="cuda")
    assert fp.flat.is_cuda and all(p.is_cuda for p in model.parameters())
    host = fp.to_host()
    assert host is fp.host and np.array_equal(host, ref)
    values = np.random.default_rng(1).standard_normal(fp.numel).astype(np.float32)
    fp.from_host(values)
    assert np.array_equal(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy(), values
    )
    assert np.array_equal(fp.to_host(), values)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 1, 8, 8, device="cuda")).sum().backward()
    opt.step()
    assert not np.array_equal(fp.to_host(), values)
    with pytest.raises(ValueError):
        fp.from_host(values[:-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lstm_round_trip():
    model = build_model("lstm", SEQ, {}, seed=0)
    fp = FlatParams(model, device="cuda")
    x = torch.randint(0, 20, (2, 6), device="cuda")
    y0 = model(x).detach().clone()
    fp.from_host(fp.to_host() * 2.0)
    assert not torch.allclose(model(x).detach(), y0)
