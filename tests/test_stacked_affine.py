"""edgefl.training.stacked_affine: the stacked step of Linear/ReLU chains with gradients
written out, against the autograd path of fit_stacked (the same model behind a wrapper
the chain detection does not recognise) and against the shapes it must refuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgefl.models.logreg import LogReg
from edgefl.models.mlp import MLP
from edgefl.training.stacked import fit_stacked, full_batch_width
from edgefl.training.stacked_affine import affine_chain, chain_inputs

K, N, D, C = 7, 29, 6, 4


class _Opaque(nn.Module):
    """The same network behind a forward of its own: fit_stacked's autograd path."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _prefixed(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"inner.{n}": v for n, v in params.items()}


def _gens() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(77 * d + 1) for d in range(K)]


def _both(model: nn.Module, X, Y, **opts):
    """(affine path, autograd path) results of fit_stacked on ``model``."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    fast = fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, **opts)
    wrapped = _Opaque(model)
    assert affine_chain(wrapped) is None
    corr = opts.pop("corrections", None)
    slow = fit_stacked(wrapped, _prefixed(start), X, Y, generators=_gens(), loss=ce,
                       corrections=None if corr is None else _prefixed(corr), **opts)  # fmt: skip
    return start, fast, slow


def _assert_close(start, fast, slow, tol=2e-6) -> None:
    (pf, lf), (ps, ls) = fast, slow
    for n in start:
        ref = ps[f"inner.{n}"]
        assert not torch.equal(pf[n], start[n].expand_as(pf[n]))  # (it trained)
        rel = ((pf[n] - ref).abs().max() / ref.abs().max()).item()
        assert rel < tol, (n, rel)
    assert torch.allclose(lf, ls, rtol=tol, atol=1e-7)


def _data(seed: int, shape=(D,)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, N, *shape, generator=g), torch.randint(0, C, (K, N), generator=g)


def _mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(D, 9, bias=bias), nn.ReLU(), nn.Linear(9, 5), nn.ReLU(),
                         nn.Linear(5, C, bias=bias))  # fmt: skip


CASES = [  # (full batch; mini-batches with momentum and weight decay; a number of steps)
    dict(lr=0.2, epochs=0, steps=4, batch_size=0),
    dict(lr=0.05, epochs=2, steps=0, batch_size=6, momentum=0.9, weight_decay=1e-3),
    dict(lr=0.1, epochs=0, steps=9, batch_size=8, momentum=0.5),
]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp-nobias"])
def test_the_written_out_step_equals_the_autograd_step(kind, opts):
    X, Y = _data(1)
    torch.manual_seed(2)
    model = nn.Linear(D, C) if kind == "linear" else _mlp(bias=kind == "mlp")
    _assert_close(*_both(model, X, Y, **opts))


@pytest.mark.parametrize("opts", CASES[1:])
def test_padded_stacks_of_different_sizes_equal_the_autograd_step(opts):
    X, Y = _data(2)
    counts = [29, 11, 17, 9, 29, 12, 20]
    _assert_close(*_both(_mlp(), X, Y, counts=counts, **opts))


def test_padded_full_batches_equal_the_autograd_step():
    counts = [25, 30, 32, 27, 29, 31, 26]
    width = full_batch_width(max(counts))
    X, Y = _data(3)
    X = torch.cat([X, torch.randn(K, width - N, D)], 1)
    Y = torch.cat([Y, torch.zeros(K, width - N, dtype=Y.dtype)], 1)
    _assert_close(*_both(_mlp(), X, Y, counts=counts, lr=0.3, steps=5))


def test_fedprox_and_scaffold_terms_equal_the_autograd_step():
    X, Y = _data(4)
    model = _mlp()
    g = torch.Generator().manual_seed(5)
    corr = {n: 0.05 * torch.randn(K, *p.shape, generator=g) for n, p in model.named_parameters()}
    _assert_close(*_both(model, X, Y, lr=0.1, epochs=1, batch_size=5, prox_mu=0.2,
                         corrections=corr))  # fmt: skip


def test_the_built_in_models_flatten_and_cast_their_examples_as_one_by_one():
    """logreg and mlp on 2x3 'images' of small integers (uint8): flattened and cast to
    float as their forward does."""
    g = torch.Generator().manual_seed(6)
    X = torch.randint(0, 4, (K, N, 2, 3), generator=g, dtype=torch.uint8)
    Y = torch.randint(0, C, (K, N), generator=g)
    for model in (LogReg(6, C), MLP(6, [8], C)):
        assert affine_chain(model) is not None
        _assert_close(*_both(model, X, Y, lr=0.05, epochs=1, batch_size=7, momentum=0.9))


def test_chains_are_recognised_and_everything_else_is_not():
    lin = nn.Linear(3, 2)
    assert affine_chain(lin) == ([("weight", "bias")], False)
    assert affine_chain(LogReg(3, 2)) == ([("linear.weight", "linear.bias")], True)
    assert affine_chain(MLP(3, [4, 5], 2))[0] == [
        ("net.0.weight", "net.0.bias"), ("net.2.weight", "net.2.bias"),
        ("net.4.weight", "net.4.bias")]  # fmt: skip
    seq = nn.Sequential(nn.Flatten(), nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2))
    assert affine_chain(seq) == ([("1.weight", None), ("3.weight", "3.bias")], True)

    class MyMLP(MLP):  # (a subclass may compute its own forward)
        pass

    hooked = nn.Linear(3, 2)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    for other in (
        nn.Sequential(nn.Linear(3, 4), nn.ReLU()),  # (ends in a ReLU)
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.1), nn.Linear(4, 2)),
        nn.Sequential(nn.Flatten(2), nn.Linear(3, 2)),
        nn.Sequential(),
        MyMLP(3, [4], 2),
        hooked,
        _Opaque(lin),
    ):
        assert affine_chain(other) is None, other
    # a plain Linear takes float vectors only (as its own forward would)
    assert chain_inputs(torch.zeros(2, 3, 4, dtype=torch.long), False) is None
    assert chain_inputs(torch.zeros(2, 3, 4, 5), False) is None
    assert chain_inputs(torch.zeros(2, 3, 4, 5, dtype=torch.uint8), True).shape == (2, 3, 20)


@pytest.mark.parametrize("opaque", [False, True])
def test_a_devices_result_is_bit_for_bit_the_same_in_any_stack(opaque):
    """The same device alone, with others and in a bigger stack, padded or not: the same
    parameters and the same mean loss, bit for bit, on the written-out path and on the
    autograd path (so a model does not depend on the rank count or train.vectorize_mb)."""
    X, Y = _data(8)
    model = _mlp()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if opaque:
        model, start = _Opaque(model), _prefixed(start)
    ce = nn.functional.cross_entropy
    counts = [29, 11, 17, 9, 29, 12, 20]
    for opts in (dict(steps=6, batch_size=0), dict(epochs=2, batch_size=4, momentum=0.9)):
        sizes = (
            (lambda sub: None)
            if opts["batch_size"] == 0
            else (lambda sub: [counts[i] for i in sub])
        )
        full, full_loss = fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, lr=0.1,
                                      counts=sizes(range(K)), **opts)  # fmt: skip
        for sub in ([2], [2, 6], [0, 2, 3, 4]):
            gens = [_gens()[i] for i in sub]
            part, loss = fit_stacked(model, start, X[sub], Y[sub], generators=gens, loss=ce,
                                     lr=0.1, counts=sizes(sub), **opts)  # fmt: skip
            at = sub.index(2)
            assert all(torch.equal(full[n][2], part[n][at]) for n in start), sub
            assert torch.equal(full_loss[2], loss[at]), sub


def test_a_large_stack_trains_in_parts_that_fit_the_caches_with_the_same_result(monkeypatch):
    """stack_part: a stack larger than one step's cache budget trains part by part; every
    device's parameters and loss are those of the stack trained at once."""
    from edgefl.training import stacked_affine

    X, Y = _data(9)
    model = _mlp()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    chain = affine_chain(model)[0]
    assert stacked_affine.stack_part(chain, shapes, 4, D) >= K  # (7 devices: one part)
    counts = [29, 11, 17, 9, 29, 12, 20]
    opts = dict(loss=nn.functional.cross_entropy, lr=0.1, epochs=2, batch_size=4,
                momentum=0.9, counts=counts, prox_mu=0.1)  # fmt: skip
    whole, whole_loss = fit_stacked(model, start, X, Y, generators=_gens(), **opts)
    per_device = 4 * (2 * D + 4 * (9 + 5 + C)) + 3 * 137  # (batch, activations, parameters)
    monkeypatch.setattr(stacked_affine, "STEP_FLOATS", 2 * per_device)
    assert stacked_affine.stack_part(chain, shapes, 4, D) == 2  # (parts of 2, 2, 2, 1)
    parts, parts_loss = fit_stacked(model, start, X, Y, generators=_gens(), **opts)
    assert all(torch.equal(whole[n], parts[n]) for n in start)
    assert torch.equal(whole_loss, parts_loss)


