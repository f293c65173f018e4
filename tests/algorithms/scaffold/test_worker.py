"""edgefl.algorithms.scaffold.worker: the corrected local gradient and c_i on a worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefl.algorithms.base import Download, LocalJob, TaskSpec
from edgefl.algorithms.scaffold.coordinator import ScaffoldCoordinator
from edgefl.algorithms.scaffold.kinds import CONTROL, CONTROL_UPDATE
from edgefl.algorithms.scaffold.plugin import Scaffold
from edgefl.models.flat import FlatParams
from edgefl.training.client import FitContext, FitTask

from ..fakes import (
    FakeCoordinatorContext,
    FakeWorkerContext,
    config,
    flush_upload,
    message,
    received,
    upload,
)

ON = "scaffold.enabled=true"


def model(buffers: bool = False) -> tuple[torch.nn.Module, FlatParams]:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)  # weight (1, 2) then bias (1,): 3 parameters
    if buffers:
        m = torch.nn.Sequential(m, torch.nn.BatchNorm1d(1))
    return m, FlatParams(m)


def make(buffers: bool = False):
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
    ctx, w, _, flat = make(buffers=True)
    assert flat.numel > flat.param_numel and w.numel == flat.param_numel == 5


def test_a_control_is_kept_by_version_and_its_message_released():
    ctx, w, _, _ = make()
    msg = control(3, [1, 2, 3])
    w.on_message(msg)
    msg.payload[:] = 0.0  # the buffer goes back to the pool
    assert w.controls[3].tolist() == [1.0, 2.0, 3.0] and ctx.released == [msg]


def test_a_control_of_the_wrong_size_is_an_error():
    ctx, w, _, _ = make()
    with pytest.raises(ValueError, match="CONTROL of version 4: 2 values, want 3"):
        w.on_message(control(4, [1, 2]))


def test_only_queued_versions_and_the_newest_keep_their_control():
    ctx, w, _, _ = make()
    ctx.queued = {1}
    for v in (0, 1, 2):
        w.on_message(control(v, [v] * 3))
    assert sorted(w.controls) == [1, 2]
    ctx.queued = set()
    w.on_message(control(5, [5] * 3))
    assert sorted(w.controls) == [5]


def test_before_train_without_the_versions_control_is_an_error():
    ctx, w, m, flat = make()
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
    ctx, w, m, flat = make()
    w.on_message(control(0, [1, -2, 0.5]))
    j = job(m, flat)
    w.before_train(0, j)
    assert len(j.fit_ctx.grad_hooks) == 1
    assert run_hook(j) == [11.0, 8.0, 10.5]
    assert j.ctx["scaffold_c"].tolist() == [1.0, -2.0, 0.5]


def test_a_later_task_corrects_the_gradient_by_c_minus_c_i():
    ctx, w, m, flat = make()
    w.load_device_state(0, {"ci": np.array([1.0, 1.0, 1.0])})
    w.on_message(control(0, [3, 0, 1]))
    j = job(m, flat)
    w.before_train(0, j)
    assert run_hook(j) == [12.0, 9.0, 10.0]


def test_encode_sends_the_delta_and_the_option_ii_variate_change():
    ctx, w, m, flat = make()
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
    ctx, w, m, flat = make()
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
    ctx, w, m, flat = make()
    w.load_device_state(0, {"ci": [1.0, 2.0, 3.0]})
    w.on_message(control(0, [0, 0, 0]))
    j = job(m, flat, lr=1.0, steps=1)
    w.before_train(0, j)
    upload(w, j, np.array([1.0, 1.0, 1.0], np.float32))
    assert w.ci[0].tolist() == [0.0, 1.0, 2.0]


def test_a_task_without_a_step_sends_a_zero_variate_change():
    ctx, w, m, flat = make()
    w.on_message(control(0, [5, 5, 5]))
    j = job(m, flat, steps=0)
    w.before_train(0, j)
    up = upload(w, j, np.ones(3, np.float32))
    assert up.payload[3:].tolist() == [0.0] * 3 and w.ci[0].tolist() == [0.0] * 3


def test_device_state_round_trips_c_i_and_is_empty_before_the_first_task():
    ctx, w, _, _ = make()
    assert w.device_state(1) == {}
    w.load_device_state(1, {"ci": [0.5, 0.25, 0.0]})
    st = w.device_state(1)
    w.ci[1][:] = 9.0  # the state is a copy
    other = make()[1]
    other.load_device_state(1, st)
    assert other.ci[1].tolist() == [0.5, 0.25, 0.0] and other.ci[1].dtype == np.float32
    other.load_device_state(0, {})  # nothing saved: nothing restored
    assert 0 not in other.ci


def test_the_coordinator_decodes_what_the_worker_sends():
    ctx, w, m, flat = make()
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
    ctx, w, m, flat = make(buffers=True)
    w.on_message(control(0, np.ones(flat.param_numel)))
    j = job(m, flat)
    w.before_train(0, j)
    assert run_hook(j) == [11.0] * flat.param_numel
