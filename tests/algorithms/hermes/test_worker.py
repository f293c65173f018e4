"""Hermes' worker half alone: it asks its context for the one hold-out split (with a gate
only), and its gate decides each gated iteration: push, the held-out loss, the score."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.fedeval.worker import FedEvalWorker
from edgefl.algorithms.hermes.worker import HermesWorker

from ..fakes import FakeWorkerContext, config

GATED = ('algorithm.gate="hermes"', "hermes.holdout_fraction=0.25")


def _data(n: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def _job(model: torch.nn.Module | None = None, new_model: bool = False) -> LocalJob:
    return LocalJob(0, 0, 0, TaskSpec(), model, None, "cpu", None, new_model=new_model)


class _Gate:
    """A gate that counts the new global models it is told of."""

    def __init__(self) -> None:
        self.received = 0

    def on_model_received(self) -> None:
        self.received += 1


def test_with_a_gate_it_asks_for_the_hold_out_and_the_split_is_the_one_rule():
    ctx = FakeWorkerContext(config(None, *GATED), {0: _data(8), 1: _data(1)})
    HermesWorker(ctx, "hermes")
    assert ctx.holdout == 0.25
    train, held = ctx.split(0)
    assert len(train) == 6 and len(held) == 2  # round(0.25 * 8) held out
    assert sorted([*train.indices, *held.indices]) == list(range(8))
    one = ctx.split(1)
    assert one[0] is one[1]  # one sample: the gate measures on the sample it trains on


def test_without_a_gate_it_holds_nothing_out_and_decides_nothing():
    ctx = FakeWorkerContext(config(), {0: _data(8)})
    w = HermesWorker(ctx, "hermes")
    assert ctx.holdout is None and ctx.split(0) is None
    assert w.gate(0, _job(torch.nn.Linear(3, 2)), None, 1) is None


def test_hermes_and_federated_evaluation_share_one_split():
    # with a gate, federated evaluation scores on Hermes' held-out split (asks for none)
    ctx = FakeWorkerContext(config(None, *GATED, "evaluation.every=1"), {0: _data(8)})
    HermesWorker(ctx, "hermes")
    FedEvalWorker(ctx, "fedeval")
    assert ctx.holdout == 0.25
    # without one, federated evaluation asks for its own fraction
    ctx2 = FakeWorkerContext(config(None, "evaluation.every=1", "evaluation.holdout=0.5"),
                             {0: _data(8)})  # fmt: skip
    HermesWorker(ctx2, "hermes")
    FedEvalWorker(ctx2, "fedeval")
    assert ctx2.holdout == 0.5 and len(ctx2.split(0)[1]) == 4
    with pytest.raises(ValueError, match="two hold-out fractions"):
        ctx2.hold_out(0.25)


def test_the_gate_pushes_at_the_local_iteration_cap():
    ctx = FakeWorkerContext(config(None, *GATED, "hermes.max_local_iterations=3"), {0: _data(8)})
    w = HermesWorker(ctx, "hermes")
    model = torch.nn.Linear(3, 2)
    held = ctx.split(0)[1]
    w.before_train(0, _job(model, new_model=True))
    pushes = [w.gate(0, _job(model), held, k)[0] for k in (1, 2, 3)]
    assert pushes[-1] is True  # the model never changes, so only the cap makes it push
    loss = w.gate(0, _job(model), held, 1)[1]
    assert math.isfinite(loss) and loss > 0


def test_a_gated_device_s_gate_hears_of_each_new_global_model_before_its_task():
    ctx = FakeWorkerContext(config(None, *GATED), {0: _data(8), 1: _data(8)})
    w = HermesWorker(ctx, "hermes")
    w.before_train(1, _job(new_model=True))  # the first task builds the device's gate
    assert set(w.gates) == {1}
    w.gates[0] = gate = _Gate()
    w.before_train(0, _job(new_model=True))  # its first task, a push or a REFRESH before
    assert gate.received == 1
    w.before_train(0, _job(new_model=False))  # it goes on from its own local model
    assert gate.received == 1
    w.before_train(0, _job(new_model=True))
    assert gate.received == 2


def test_without_a_gate_a_new_global_model_builds_no_gate():
    ctx = FakeWorkerContext(config(), {0: _data(8)})
    w = HermesWorker(ctx, "hermes")
    w.before_train(0, _job(new_model=True))  # (every task without a gate)
    assert w.gates == {} and w.device_state(0) == {}


def test_a_non_finite_held_out_loss_is_pushed_as_it_is():
    ctx = FakeWorkerContext(config(None, *GATED), {0: _data(8)})
    w = HermesWorker(ctx, "hermes")
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    push, loss, z = w.gate(0, _job(model), ctx.split(0)[1], 1)
    assert push is True and math.isnan(loss) and z == 0.0


def test_the_gate_state_round_trips_per_device():
    ctx = FakeWorkerContext(config(None, *GATED), {0: _data(8)})
    w = HermesWorker(ctx, "hermes")
    model = torch.nn.Linear(3, 2)
    w.before_train(0, _job(model, new_model=True))
    w.gate(0, _job(model), ctx.split(0)[1], 1)
    st = w.device_state(0)
    assert set(st) == {"gate"} and w.device_state(5) == {}
    w2 = HermesWorker(ctx, "hermes")
    w2.load_device_state(0, st)
    assert w2.device_state(0) == st
