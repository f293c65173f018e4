"""Per-example / per-microbatch gradients (edgefl.models.per_example)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgefl.data.base import DataInfo
from edgefl.models import FlatParams, build_model
from edgefl.models.per_example import (
    PerExampleGrads,
    per_example_grads,
    per_microbatch_grads,
)
from edgefl.models.train import loss_fn


def loop_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Reference: one torch.autograd.grad call per example, flattened in parameter order."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i : i + 1]), y[i : i + 1], task)
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def make(name: str, args: dict | None = None):
    torch.manual_seed(0)
    if name == "lstm":
        info = DataInfo((7,), 11, "lm", "int64")
        x = torch.randint(0, 11, (6, 7))
        y = torch.randint(0, 11, (6, 7))
        task = "lm"
    elif name == "cnn":
        info = DataInfo((1, 6, 6), 3)
        x, y, task = torch.randn(6, 1, 6, 6), torch.randint(0, 3, (6,)), "classification"
    else:
        info = DataInfo((5,), 3)
        x, y, task = torch.randn(6, 5), torch.randint(0, 3, (6,)), "classification"
    return build_model(name, info, args or {}, seed=1), x, y, task


CASES = [
    ("logreg", None),
    ("mlp", {"hidden": [8, 4]}),
    ("cnn", {"channels": [4, 4]}),
    ("lstm", {"embed": 5, "hidden": 6, "layers": 1}),
    ("lstm", {"embed": 5, "hidden": 6, "layers": 2}),
]


@pytest.mark.parametrize(("name", "args"), CASES)
def test_equals_loop_of_single_example_grads(name, args):
    model, x, y, task = make(name, args)
    flat = FlatParams(model)
    pe = PerExampleGrads(model, task)
    g, losses = pe(x, y)
    assert g.shape == (6, flat.numel) and g.dtype == torch.float32
    torch.testing.assert_close(g, loop_grads(model, x, y, task), rtol=1e-4, atol=1e-6)
    assert pe.method == "auto"  # no fallback was needed
    with torch.no_grad():
        ref_losses = torch.stack(
            [loss_fn(model(x[i : i + 1]), y[i : i + 1], task) for i in range(6)]
        )
    torch.testing.assert_close(losses, ref_losses)
    # the mean of per-example gradients is the minibatch gradient
    model.zero_grad()
    loss_fn(model(x), y, task).backward()
    batch = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(g.mean(0), batch, rtol=1e-4, atol=1e-6)


def test_flat_order_matches_flatparams():
    model, x, y, task = make("mlp", {"hidden": [4]})
    flat = FlatParams(model)
    g = per_example_grads(model, x, y, task)
    params = dict(model.named_parameters())
    for name, off, shape in zip(flat.names, flat.offsets, flat.shapes):
        n = params[name].numel()
        loss = loss_fn(model(x[2:3]), y[2:3], task)
        (ref,) = torch.autograd.grad(loss, [params[name]])
        assert ref.shape == shape
        torch.testing.assert_close(g[2, off : off + n], ref.reshape(-1), rtol=1e-4, atol=1e-6)


def test_tracks_current_parameters():
    model, x, y, task = make("logreg")
    flat = FlatParams(model)
    pe = PerExampleGrads(model, task)
    before = pe(x, y)[0].clone()
    flat.host[:] += torch.randn(flat.numel).numpy()  # an optimiser step writes here
    after = pe(x, y)[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, loop_grads(model, x, y, task), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("name", "args"), [CASES[1], CASES[4]])
def test_microbatches_are_means_of_examples(name, args):
    model, x, y, task = make(name, args)
    pe = PerExampleGrads(model, task)
    g = pe(x, y)[0]
    mb, losses = pe.microbatches(x, y, 4)  # units [0..3], [4, 5]
    assert mb.shape == (2, g.shape[1]) and losses.shape == (2,)
    torch.testing.assert_close(mb[0], g[:4].mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mb[1], g[4:].mean(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        per_microbatch_grads(model, x, y, task, 3),
        torch.stack([g[:3].mean(0), g[3:].mean(0)]),
        rtol=1e-4,
        atol=1e-6,
    )
    torch.testing.assert_close(pe.microbatches(x, y, 1)[0], g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError):
        pe.microbatches(x, y, 0)


def test_loop_method_matches_vmap():
    model, x, y, task = make("lstm", {"embed": 4, "hidden": 5, "layers": 1})
    a = PerExampleGrads(model, task)(x, y)[0]
    b = PerExampleGrads(model, task, method="loop")(x, y)[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    c = PerExampleGrads(model, task, method="vmap", chunk_size=2)(x, y)[0]
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def test_lstm_model_left_untouched_and_seq_first_lstm():
    model, x, y, task = make("lstm", {"embed": 4, "hidden": 5, "layers": 2})
    PerExampleGrads(model, task)(x, y)
    assert "forward" not in vars(model.lstm)  # the caller's module is not patched

    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 4)
            self.rnn = nn.LSTM(4, 5, num_layers=2)  # (T, B, F)
            self.out = nn.Linear(5, 11)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            h, _ = self.rnn(self.emb(t).transpose(0, 1))
            return self.out(h.transpose(0, 1))

    torch.manual_seed(3)
    m = SeqFirst()
    g = PerExampleGrads(m, "lm")(x, y)[0]
    torch.testing.assert_close(g, loop_grads(m, x, y, "lm"), rtol=1e-4, atol=1e-6)


def test_tied_weights_counted_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(11, 4)
            self.out = nn.Linear(4, 11)
            self.out.weight = self.emb.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.emb(t)))

    torch.manual_seed(0)
    m = Tied()
    x, y = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    pe = PerExampleGrads(m, "lm")
    g = pe(x, y)[0]
    assert g.shape == (3, FlatParams(m).numel) == (3, 11 * 4 + 11)
    torch.testing.assert_close(g, loop_grads(m, x, y, "lm"), rtol=1e-4, atol=1e-6)


def test_falls_back_to_loop_when_vmap_fails():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum().item() > 0:  # .item() is impossible under vmap
                return self.lin(x)
            return self.lin(-x)

    torch.manual_seed(0)
    m = DataDependent()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.raises(RuntimeError):
        PerExampleGrads(m, "classification", method="vmap")(x, y)
    pe = PerExampleGrads(m, "classification")
    g = pe(x, y)[0]
    assert pe.method == "loop"
    torch.testing.assert_close(g, loop_grads(m, x, y, "classification"), rtol=1e-5, atol=1e-7)


def test_bad_arguments():
    model, *_ = make("logreg")
    with pytest.raises(ValueError):
        PerExampleGrads(model, "classification", method="fast")
    with pytest.raises(Exception, match="task"):
        PerExampleGrads(model, "segmentation")
    pe = PerExampleGrads(model, "classification")
    g, losses = pe(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert g.shape == (0, 18) and losses.shape == (0,)
