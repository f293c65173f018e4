"""edgefl.algorithms.hermes.coordinator: allocation, loss-weighted aggregation, broadcast,
the WI / API metrics and the checkpoint state of rank 0's half."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.base import TaskSpec
from edgefl.algorithms.hermes.coordinator import HermesCoordinator, settled_cv
from edgefl.algorithms.hermes.loss_weighted import LossSoftmax, LossWeighted
from edgefl.data.holdout import holdout_size
from edgefl.policies.consistency import Apply, Arrival

from ..fakes import FakeCoordinatorContext, config


def make(samples=None, *sets, **kw):
    ctx = FakeCoordinatorContext(config(None, *sets), samples or {0: 100, 1: 200}, **kw)
    return ctx, HermesCoordinator(ctx, "hermes")


def arrival(d, delta, task=0):
    return Arrival(device=d, task=task, base_version=0, samples=10, loss=1.0,
                   delta=np.asarray(delta, np.float32))  # fmt: skip


# -- construction -------------------------------------------------------------------------


def test_ungated_fixed_run_holds_nothing_out_and_leaves_tasks_alone():
    ctx, h = make()
    assert ctx.holdout is None and [ctx.train_size(d) for d in (0, 1)] == [100, 200]
    assert not h.allocating and not h.loss_agg and not h.broadcast
    spec = TaskSpec(samples=0, batch=0)
    h.shape_task(0, spec)
    assert (spec.samples, spec.batch) == (0, 0)
    # the metrics know every device from the start
    assert sorted(h.metrics.iterations) == [0, 1]


def test_a_gated_run_holds_out_the_configured_fraction_before_sizing_the_devices():
    ctx, h = make({0: 100, 1: 7}, 'algorithm.gate="hermes"', "hermes.holdout_fraction=0.25")
    assert ctx.holdout == 0.25
    want = {d: n - holdout_size(n, 0.25) for d, n in {0: 100, 1: 7}.items()}
    assert {d: ctx.train_size(d) for d in (0, 1)} == want
    # the allocator was given the training sizes, not the raw sample counts
    st = h.allocator.state_dict()
    assert st["devices"] == [0, 1] and st["dataset_size"] == [want[0], want[1]]


def test_hermes_allocation_starts_each_device_at_its_initial_fraction():
    ctx, h = make({0: 100, 1: 200, 2: 3}, 'algorithm.allocation="hermes"',
                  "allocation.initial_fraction=0.3", "train.batch_size=32")  # fmt: skip
    got = {}
    for d in (0, 1, 2):
        spec = TaskSpec()
        h.shape_task(d, spec)
        got[d] = (spec.samples, spec.batch)
    # D = max(1, int(0.3 n)); b = min(batch_size, D)
    assert got == {0: (30, 30), 1: (60, 32), 2: (1, 1)}


def test_the_memory_cap_bounds_the_first_allocation():
    cfg = config(None, 'algorithm.allocation="hermes"', "allocation.initial_fraction=1.0")
    ctx = FakeCoordinatorContext(cfg, {0: 100, 1: 100})
    ctx.caps = {0: 40}  # device 1: 0 = no cap
    h = HermesCoordinator(ctx, "hermes")
    assert h.allocator.allocation(0).samples == 40
    assert h.allocator.allocation(1).samples == 100


def test_a_full_batch_config_gives_the_allocator_the_default_batch():
    _, h = make({0: 500}, 'algorithm.allocation="hermes"', "train.batch_size=0")
    assert h.allocator.allocation(0).batch == 32


# -- iterations and allocation ------------------------------------------------------------


def test_on_iteration_records_times_and_feeds_only_positive_ones_to_the_allocator():
    _, h = make({0: 100, 1: 100}, 'algorithm.allocation="hermes"')
    h.on_iteration(0, 2.0)
    h.on_iteration(0, 0.0)  # an unmeasured iteration: the allocator would refuse it
    h.on_iteration(1, 1.0)
    assert list(h.metrics.times[0]) == [2.0, 0.0] and h.metrics.iterations == {0: 2, 1: 1}
    assert h.allocator.state_dict()["measurements"] == [1, 1]


def test_a_fixed_allocation_does_not_measure():
    _, h = make()
    h.on_iteration(0, 3.0)
    assert list(h.metrics.times[0]) == [3.0]
    assert h.allocator.state_dict()["measurements"] == [0, 0]


def test_allocation_moves_a_slow_device_toward_the_median_time():
    _, h = make({0: 1000, 1: 1000, 2: 1000}, 'algorithm.allocation="hermes"',
                'allocation.trigger="always"', "allocation.smoothing=1.0")  # fmt: skip
    before = {d: h.allocator.allocation(d).samples for d in (0, 1, 2)}
    for _ in range(3):
        for d, t in ((0, 1.0), (1, 1.0), (2, 4.0)):
            h.on_iteration(d, t)
    after = {d: TaskSpec() for d in (0, 1, 2)}
    for d, spec in after.items():
        h.shape_task(d, spec)
    assert after[2].samples < before[2]  # the slow device gets less work


# -- loss-weighted aggregation ------------------------------------------------------------


def test_aggregate_is_left_to_the_aggregator_without_a_loss_aggregation():
    _, h = make()
    assert h.aggregate(Apply("aggregate", [arrival(0, [1, 0, 0, 0])])) is None


def _loss_ctx(*sets, model=(1.0, 1.0, 0.0, 0.0)):
    calls = []

    def loss(v):
        calls.append(v.copy())
        return float(np.dot(v, v))

    ctx = FakeCoordinatorContext(config(None, *sets), {0: 10, 1: 10, 2: 10},
                                 model=np.array(model, np.float32), test_loss_fn=loss)  # fmt: skip
    return ctx, calls


def test_loss_weighted_folds_the_round_in_device_order_by_candidate_test_loss():
    ctx, calls = _loss_ctx('algorithm.aggregation="loss-weighted"')
    ctx.aggregator_ = LossWeighted()
    h = HermesCoordinator(ctx, "hermes")
    d0, d1 = np.array([1, 0, 0, 0], np.float32), np.array([0, 0, 2, 0], np.float32)
    # arrival order 1, 0: an aggregate round is folded in ascending device order
    step = h.aggregate(Apply("aggregate", [arrival(1, d1), arrival(0, d0)]))
    g = np.array([1, 1, 0, 0.0])
    gl, c1 = g @ g, (g + d1) @ (g + d1)
    w1, w2 = 1 / gl, 1 / c1
    want = (w1 * d0 + w2 * d1) / (w1 + w2)  # device 0 starts the average
    np.testing.assert_allclose(step, want, rtol=1e-6)
    assert step.dtype == np.float32
    # one global evaluation (the unchanged model) and one per candidate
    assert len(calls) == 3 and np.array_equal(calls[0], g)


def test_outside_an_aggregate_round_arrivals_are_folded_as_they_came():
    ctx, _ = _loss_ctx('algorithm.aggregation="loss-weighted"')
    ctx.aggregator_ = LossWeighted()
    h = HermesCoordinator(ctx, "hermes")
    d0, d1 = np.array([1, 0, 0, 0], np.float32), np.array([0, 0, 2, 0], np.float32)
    step = h.aggregate(Apply("terms", [arrival(1, d1), arrival(0, d0)], [1.0, 1.0]))
    g = np.array([1, 1, 0, 0.0])
    w1, w2 = 1 / (g @ g), 1 / ((g + d0) @ (g + d0))
    np.testing.assert_allclose(step, (w1 * d1 + w2 * d0) / (w1 + w2), rtol=1e-6)


def test_an_asynchronous_policys_share_scales_each_update_it_folds_in():
    """ASP/SSP give each arrival its share of the fleet (``coef``): the update enters the
    average scaled by it, as plain ASP applies it; the candidate is still judged on the
    whole update. (Unscaled, every push was ~devices times ASP's step, and Hermes
    diverged at server.lr 1.)"""
    ctx, calls = _loss_ctx('algorithm.aggregation="loss-weighted"')
    ctx.aggregator_ = LossWeighted()
    h = HermesCoordinator(ctx, "hermes")
    d0, d1 = np.array([1, 0, 0, 0], np.float32), np.array([0, 0, 2, 0], np.float32)
    step = h.aggregate(Apply("terms", [arrival(1, d1), arrival(0, d0)], [0.25, 0.5]))
    g = np.array([1, 1, 0, 0.0])
    w1, w2 = 1 / (g @ g), 1 / ((g + d0) @ (g + d0))
    want = (w1 * 0.25 * d1 + w2 * 0.5 * d0) / (w1 + w2)
    np.testing.assert_allclose(step, want, rtol=1e-6)
    assert np.array_equal(calls[1], g + d1) and np.array_equal(calls[2], g + d0)
    # loss-softmax takes the same share
    ctx, _ = _loss_ctx('algorithm.aggregation="loss-softmax"')
    ctx.aggregator_ = LossSoftmax(temperature=1.0, buffer=1)
    h = HermesCoordinator(ctx, "hermes")
    step = h.aggregate(Apply("terms", [arrival(1, d1)], [0.25]))
    np.testing.assert_allclose(step, 0.25 * d1, rtol=1e-6)


def test_the_global_test_loss_is_evaluated_once_per_model_version():
    ctx, calls = _loss_ctx('algorithm.aggregation="loss-weighted"')
    ctx.aggregator_ = LossWeighted()
    h = HermesCoordinator(ctx, "hermes")
    d = np.array([0, 0, 1, 0], np.float32)
    h.aggregate(Apply("aggregate", [arrival(0, d)]))
    h.aggregate(Apply("aggregate", [arrival(1, d)]))
    assert len(calls) == 3  # global, candidate, candidate (same version: cached)
    ctx.step(np.array([1, 0, 0, 0], np.float32))
    h.aggregate(Apply("aggregate", [arrival(2, d)]))
    assert len(calls) == 5 and np.array_equal(calls[3], [2, 1, 0, 0])


def test_loss_softmax_buffers_each_device_with_its_candidate_loss():
    ctx, _ = _loss_ctx('algorithm.aggregation="loss-softmax"', "hermes.softmax_temperature=1.0")
    agg = ctx.aggregator_ = LossSoftmax(temperature=1.0, buffer=4)
    h = HermesCoordinator(ctx, "hermes")
    d0, d1 = np.array([1, 0, 0, 0], np.float32), np.array([0, 0, 2, 0], np.float32)
    step = h.aggregate(Apply("aggregate", [arrival(0, d0), arrival(1, d1)]))
    g = np.array([1, 1, 0, 0.0])
    c = np.array([(g + d0) @ (g + d0), (g + d1) @ (g + d1)])
    w = np.exp(-(c - c.min()))
    w /= w.sum()
    np.testing.assert_allclose(step, w[0] * d0 + w[1] * d1, rtol=1e-6)
    assert agg.buffered == [0, 1]


# -- broadcast ----------------------------------------------------------------------------


def test_broadcast_all_refreshes_every_busy_device_but_the_pushers():
    ctx, h = make({0: 10, 1: 10, 2: 10, 3: 10}, 'algorithm.gate="hermes"',
                  'hermes.broadcast="all"')  # fmt: skip
    ctx.inflight = {1: (4, 0, 0.0), 2: (3, 0, 0.0), 3: (1, 0, 0.0)}
    h.after_apply(Apply("aggregate", [arrival(2, np.zeros(8))]), 1.0)
    assert sorted(ctx.refreshed) == [1, 3]


@pytest.mark.parametrize(
    "sets",
    [('algorithm.gate="hermes"',), ('hermes.broadcast="all"',)],  # pusher only / not gated
)
def test_no_refresh_without_a_gated_broadcast_to_all(sets):
    ctx, h = make({0: 10, 1: 10}, *sets)
    ctx.inflight = {1: (0, 0, 0.0)}
    h.after_apply(Apply("aggregate", [arrival(0, np.zeros(8))]), 1.0)
    assert ctx.refreshed == []


# -- summary and state --------------------------------------------------------------------


def _records(ctx, recs):
    for d, r in recs.items():
        ctx.devices_[d].update(r)


def test_summary_reports_wi_api_calls_bytes_and_allocations():
    ctx, h = make({0: 100, 1: 200})
    _records(ctx, {
        0: {"iterations": 10, "requests": 2, "msgs_up": 2, "bytes_up": 100, "bytes_down": 50},
        1: {"iterations": 4, "requests": 0, "msgs_up": 1, "bytes_up": 7, "bytes_down": 3},
    })  # fmt: skip
    ctx.control = 5
    for t0, t1 in ((1.0, 3.0), (2.0, 2.0)):
        h.on_iteration(0, t0)
        h.on_iteration(1, t1)
    s = h.summary()["hermes"]
    assert s["wi"] == {"0": 5.0, "1": 0.0} and s["wi_mean"] == 2.5
    assert (s["iterations"], s["pulls"], s["pushes"], s["api_calls"]) == (14, 2, 3, 5)
    assert s["control_messages"] == 5 and s["bytes"] == 160
    assert s["iteration_time_cv"] == pytest.approx([0.5, 0.0])
    assert s["iteration_time_cv_first"] == pytest.approx(0.5) and s["iteration_time_cv_last"] == 0
    assert s["iteration_time_cv_settled"] == pytest.approx(1 / 4)  # means 1.5 and 2.5
    assert s["allocations"] == {"0": [100, 32], "1": [200, 32]}


def test_summary_before_any_iteration_has_no_cv():
    ctx, h = make({0: 10})
    _records(ctx, {0: {"iterations": 0, "msgs_up": 0, "bytes_down": 0}})
    s = h.summary()["hermes"]
    assert s["iteration_time_cv"] == [] and s["iteration_time_cv_first"] is None
    assert s["iteration_time_cv_settled"] is None and s["wi"] == {"0": 0.0}


def test_settled_cv_uses_the_last_iterations_of_at_least_two_devices():
    assert settled_cv({0: [1.0, 2.0]}) is None
    assert settled_cv({0: [], 1: [3.0]}) is None
    assert settled_cv({0: [0.0], 1: [0.0]}) is None
    # only the last 2 count: means 1 and 3 -> std 1 / mean 2
    assert settled_cv({0: [100.0, 1.0, 1.0], 1: [0.0, 3.0, 3.0]}, last=2) == pytest.approx(0.5)


def test_state_dict_round_trip_restores_metrics_and_allocations():
    sets = ('algorithm.allocation="hermes"', 'allocation.trigger="always"')
    _, h = make({0: 1000, 1: 1000, 2: 1000}, *sets)
    for d, t in ((0, 1.0), (1, 2.0), (2, 5.0)):
        h.on_iteration(d, t)
    st = h.state_dict()
    _, h2 = make({0: 1000, 1: 1000, 2: 1000}, *sets)
    assert h2.allocator.allocations() != h.allocator.allocations()
    h2.load_state_dict(st)
    assert h2.allocator.allocations() == h.allocator.allocations()
    assert h2.metrics.times == h.metrics.times and h2.metrics.iterations == h.metrics.iterations
    assert h2.state_dict() == st
