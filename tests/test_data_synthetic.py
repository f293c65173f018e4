"""LEAF synthetic and generated-text sources, plus the generic argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefl.data import DataInfo, load_federated, pooled
from edgefl.errors import DataError


def _equal(a: torch.utils.data.TensorDataset, b: torch.utils.data.TensorDataset) -> bool:
    return all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors, strict=True))


def test_synthetic_shapes_dtypes_and_info() -> None:
    fd = load_federated("synthetic", {"dim": 12, "classes": 5}, 6, seed=0)
    assert fd.num_devices == 6
    assert fd.info == DataInfo((12,), 5, "classification", "float32")
    for k in range(6):
        x, y = fd.train(k).tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape == (fd.num_samples(k), 12) and y.shape == (fd.num_samples(k),)
        assert fd.num_samples(k) >= 20
        assert 0 <= int(y.min()) and int(y.max()) < 5
    xt, yt = fd.test().tensors
    assert xt.shape == (6 * 20, 12) and yt.shape == (6 * 20,)


def test_synthetic_deterministic_and_seed_sensitive() -> None:
    a = load_federated("synthetic", {}, 5, seed=7)
    b = load_federated("synthetic", {}, 5, seed=7)
    c = load_federated("synthetic", {}, 5, seed=8)
    for k in range(5):
        assert _equal(a.train(k), b.train(k))
    assert _equal(a.test(), b.test())
    assert not torch.equal(a.train(0).tensors[0][:5], c.train(0).tensors[0][:5])


def test_synthetic_device_independence() -> None:
    alone = load_federated("synthetic", {}, 10, seed=3)
    d3_alone = alone.train(3)
    assert set(alone._train) == {3} and set(alone._sizes) == {3}  # nothing else was built
    after = load_federated("synthetic", {}, 10, seed=3)
    for k in range(3):
        after.train(k)
    assert _equal(d3_alone, after.train(3))
    # The number of devices does not change device 3's data either.
    more = load_federated("synthetic", {}, 50, seed=3)
    assert _equal(d3_alone, more.train(3))
    # Nor does the test set depend on which devices were trained first.
    assert _equal(alone.test(), after.test())


def test_synthetic_labels_are_varied_and_devices_non_iid() -> None:
    fd = load_federated("synthetic", {"alpha": 1.0, "beta": 1.0}, 30, seed=0)
    y = pooled(fd).tensors[1]
    counts = torch.bincount(y, minlength=10)
    assert (counts > 0).sum() >= 5, counts
    assert int(counts.max()) < len(y)
    # Different devices have clearly different feature means (non-IID via v_k).
    means = torch.stack([fd.train(k).tensors[0].mean(0) for k in range(30)])
    assert float(means.std(0).mean()) > 0.5


def test_synthetic_iid_shares_one_model() -> None:
    fd = load_federated("synthetic", {"iid": True, "dim": 10}, 8, seed=1)
    w0 = fd._device_params(0)[1]
    for k in range(1, 8):
        n, w, b, v = fd._device_params(k)
        assert np.array_equal(w, w0) and not v.any()
    means = torch.stack([fd.train(k).tensors[0].mean(0) for k in range(8)])
    assert float(means.abs().max()) < 1.0


def test_synthetic_bytes_are_pinned() -> None:
    """Every split's bytes, IID and not, recorded before IID devices stopped drawing their
    unused own models (rank 0 builds a 100,000-device test set faster): the data, and so
    every model trained on it, is unchanged."""
    import hashlib

    h = hashlib.sha256()
    for iid in (True, False):
        bench = {"alpha": 0.0, "beta": 0.0, "classes": 10, "dim": 20, "min_samples": 200,
                 "samples_mean_log": 0.0, "samples_sigma": 0.0,
                 "test_samples_per_device": 100}  # fmt: skip
        for args in ({**bench, "iid": iid}, {"iid": iid}):
            fd = load_federated("synthetic", args, 300, seed=3)
            for part in fd.test().tensors:
                h.update(part.numpy().tobytes())
            for k in (0, 7, 299):
                for part in fd.train(k).tensors:
                    h.update(part.numpy().tobytes())
                h.update(str(fd.num_samples(k)).encode())
    assert h.hexdigest() == "5d0af7a8d50847705fc5e24d1badac49e0157b8bb711bd4b36bc96c0fd0d155a"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"alpah": 1.0}, ["data.args.alpah", "unknown", "alpha", "beta"]),
        ({"alpha": -1.0}, ["data.args.alpha", ">= 0"]),
        ({"dim": 0}, ["data.args.dim", ">= 1"]),
        ({"classes": 1}, ["data.args.classes", ">= 2"]),
        ({"classes": "3"}, ["data.args.classes", "integer"]),
        ({"iid": "yes"}, ["data.args.iid", "true or false"]),
        ({"beta": float("nan")}, ["data.args.beta", "finite"]),
        ({"test_samples_per_device": 0}, ["data.args.test_samples_per_device"]),
    ],
)
def test_synthetic_bad_args(args: dict, words: list[str]) -> None:
    with pytest.raises(DataError) as err:
        load_federated("synthetic", args, 4, seed=0)
    msg = str(err.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg


@pytest.mark.parametrize("device", [-1, 4, 1.5, True, "0"])
def test_bad_device_id(device: object) -> None:
    fd = load_federated("synthetic", {}, 4, seed=0)
    with pytest.raises(DataError, match="device id"):
        fd.train(device)  # type: ignore[arg-type]
    with pytest.raises(DataError, match="device id"):
        fd.num_samples(device)  # type: ignore[arg-type]


def test_bad_run_params_and_unknown_source() -> None:
    with pytest.raises(DataError, match="num_devices"):
        load_federated("synthetic", {}, 0, seed=0)
    with pytest.raises(DataError, match="seed"):
        load_federated("synthetic", {}, 2, seed=-1)
    with pytest.raises(DataError, match="data.args"):
        load_federated("synthetic", [1, 2], 2, seed=0)  # type: ignore[arg-type]
    with pytest.raises(DataError) as err:
        load_federated("mnist", {}, 2, seed=0)
    msg = str(err.value)
    for word in ("'mnist'", "synthetic", "partition", "fedh5", "text", "module:function"):
        assert word in msg


# ---- text -------------------------------------------------------------------------------


def test_text_tokens_in_range_and_shifted() -> None:
    fd = load_federated("text", {"seq_len": 16, "vocab": 24, "chars_per_device": 500}, 4, 0)
    assert fd.info == DataInfo((16,), 24, "lm", "int64")
    for k in range(4):
        x, y = fd.train(k).tensors
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert x.shape == y.shape == (fd.num_samples(k), 16)
        assert fd.num_samples(k) == (500 - 1) // 16
        assert int(x.min()) >= 0 and int(x.max()) < 24
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one symbol
        assert torch.equal(x[1:, 0], y[:-1, -1])  # windows are contiguous
    xt, yt = fd.test().tensors
    assert xt.shape == (200, 16) and int(yt.max()) < 24


def test_text_deterministic_independent_and_non_iid() -> None:
    a = load_federated("text", {}, 6, seed=1)
    b = load_federated("text", {}, 6, seed=1)
    c = load_federated("text", {}, 6, seed=2)
    assert _equal(a.train(4), b.train(4))
    assert set(a._train) == {4}
    assert _equal(a.test(), b.test())
    assert not torch.equal(a.train(4).tensors[0], c.train(4).tensors[0])
    # Authors differ: their symbol distributions are not identical.
    h0 = torch.bincount(a.train(0).tensors[0].reshape(-1), minlength=30).float()
    h1 = torch.bincount(a.train(1).tensors[0].reshape(-1), minlength=30).float()
    assert float((h0 / h0.sum() - h1 / h1.sum()).abs().sum()) > 0.1


def test_text_has_structure_beyond_unigram() -> None:
    fd = load_federated("text", {}, 8, seed=0)
    x, y = pooled(fd).tensors
    xs, ys = x.reshape(-1).numpy(), y.reshape(-1).numpy()
    uni = np.bincount(ys, minlength=30) + 1.0
    uni /= uni.sum()
    big = np.ones((30, 30))
    np.add.at(big, (xs, ys), 1.0)
    big /= big.sum(1, keepdims=True)
    xt, yt = (t.reshape(-1).numpy() for t in fd.test().tensors)
    ce_uni = -np.log(uni[yt]).mean()
    ce_big = -np.log(big[xt, yt]).mean()
    assert ce_big < ce_uni - 0.5


def test_text_bad_args() -> None:
    with pytest.raises(DataError, match="data.args.vocab"):
        load_federated("text", {"vocab": 2}, 2, 0)
    with pytest.raises(DataError, match="data.args.chars_per_device"):
        load_federated("text", {"seq_len": 50, "chars_per_device": 40}, 2, 0)
    with pytest.raises(DataError, match="data.args.length"):
        load_federated("text", {"length": 3}, 2, 0)
