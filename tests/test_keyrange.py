"""Key ranges, parameter rows/columns, working sets and row-sparse pull/push helpers."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.models.flat import FlatParams
from edgefl.policies.keyrange import (
    KeyRange,
    ParamLayout,
    WorkingSet,
    check_keys,
    csr_columns,
    densify,
    even_ranges,
    gather,
    linear_working_set,
    rows_pull,
    rows_push_add,
    scatter,
    scatter_add,
    sparsify,
)


def test_key_range_basics_and_even_split() -> None:
    r = KeyRange(3, 10)
    assert r.size == 7
    assert r.keys().tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert r.contains(np.array([2, 3, 9, 10])).tolist() == [False, True, True, False]
    assert r.select(np.array([0, 3, 5, 10, 12])).tolist() == [3, 5]
    assert r.intersect(KeyRange(8, 20)) == KeyRange(8, 10)
    assert r.intersect(KeyRange(12, 20)).size == 0
    assert even_ranges(10, 3) == [KeyRange(0, 4), KeyRange(4, 7), KeyRange(7, 10)]
    with pytest.raises(ValueError):
        KeyRange(5, 4)
    with pytest.raises(ValueError):
        r.split(0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 500), st.integers(1, 40))
def test_even_ranges_cover_exactly(numel: int, parts: int) -> None:
    rs = even_ranges(numel, parts)
    assert len(rs) == parts
    assert rs[0].start == 0 and rs[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(rs, rs[1:]))
    sizes = [x.size for x in rs]
    assert max(sizes) - min(sizes) <= 1


def test_check_keys_rejects_bad_lists() -> None:
    assert check_keys([1, 4, 7], 8).dtype == np.int64
    for bad in ([3, 1], [1, 1], [0, 8], [-1, 2]):
        with pytest.raises(ValueError):
            check_keys(bad, 8)
    with pytest.raises(ValueError, match="integers"):
        check_keys(np.array([0.5, 1.5]), 8)
    with pytest.raises(ValueError, match="1-D"):
        check_keys(np.zeros((2, 2), int), 8)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.lin = torch.nn.Linear(3, 2)


def test_layout_rows_and_columns_match_flat_params() -> None:
    torch.manual_seed(0)
    net = _Net()
    fp = FlatParams(net)
    lay = ParamLayout.from_flat(fp)
    assert lay.names == ("emb.weight", "lin.weight", "lin.bias") and lay.numel == 20 + 6 + 2
    assert lay.range_of("lin.weight") == KeyRange(20, 26)
    assert lay.num_rows("emb.weight") == 5 and lay.row_size("emb.weight") == 4
    # row keys of embedding rows 1 and 3: 4..7 and 12..15
    assert lay.row_keys("emb.weight", [1, 3]).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    flat = fp.to_host()
    got = rows_pull(flat, lay, "emb.weight", [1, 3])
    assert np.array_equal(got, net.emb.weight.detach().numpy()[[1, 3]])
    # column keys of the linear weight (2, 3): input feature j is column j
    cols = lay.column_keys("lin.weight", [0, 2])
    assert cols.tolist() == [20, 22, 23, 25]
    assert np.array_equal(gather(flat, cols), net.lin.weight.detach().numpy()[:, [0, 2]].ravel())
    assert lay.rows_of_keys("emb.weight", [5, 6, 13, 21]).tolist() == [1, 3]
    # a row-sparse push lands in the model's parameters (they view the flat buffer)
    before = net.emb.weight.detach().numpy().copy()
    rows_push_add(flat, lay, "emb.weight", [0, 4], np.ones((2, 4), np.float32), scale=0.5)
    after = net.emb.weight.detach().numpy()
    assert np.array_equal(after[[0, 4]], before[[0, 4]] + np.float32(0.5))
    assert np.array_equal(after[1:4], before[1:4])


def test_layout_from_shapes_and_errors() -> None:
    lay = ParamLayout.from_shapes(["w", "b"], [(7,), (1,)])
    assert lay.offsets == (0, 7) and lay.numel == 8
    assert lay.column_keys("w", [2, 5]).tolist() == [2, 5]
    with pytest.raises(KeyError, match="no parameter"):
        lay.range_of("x")
    with pytest.raises(ValueError, match="duplicate"):
        ParamLayout.from_shapes(["w", "w"], [(1,), (1,)])
    with pytest.raises(ValueError):
        lay.column_keys("w", [7])


def test_working_set_of_a_sparse_linear_model() -> None:
    x = sp.csr_matrix(
        (np.array([1.0, 0.0, 2.0, 3.0]), (np.array([0, 0, 1, 2]), np.array([4, 1, 9, 4]))),
        shape=(3, 10),
    )
    cols = csr_columns(x)
    assert cols.tolist() == [4, 9]  # the explicitly stored zero at column 1 is ignored
    lay = ParamLayout.from_shapes(["weight", "bias"], [(10,), (1,)])
    ws = linear_working_set(lay, "weight", cols, dense=["bias"])
    assert ws.keys.tolist() == [4, 9, 10]
    assert ws.fraction == pytest.approx(3 / 11)
    other = WorkingSet(np.array([0, 4]), 11)
    assert ws.union(other).keys.tolist() == [0, 4, 9, 10]
    parts = ws.split(even_ranges(11, 2))
    assert [p.tolist() for p in parts] == [[4], [9, 10]]
    # two output classes: feature j owns keys j and 10 + j
    lay2 = ParamLayout.from_shapes(["weight"], [(2, 10)])
    assert linear_working_set(lay2, "weight", cols).keys.tolist() == [4, 9, 14, 19]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 200),
    st.data(),
)
def test_sparse_push_equals_dense_add(space: int, data) -> None:
    keys = np.array(sorted(data.draw(st.sets(st.integers(0, space - 1), max_size=space))))
    keys = keys.astype(np.int64)
    vals = np.array(
        data.draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=keys.size, max_size=keys.size)),
        np.float32,
    )
    base = np.arange(space, dtype=np.float32) * np.float32(0.25)
    sparse = scatter_add(base.copy(), keys, vals, scale=1.0)
    dense = base + densify(keys, vals, space)
    assert np.array_equal(sparse, dense)
    k2, v2 = sparsify(densify(keys, vals, space))
    nz = vals != 0
    assert np.array_equal(k2, keys[nz]) and np.array_equal(v2, vals[nz])
    pulled = gather(sparse, keys)
    assert np.array_equal(scatter(np.zeros(space, np.float32), keys, pulled)[keys], pulled)
