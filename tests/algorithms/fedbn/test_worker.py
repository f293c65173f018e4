"""edgefl.algorithms.fedbn.worker: every device's own float buffer values (put in before a
task, kept out of its update, saved in checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.fedbn.worker import FedBNWorker
from edgefl.models.flat import FlatParams

from ..fakes import FakeWorkerContext, config, flush_upload, upload


def _model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4)] + ([nn.BatchNorm1d(4)] if bn else []) + [nn.Linear(4, 2)]
    return nn.Sequential(*layers)


class Rank:
    """A worker rank: its CPU model (the context's flat) and the model its tasks train
    (``job.flat``), as the runtime builds them."""

    def __init__(self, bn: bool = True) -> None:
        self.ctx = FakeWorkerContext(config(None, 'model.buffers="local"'), {0: [1], 1: [1]},
                                     flat=FlatParams(_model(bn)))  # fmt: skip
        self.w = FedBNWorker(self.ctx, "fedbn")
        self.model = _model(bn)
        self.task_flat = FlatParams(self.model)

    def job(self, d: int, task: int = 0) -> LocalJob:
        return LocalJob(d, task, 0, TaskSpec(), model=self.model, flat=self.task_flat)

    def train(self, d: int, seed: int, task: int = 0) -> LocalJob:
        """One task as the runtime runs it: before_train, a forward pass in train mode
        (BatchNorm moves its running statistics), after_train."""
        job = self.job(d, task)
        self.w.before_train(d, job)
        g = torch.Generator().manual_seed(seed)
        self.model.train()
        with torch.no_grad():
            self.model(3.0 + 2.0 * torch.randn(16, 3, generator=g))
        self.w.after_train(d, job)
        return job

    def update(self, d: int, job: LocalJob) -> np.ndarray:
        delta = np.zeros(self.task_flat.numel, np.float32)
        assert upload(self.w, job, delta).by == ""  # a dense transform: never encodes
        return delta


def test_the_initial_values_are_the_rank_model_s_buffers_copied_at_construction():
    r = Rank()
    sl = r.ctx.flat.buffer_slice
    assert sl == slice(r.ctx.flat.param_numel, r.ctx.flat.numel) and r.w.sl == sl
    assert r.w.initial.size == 8  # running_mean + running_var of 4 features
    np.testing.assert_array_equal(r.w.initial, r.ctx.flat.to_host()[sl])
    r.ctx.flat.load_buffers(np.full(8, 9.0, np.float32))  # the warm-up step moves them
    assert not np.any(r.w.initial == 9.0)


def test_a_device_s_first_task_starts_from_the_initial_buffers():
    r = Rank()
    r.task_flat.load_buffers(np.full(8, 5.0, np.float32))  # another device trained here
    r.w.before_train(0, r.job(0))
    np.testing.assert_array_equal(r.task_flat.buffer_values(), r.w.initial)


def test_after_a_task_its_buffers_are_kept_and_zeroed_in_the_update():
    r = Rank()
    job = r.train(0, seed=1)
    trained = r.task_flat.buffer_values()
    assert not np.allclose(trained, r.w.initial)
    np.testing.assert_array_equal(r.w.values[0], trained)
    delta = np.arange(r.task_flat.numel, dtype=np.float32) + 1.0
    params_part = delta[: r.task_flat.param_numel].copy()
    up = upload(r.w, job, delta)
    assert up.by == "" and up.payload is None  # the update goes on to the others
    assert up.delta is delta  # edited in place, the core's buffer
    assert not delta[r.w.sl].any()
    np.testing.assert_array_equal(delta[: r.task_flat.param_numel], params_part)
    assert r.ctx.sent == []


def test_each_device_resumes_from_its_own_buffers():
    r = Rank()
    r.update(0, r.train(0, seed=1))
    mine = r.w.values[0].copy()
    r.w.before_train(1, r.job(1))  # device 1's first task on the same model
    np.testing.assert_array_equal(r.task_flat.buffer_values(), r.w.initial)
    r.update(1, r.train(1, seed=2))
    assert not np.allclose(r.w.values[1], mine)
    np.testing.assert_array_equal(r.w.values[0], mine)  # device 1 did not touch device 0's
    r.w.before_train(0, r.job(0, task=1))
    np.testing.assert_array_equal(r.task_flat.buffer_values(), mine)


def test_values_are_kept_after_every_local_iteration_even_without_an_update():
    r = Rank()
    r.train(0, seed=3)  # a gated device that does not push: no encode
    kept = r.w.values[0].copy()
    np.testing.assert_array_equal(kept, r.task_flat.buffer_values())
    r.task_flat.load_buffers(np.zeros(8, np.float32))
    r.w.before_train(0, r.job(0, task=1))  # a continued task starts from the kept values
    np.testing.assert_array_equal(r.task_flat.buffer_values(), kept)
    assert r.w.gate(0, r.job(0), None, 1) is None  # the gate decision is left to others


def test_the_device_state_round_trips_and_is_a_copy():
    r = Rank()
    assert r.w.device_state(0) == {}
    r.update(0, r.train(0, seed=4))
    st = r.w.device_state(0)
    saved = st["buffers"].copy()
    st["buffers"][:] = -1.0
    np.testing.assert_array_equal(r.w.values[0], saved)  # the state was a copy
    s = Rank()
    s.w.load_device_state(0, {"buffers": saved.tolist()})  # (as a checkpoint may hold it)
    assert s.w.values[0].dtype == np.float32
    s.w.before_train(0, s.job(0))
    np.testing.assert_array_equal(s.task_flat.buffer_values(), saved)


def test_an_empty_state_restores_nothing_and_a_wrong_size_is_refused():
    r = Rank()
    r.w.load_device_state(0, {})
    assert r.w.values == {}
    with pytest.raises(
        ValueError, match="device 1: saved model buffers have 7 values, the model 8"
    ):
        r.w.load_device_state(1, {"buffers": np.zeros(7, np.float32)})
    assert 1 not in r.w.values


def test_a_model_without_float_buffers_leaves_its_updates_alone():
    r = Rank(bn=False)
    assert r.w.initial.size == 0 and r.w.sl.start == r.w.sl.stop
    r.w.before_train(0, r.job(0))
    delta = np.ones(r.task_flat.numel, np.float32)
    assert upload(r.w, r.job(0), delta).by == ""
    assert delta.all()


def test_the_end_of_training_flush_stays_an_all_zero_dense_update():
    r = Rank()
    r.update(0, r.train(0, seed=5))
    up = flush_upload(r.w, 0, 1)
    assert (up.by, up.kind, up.payload) == ("", None, None)
    assert up.delta.shape == (r.task_flat.numel,) and not up.delta.any()
    assert up.aux == (1.0, 0.0, 0.0, 0.0) and r.ctx.sent == []
