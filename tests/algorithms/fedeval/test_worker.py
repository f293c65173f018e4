"""edgefl.algorithms.fedeval.worker: a device evaluates the start model on its held-out
split every K versions and reports it (FED_EVAL) before it trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Subset, TensorDataset

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.fedeval.coordinator import FedEvalCoordinator
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.fedeval.metrics import decode
from edgefl.algorithms.fedeval.plugin import FederatedEvaluation
from edgefl.algorithms.fedeval.worker import FedEvalWorker
from edgefl.comm import Message

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config


def hits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).float()


HITS = f'evaluation.metrics=["{__name__}:hits"]'
GATED = 'algorithm.gate="hermes"'


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 2, generator=g), torch.randint(0, 3, (n,), generator=g))


def make(*sets: str) -> tuple[FakeWorkerContext, FedEvalWorker, torch.nn.Module]:
    cfg = config(None, "evaluation.every=2", "evaluation.holdout=0.3", *sets)
    ctx = FakeWorkerContext(cfg, {0: data(10, 0), 1: data(20, 1)})
    torch.manual_seed(0)
    return ctx, FederatedEvaluation.worker(ctx, FederatedEvaluation.name), torch.nn.Linear(2, 3)


def job(d: int, version: int, m: torch.nn.Module, new_model: bool = True) -> LocalJob:
    """A task from ``version``; ``new_model``: it starts from a global model (the core says
    so for every task without a gate; with a gate, when the device just adopted one)."""
    return LocalJob(d, 5, version, TaskSpec(), model=m, new_model=new_model)


def sent_result(ctx, i: int = 0) -> dict:
    s = ctx.sent[i]
    assert (s.rank, s.kind) == (0, FED_EVAL)
    return decode(s.payload, [])


def test_without_a_gate_the_worker_asks_for_the_evaluation_holdout():
    ctx, w, _ = make()
    assert ctx.holdout == 0.3 and not w.gated
    train, held = ctx.split(1)
    assert (len(train), len(held)) == (14, 6)


def test_with_a_gate_it_leaves_the_holdout_to_hermes():
    ctx, w, _ = make(GATED)
    assert w.gated and ctx.holdout is None


def test_a_task_from_an_evaluated_version_reports_the_start_models_held_out_scores():
    ctx, w, m = make()
    w.before_train(1, job(1, 4, m))
    s = ctx.sent[0]
    assert (s.device, s.round) == (1, 4)
    r = sent_result(ctx)
    held = ctx.split(1)[1]
    x, y = held[:]
    with torch.no_grad():
        out = m(x)
    assert (r["version"], r["device"], r["samples"]) == (4, 1, len(held)) == (4, 1, 6)
    assert r["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-5)
    assert r["accuracy"] == pytest.approx(float((out.argmax(-1) == y).float().mean()))


@pytest.mark.parametrize("version", [1, 3, 5])
def test_a_task_from_another_version_evaluates_nothing(version):
    ctx, w, m = make()
    w.before_train(0, job(0, version, m))
    assert ctx.sent == []


def test_the_configured_metrics_are_reported_as_their_mean():
    ctx, w, m = make(HITS)
    w.before_train(0, job(0, 0, m))
    r = decode(ctx.sent[0].payload, ["hits"])
    assert r["hits"] == pytest.approx(r["accuracy"])  # hits is the accuracy, per example


def test_an_evaluation_leaves_torchs_random_stream_alone():
    ctx, w, m = make()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    w.before_train(0, job(0, 0, m))
    assert torch.equal(torch.rand(3), expected)


def test_a_gated_device_evaluates_only_a_fresh_global_model_once():
    ctx, w, m = make(GATED)
    ds = ctx.data[0]
    ctx.splits[0] = (Subset(ds, range(7)), Subset(ds, range(7, 10)))  # Hermes' split
    w.before_train(0, job(0, 0, m, new_model=False))  # goes on from its own local model
    assert ctx.sent == []
    w.before_train(0, job(0, 2, m, new_model=True))  # it just adopted global version 2
    assert sent_result(ctx)["samples"] == 3
    w.before_train(0, job(0, 2, m, new_model=False))  # the next local iteration
    assert len(ctx.sent) == 1


def test_a_fresh_gated_model_of_a_version_not_evaluated_is_skipped_and_forgotten():
    ctx, w, m = make(GATED)
    ctx.splits[1] = (Subset(ctx.data[1], range(14)), Subset(ctx.data[1], range(14, 20)))
    w.before_train(1, job(1, 3, m, new_model=True))
    assert ctx.sent == []
    w.before_train(1, job(1, 4, m, new_model=False))  # (no version-4 model was adopted)
    assert ctx.sent == []
    w.before_train(1, job(1, 4, m, new_model=True))
    assert sent_result(ctx)["version"] == 4


def test_without_a_held_out_split_the_evaluation_is_an_error():
    ctx, w, m = make(GATED)
    with pytest.raises(RuntimeError, match="device 0: no held-out split"):
        w.before_train(0, job(0, 0, m))


def test_rank_0_accepts_what_the_worker_sends():
    ctx, w, m = make(HITS)
    c_ctx = FakeCoordinatorContext(ctx.cfg_, {0: 10, 1: 20})
    co = FedEvalCoordinator(c_ctx, "fedeval")
    w.before_train(0, job(0, 0, m))
    s = ctx.sent[0]
    co.on_message(Message(kind=s.kind, src=1, device=s.device, round=s.round,
                          payload=s.payload, nbytes=s.payload.nbytes))  # fmt: skip
    assert c_ctx.rejected == []
    got = co.pending[0]["0"]
    assert set(got) == {"samples", "loss", "accuracy", "hits"} and got["samples"] == 3
    assert c_ctx.train_size(0) + got["samples"] == 10  # both sides hold out the same
    assert np.isfinite(got["loss"])
