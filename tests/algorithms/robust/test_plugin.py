"""The norm-bound plugin (edgefl.algorithms.robust.plugin): when it is on, what it
requires, and its coordinator half filtering a model change's arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms import check_requirements
from edgefl.algorithms.robust.plugin import NormBound, NormBoundCoordinator
from edgefl.comm import Kind
from edgefl.errors import ConfigError
from edgefl.policies.consistency import Apply, Arrival

from ..fakes import FakeCoordinatorContext, config, message

NUMEL = 4


def _ctx(*sets, n_workers=2):
    samples = {d: 10 for d in range(4)}
    return FakeCoordinatorContext(config(None, *sets), samples, n_workers, numel=NUMEL)


def _arrival(d, norm, loss=0.5, numel=NUMEL):
    delta = np.zeros(numel, np.float32)
    delta[0] = norm
    msg = message(Kind.UPDATE, src=1 + d % 2, device=d, payload=delta)
    return Arrival(d, 1, 0, 10, loss, delta, msg=msg)


def test_the_plugin_has_only_a_coordinator_half():
    assert NormBound.name == "norm_bound"
    assert NormBound.coordinator is NormBoundCoordinator
    assert NormBound.worker is None


@pytest.mark.parametrize(
    "sets,on",
    [
        ((), False),
        (("robust.norm_bound=1.0",), True),
        (("robust.norm_bound_relative=2.0",), True),
        (("robust.norm_bound_mode=clip",), False),
        (("algorithm.aggregation=krum", "robust.krum_f=1"), False),
    ],
)
def test_enabled_by_either_bound(sets, on):
    assert NormBound.enabled(config(None, *sets)) is on


@pytest.mark.parametrize("key", ["robust.norm_bound", "robust.norm_bound_relative"])
def test_a_bound_needs_an_aggregating_consistency(key):
    bad = config(None, f"{key}=2.0", "algorithm.consistency=fedasync")
    reqs = [("norm_bound", r) for r in NormBound.requires]
    with pytest.raises(ConfigError) as e:
        check_requirements(bad, reqs)
    msg = str(e.value)
    assert f"config key '{key}' = 2.0" in msg and "algorithm.consistency" in msg
    assert "fedasync" in msg and "because" in msg
    check_requirements(config(None, f"{key}=2.0"), reqs)  # bsp: fine
    check_requirements(config(None, "algorithm.consistency=fedasync"), reqs)  # off: fine


def test_a_relative_bound_below_one_is_refused_when_the_half_is_built():
    with pytest.raises(ConfigError, match="robust.norm_bound_relative"):
        NormBoundCoordinator(_ctx("robust.norm_bound_relative=0.5"), "norm_bound")


def test_an_update_above_the_bound_is_rejected_logged_and_released():
    ctx = _ctx("robust.norm_bound=3.0")
    half = NormBoundCoordinator(ctx, "norm_bound")
    arr = [_arrival(0, 1.0), _arrival(1, 10.0), _arrival(2, 2.0)]
    out = half.transform(Apply("terms", list(arr), [0.1, 0.2, 0.3]))
    assert out.mode == "terms"
    assert [a.device for a in out.arrivals] == [0, 2]
    assert out.coefs == [0.1, 0.3]  # the kept arrivals keep their coefficients
    ((rank, why),) = ctx.rejected
    assert rank == ctx.rank_of(1) == 2
    assert why.startswith("update of device 1: norm 10 above the bound 3")
    assert ctx.released == [arr[1].msg]


def test_clip_mode_scales_an_update_down_to_the_bound_and_keeps_it():
    ctx = _ctx("robust.norm_bound=3.0", "robust.norm_bound_mode=clip")
    half = NormBoundCoordinator(ctx, "norm_bound")
    arr = [_arrival(0, 1.0), _arrival(1, -12.0)]
    out = half.transform(Apply("aggregate", list(arr)))
    assert [a.device for a in out.arrivals] == [0, 1] and out.coefs == []
    assert out.arrivals[1] is arr[1]  # the arrival itself, with the clipped delta
    assert out.arrivals[1].delta.tolist() == [-3.0, 0.0, 0.0, 0.0]
    assert out.arrivals[0].delta.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert ctx.rejected == [] and ctx.released == []


def test_a_relative_bound_follows_the_rounds_median_norm():
    ctx = _ctx("robust.norm_bound_relative=2.0")
    half = NormBoundCoordinator(ctx, "norm_bound")
    arr = [_arrival(0, 1.0), _arrival(1, 1.5), _arrival(2, 2.0), _arrival(3, 4.5)]
    out = half.transform(Apply("aggregate", list(arr)))  # median 1.75: bound 3.5
    assert [a.device for a in out.arrivals] == [0, 1, 2]
    assert "robust.norm_bound_relative = 2 x median 1.75" in ctx.rejected[0][1]


def test_non_finite_and_misshapen_updates_are_always_rejected():
    ctx = _ctx("robust.norm_bound=100.0")
    half = NormBoundCoordinator(ctx, "norm_bound")
    nan = _arrival(0, float("nan"))
    bad_loss = _arrival(1, 1.0, loss=float("inf"))
    short = _arrival(2, 1.0, numel=NUMEL - 1)
    ok = _arrival(3, 1.0)
    out = half.transform(Apply("aggregate", [nan, bad_loss, short, ok]))
    assert [a.device for a in out.arrivals] == [3]
    reasons = dict((why.split(":")[0], why) for _, why in ctx.rejected)
    assert "non-finite values" in reasons["update of device 0"]
    assert "non-finite loss" in reasons["update of device 1"]
    assert "shape" in reasons["update of device 2"]
    assert len(ctx.released) == 3


def test_nothing_to_filter():
    ctx = _ctx("robust.norm_bound=1.0")
    out = NormBoundCoordinator(ctx, "norm_bound").transform(Apply("aggregate", []))
    assert out.arrivals == [] and out.coefs == [] and ctx.rejected == []
