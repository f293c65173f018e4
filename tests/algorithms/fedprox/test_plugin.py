"""edgefl.algorithms.fedprox.plugin: the FedProx plugin class (a worker half only)."""

from __future__ import annotations

from edgefl.algorithms import check_config, coordinator_plugins, load, worker_plugins
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.fedprox.plugin import FedProx
from edgefl.algorithms.fedprox.worker import FedProxWorker

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config


def test_the_plugin_has_a_worker_half_only():
    assert issubclass(FedProx, Plugin) and FedProx.name == "fedprox"
    assert FedProx.worker is FedProxWorker and FedProx.coordinator is None
    assert FedProx.requires == ()


def test_it_follows_fedprox_enabled():
    assert not FedProx.enabled(config()) and FedProx not in load(config())
    cfg = config(None, "fedprox.enabled=true")
    assert FedProx.enabled(cfg) and FedProx in load(cfg)
    check_config(cfg)


def test_the_runtime_builds_its_worker_half_and_no_coordinator_half():
    cfg = config(None, "fedprox.enabled=true")
    halves = [p for p in worker_plugins(FakeWorkerContext(cfg, {0: [1]})) if p.name == "fedprox"]
    assert len(halves) == 1 and isinstance(halves[0], FedProxWorker)
    ctx = FakeCoordinatorContext(cfg, {0: 1})
    assert all(p.name != "fedprox" for p in coordinator_plugins(ctx))
