"""The ``partition`` source, ``partition_indices`` and ``pooled``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.data import gaussian_mixture, load_federated, partition_indices, pooled
from edgefl.errors import DataError

SCHEMES = ["iid", "dirichlet", "shards", "quantity"]


def _labels(n: int, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=n)


def _check_partition(parts: list[np.ndarray], n: int, num_devices: int) -> None:
    assert len(parts) == num_devices
    assert all(len(p) >= 1 for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == n  # disjoint ...
    assert np.array_equal(np.sort(joined), np.arange(n))  # ... and covering


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partition_disjoint_covering_deterministic(scheme: str) -> None:
    y = _labels(2000)
    a = partition_indices(y, 25, scheme, seed=4)
    b = partition_indices(y, 25, scheme, seed=4)
    c = partition_indices(y, 25, scheme, seed=5)
    _check_partition(a, 2000, 25)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert any(not np.array_equal(p, q) for p, q in zip(a, c, strict=True))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    devices=st.integers(1, 40),
    classes=st.integers(1, 12),
    scheme=st.sampled_from(SCHEMES),
    seed=st.integers(0, 2**31),
    alpha=st.floats(0.01, 10.0),
    shards=st.integers(1, 5),
)
def test_partition_properties(
    n: int, devices: int, classes: int, scheme: str, seed: int, alpha: float, shards: int
) -> None:
    y = _labels(n, classes, seed % 1000)
    if n < devices:
        with pytest.raises(DataError, match=f"device {n} would be empty"):
            partition_indices(y, devices, scheme, seed, alpha=alpha, shards_per_device=shards)
        return
    parts = partition_indices(y, devices, scheme, seed, alpha=alpha, shards_per_device=shards)
    _check_partition(parts, n, devices)


def _label_tv(y: np.ndarray, parts: list[np.ndarray], classes: int = 10) -> float:
    """Mean total-variation distance between device label distributions and the global one."""
    glob = np.bincount(y, minlength=classes) / len(y)
    dists = [
        0.5 * np.abs(np.bincount(y[p], minlength=classes) / len(p) - glob).sum() for p in parts
    ]
    return float(np.mean(dists))


def test_dirichlet_is_skewed_compared_with_iid() -> None:
    y = _labels(5000)
    tv_iid = _label_tv(y, partition_indices(y, 20, "iid", 0))
    tv_dir = _label_tv(y, partition_indices(y, 20, "dirichlet", 0, alpha=0.1))
    tv_mild = _label_tv(y, partition_indices(y, 20, "dirichlet", 0, alpha=100.0))
    assert tv_iid < 0.15
    assert tv_dir > 0.5
    assert tv_mild < tv_dir


def test_shards_limit_labels_per_device() -> None:
    y = _labels(4000)
    parts = partition_indices(y, 20, "shards", 1, shards_per_device=2)
    distinct = [len(np.unique(y[p])) for p in parts]
    assert max(distinct) <= 4  # two label-sorted shards span at most a few labels
    iid = [len(np.unique(y[p])) for p in partition_indices(y, 20, "iid", 1)]
    assert min(iid) == 10
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 2


def test_quantity_skews_sizes_not_labels() -> None:
    y = _labels(5000)
    parts = partition_indices(y, 20, "quantity", 2, quantity_sigma=1.0)
    sizes = np.array([len(p) for p in parts])
    assert sizes.std() / sizes.mean() > 0.4
    iid_sizes = np.array([len(p) for p in partition_indices(y, 20, "iid", 2)])
    assert iid_sizes.max() - iid_sizes.min() <= 1
    flat = partition_indices(y, 20, "quantity", 2, quantity_sigma=0.0)
    assert max(len(p) for p in flat) - min(len(p) for p in flat) <= 1


def test_partition_indices_bad_input() -> None:
    y = _labels(100)
    with pytest.raises(DataError, match="scheme"):
        partition_indices(y, 5, "pathological", 0)
    with pytest.raises(DataError, match="alpha"):
        partition_indices(y, 5, "dirichlet", 0, alpha=0.0)
    with pytest.raises(DataError, match="shards_per_device"):
        partition_indices(y, 5, "shards", 0, shards_per_device=0)
    with pytest.raises(DataError, match="quantity_sigma"):
        partition_indices(y, 5, "quantity", 0, quantity_sigma=-1.0)
    with pytest.raises(DataError, match="1-D"):
        partition_indices(y.reshape(10, 10), 5, "iid", 0)
    with pytest.raises(DataError, match="integers"):
        partition_indices(y.astype(float), 5, "iid", 0)
    with pytest.raises(DataError, match="device 100 would be empty"):
        partition_indices(y, 101, "iid", 0)


def test_partition_source_gaussian_mixture() -> None:
    args = {"scheme": "dirichlet", "alpha": 0.3, "dataset_args": {"samples": 2000}}
    fd = load_federated("partition", args, 12, seed=0)
    assert fd.info.input_shape == (20,) and fd.info.num_classes == 10
    total = pooled(fd)
    assert len(total) + len(fd.test()) == 2000
    assert abs(len(fd.test()) - 400) <= 10  # stratified 20 %
    assert sum(fd.num_samples(k) for k in range(12)) == len(total)
    assert all(len(fd.train(k)) == fd.num_samples(k) >= 1 for k in range(12))
    # pooled = devices concatenated in order
    assert torch.equal(total.tensors[0][: fd.num_samples(0)], fd.train(0).tensors[0])
    again = load_federated("partition", args, 12, seed=0)
    for k in range(12):
        assert torch.equal(fd.train(k).tensors[0], again.train(k).tensors[0])
    assert torch.equal(fd.test().tensors[1], again.test().tensors[1])


def test_gaussian_mixture_is_learnable_but_not_trivial() -> None:
    x, y = gaussian_mixture(seed=0)
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (6000, 20)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model = torch.nn.Linear(20, 10)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=100)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xt[:4800]), yt[:4800])
        loss.backward()
        return loss

    opt.step(closure)
    acc = float((model(xt[4800:]).argmax(1) == yt[4800:]).float().mean())
    assert 0.85 <= acc <= 0.96, acc


def test_partition_source_errors() -> None:
    with pytest.raises(DataError, match="device 24 would be empty"):
        load_federated("partition", {"dataset_args": {"samples": 30, "classes": 2}}, 30, seed=0)
    with pytest.raises(DataError, match="holds out no example"):
        load_federated(
            "partition", {"dataset_args": {"samples": 6}, "test_fraction": 0.1}, 2, seed=0
        )
    with pytest.raises(DataError, match="data.args.scheme"):
        load_federated("partition", {"scheme": "random"}, 4, seed=0)
    with pytest.raises(DataError, match="data.args.test_fraction"):
        load_federated("partition", {"test_fraction": 1.0}, 4, seed=0)
    with pytest.raises(DataError, match="data.args.dataset_args.sample"):
        load_federated("partition", {"dataset_args": {"sample": 10}}, 4, seed=0)
    with pytest.raises(DataError, match="unknown dataset"):
        load_federated("partition", {"dataset": "cifar"}, 4, seed=0)
    with pytest.raises(DataError, match="cannot import module 'no_such_mod_xyz'"):
        load_federated("partition", {"dataset": "no_such_mod_xyz:make"}, 4, seed=0)
    with pytest.raises(DataError, match="num_classes"):
        load_federated("partition", {"num_classes": 3}, 4, seed=0)


def test_partition_custom_dataset_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "edgefl_test_central_ds.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            import torch

            def arrays(n=300):
                rng = np.random.default_rng(0)
                return rng.normal(size=(n, 1, 4, 4)), np.arange(n) % 3

            def tensor_dataset():
                x = torch.randn(50, 5, dtype=torch.float64)
                return torch.utils.data.TensorDataset(x, torch.arange(50) % 2)

            def bad():
                return "nope"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = "edgefl_test_central_ds"
    fd = load_federated(
        "partition",
        {"dataset": f"{mod}:arrays", "dataset_args": {"n": 200}, "scheme": "shards"},
        5,
        seed=1,
    )
    assert fd.info.input_shape == (1, 4, 4) and fd.info.num_classes == 3
    assert fd.train(0).tensors[0].dtype == torch.float32
    assert len(pooled(fd)) + len(fd.test()) == 200
    fd2 = load_federated("partition", {"dataset": f"{mod}:tensor_dataset"}, 3, seed=1)
    assert fd2.info.input_shape == (5,) and fd2.info.num_classes == 2
    with pytest.raises(DataError, match="expected \\(x, y\\) arrays"):
        load_federated("partition", {"dataset": f"{mod}:bad"}, 3, seed=1)
    with pytest.raises(DataError, match="dataset_args"):
        load_federated(
            "partition", {"dataset": f"{mod}:arrays", "dataset_args": {"m": 1}}, 3, seed=1
        )
    with pytest.raises(DataError, match="has no function 'missing'"):
        load_federated("partition", {"dataset": f"{mod}:missing"}, 3, seed=1)
