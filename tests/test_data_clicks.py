"""The built-in sparse ``clicks`` dataset: shape, determinism, power law, non-IID skew."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from edgefl.data import BUILTIN_SOURCES, DataInfo, load_federated
from edgefl.data.clicks import ClicksFederated, SparseExamples, zipf_cdf
from edgefl.errors import DataError
from edgefl.policies.keyrange import csr_columns

SMALL = {"features": 5000, "samples_per_device": 200, "nnz_per_example": 8}


def _same(a: SparseExamples, b: SparseExamples) -> bool:
    return (a.csr != b.csr).nnz == 0 and np.array_equal(a.labels, b.labels)


def test_registered_and_shapes() -> None:
    assert "clicks" in BUILTIN_SOURCES
    fd = load_federated("clicks", SMALL, 4, seed=0)
    assert fd.info == DataInfo((5000,), 2, "classification", "float32")
    for k in range(4):
        ex = fd.train(k)
        assert isinstance(ex.csr, sp.csr_matrix) and ex.csr.dtype == np.float32
        assert ex.csr.shape == (200, 5000) and len(ex) == fd.num_samples(k) == 200
        per_row = np.diff(ex.csr.indptr)
        assert per_row.max() <= 8 and per_row.min() >= 1
        assert np.all(ex.csr.data == 1.0)
        assert set(np.unique(ex.labels)) <= {0, 1} and ex.labels.dtype == np.int64
    te = fd.test()
    assert te.csr.shape == (4 * 100, 5000)
    x, y = fd.train(1)[3]
    assert x.dtype == torch.float32 and x.shape == (5000,) and y.dtype == torch.int64
    assert np.array_equal(x.numpy(), fd.train(1).csr[3].toarray().ravel())
    xs, ys = fd.train(1).torch_sparse()
    assert torch.equal(xs.to_dense(), torch.from_numpy(fd.train(1).csr.toarray()))
    assert torch.equal(ys, torch.from_numpy(fd.train(1).labels))


def test_deterministic_and_device_independent() -> None:
    a = load_federated("clicks", SMALL, 6, seed=3)
    b = load_federated("clicks", SMALL, 6, seed=3)
    c = load_federated("clicks", SMALL, 6, seed=4)
    alone = a.train(4)
    assert set(a._train) == {4}  # nothing else was built
    for k in range(6):
        assert _same(b.train(k), a.train(k))
    assert _same(alone, b.train(4))
    assert _same(a.test(), b.test())
    assert not _same(a.train(0), c.train(0))
    more = load_federated("clicks", SMALL, 50, seed=3)  # the device count does not matter
    assert _same(more.train(4), alone)


def test_feature_frequencies_follow_the_zipf_law() -> None:
    fd = load_federated(
        "clicks",
        {
            "features": 20000,
            "samples_per_device": 4000,
            "nnz_per_example": 10,
            "noniid": 0.0,
            "zipf": 1.2,
        },
        2,
        seed=0,
    )
    counts = sum(np.bincount(fd.train(k).csr.indices, minlength=20000) for k in range(2)).astype(
        float
    )
    ranks = np.arange(20, 400)  # feature id = popularity rank when noniid = 0
    slope = np.polyfit(np.log(ranks + 1), np.log(counts[ranks]), 1)[0]
    assert slope == pytest.approx(-1.2, abs=0.12)
    assert counts[0] > counts[10] > counts[1000]
    cdf = zipf_cdf(20000, 1.2)
    assert cdf[-1] == pytest.approx(1.0) and np.all(np.diff(cdf) > 0)


def test_noniid_skews_working_sets_and_labels() -> None:
    def overlap(noniid: float) -> float:
        fd = load_federated("clicks", {**SMALL, "noniid": noniid, "label_skew": 0.0}, 2, seed=1)
        a, b = (set(csr_columns(fd.train(k).csr).tolist()) for k in range(2))
        return len(a & b) / len(a | b)

    assert overlap(0.0) > 2 * overlap(1.0)
    fd = load_federated("clicks", {**SMALL, "label_skew": 3.0}, 8, seed=0)
    rates = [fd.train(k).labels.mean() for k in range(8)]
    assert max(rates) - min(rates) > 0.3  # devices' click rates differ a lot


def test_million_features_stay_sparse_and_fast() -> None:
    fd = ClicksFederated({"samples_per_device": 500}, 2, seed=0)  # default 10**6 features
    ex = fd.train(0)
    assert ex.csr.shape == (500, 1_000_000) and ex.nnz <= 500 * 20
    stored = ex.csr.data.nbytes + ex.csr.indices.nbytes + ex.csr.indptr.nbytes
    assert stored < 100_000  # bytes: sparse, nothing of size `features` per device
    assert csr_columns(ex.csr).size / 1_000_000 < 0.02


def test_bad_args() -> None:
    with pytest.raises(DataError, match="data.args.zipf"):
        load_federated("clicks", {"zipf": 0.0}, 2, seed=0)
    with pytest.raises(DataError, match="data.args.noniid"):
        load_federated("clicks", {"noniid": 1.5}, 2, seed=0)
    with pytest.raises(DataError, match="unknown arg"):
        load_federated("clicks", {"dim": 3}, 2, seed=0)
    with pytest.raises(DataError, match="out of range"):
        load_federated("clicks", SMALL, 2, seed=0).train(2)
