"""edgefl.algorithms.ordering.coordinator: rank 0 opens an epoch, balances GRADS rows as they
arrive, rejects what does not fit and sends every device its next order (ORDER)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.ordering.coordinator import OrderingCoordinator
from edgefl.algorithms.ordering.kinds import GRADS, ORDER
from edgefl.algorithms.ordering.orderers import make_orderer, replay_epoch_debug
from edgefl.errors import CheckpointError
from edgefl.policies.consistency import Apply, Arrival

from ..fakes import FakeCoordinatorContext, config, message

SIZES = {0: 4, 1: 6, 2: 5}


def make(name="cd-grab", *sets, samples=None, **kw):
    cfg = config(None, f'algorithm.ordering="{name}"', *sets)
    ctx = FakeCoordinatorContext(cfg, samples or SIZES, **kw)
    c = OrderingCoordinator(ctx, "ordering")
    return ctx, c


def started(name="cd-grab", *sets, **kw):
    ctx, c = make(name, *sets, **kw)
    c.on_start()
    ctx.inflight = {d: (3, 0, 0.0) for d in ctx.devices}  # every device runs task 3
    return ctx, c


def grads(d, first, rows, task=3, src=None, width=None):
    rows = np.asarray(rows, np.float32)
    n, w = rows.shape
    return message(GRADS, src=src or 1 + d % 2, device=d, round=task,
                   aux=(float(n), float(width or w), float(first), 0.0),
                   payload=rows.reshape(-1))  # fmt: skip


def rows_of(d, n, width=3, seed=0):
    return np.random.default_rng(seed + 10 * d).standard_normal((n, width)).astype(np.float32)


def apply_all(devices):
    arr = [Arrival(d, 3, 0, SIZES[d], 1.0, np.zeros(8, np.float32)) for d in devices]
    return Apply("aggregate", arr)


def test_it_handles_grads_and_orders_are_a_distinct_kind():
    assert OrderingCoordinator.message_kinds == (GRADS,) and GRADS != ORDER


# -- on_start -----------------------------------------------------------------------------


def test_on_start_sends_every_device_its_drr_order_of_epoch_0():
    ctx, c = make()
    c.on_start()
    ref = make_orderer("cd-grab", 0)
    assert ctx.sent_kinds() == [ORDER] * 3
    for w, (d, s) in enumerate(zip(sorted(SIZES), ctx.sent)):
        assert (s.rank, s.device, s.round) == (1 + d % 2, d, 0)
        assert s.payload.dtype == np.int32
        assert np.array_equal(s.payload, ref.shuffled(w, SIZES[d], 0))
    assert c.stream is not None and c.stream.sizes == [4, 6, 5]


def test_on_start_orders_the_training_split_in_units():
    ctx = FakeCoordinatorContext(config(None, 'algorithm.ordering="id-grab"',
                                        'ordering.unit="microbatch"', "ordering.microbatch=2"),
                                 {0: 10, 1: 5})  # fmt: skip
    ctx.hold_out(0.2)  # 8 and 4 training samples
    c = OrderingCoordinator(ctx, "ordering")
    c.on_start()
    assert [s.payload.size for s in ctx.sent] == [4, 2]


def test_a_resumed_run_sends_the_checkpointed_orders():
    ctx, c = started()
    for d in SIZES:
        c.on_message(grads(d, 0, rows_of(d, SIZES[d])))
    c.after_apply(apply_all(SIZES), 1.0)
    st, sent = c.state_dict(), [s.payload for s in ctx.sent[-3:]]
    ctx2, c2 = make()
    c2.load_state_dict(st)
    c2.on_start()
    assert [s.round for s in ctx2.sent] == [1, 1, 1]
    assert all(np.array_equal(a.payload, b) for a, b in zip(ctx2.sent, sent))


# -- GRADS --------------------------------------------------------------------------------


def test_rows_in_sequence_are_balanced_as_they_arrive():
    ctx, c = started()
    c.on_message(grads(1, 0, rows_of(1, 6)[:2]))
    c.on_message(grads(1, 2, rows_of(1, 6)[2:]))
    assert ctx.rejected == [] and c.stream.count == [0, 6, 0]
    assert c.stream.missing == set()


def test_grads_before_an_epoch_is_open_are_rejected():
    ctx, c = make()
    c.on_message(grads(0, 0, rows_of(0, 4)))
    assert len(ctx.rejected) == 1 and "no ordering epoch open" in ctx.rejected[0][1]


def test_grads_of_an_unknown_device_are_rejected():
    ctx, c = started()
    c.on_message(grads(9, 0, rows_of(0, 2), src=2))
    assert ctx.rejected == [(2, "GRADS of device 9: no ordering epoch open")]


@pytest.mark.parametrize(
    "msg, why",
    [
        (grads(0, 0, rows_of(0, 2), task=2), "for task 2, device 0 is running task 3"),
        (grads(0, 0, rows_of(0, 2), width=4), "6 values are not 2 rows of 4"),
        (grads(0, 2, rows_of(0, 2)), "rows from 2, expected from 0"),
        (grads(0, 0, rows_of(0, 5)), "sent 5 gradients for 4 units"),
        (grads(0, 0, np.full((2, 3), np.nan)), "non-finite"),
        (
            message(
                GRADS,
                src=1,
                device=0,
                round=3,
                aux=(float("nan"), 3.0, 0.0, 0.0),
                payload=np.ones(6, np.float32),
            ),
            "is not 3 counts",
        ),  # fmt: skip
        (
            message(
                GRADS,
                src=1,
                device=0,
                round=3,
                aux=(2.0, 3.0, float("inf"), 0.0),
                payload=np.ones(6, np.float32),
            ),
            "is not 3 counts",
        ),  # fmt: skip
    ],
)
def test_grads_that_do_not_fit_are_rejected_and_the_device_gets_drr_next(msg, why):
    ctx, c = started()
    c.on_message(msg)
    assert len(ctx.rejected) == 1
    rank, text = ctx.rejected[0]
    assert rank == 1 and text.startswith("GRADS of device 0: ") and why in text
    assert c.stream.missing == {0} and c.stream.count[0] == 0
    # the other devices complete; device 0 gets the D-RR order of epoch 1
    for d in (1, 2):
        c.on_message(grads(d, 0, rows_of(d, SIZES[d])))
    del ctx.sent[:]
    c.after_apply(apply_all(SIZES), 1.0)
    assert np.array_equal(ctx.sent[0].payload, make_orderer("cd-grab", 0).shuffled(0, 4, 1))


def test_a_second_bad_message_does_not_drop_twice():
    ctx, c = started()
    c.on_message(grads(0, 2, rows_of(0, 2)))
    c.on_message(grads(0, 2, rows_of(0, 2)))
    assert len(ctx.rejected) == 2 and c.stream.missing == {0}


# -- after_apply --------------------------------------------------------------------------


def test_after_apply_sends_the_orders_the_orderer_balances_from_the_rows():
    ctx, c = started()
    rows = {d: rows_of(d, SIZES[d]) for d in SIZES}
    c.on_message(grads(2, 0, rows[2][:3]))  # interleaved and split: same decisions
    for d in (0, 1):
        c.on_message(grads(d, 0, rows[d]))
    c.on_message(grads(2, 3, rows[2][3:]))
    ref = make_orderer("cd-grab", 0)
    used = ref.initial_orders([4, 6, 5])
    want = ref.next_orders([rows[0], rows[1], rows[2]], used)
    del ctx.sent[:]
    c.after_apply(apply_all(SIZES), 1.0)
    assert ctx.rejected == [] and ctx.sent_kinds() == [ORDER] * 3
    assert [s.round for s in ctx.sent] == [1, 1, 1]
    for s, o in zip(ctx.sent, want):
        assert np.array_equal(s.payload, o)
    assert c.orderer.epoch == 1 and c.stream.epoch == 1 and c.stream.count == [0, 0, 0]
    assert c.seconds >= 0.0 and c.wait_seconds >= 0.0


def test_a_device_without_an_update_this_round_gets_a_drr_order():
    ctx, c = started()
    for d in SIZES:
        c.on_message(grads(d, 0, rows_of(d, SIZES[d])))
    del ctx.sent[:]
    c.after_apply(apply_all([0, 2]), 1.0)
    ref = make_orderer("cd-grab", 0)
    assert np.array_equal(ctx.sent[1].payload, ref.shuffled(1, 6, 1))
    assert not np.array_equal(ctx.sent[0].payload, ref.shuffled(0, 4, 1))


def test_after_apply_waits_for_an_aggregate_round():
    ctx, c = started()
    del ctx.sent[:]
    c.after_apply(Apply("terms", [], []), 1.0)
    assert ctx.sent == [] and c.orderer.epoch == 0


def test_rr_ignores_the_rows_and_reshuffles():
    ctx, c = started("rr")
    c.on_message(grads(0, 0, rows_of(0, 4)))
    del ctx.sent[:]
    c.after_apply(apply_all(SIZES), 1.0)
    ref = make_orderer("rr", 0)
    for w, (d, s) in enumerate(zip(sorted(SIZES), ctx.sent)):
        assert np.array_equal(s.payload, ref.shuffled(w, SIZES[d], 1))


# -- re-hosting ---------------------------------------------------------------------------


def test_a_moved_device_that_sent_rows_is_dropped_and_its_late_rows_ignored():
    ctx, c = started()
    c.on_message(grads(1, 0, rows_of(1, 6)[:2]))
    first = next(s.payload for s in ctx.sent if s.device == 1)
    del ctx.sent[:]
    c.on_device_moved(1, 2, 1.0, {})
    assert len(ctx.sent) == 1
    s = ctx.sent[0]
    assert (s.rank, s.kind, s.device, s.round) == (2, ORDER, 1, 0)
    assert np.array_equal(s.payload, first)
    assert c.stream.missing == {1} and c.stream.moved == {1}
    c.on_message(grads(1, 0, rows_of(1, 6), src=2))  # its re-run on the new rank
    assert ctx.rejected == []


def test_a_moved_device_that_sent_nothing_re_runs_normally():
    ctx, c = started()
    c.on_device_moved(0, 2, 1.0, {})
    assert c.stream.missing == set()
    c.on_message(grads(0, 0, rows_of(0, 4), src=2))
    assert ctx.rejected == [] and c.stream.count[0] == 4


def test_a_move_before_the_first_orders_sends_nothing():
    ctx, c = make()
    c.on_device_moved(0, 2, 0.0, {})
    assert ctx.sent == []


# -- debug dumps, summary, state ----------------------------------------------------------


def test_save_debug_writes_a_replayable_epoch(tmp_path):
    ctx, c = started("id-grab", "ordering.save_debug=true", out_dir=tmp_path)
    for d in SIZES:
        c.on_message(grads(d, 0, rows_of(d, SIZES[d])))
    del ctx.sent[:]
    c.after_apply(apply_all(SIZES), 1.0)
    path = tmp_path / "ordering" / "epoch-00000.npz"
    assert path.exists()
    recomputed, sent = replay_epoch_debug(path)
    for a, b, s in zip(recomputed, sent, ctx.sent):
        assert np.array_equal(a, b) and np.array_equal(b, s.payload)


def test_without_save_debug_nothing_is_written(tmp_path):
    ctx, c = started("id-grab", out_dir=tmp_path)
    c.after_apply(apply_all(SIZES), 1.0)
    assert not (tmp_path / "ordering").exists()


def test_summary_names_the_orderer_and_its_epochs():
    ctx, c = started("id-grab-bal")
    c.after_apply(apply_all(SIZES), 1.0)
    s = c.summary()["ordering"]
    assert (s["name"], s["epochs"]) == ("id-grab-bal", 1)
    assert s["seconds"] >= 0.0 and s["wait_seconds"] >= 0.0


def test_state_dict_round_trip_and_a_mismatched_ordering_is_refused():
    ctx, c = started()
    for d in SIZES:
        c.on_message(grads(d, 0, rows_of(d, SIZES[d])))
    c.after_apply(apply_all(SIZES), 1.0)
    c.seconds, c.wait_seconds = 1.5, 0.5
    st = c.state_dict()
    _, c2 = make()
    c2.load_state_dict(st)
    assert (c2.seconds, c2.wait_seconds, c2.orderer.epoch) == (1.5, 0.5, 1)
    assert all(np.array_equal(a, b) for a, b in zip(c2.orderer.orders, c.orderer.orders))
    _, other = make("id-grab")
    with pytest.raises(CheckpointError, match="saved by 'cd-grab'"):
        other.load_state_dict(st)
