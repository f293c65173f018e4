"""edgefl.algorithms.fedbn (one module: the buffer checks, FedBN's worker half, the two plugin
classes), each without MPI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import edgefl.algorithms.fedbn
import edgefl.algorithms.fedbn as checks
from edgefl.algorithms import BUILTIN, builtin_classes, coordinator_plugins, load, worker_plugins
from edgefl.algorithms.base import LocalJob, Plugin, TaskSpec
from edgefl.algorithms.fedbn import FedBN, FedBNWorker, ModelBuffers
from edgefl.errors import ConfigError
from edgefl.models.flat import FlatParams

from .fakes import FakeCoordinatorContext, FakeWorkerContext, config, flush_upload, upload


def test_one_module_holds_both_plugins_and_says_what_each_does():
    mod = edgefl.algorithms.fedbn
    assert not hasattr(mod, "__path__")  # a module, not a package
    assert 'model.buffers = "local"' in mod.__doc__
    assert "``ModelBuffers``" in mod.__doc__ and "``FedBN``" in mod.__doc__
    assert FedBN.worker is FedBNWorker and ModelBuffers.worker is None


def test_the_module_provides_two_built_in_plugins_first_in_hook_order():
    assert {"fedbn:ModelBuffers", "fedbn:FedBN"} <= set(BUILTIN)
    names = [c.name for c in builtin_classes()]
    assert names[:2] == ["model_buffers", "fedbn"]


LOCAL = 'model.buffers="local"'


def test_model_buffers_is_always_on_and_runs_nothing_during_a_job():
    assert issubclass(ModelBuffers, Plugin) and ModelBuffers.name == "model_buffers"
    assert ModelBuffers.coordinator is None and ModelBuffers.worker is None
    assert ModelBuffers.enabled(config()) and ModelBuffers in load(config())


def test_fedbn_is_a_worker_half_on_only_with_local_buffers():
    assert issubclass(FedBN, Plugin) and FedBN.name == "fedbn"
    assert FedBN.worker is FedBNWorker and FedBN.coordinator is None
    assert not FedBN.enabled(config()) and FedBN not in load(config())
    assert FedBN.enabled(config(None, LOCAL)) and FedBN in load(config(None, LOCAL))


def test_the_fedbn_worker_half_is_built_first_of_the_worker_halves():
    torch.manual_seed(0)
    flat = FlatParams(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
    cfg = config(None, LOCAL, "fedprox.enabled=true")
    halves = worker_plugins(FakeWorkerContext(cfg, {0: [1]}, flat=flat))
    assert isinstance(halves[0], FedBNWorker) and halves[0].name == "fedbn"
    assert "fedprox" in [h.name for h in halves]  # (another worker half comes after it)
    ctx = FakeCoordinatorContext(cfg, {0: 1})
    assert all(p.name not in ("fedbn", "model_buffers") for p in coordinator_plugins(ctx))


def test_model_buffers_passes_a_config_without_conflicts_without_building_the_model(
    monkeypatch,
):
    def boom(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(checks, "buffer_names_of", boom)
    ModelBuffers.check_config(config())
    ModelBuffers.check_config(config(None, LOCAL, 'server.optimizer="adam"'))


def test_model_buffers_refuses_a_conflict_when_the_model_has_float_buffers(monkeypatch):
    monkeypatch.setattr(
        checks, "buffer_names_of", lambda cfg: ["bn.running_mean", "bn.running_var"]
    )
    with pytest.raises(ConfigError, match=r"config key 'dp\.enabled' = true: cannot run with"):
        ModelBuffers.check_config(config(None, "dp.enabled=true"))
    with pytest.raises(ConfigError, match=r"'server\.optimizer' = 'adam'.*'federate'"):
        ModelBuffers.check_config(config(None, 'server.optimizer="adam"'))
    ModelBuffers.check_config(config(None, LOCAL, 'server.optimizer="adam"'))  # zero updates


def test_model_buffers_lets_a_conflict_pass_when_the_model_has_no_float_buffers(monkeypatch):
    monkeypatch.setattr(checks, "buffer_names_of", lambda cfg: [])
    ModelBuffers.check_config(config(None, "dp.enabled=true"))


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