@pytest.mark.parametrize("opaque", [False, True])
def test_frozen_parameters_stay_as_the_sequential_trainer_leaves_them(opaque):
    """A layer with requires_grad False: torch's SGD leaves it alone (no gradient, no weight
    decay, no momentum); so does the stack, on both paths, and trains the rest as one by
    one does. (A job refuses frozen parameters when it builds its model, FlatParams; this
    is fit_stacked as a library function.)"""
    from edgefl.training.client import FitContext
    from edgefl.training.trainer import fit_loop

    X, Y = _data(10)
    model = _mlp()
    model[0].weight.requires_grad_(False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opts = dict(lr=0.1, epochs=1, steps=0, batch_size=6, momentum=0.9, weight_decay=1e-2)
    net, names = (_Opaque(model), _prefixed(start)) if opaque else (model, start)
    got, _ = fit_stacked(net, names, X, Y, generators=_gens(),
                         loss=nn.functional.cross_entropy, **opts)  # fmt: skip
    for d, g in enumerate(_gens()):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        ctx = FitContext(d, 0, 0, g, "cpu", nn.functional.cross_entropy, None)
        fit_loop(model, torch.utils.data.TensorDataset(X[d], Y[d]), epochs=1, steps=0,
                 batch_size=6, generator=g, optimizer=opt, ctx=ctx)  # fmt: skip
        for n, p in model.named_parameters():
            mine = got[f"inner.{n}" if opaque else n][d]
            if n == "0.weight":
                assert torch.equal(mine, start[n])  # (frozen: untouched)
            else:
                assert not torch.equal(mine, start[n])
                assert (mine - p).abs().max() <= 1e-5 * p.abs().max(), (d, n)
