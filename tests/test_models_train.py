"""loss_fn / evaluate / local_train on toy problems."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from edgefl.models import FlatParams, build_model
from edgefl.models.train import evaluate, local_train, loss_fn

INFO = SimpleNamespace(
    input_shape=(2,), num_classes=2, task="classification", input_dtype="float32"
)
TRAIN = dict(lr=0.5, momentum=0.0, weight_decay=0.0, task="classification")


def blobs(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 2, generator=g) * 0.5 + (y.float() * 2 - 1).unsqueeze(1) * 2
    return TensorDataset(x, y)


class ListDataset(Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.x, self.y = base.tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_loss_fn_lm_flattens():
    logits = torch.randn(2, 3, 5)
    y = torch.randint(0, 5, (2, 3))
    ref = torch.nn.functional.cross_entropy(logits.reshape(6, 5), y.reshape(6))
    assert torch.allclose(loss_fn(logits, y, "lm"), ref)


def test_evaluate_hand_made():
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])  # third sample misclassified
    loss, acc = evaluate(model, TensorDataset(x, y), "classification", batch_size=3)
    expect = torch.nn.functional.cross_entropy(x, y).item()
    assert acc == pytest.approx(0.75) and loss == pytest.approx(expect, rel=1e-6)
    assert evaluate(model, ListDataset(TensorDataset(x, y)), "classification", 0) == pytest.approx(
        (loss, acc)
    )
    assert evaluate(model, Subset(TensorDataset(x, y), [0, 2]), "classification")[1] == 0.5
    assert all(
        math.isnan(v) for v in evaluate(model, TensorDataset(x[:0], y[:0]), "classification")
    )


def test_evaluate_lm_token_level():
    class Fixed(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(x, 4).float() * 10  # predicts its input token

    x = torch.tensor([[0, 1, 2], [3, 3, 3]])
    y = torch.tensor([[0, 1, 0], [3, 0, 3]])  # 4 of 6 tokens right
    _, acc = evaluate(Fixed(), TensorDataset(x, y), "lm")
    assert acc == pytest.approx(4 / 6)


def test_local_train_reduces_loss_and_is_deterministic():
    data = blobs()

    def run(seed):
        model = build_model("logreg", INFO, {}, seed=0)
        fp = FlatParams(model)
        before = evaluate(model, data, "classification")[0]
        out = local_train(
            model,
            data,
            epochs=3,
            steps=0,
            batch_size=16,
            generator=torch.Generator().manual_seed(seed),
            **TRAIN,
        )
        return before, evaluate(model, data, "classification"), out, fp.snapshot()

    before, (after, acc), (mean_loss, samples), p1 = run(1)
    assert after < before * 0.5 and acc > 0.95
    assert samples == 3 * 200 and mean_loss > 0
    _, _, out2, p2 = run(1)
    assert out2[0] == mean_loss and np.array_equal(p1, p2)
    _, _, _, p3 = run(2)
    assert not np.array_equal(p1, p3)


def test_steps_vs_epochs_counts():
    data = blobs(n=50)
    model = build_model("mlp", INFO, {"hidden": [8]}, seed=0)
    g = torch.Generator().manual_seed(0)
    assert (
        local_train(model, data, epochs=9, steps=7, batch_size=16, generator=g, **TRAIN)[1]
        == 50 + 3 * 16
    )  # epoch 1: 16+16+16+2 (4 steps), then 3 batches of the reshuffled epoch 2
    assert (
        local_train(model, data, epochs=2, steps=0, batch_size=16, generator=g, **TRAIN)[1] == 100
    )
    assert local_train(model, data, epochs=2, steps=0, batch_size=0, generator=g, **TRAIN)[1] == 100
    assert local_train(model, data, epochs=0, steps=3, batch_size=0, generator=g, **TRAIN)[1] == 150
    assert local_train(model, data, epochs=0, steps=0, batch_size=8, generator=g, **TRAIN) == (
        0.0,
        0,
    )


def test_generic_dataset_matches_fast_path():
    data = blobs(n=60)
    results = []
    for ds in (data, ListDataset(data)):
        model = build_model("mlp", INFO, {"hidden": [4]}, seed=3)
        fp = FlatParams(model)
        out = local_train(
            model,
            ds,
            epochs=0,
            steps=5,
            batch_size=7,
            momentum=0.9,
            weight_decay=1e-3,
            lr=0.1,
            task="classification",
            generator=torch.Generator().manual_seed(5),
        )
        results.append((out, fp.snapshot()))
    assert results[0][0][1] == results[1][0][1] == 35
    assert results[0][0][0] == pytest.approx(results[1][0][0], rel=1e-5)
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


def test_lm_training_runs():
    info = SimpleNamespace(input_shape=(8,), num_classes=6, task="lm", input_dtype="int64")
    seq = torch.arange(8).remainder(6).repeat(32, 1)
    data = TensorDataset(seq, seq.roll(-1, dims=1))
    model = build_model("lstm", info, {"embed": 8, "hidden": 16}, seed=0)
    before = evaluate(model, data, "lm")[0]
    loss, n = local_train(
        model,
        data,
        epochs=0,
        steps=30,
        batch_size=8,
        lr=1.0,
        momentum=0.0,
        weight_decay=0.0,
        generator=torch.Generator().manual_seed(0),
        task="lm",
    )
    assert n == 240 and evaluate(model, data, "lm")[0] < before
