"""edgefl.algorithms.fedeval.coordinator: results collected by version, landed in rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from edgefl.algorithms.base import TaskSpec
from edgefl.algorithms.fedeval.coordinator import FedEvalCoordinator
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.fedeval.metrics import encode
from edgefl.algorithms.fedeval.plugin import FederatedEvaluation
from edgefl.comm import Message
from edgefl.comm.taskflags import CONTINUE, FLUSH, REFRESH
from edgefl.comm.wire import HEADER_BYTES

from ..fakes import FakeCoordinatorContext, config

SAMPLES = {0: 10, 1: 30, 2: 20}


def hits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).float()


def make(*sets: str, samples=None) -> FakeCoordinatorContext:
    return FakeCoordinatorContext(config(None, "evaluation.every=2", *sets), samples or SAMPLES)


def half(ctx) -> FedEvalCoordinator:
    return FederatedEvaluation.coordinator(ctx, FederatedEvaluation.name)


def result(d: int, v: int, samples: int, loss: float, acc: float, round=None, **extra):
    body = {"version": v, "device": d, "samples": samples, "loss": loss, "accuracy": acc}
    payload = encode({**body, **extra})
    return Message(kind=FED_EVAL, src=1 + d % 2, device=d, round=v if round is None else round,
                   payload=payload, nbytes=payload.nbytes)  # fmt: skip


def row(ctx, **kw) -> dict:
    return {"round": ctx.version, **kw}


def test_without_a_gate_rank_0_holds_out_the_evaluation_split():
    ctx = make("evaluation.holdout=0.5")
    half(ctx)
    assert ctx.holdout == 0.5 and [ctx.train_size(d) for d in SAMPLES] == [5, 15, 10]


def test_with_a_gate_the_holdout_is_left_to_hermes():
    ctx = make('algorithm.gate="hermes"')
    co = half(ctx)
    assert co.gated and ctx.holdout is None and ctx.train_size(1) == 30


def test_a_task_starting_from_an_evaluated_version_is_booked():
    ctx = make()
    co = half(ctx)
    co.shape_task(0, TaskSpec())
    assert co.booked == {0: 0} and co.open == {0: {0}}
    ctx.step(np.zeros(ctx.numel))  # version 1: 1 % 2, not evaluated
    co.shape_task(0, TaskSpec())  # the device's previous task is over
    assert co.booked == {} and co.open == {0: set()}


def test_a_flush_task_evaluates_nothing():
    co = half(make())
    co.shape_task(1, TaskSpec(flags=FLUSH))
    assert co.booked == {} and co.open == {}


@pytest.mark.parametrize(
    "flags, booked", [(0, True), (CONTINUE, False), (CONTINUE | REFRESH, True)]
)
def test_a_gated_device_evaluates_only_when_it_gets_the_global_model(flags, booked):
    co = half(make('algorithm.gate="hermes"'))
    co.shape_task(2, TaskSpec(flags=flags))
    assert (co.booked == {2: 0}) is booked


def test_a_result_is_kept_under_its_version_and_its_bytes_counted():
    ctx = make()
    co = half(ctx)
    msg = result(1, 0, 6, 0.5, 0.75)
    co.on_message(msg)
    assert co.pending == {0: {"1": {"samples": 6, "loss": 0.5, "accuracy": 0.75}}}
    assert ctx.booked == [(1, HEADER_BYTES + msg.nbytes)] and ctx.rejected == []


def test_a_result_keeps_the_configured_metrics_too():
    ctx = make(f'evaluation.metrics=["{__name__}:hits"]')
    co = half(ctx)
    co.on_message(result(0, 0, 2, 0.1, 1.0, hits=0.5, junk=7))
    assert co.keys == ["loss", "accuracy", "hits"]
    assert co.pending[0]["0"] == {"samples": 2, "loss": 0.1, "accuracy": 1.0, "hits": 0.5}


def test_a_result_without_a_configured_metric_is_rejected():
    ctx = make(f'evaluation.metrics=["{__name__}:hits"]')
    co = half(ctx)
    co.on_message(result(0, 0, 2, 0.1, 1.0))
    assert co.pending == {} and ctx.rejected[0][0] == 1 and "hits" in ctx.rejected[0][1]


@pytest.mark.parametrize(
    "msg, why",
    [
        (Message(kind=FED_EVAL, src=2, device=1, payload=np.frombuffer(b"\xff{", np.uint8)),
         "not a JSON evaluation result"),
        (result(1, 0, -1, 0.5, 0.5), "bad sample count"),
        (result(1, 2, 5, 0.5, 0.5, round=4), "version 2 mismatch"),
        (result(7, 0, 5, 0.5, 0.5), "FED_EVAL of device 7"),
    ],
)  # fmt: skip
def test_a_malformed_or_foreign_result_is_rejected_not_kept(msg, why):
    ctx = make()
    co = half(ctx)
    co.on_message(msg)
    assert co.pending == {} and ctx.booked == []
    ((rank, text),) = ctx.rejected
    assert rank == msg.src and "FED_EVAL of device" in text and why in text


def two_results(ctx, co):
    """Devices 0 and 1 evaluate version 0 (10 and 30 samples), then the model moves on."""
    co.shape_task(0, TaskSpec())
    co.shape_task(1, TaskSpec())
    co.on_message(result(0, 0, 10, 1.0, 0.5))
    co.on_message(result(1, 0, 30, 3.0, float("nan")))
    ctx.step(np.zeros(ctx.numel))


def test_a_version_lands_once_the_model_moved_on_and_its_tasks_ended():
    ctx = make()
    co = half(ctx)
    two_results(ctx, co)
    r = row(ctx)
    co.on_row(r)
    assert "fed_version" not in r  # both tasks that evaluated it still run
    co.on_iteration(0, 1.0)
    co.on_device_dead(1, 2.0)
    r = row(ctx)
    co.on_row(r)
    assert r["fed_version"] == 0 and list(r["fed_eval"]) == ["0", "1"]
    assert r["fed_loss"] == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)
    assert r["fed_accuracy"] == pytest.approx(0.5)  # the nan of device 1 is left out
    assert co.pending == {} and co.landed == 1
    assert co.last == {"version": 0, "devices": 2, "fed_loss": pytest.approx(2.5),
                       "fed_accuracy": pytest.approx(0.5)}  # fmt: skip


def test_a_version_does_not_land_before_the_model_moved_past_it():
    ctx = make()
    co = half(ctx)
    co.on_message(result(2, 0, 4, 1.0, 1.0))  # nothing booked: no task holds it
    r = row(ctx)
    co.on_row(r)
    assert "fed_version" not in r and 0 in co.pending
    ctx.step(np.zeros(ctx.numel))
    co.on_row(r)
    assert r["fed_version"] == 0 and r["fed_eval"] == {
        "2": {"samples": 4, "loss": 1.0, "accuracy": 1.0}
    }


def test_a_row_takes_one_version_the_oldest_ready_one():
    ctx = make("evaluation.every=1")
    co = half(ctx)
    co.on_message(result(0, 0, 1, 1.0, 1.0))
    ctx.step(np.zeros(ctx.numel))
    co.on_message(result(0, 1, 1, 2.0, 1.0))
    ctx.step(np.zeros(ctx.numel))
    first, second = row(ctx), row(ctx)
    co.on_row(first)
    co.on_row(second)
    assert (first["fed_version"], first["fed_loss"]) == (0, 1.0)
    assert (second["fed_version"], second["fed_loss"]) == (1, 2.0)


def test_the_final_row_lands_the_oldest_waiting_version_and_drops_the_rest():
    ctx = make("evaluation.every=1", "run.rounds=3")
    co = half(ctx)
    for v in range(3):
        co.shape_task(0, TaskSpec())  # device 0's task evaluating v never ends
        co.on_message(result(0, v, 1, float(v), 1.0))
        ctx.step(np.zeros(ctx.numel))
    r = row(ctx)  # round 3 = run.rounds
    co.on_row(r)
    assert r["fed_version"] == 0 and co.pending == {}
    assert co.summary() == {"fed_eval": {"every": 1, "versions_landed": 1,
                                         "versions_dropped": [1, 2], "last": co.last,
                                         "final": None}}  # fmt: skip


def test_a_version_whose_devices_all_ended_without_a_result_is_forgotten():
    ctx = make()
    co = half(ctx)
    co.shape_task(0, TaskSpec())
    co.on_device_dead(0, 1.0)
    ctx.step(np.zeros(ctx.numel))
    co.on_row(row(ctx))
    assert co.open == {} and co.pending == {} and co.landed == 0


def test_the_test_set_is_scored_on_the_metrics_when_the_row_has_a_test_accuracy():
    ctx = make(f'evaluation.metrics=["{__name__}:hits"]')
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))  # predicts the larger input
    ctx.model_ = model
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    ctx.test_set_ = TensorDataset(x, torch.tensor([0, 1, 1, 1]))
    co = half(ctx)
    with_test = row(ctx, test_accuracy=0.75)
    co.on_row(with_test)
    assert with_test["test_hits"] == pytest.approx(0.75)
    without = row(ctx, test_accuracy=None)
    co.on_row(without)
    assert "test_hits" not in without


def test_no_test_metric_is_computed_without_metrics():
    ctx = make()  # ctx.model is None: touching it would raise
    r = row(ctx, test_accuracy=0.5)
    half(ctx).on_row(r)
    assert not any(k.startswith("test_") and k != "test_accuracy" for k in r)


def test_state_dict_round_trips_the_counters_and_drops_pending_results():
    ctx = make()
    co = half(ctx)
    co.on_message(result(0, 0, 10, 1.0, 0.5))
    ctx.step(np.zeros(ctx.numel))
    co.on_row(row(ctx))
    co.dropped = [4]
    co.on_message(result(1, 2, 3, 1.0, 1.0))  # still pending: not saved
    st = co.state_dict()
    assert set(st) == {"landed", "dropped", "last"}
    other = half(make())
    other.load_state_dict(st)
    assert (other.landed, other.dropped, other.last) == (1, [4], co.last)
    assert other.pending == {}
    s = other.summary()["fed_eval"]
    assert s["versions_landed"] == 1 and s["versions_dropped"] == [4]


def test_load_state_dict_of_an_empty_state_starts_from_zero():
    co = half(make())
    co.load_state_dict({})
    assert (co.landed, co.dropped, co.last) == (0, [], None)
