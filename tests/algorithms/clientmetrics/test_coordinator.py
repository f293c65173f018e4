"""edgefl.algorithms.clientmetrics.coordinator: a device's metrics land in the row of its
update, per device and as their sample-weighted mean."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgefl.algorithms.clientmetrics.codec import MAX_METRICS, encode
from edgefl.algorithms.clientmetrics.coordinator import ClientMetricsCoordinator
from edgefl.algorithms.clientmetrics.kinds import CLIENT_METRICS
from edgefl.algorithms.clientmetrics.plugin import ClientMetrics
from edgefl.comm import Message
from edgefl.comm.wire import HEADER_BYTES

from ..fakes import FakeCoordinatorContext, config


def make(samples=None) -> tuple[FakeCoordinatorContext, ClientMetricsCoordinator]:
    ctx = FakeCoordinatorContext(config(None, 'train.client="my_pkg.clients:fit"'),
                                 samples or {0: 10, 1: 30, 2: 5})  # fmt: skip
    return ctx, ClientMetrics.coordinator(ctx, ClientMetrics.name)


def metrics_msg(d: int, samples: int = 0, src: int = 1, **metrics) -> Message:
    p = encode(samples, metrics)
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
