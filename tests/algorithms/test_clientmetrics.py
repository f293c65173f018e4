"""edgefl.algorithms.clientmetrics (one module: the kind and its codec, both halves, the plugin
class), each without MPI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgefl.algorithms.clientmetrics
from edgefl.algorithms import coordinator_plugins, load, worker_plugins
from edgefl.algorithms.base import LocalJob, Plugin, TaskSpec
from edgefl.algorithms.clientmetrics import (
    CLIENT_METRICS,
    MAX_METRICS,
    ClientMetrics,
    ClientMetricsCoordinator,
    ClientMetricsWorker,
    decode_metrics,
    encode_metrics,
)
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.scaffold import CONTROL, CONTROL_UPDATE, Scaffold
from edgefl.comm import Message
from edgefl.comm.wire import HEADER_BYTES, SPECS, DType, Kind, kind_of

from .fakes import FakeCoordinatorContext, FakeWorkerContext, config, flush_upload, upload

CLIENT = 'train.client="my_pkg.clients:fit"'


def test_the_package_names_where_the_metrics_land():
    doc = edgefl.algorithms.clientmetrics.__doc__
    assert "devices/<id>/client/<name>" in doc and "client/<name>" in doc


def test_the_loader_runs_it_only_with_a_user_client():
    assert ClientMetrics not in load(config())
    assert ClientMetrics in load(config(None, CLIENT))


def test_the_runtime_builders_hand_each_half_its_context():
    cfg = config(None, CLIENT)
    c = FakeCoordinatorContext(cfg, {0: 3})
    w = FakeWorkerContext(cfg, {0: [1, 2, 3]})
    (co,) = [p for p in coordinator_plugins(c) if isinstance(p, ClientMetricsCoordinator)]
    (wo,) = [p for p in worker_plugins(w) if isinstance(p, ClientMetricsWorker)]
    assert co.ctx is c and wo.ctx is w and co.name == wo.name == "client_metrics"
    assert co.latest == {}


def test_client_metrics_is_registered_under_its_own_code():
    assert (CLIENT_METRICS.name, int(CLIENT_METRICS)) == ("CLIENT_METRICS", 27)
    assert kind_of(27) is CLIENT_METRICS
    assert int(CLIENT_METRICS) not in {int(k) for k in Kind}
    assert int(CLIENT_METRICS) not in {int(FED_EVAL), int(CONTROL), int(CONTROL_UPDATE)}


def test_it_goes_up_as_json_bytes_of_any_length():
    spec = SPECS[CLIENT_METRICS]
    assert spec.direction == "up" and spec.dtypes == frozenset({DType.UINT8})
    assert spec.payload == "any"


CLIENT = 'train.client="my_pkg.clients:fit"'


def test_the_plugin_wires_its_halves_and_the_kind_rank_0_handles():
    assert issubclass(ClientMetrics, Plugin) and ClientMetrics.name == "client_metrics"
    assert ClientMetrics.coordinator is ClientMetricsCoordinator
    assert ClientMetrics.worker is ClientMetricsWorker
    assert ClientMetricsCoordinator.message_kinds == (CLIENT_METRICS,)
    assert ClientMetricsWorker.message_kinds == ()  # it only sends
    assert ClientMetrics.requires == ()


def test_it_is_on_exactly_when_a_user_client_is_configured():
    assert not ClientMetrics.enabled(config())
    assert ClientMetrics.enabled(config(None, CLIENT))


def test_its_worker_half_runs_before_a_plugin_that_sends_the_update_itself():
    classes = load(config(None, CLIENT, "scaffold.enabled=true"))
    assert classes.index(ClientMetrics) < classes.index(Scaffold)


def make(samples=None) -> tuple[FakeCoordinatorContext, ClientMetricsCoordinator]:
    ctx = FakeCoordinatorContext(config(None, 'train.client="my_pkg.clients:fit"'),
                                 samples or {0: 10, 1: 30, 2: 5})  # fmt: skip
    return ctx, ClientMetrics.coordinator(ctx, ClientMetrics.name)


def metrics_msg(d: int, samples: int = 0, src: int = 1, **metrics) -> Message:
    p = encode_metrics(samples, metrics)
    return Message(kind=CLIENT_METRICS, src=src, device=d, round=3, payload=p, nbytes=p.nbytes)


def raw(d: int, text: bytes | str, src: int = 2) -> Message:
    b = text if isinstance(text, bytes) else text.encode("utf-8")
    return Message(kind=CLIENT_METRICS, src=src, device=d, payload=np.frombuffer(b, np.uint8))


def row(*devices: int) -> dict:
    return {"round": 1, "devices": {str(d): {"msgs_up": 1} for d in devices}}


def test_a_devices_metrics_are_kept_and_their_bytes_counted():
    ctx, co = make()
    msg = metrics_msg(1, samples=30, loss_sum=4.5)
    co.on_message(msg)
    assert co.latest == {"1": {"samples": 30.0, "loss_sum": 4.5}}
    assert ctx.booked == [(1, HEADER_BYTES + msg.nbytes)] and ctx.rejected == []


def test_a_newer_message_of_a_device_replaces_its_metrics():
    _, co = make()
    co.on_message(metrics_msg(0, 1, a=1.0, b=2.0))
    co.on_message(metrics_msg(0, 2, a=3.0))
    assert co.latest == {"0": {"samples": 2.0, "a": 3.0}}


@pytest.mark.parametrize(
    "text, why",
    [
        (b"\xff\xfe", "not UTF-8 JSON"),
        ("{not json", "not UTF-8 JSON"),
        ("[1, 2]", "not an object"),
        (
            json.dumps({"samples": 1, **{f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}}),
            "at most 64",
        ),
        (json.dumps({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}), "at most 64"),
        ('{"samples": 1, "m": "high"}', "metric 'm' is not a number"),
        ('{"samples": 1, "ok": true}', "metric 'ok' is not a number"),
        ('{"samples": 1, "m": NaN}', "metric 'm' is not finite"),
        ('{"samples": 1, "m": Infinity}', "metric 'm' is not finite"),
    ],
)
def test_a_malformed_payload_is_rejected_not_kept(text, why):
    ctx, co = make()
    co.on_message(raw(2, text, src=2))
    assert co.latest == {} and ctx.booked == []
    ((rank, msg),) = ctx.rejected
    assert rank == 2 and msg.startswith("CLIENT_METRICS of device 2: ") and why in msg


def test_the_most_metrics_a_task_may_report_are_accepted():
    _, co = make()
    co.on_message(metrics_msg(0, 1, **{f"m{i}": float(i) for i in range(MAX_METRICS)}))
    assert len(co.latest["0"]) == MAX_METRICS + 1


def test_the_metrics_of_an_unknown_device_are_rejected():
    ctx, co = make()
    co.on_message(metrics_msg(9, 1, a=1.0, src=3))
    assert co.latest == {} and ctx.booked == []
    assert ctx.rejected == [(3, "CLIENT_METRICS of unknown device 9")]


def test_a_row_takes_each_updating_devices_metrics_and_their_weighted_mean():
    _, co = make()
    co.on_message(metrics_msg(0, 10, acc=0.5, norm=2.0))
    co.on_message(metrics_msg(1, 30, acc=0.9))
    r = row(0, 1)
    co.on_row(r)
    assert r["devices"]["0"] == {"msgs_up": 1, "client": {"acc": 0.5, "norm": 2.0}}
    assert r["devices"]["1"] == {"msgs_up": 1, "client": {"acc": 0.9}}
    # each mean over the devices that report the metric, weighted by their samples
    assert r["client"] == {"acc": pytest.approx((10 * 0.5 + 30 * 0.9) / 40), "norm": 2.0}
    assert co.latest == {}


def test_metrics_wait_for_the_row_of_their_devices_update():
    _, co = make()
    co.on_message(metrics_msg(0, 10, acc=0.5))
    co.on_message(metrics_msg(2, 5, acc=0.1))
    r = row(0, 1)  # device 1 updated without metrics, device 2 not at all
    co.on_row(r)
    assert "client" not in r["devices"]["1"] and r["client"] == {"acc": 0.5}
    assert co.latest == {"2": {"samples": 5.0, "acc": 0.1}}
    later = row(2)
    co.on_row(later)
    assert later["client"] == {"acc": 0.1} and co.latest == {}


def test_without_sample_counts_the_mean_is_unweighted():
    _, co = make()
    co.on_message(metrics_msg(0, 0, m=1.0))
    co.on_message(metrics_msg(1, 0, m=4.0))
    r = row(0, 1)
    co.on_row(r)
    assert r["client"] == {"m": 2.5}


def test_a_row_without_metrics_gets_no_client_key():
    _, co = make()
    r, bare = row(0, 1), {"round": 2}
    co.on_row(r)
    co.on_message(metrics_msg(0, 1, m=1.0))
    co.on_row(bare)  # (a row with no "devices" at all)
    assert "client" not in r and "client" not in bare and "devices" not in bare
    assert r["devices"] == {"0": {"msgs_up": 1}, "1": {"msgs_up": 1}}


CFG = config(None, 'train.client="my_pkg.clients:fit"')


def make_worker() -> tuple[FakeWorkerContext, ClientMetricsWorker]:
    ctx = FakeWorkerContext(CFG, {3: [0] * 5, 4: [0] * 2})
    return ctx, ClientMetrics.worker(ctx, ClientMetrics.name)


def job(d: int, task: int, metrics: dict, samples: int | None = None) -> LocalJob:
    j = LocalJob(d, task, 0, TaskSpec(), metrics=dict(metrics))
    if samples is not None:
        j.ctx["client_samples"] = samples
    return j


def test_the_metrics_go_to_rank_0_and_the_update_is_left_to_others():
    ctx, w = make_worker()
    up = upload(w, job(3, 9, {"grad_norm": 1.5, "steps": 4}, samples=5), np.ones(8))
    assert (up.by, up.kind, up.payload) == ("", None, None)  # the update: left to others
    assert up.delta.tolist() == [1.0] * 8
    (s,) = ctx.sent  # the side message, sent before the core sends the update
    assert (s.rank, s.kind, s.device, s.round) == (0, CLIENT_METRICS, 3, 9)
    assert s.payload.dtype == np.uint8
    assert decode_metrics(s.payload) == {"samples": 5.0, "grad_norm": 1.5, "steps": 4.0}


def test_a_task_without_metrics_sends_nothing():
    ctx, w = make_worker()
    assert upload(w, job(3, 0, {}, samples=5), np.ones(8)).by == ""
    assert ctx.sent == []


def test_the_end_of_training_flush_sends_no_metrics_and_is_left_to_others():
    ctx, w = make_worker()
    up = flush_upload(w, 3, 4)
    assert (up.by, up.kind, up.payload) == ("", None, None) and ctx.sent == []


def test_without_the_clients_sample_count_zero_samples_are_reported():
    ctx, w = make_worker()
    upload(w, job(4, 1, {"m": 2.0}), np.ones(8))
    assert decode_metrics(ctx.sent[0].payload)["samples"] == 0.0


def test_rank_0_folds_what_the_worker_sends_into_the_row():
    ctx, w = make_worker()
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
