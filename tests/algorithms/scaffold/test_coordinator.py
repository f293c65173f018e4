"""edgefl.algorithms.scaffold.coordinator: the server variate c on rank 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from edgefl.algorithms.base import Download
from edgefl.algorithms.scaffold.coordinator import ScaffoldCoordinator
from edgefl.algorithms.scaffold.kinds import CONTROL, CONTROL_UPDATE
from edgefl.algorithms.scaffold.plugin import Scaffold
from edgefl.comm.wire import HEADER_BYTES
from edgefl.policies.consistency import Apply, Arrival

from ..fakes import FakeCoordinatorContext, config, message

N, P = 8, 6  # flat model size; parameters (the rest are float buffers)


@dataclass
class Flat:
    """The part of a FlatParams the halves read: the sizes."""

    numel: int
    param_numel: int


def make(samples=None, numel=N, params=P, **kw) -> FakeCoordinatorContext:
    ctx = FakeCoordinatorContext(
        config(None, "scaffold.enabled=true"), samples or {0: 10, 1: 20, 2: 30, 3: 40},
        numel=numel, **kw,
    )  # fmt: skip
    ctx.flat_ = Flat(numel, params)
    return ctx


def half(ctx) -> ScaffoldCoordinator:
    return Scaffold.coordinator(ctx, Scaffold.name)  # as the runtime builds it


def update(d: int, delta, dc, task: int = 0):
    payload = np.concatenate([np.asarray(delta, np.float32), np.asarray(dc, np.float32)])
    return message(CONTROL_UPDATE, src=1 + d % 2, device=d, round=task, payload=payload)


def arrival(d: int) -> Arrival:
    return Arrival(d, 0, 0, 10, 0.0, np.zeros(N, np.float32))


def test_the_server_variate_starts_at_zero_over_the_parameters_only():
    co = half(make())
    assert co.c.dtype == np.float32 and co.c.tolist() == [0.0] * P and co.pending == {}


def test_a_flat_without_buffers_sizes_c_by_numel():
    class NoBuffers:
        numel = 5

    ctx = make(numel=5)
    ctx.flat_ = NoBuffers()
    assert half(ctx).c.size == 5


def test_the_variate_of_the_current_version_goes_before_each_model_download():
    ctx = make()
    co = half(ctx)
    co.c[:] = 0.5
    ctx.version_ = 7
    down = Download(2, 7)
    co.send_model(down)
    assert (down.by, down.kind, down.payload) == ("", None, None)  # the model is the core's
    (s,) = ctx.sent
    assert (s.rank, s.kind, s.round) == (2, CONTROL, 7)
    assert s.payload.tolist() == [0.5] * P


def test_the_variate_sent_is_a_copy_that_later_steps_do_not_change():
    class Keeping(FakeCoordinatorContext):
        def send(self, rank, kind, device=-1, round=0, aux=(), payload=None):
            self.sent.append(payload)  # keeps the very array handed over

    ctx = Keeping(config(None, "scaffold.enabled=true"), {0: 1}, numel=N)
    ctx.flat_ = Flat(N, P)
    co = half(ctx)
    co.send_model(Download(1, 0))
    co.c += 1.0
    assert ctx.sent[0].tolist() == [0.0] * P


def test_on_start_of_a_fresh_run_sends_nothing():
    ctx = make({0: 1, 1: 1, 2: 1, 3: 1}, n_workers=3)
    half(ctx).on_start()
    assert ctx.sent == []


def test_on_start_of_a_resumed_run_resends_c_to_every_hosting_rank():
    ctx = make({0: 1, 1: 1, 2: 1, 3: 1}, n_workers=3)
    ctx.resuming_ = True
    ctx.version_ = 5
    half(ctx).on_start()
    assert [(s.rank, s.kind, s.round) for s in ctx.sent] == [(r, CONTROL, 5) for r in (1, 2, 3)]


def test_down_bytes_counts_the_model_and_the_variate_messages():
    co = half(make())
    assert co.down_bytes(0) == 3 * HEADER_BYTES + 4 * N + 4 * P


def test_decode_splits_the_payload_into_the_delta_and_the_variate_change():
    co = half(make())
    delta, dc = np.arange(N, dtype=np.float32), np.full(P, -2.0, np.float32)
    msg = update(1, delta, dc)
    got, why, used = co.decode(1, 0, msg)
    assert why == "" and used is msg
    assert got.tolist() == delta.tolist() and got.dtype == np.float32
    assert co.pending[1].tolist() == dc.tolist()
    msg.payload[:] = 9.0  # the buffer goes back to the pool: nothing may alias it
    assert got.tolist() == delta.tolist() and co.pending[1].tolist() == dc.tolist()


@pytest.mark.parametrize("size", [N, N + P - 1, N + P + 1])
def test_decode_refuses_a_payload_of_the_wrong_size(size):
    co = half(make())
    msg = message(CONTROL_UPDATE, device=0, payload=np.zeros(size, np.float32))
    got, why, _ = co.decode(0, 3, msg)
    assert got is None and f"{size} values, want {N + P}" in why and "device 0" in why
    assert co.pending == {}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_decode_refuses_a_non_finite_variate_change(bad):
    co = half(make())
    dc = np.zeros(P, np.float32)
    dc[2] = bad
    got, why, _ = co.decode(2, 0, update(2, np.zeros(N), dc))
    assert got is None and "non-finite" in why and co.pending == {}


def test_after_apply_steps_c_by_the_mean_over_all_devices_of_the_applied_changes():
    co = half(make())  # 4 devices
    co.decode(0, 0, update(0, np.zeros(N), np.full(P, 1.0)))
    co.decode(1, 0, update(1, np.zeros(N), np.full(P, 3.0)))
    co.decode(2, 0, update(2, np.zeros(N), np.full(P, 100.0)))  # not in this step
    co.after_apply(Apply("aggregate", [arrival(0), arrival(1)]), 1.0)
    assert co.c.tolist() == [1.0] * P  # (1 + 3) / 4, not / 2
    assert set(co.pending) == {2}  # a change waits for the step that uses its update
    co.after_apply(Apply("aggregate", [arrival(2)]), 2.0)
    assert co.c.tolist() == [26.0] * P and co.pending == {}


def test_an_apply_without_scaffold_updates_leaves_c_alone():
    co = half(make())
    co.c[:] = 2.0
    co.after_apply(Apply("aggregate", [arrival(3)]), 1.0)
    assert co.c.tolist() == [2.0] * P


def test_the_summary_reports_the_norm_of_c():
    co = half(make(params=4))
    co.c[:] = [3.0, 0.0, 4.0, 0.0]
    assert co.summary() == {"scaffold": {"control_norm": pytest.approx(5.0)}}


def test_state_dict_round_trips_c_and_the_pending_changes():
    co = half(make())
    co.c[:] = 0.25
    co.decode(3, 0, update(3, np.zeros(N), np.full(P, -1.5)))
    st = co.state_dict()
    co.c[:] = 99.0  # the state is a copy
    co.pending[3][:] = 99.0
    other = half(make())
    other.load_state_dict(st)
    assert other.c.tolist() == [0.25] * P and other.c.dtype == np.float32
    assert list(other.pending) == [3] and other.pending[3].tolist() == [-1.5] * P
    other.after_apply(Apply("aggregate", [arrival(3)]), 0.0)
    assert other.c.tolist() == [0.25 - 1.5 / 4] * P


def test_load_state_dict_without_pending_changes_clears_them():
    co = half(make())
    co.decode(0, 0, update(0, np.zeros(N), np.ones(P)))
    co.load_state_dict({"c": np.ones(P)})
    assert co.pending == {} and co.c.tolist() == [1.0] * P
