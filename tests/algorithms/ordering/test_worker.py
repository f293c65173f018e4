"""edgefl.algorithms.ordering.worker: a device keeps rank 0's order (ORDER), trains one epoch
in it and ships its per-unit gradients (GRADS), streamed or at the end, sketched or not."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.ordering.kinds import GRADS, ORDER
from edgefl.algorithms.ordering.worker import OrderingWorker
from edgefl.models.per_example import PerExampleGrads

from ..fakes import FakeWorkerContext, config, message

N = 6


def dataset(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def make(name="cd-grab", *sets, ds=None):
    ds = ds or dataset()
    ctx = FakeWorkerContext(config(None, f'algorithm.ordering="{name}"', *sets), {0: ds},
                            numel=8)  # fmt: skip
    return ctx, OrderingWorker(ctx, "ordering"), ds


def job(ds, task=5, lr=0.1, m=None):
    return LocalJob(device=0, task=task, version=0, spec=TaskSpec(), model=m or model(),
                    dataset=ds, fit_task=SimpleNamespace(lr=lr),
                    fit_ctx=SimpleNamespace(before_step=None))  # fmt: skip


def give_order(ctx, w, order):
    msg = message(ORDER, src=0, device=0, round=0, payload=np.asarray(order, np.int32))
    w.on_message(msg)
    return msg


def grads_msgs(ctx):
    return [s for s in ctx.sent if s.kind == GRADS]


def test_it_handles_orders():
    assert OrderingWorker.message_kinds == (ORDER,)


def test_an_order_is_kept_per_device_and_its_buffer_released():
    ctx, w, _ = make()
    msg = give_order(ctx, w, [2, 0, 1])
    assert w.orders[0].tolist() == [2, 0, 1] and w.orders[0].dtype == np.int64
    assert ctx.released == [msg]
    give_order(ctx, w, [0, 1, 2])  # the next epoch's replaces it
    assert w.orders[0].tolist() == [0, 1, 2]


def test_training_without_an_order_is_an_error():
    ctx, w, ds = make()
    with pytest.raises(RuntimeError, match="device 0: no example order received before task 5"):
        w.train(0, job(ds))


def test_streamed_rows_go_to_rank_0_after_every_step():
    ctx, w, ds = make("cd-grab", "train.batch_size=4")
    give_order(ctx, w, [5, 4, 3, 2, 1, 0])
    loss = w.train(0, job(ds, task=5))
    assert np.isfinite(loss)
    msgs = grads_msgs(ctx)
    assert [(s.rank, s.device, s.round) for s in msgs] == [(0, 0, 5)] * 2
    assert [s.aux for s in msgs] == [(4.0, 8.0, 0.0, 0.0), (2.0, 8.0, 4.0, 0.0)]
    assert all(s.payload.dtype == np.float32 and s.payload.size == s.aux[0] * 8 for s in msgs)


def test_the_first_rows_are_the_gradients_at_the_start_model_in_visit_order():
    ctx, w, ds = make("id-grab", "train.batch_size=2")
    order = [3, 1, 0, 2, 5, 4]
    give_order(ctx, w, order)
    m = model()
    x, y = ds.tensors
    want, _ = PerExampleGrads(model(), "classification")(x[[3, 1]], y[[3, 1]])
    w.train(0, job(ds, m=m))
    first = grads_msgs(ctx)[0].payload.reshape(2, 8)
    np.testing.assert_allclose(first, want.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_ship_epoch_sends_one_message_with_every_row():
    ctx, w, ds = make("cd-grab", "train.batch_size=2", 'ordering.ship="epoch"')
    give_order(ctx, w, range(N))
    w.train(0, job(ds))
    msgs = grads_msgs(ctx)
    assert len(msgs) == 1 and msgs[0].aux == (6.0, 8.0, 0.0, 0.0)


def test_the_training_moves_the_model():
    ctx, w, ds = make("rr")
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    give_order(ctx, w, range(N))
    w.train(0, job(ds, m=m))
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_rr_needs_no_gradients_and_sends_none():
    ctx, w, ds = make("rr")
    give_order(ctx, w, [1, 0, 2, 3, 5, 4])
    assert np.isfinite(w.train(0, job(ds)))
    assert ctx.sent == []


def test_a_sketch_ships_rows_of_sketch_dim_values():
    ctx, w, ds = make("cd-grab", "ordering.sketch_dim=3", 'ordering.ship="epoch"')
    give_order(ctx, w, range(N))
    m = model()
    x, y = ds.tensors
    full, _ = PerExampleGrads(model(), "classification")(x, y)
    w.train(0, job(ds, lr=0.0, m=m))  # lr 0: every row is a gradient at the start model
    (s,) = grads_msgs(ctx)
    assert s.aux == (6.0, 3.0, 0.0, 0.0)
    want = w.orderer.project(full.detach().numpy())
    np.testing.assert_allclose(s.payload.reshape(6, 3), want, rtol=1e-5, atol=1e-6)


def test_microbatch_units_ship_each_units_mean_gradient_in_unit_visit_order():
    # 5 examples in units of 2: units {0,1}, {2,3}, {4}; visited as units 2, 0, 1
    ds = dataset(5)
    ctx, w, _ = make("id-grab", 'ordering.unit="microbatch"', "ordering.microbatch=2", ds=ds)
    give_order(ctx, w, [2, 0, 1])
    x, y = ds.tensors
    per, _ = PerExampleGrads(model(), "classification")(x, y)
    per = per.detach().numpy()
    w.train(0, job(ds, lr=0.0))
    (s,) = grads_msgs(ctx)  # microbatch units are never streamed
    assert s.aux == (3.0, 8.0, 0.0, 0.0)
    want = np.stack([per[[4]].mean(0), per[[0, 1]].mean(0), per[[2, 3]].mean(0)])
    np.testing.assert_allclose(s.payload.reshape(3, 8), want, rtol=1e-5, atol=1e-6)


def test_a_bad_order_is_refused_before_training():
    ctx, w, ds = make("cd-grab")
    give_order(ctx, w, [0, 1, 2])  # 3 items for 6 examples
    with pytest.raises(ValueError, match="not a permutation of 6 examples"):
        w.train(0, job(ds))
    assert ctx.sent == []
