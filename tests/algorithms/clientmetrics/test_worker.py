"""edgefl.algorithms.clientmetrics.worker: a task's metrics go up just before its update."""

from __future__ import annotations

import numpy as np

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.clientmetrics.codec import decode
from edgefl.algorithms.clientmetrics.coordinator import ClientMetricsCoordinator
from edgefl.algorithms.clientmetrics.kinds import CLIENT_METRICS
from edgefl.algorithms.clientmetrics.plugin import ClientMetrics
from edgefl.algorithms.clientmetrics.worker import ClientMetricsWorker
from edgefl.comm import Message

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config, flush_upload, upload

CFG = config(None, 'train.client="my_pkg.clients:fit"')


def make() -> tuple[FakeWorkerContext, ClientMetricsWorker]:
    ctx = FakeWorkerContext(CFG, {3: [0] * 5, 4: [0] * 2})
    return ctx, ClientMetrics.worker(ctx, ClientMetrics.name)


def job(d: int, task: int, metrics: dict, samples: int | None = None) -> LocalJob:
    j = LocalJob(d, task, 0, TaskSpec(), metrics=dict(metrics))
    if samples is not None:
        j.ctx["client_samples"] = samples
    return j


def test_the_metrics_go_to_rank_0_and_the_update_is_left_to_others():
    ctx, w = make()
    up = upload(w, job(3, 9, {"grad_norm": 1.5, "steps": 4}, samples=5), np.ones(8))
    assert (up.by, up.kind, up.payload) == ("", None, None)  # the update: left to others
    assert up.delta.tolist() == [1.0] * 8
    (s,) = ctx.sent  # the side message, sent before the core sends the update
    assert (s.rank, s.kind, s.device, s.round) == (0, CLIENT_METRICS, 3, 9)
    assert s.payload.dtype == np.uint8
    assert decode(s.payload) == {"samples": 5.0, "grad_norm": 1.5, "steps": 4.0}


def test_a_task_without_metrics_sends_nothing():
    ctx, w = make()
    assert upload(w, job(3, 0, {}, samples=5), np.ones(8)).by == ""
    assert ctx.sent == []


def test_the_end_of_training_flush_sends_no_metrics_and_is_left_to_others():
    ctx, w = make()
    up = flush_upload(w, 3, 4)
    assert (up.by, up.kind, up.payload) == ("", None, None) and ctx.sent == []


def test_without_the_clients_sample_count_zero_samples_are_reported():
    ctx, w = make()
    upload(w, job(4, 1, {"m": 2.0}), np.ones(8))
    assert decode(ctx.sent[0].payload)["samples"] == 0.0


def test_rank_0_folds_what_the_worker_sends_into_the_row():
    ctx, w = make()
    upload(w, job(3, 2, {"m": 2.0}, samples=5), np.ones(8))
    upload(w, job(4, 2, {"m": 8.0}, samples=15), np.ones(8))
    c_ctx = FakeCoordinatorContext(CFG, {3: 5, 4: 2})
    co = ClientMetricsCoordinator(c_ctx, "client_metrics")
    for s in ctx.sent:
        co.on_message(Message(kind=s.kind, src=1, device=s.device, round=s.round,
                              payload=s.payload, nbytes=s.payload.nbytes))  # fmt: skip
    row = {"devices": {"3": {}, "4": {}}}
    co.on_row(row)
    assert c_ctx.rejected == []
    assert row["devices"] == {"3": {"client": {"m": 2.0}}, "4": {"client": {"m": 8.0}}}
    assert row["client"] == {"m": (5 * 2.0 + 15 * 8.0) / 20}
