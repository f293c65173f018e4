"""edgefl.algorithms.scaffold (one module: config section, kinds, the variates' arithmetic, both
halves, the plugin class), each without MPI."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import edgefl.algorithms.scaffold
from edgefl.algorithms import (
    check_requirements,
    coordinator_plugins,
    load,
    plugin_requirements,
    worker_plugins,
)
from edgefl.algorithms.base import Download, LocalJob, Plugin, TaskSpec
from edgefl.algorithms.scaffold import (
    CONTROL,
    CONTROL_UPDATE,
    SECTIONS,
    Scaffold,
    ScaffoldCoordinator,
    ScaffoldWorker,
)
from edgefl.comm.wire import HEADER_BYTES, SPECS, DType, Kind, kind_of, register_kind
from edgefl.config.fields import Field
from edgefl.errors import ConfigError
from edgefl.models.flat import FlatParams
from edgefl.policies.consistency import Apply, Arrival
from edgefl.training.client import FitContext, FitTask

from .fakes import (
    FakeCoordinatorContext,
    FakeWorkerContext,
    config,
    flush_upload,
    message,
    received,
    upload,
)


def test_the_package_documents_option_ii_of_the_paper():
    doc = edgefl.algorithms.scaffold.__doc__
    assert "option II" in doc and "c_i+ = c_i - c + (x - y_i) / (K lr)" in doc


def test_the_loader_runs_scaffold_only_when_it_is_enabled():
    assert Scaffold not in load(config())
    assert Scaffold in load(config(None, "scaffold.enabled=true"))


def test_the_runtime_builders_hand_each_half_its_context():
    cfg = config(None, "scaffold.enabled=true")
    c = FakeCoordinatorContext(cfg, {0: 5, 1: 5})
    c.flat_ = Flat(8, 6)
    w = FakeWorkerContext(cfg, {0: [1, 2]}, flat=Flat(8, 6))
    (co,) = [p for p in coordinator_plugins(c) if isinstance(p, ScaffoldCoordinator)]
    (wo,) = [p for p in worker_plugins(w) if isinstance(p, ScaffoldWorker)]
    assert co.ctx is c and wo.ctx is w and co.name == wo.name == "scaffold"
    assert co.c.size == wo.numel == 6  # the variates cover the parameters only


def test_the_section_is_one_boolean_switch_off_by_default():
    assert set(SECTIONS) == {"scaffold"}
    (key,) = SECTIONS["scaffold"]
    f = SECTIONS["scaffold"][key]
    assert key == "enabled" and isinstance(f, Field)
    assert f.type == "bool" and f.default is False and f.doc


def test_the_effective_config_has_the_default_and_takes_an_override():
    assert config()["scaffold"] == {"enabled": False}
    assert config(None, "scaffold.enabled=true")["scaffold"]["enabled"] is True
    assert config({"scaffold": {"enabled": True}})["scaffold"]["enabled"] is True


@pytest.mark.parametrize("setting", ['scaffold.enabled="yes"', "scaffold.enabled=1"])
def test_a_non_boolean_is_refused_naming_the_key(setting):
    with pytest.raises(ConfigError, match="scaffold.enabled"):
        config(None, setting)


def test_an_unknown_key_of_the_section_is_refused():
    with pytest.raises(ConfigError, match="scaffold"):
        config({"scaffold": {"option": 2}})


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


ON = "scaffold.enabled=true"


def test_the_plugin_wires_its_two_halves_and_their_kinds():
    assert issubclass(Scaffold, Plugin) and Scaffold.name == "scaffold"
    assert Scaffold.coordinator is ScaffoldCoordinator and Scaffold.worker is ScaffoldWorker
    assert ScaffoldCoordinator.update_kinds == (CONTROL_UPDATE,)
    assert ScaffoldWorker.message_kinds == (CONTROL,)
    assert Scaffold.summary_keys == {"scaffold": None}


def test_it_is_enabled_by_its_switch_only():
    assert not Scaffold.enabled(config())
    assert Scaffold.enabled(config(None, ON))


def test_every_requirement_is_triggered_by_the_switch_and_met_by_the_defaults():
    keys = [r.key for r in Scaffold.requires]
    assert len(keys) == len(set(keys)) == 9
    for r in Scaffold.requires:
        assert r.when == "scaffold.enabled" and r.because
        assert r.holds(config(None, ON))
    assert ("scaffold", Scaffold.requires[0]) in plugin_requirements(config())


@pytest.mark.parametrize(
    "setting, key",
    [
        ('algorithm.consistency="asp"', "algorithm.consistency"),
        ('algorithm.gate="hermes"', "algorithm.gate"),
        ("fedprox.enabled=true", "fedprox.enabled"),
        ("ps.sparse=true", "ps.sparse"),
        ("ps.servers=2", "ps.servers"),
        ('algorithm.residual="gddr"', "algorithm.residual"),
        ('ps.pull="working-set"', "ps.pull"),
        ("train.momentum=0.9", "train.momentum"),  # (the diverging job of issue 28)
        ('train.optimizer="adam"', "train.optimizer"),
    ],
)
def test_a_conflicting_setting_is_refused_naming_both_keys(setting, key):
    cfg = config(None, ON, setting)
    with pytest.raises(ConfigError) as e:
        check_requirements(cfg, [("scaffold", r) for r in Scaffold.requires])
    msg = str(e.value)
    assert "'scaffold.enabled' = true" in msg and f"needs {key}" in msg and "because" in msg


def test_the_same_settings_are_fine_with_scaffold_off():
    cfg = config(None, 'algorithm.consistency="asp"', "fedprox.enabled=true")
    check_requirements(cfg, [("scaffold", r) for r in Scaffold.requires])  # no error
    assert not any(r.applies(cfg) for r in Scaffold.requires)


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


ON = "scaffold.enabled=true"


def model(buffers: bool = False) -> tuple[torch.nn.Module, FlatParams]:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)  # weight (1, 2) then bias (1,): 3 parameters
    if buffers:
        m = torch.nn.Sequential(m, torch.nn.BatchNorm1d(1))
    return m, FlatParams(m)


def make_worker(buffers: bool = False):
    m, flat = model(buffers)
    ctx = FakeWorkerContext(config(None, ON), {0: list(range(4)), 1: list(range(6))}, flat=flat)
    return ctx, Scaffold.worker(ctx, Scaffold.name), m, flat


def job(m, flat, version=0, task=0, lr=0.5, steps=0, d=0) -> LocalJob:
    fit_ctx = FitContext(d, task, version, torch.Generator(), "cpu", None, None, steps=steps)
    fit_task = FitTask(epochs=1, steps=0, batch_size=0, lr=lr)
    return LocalJob(d, task, version, TaskSpec(), model=m, flat=flat, fit_ctx=fit_ctx,
                    fit_task=fit_task, aux=(4.0, 0.1, 1.0, 1.0))  # fmt: skip


def control(version: int, values) -> object:
    return message(CONTROL, src=0, round=version, payload=np.asarray(values, np.float32))


def test_the_variates_cover_the_parameters_but_not_the_float_buffers():
    ctx, w, _, flat = make_worker(buffers=True)
    assert flat.numel > flat.param_numel and w.numel == flat.param_numel == 5


def test_a_control_is_kept_by_version_and_its_message_released():
    ctx, w, _, _ = make_worker()
    msg = control(3, [1, 2, 3])
    w.on_message(msg)
    msg.payload[:] = 0.0  # the buffer goes back to the pool
    assert w.controls[3].tolist() == [1.0, 2.0, 3.0] and ctx.released == [msg]


def test_a_control_of_the_wrong_size_is_an_error():
    ctx, w, _, _ = make_worker()
    with pytest.raises(ValueError, match="CONTROL of version 4: 2 values, want 3"):
        w.on_message(control(4, [1, 2]))


def test_only_queued_versions_and_the_newest_keep_their_control():
    ctx, w, _, _ = make_worker()
    ctx.queued = {1}
    for v in (0, 1, 2):
        w.on_message(control(v, [v] * 3))
    assert sorted(w.controls) == [1, 2]
    ctx.queued = set()
    w.on_message(control(5, [5] * 3))
    assert sorted(w.controls) == [5]


def test_before_train_without_the_versions_control_is_an_error():
    ctx, w, m, flat = make_worker()
    w.on_message(control(1, [0, 0, 0]))
    with pytest.raises(
        RuntimeError, match="device 0: no SCAFFOLD control variate of model version 2"
    ):
        w.before_train(0, job(m, flat, version=2))


def run_hook(j: LocalJob) -> list[float]:
    for p in j.model.parameters():
        p.grad = torch.full_like(p, 10.0)
    j.fit_ctx.before_step(j.model)
    return torch.cat([p.grad.reshape(-1) for p in j.model.parameters()]).tolist()


def test_the_first_task_corrects_the_gradient_by_c():
    ctx, w, m, flat = make_worker()
    w.on_message(control(0, [1, -2, 0.5]))
    j = job(m, flat)
    w.before_train(0, j)
    assert len(j.fit_ctx.grad_hooks) == 1
    assert run_hook(j) == [11.0, 8.0, 10.5]
    assert j.ctx["scaffold_c"].tolist() == [1.0, -2.0, 0.5]


def test_a_later_task_corrects_the_gradient_by_c_minus_c_i():
    ctx, w, m, flat = make_worker()
    w.load_device_state(0, {"ci": np.array([1.0, 1.0, 1.0])})
    w.on_message(control(0, [3, 0, 1]))
    j = job(m, flat)
    w.before_train(0, j)
    assert run_hook(j) == [12.0, 9.0, 10.0]


def test_encode_sends_the_delta_and_the_option_ii_variate_change():
    ctx, w, m, flat = make_worker()
    w.on_message(control(0, [1, 1, 1]))
    j = job(m, flat, task=7, lr=0.5, steps=4)
    w.before_train(0, j)
    delta = np.array([2.0, -4.0, 0.0], np.float32)
    s = upload(w, j, delta)
    assert (s.by, s.kind, s.device, s.task, s.aux) == ("scaffold", CONTROL_UPDATE, 0, 7, j.aux)
    assert ctx.sent == []  # the core sends the one message
    dc = [-1 - 2.0 / 2, -1 + 4.0 / 2, -1.0]  # -c - delta / (K lr), K lr = 2
    assert s.payload.tolist() == [2.0, -4.0, 0.0, *dc]
    assert w.ci[0].tolist() == dc  # c_i+ = c_i + dc_i, from zeros
    delta[:] = 9.0  # the core's buffer goes back to the pool: the payload is a copy
    assert s.payload.tolist() == [2.0, -4.0, 0.0, *dc]


def test_the_end_of_training_flush_is_left_to_the_core():
    ctx, w, m, flat = make_worker()
    w.on_message(control(0, [1, 1, 1]))
    j = job(m, flat, lr=0.5, steps=4)
    w.before_train(0, j)
    upload(w, j, np.ones(3, np.float32))
    ci = w.ci[0].tolist()
    up = flush_upload(w, 0, 1)
    assert (up.by, up.kind, up.payload) == ("", None, None)  # the core's zero UPDATE
    assert up.aux == (4.0, 0.0, 0.0, 0.0) and not up.delta.any()
    assert w.ci[0].tolist() == ci and ctx.sent == []


def test_c_i_accumulates_over_tasks():
    ctx, w, m, flat = make_worker()
    w.load_device_state(0, {"ci": [1.0, 2.0, 3.0]})
    w.on_message(control(0, [0, 0, 0]))
    j = job(m, flat, lr=1.0, steps=1)
    w.before_train(0, j)
    upload(w, j, np.array([1.0, 1.0, 1.0], np.float32))
    assert w.ci[0].tolist() == [0.0, 1.0, 2.0]


def test_a_task_without_a_step_sends_a_zero_variate_change():
    ctx, w, m, flat = make_worker()
    w.on_message(control(0, [5, 5, 5]))
    j = job(m, flat, steps=0)
    w.before_train(0, j)
    up = upload(w, j, np.ones(3, np.float32))
    assert up.payload[3:].tolist() == [0.0] * 3 and w.ci[0].tolist() == [0.0] * 3


def test_device_state_round_trips_c_i_and_is_empty_before_the_first_task():
    ctx, w, _, _ = make_worker()
    assert w.device_state(1) == {}
    w.load_device_state(1, {"ci": [0.5, 0.25, 0.0]})
    st = w.device_state(1)
    w.ci[1][:] = 9.0  # the state is a copy
    other = make_worker()[1]
    other.load_device_state(1, st)
    assert other.ci[1].tolist() == [0.5, 0.25, 0.0] and other.ci[1].dtype == np.float32
    other.load_device_state(0, {})  # nothing saved: nothing restored
    assert 0 not in other.ci


def test_the_coordinator_decodes_what_the_worker_sends():
    ctx, w, m, flat = make_worker()
    c_ctx = FakeCoordinatorContext(config(None, ON), {0: 4, 1: 6}, numel=flat.numel)
    c_ctx.flat_ = flat
    co = ScaffoldCoordinator(c_ctx, "scaffold")
    co.c[:] = [1.0, 0.0, -1.0]
    dl = Download(1, 0)
    co.send_model(dl)
    assert dl.by == ""  # the model itself is the core's
    down = c_ctx.sent[0]
    w.on_message(control(down.round, down.payload))
    j = job(m, flat, lr=0.1, steps=10)
    w.before_train(0, j)
    up = upload(w, j, np.array([1.0, 2.0, 3.0], np.float32))
    delta, why, _ = co.decode(0, 0, received(up))
    assert why == "" and delta.tolist() == [1.0, 2.0, 3.0]
    assert co.pending[0].tolist() == w.ci[0].tolist() == [-2.0, -2.0, -2.0]


def test_a_model_with_float_buffers_can_be_trained_with_scaffold():
    ctx, w, m, flat = make_worker(buffers=True)
    w.on_message(control(0, np.ones(flat.param_numel)))
    j = job(m, flat)
    w.before_train(0, j)
    assert run_hook(j) == [11.0] * flat.param_numel
