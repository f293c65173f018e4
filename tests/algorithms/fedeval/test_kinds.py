"""edgefl.algorithms.fedeval.kinds: FED_EVAL, one device's result going up."""

from __future__ import annotations

from edgefl.algorithms.clientmetrics import CLIENT_METRICS
from edgefl.algorithms.fedeval.kinds import FED_EVAL
from edgefl.algorithms.scaffold import CONTROL, CONTROL_UPDATE
from edgefl.comm.wire import SPECS, DType, Kind, kind_of


def test_fed_eval_is_registered_under_its_own_code():
    assert (FED_EVAL.name, int(FED_EVAL)) == ("FED_EVAL", 24) and kind_of(24) is FED_EVAL
    assert int(FED_EVAL) not in {int(k) for k in Kind}
    others = {int(CONTROL), int(CONTROL_UPDATE), int(CLIENT_METRICS)}
    assert int(FED_EVAL) not in others


def test_it_goes_up_as_json_bytes_of_any_length():
    spec = SPECS[FED_EVAL]
    assert spec.direction == "up" and spec.dtypes == frozenset({DType.UINT8})
    assert spec.payload == "any"
