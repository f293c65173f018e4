"""edgefl.algorithms.fedbn.plugin: ModelBuffers (the checks, always on, no halves) and
FedBN (model.buffers = "local", a worker half)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import edgefl.algorithms.fedbn.checks as checks
from edgefl.algorithms import coordinator_plugins, load, worker_plugins
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.fedbn.plugin import FedBN, ModelBuffers
from edgefl.algorithms.fedbn.worker import FedBNWorker
from edgefl.errors import ConfigError
from edgefl.models.flat import FlatParams

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config

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
