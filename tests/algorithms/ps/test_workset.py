"""Working sets (edgefl.algorithms.ps.workset): which runs pull them, the keys a device's
data touches, the malformed-set test hook and the KKT filter's loss gradient."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch
from torch.utils.data import TensorDataset

from edgefl.algorithms.ps.workset import (
    WORKING_SET_MODELS,
    device_working_set,
    loss_gradient,
    malformed,
    working_set_pulls,
)
from edgefl.models.flat import FlatParams
from edgefl.models.logreg import LogReg
from edgefl.policies.keyrange import ParamLayout, check_keys

from ..fakes import config


def _layout(n_in: int = 6, classes: int = 2) -> ParamLayout:
    # linear.weight (classes, n_in) at 0.., linear.bias after it
    return ParamLayout.from_flat(FlatParams(LogReg(n_in, classes)))


def test_only_logreg_with_working_set_pulls_pulls_working_sets():
    assert WORKING_SET_MODELS == ("logreg",)
    assert working_set_pulls(config(None, "ps.pull=working-set", "model.name=logreg"))
    assert not working_set_pulls(config(None, "ps.pull=working-set"))  # mlp
    assert not working_set_pulls(config(None, "model.name=logreg"))  # full pulls


def test_a_dense_datasets_working_set_is_its_nonzero_columns_and_the_bias():
    x = torch.zeros(3, 6)
    x[0, 1] = 1.0
    x[2, 4] = -2.0
    ds = TensorDataset(x, torch.zeros(3, dtype=torch.long))
    keys = device_working_set(_layout(), ds)
    # columns 1 and 4 of both weight rows (row size 6), then bias keys 12, 13
    assert keys.tolist() == [1, 4, 7, 10, 12, 13]
    assert keys.dtype == np.int64


def test_image_shaped_inputs_are_flattened_as_logreg_does():
    x = torch.zeros(2, 2, 3)  # 6 features after flatten
    x[1, 1, 0] = 1.0  # feature 3
    ds = TensorDataset(x, torch.zeros(2, dtype=torch.long))
    assert device_working_set(_layout(), ds).tolist() == [3, 9, 12, 13]


def test_a_datasets_without_tensors_works_through_its_pairs():
    pairs = [(torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0]), 0)] * 2
    assert device_working_set(_layout(), pairs).tolist() == [2, 8, 12, 13]


def test_a_csr_dataset_uses_its_stored_nonzero_columns():
    m = scipy.sparse.csr_matrix(
        (np.array([1.0, 0.0, 3.0]), np.array([0, 2, 5]), np.array([0, 2, 3])), shape=(2, 6)
    )

    class Clicks:
        csr = m

    # the explicitly stored zero at column 2 is not in the set
    assert device_working_set(_layout(), Clicks()).tolist() == [0, 5, 6, 11, 12, 13]


@pytest.mark.parametrize("how", ["unsorted", "duplicate", "out-of-range"])
def test_malformed_key_lists_fail_the_check_rank_0_makes(how):
    keys = np.array([1, 4, 7], np.int32)
    check_keys(keys, 10)
    bad = malformed(keys, how, 10)
    assert bad.dtype == keys.dtype
    with pytest.raises(ValueError):
        check_keys(bad, 10)


def test_malformed_shapes():
    keys = np.array([1, 4, 7], np.int64)
    assert malformed(keys, "unsorted", 10).tolist() == [7, 4, 1]
    assert malformed(keys, "duplicate", 10).tolist() == [1, 1, 4, 7]
    assert malformed(keys, "out-of-range", 10).tolist() == [1, 4, 7, 10]


def _model_and_data(n: int = 10):
    torch.manual_seed(0)
    model = LogReg(4, 3)
    x = torch.randn(n, 4)
    y = torch.randint(0, 3, (n,))
    return model, TensorDataset(x, y)


def test_loss_gradient_is_the_mean_loss_gradient_in_flat_order():
    model, ds = _model_and_data(10)
    g = loss_gradient(model, ds, "classification", batch_size=3)  # 4 uneven batches
    x, y = ds.tensors
    loss = torch.nn.functional.cross_entropy(model(x), y)
    gw, gb = torch.autograd.grad(loss, [model.linear.weight, model.linear.bias])
    want = torch.cat([gw.reshape(-1), gb]).numpy()
    assert g.dtype == np.float32 and g.shape == (4 * 3 + 3,)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_loss_gradient_leaves_the_model_as_it_was():
    model, ds = _model_and_data(5)
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    loss_gradient(model, ds, "classification")
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.eval()
    loss_gradient(model, ds, "classification")
    assert not model.training


def test_loss_gradient_uses_the_given_loss_and_is_zero_without_data():
    model, ds = _model_and_data(6)

    def zero_loss(out, y):
        return out.sum() * 0.0

    assert not loss_gradient(model, ds, "classification", loss=zero_loss).any()
    empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    g = loss_gradient(model, empty, "classification")
    assert g.shape == (15,) and not g.any()
