"""edgefl.algorithms.clientmetrics.kinds: CLIENT_METRICS, one task's metrics going up."""

from __future__ import annotations

from edgefl.algorithms.clientmetrics.kinds import CLIENT_METRICS
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.scaffold.kinds import CONTROL, CONTROL_UPDATE
from edgefl.comm.wire import SPECS, DType, Kind, kind_of


def test_client_metrics_is_registered_under_its_own_code():
    assert (CLIENT_METRICS.name, int(CLIENT_METRICS)) == ("CLIENT_METRICS", 27)
    assert kind_of(27) is CLIENT_METRICS
    assert int(CLIENT_METRICS) not in {int(k) for k in Kind}
    assert int(CLIENT_METRICS) not in {int(FED_EVAL), int(CONTROL), int(CONTROL_UPDATE)}


def test_it_goes_up_as_json_bytes_of_any_length():
    spec = SPECS[CLIENT_METRICS]
    assert spec.direction == "up" and spec.dtypes == frozenset({DType.UINT8})
    assert spec.payload == "any"
