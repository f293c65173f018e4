"""edgefl.algorithms.scaffold.kinds: CONTROL (down) and CONTROL_UPDATE (up)."""

from __future__ import annotations

import pytest

from edgefl.algorithms.scaffold.kinds import CONTROL, CONTROL_UPDATE
from edgefl.comm.wire import SPECS, DType, Kind, kind_of, register_kind


def test_the_two_kinds_are_distinct_and_registered_under_their_codes():
    assert int(CONTROL) != int(CONTROL_UPDATE)
    assert (CONTROL.name, int(CONTROL)) == ("CONTROL", 25)
    assert (CONTROL_UPDATE.name, int(CONTROL_UPDATE)) == ("CONTROL_UPDATE", 26)
    assert kind_of(25) is CONTROL and kind_of(26) is CONTROL_UPDATE


def test_they_take_no_core_code():
    core = {int(k) for k in Kind}
    assert int(CONTROL) not in core and int(CONTROL_UPDATE) not in core


def test_the_variate_goes_down_and_the_update_up_both_float32_of_any_size():
    down, up = SPECS[CONTROL], SPECS[CONTROL_UPDATE]
    assert down.direction == "down" and up.direction == "up"
    assert down.dtypes == up.dtypes == frozenset({DType.FLOAT32})
    # "any": the update is model delta plus variate, longer than the model
    assert down.payload == up.payload == "any"


def test_registering_again_returns_the_same_kind_and_a_clash_is_refused():
    assert register_kind("CONTROL", 25, "down", {DType.FLOAT32}, "any") is CONTROL
    with pytest.raises(ValueError, match="taken"):
        register_kind("NOT_CONTROL", 25, "down", {DType.FLOAT32}, "any")
