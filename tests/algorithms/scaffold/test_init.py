"""edgefl.algorithms.scaffold: the package is a built-in plugin the loader finds."""

from __future__ import annotations

import edgefl.algorithms.scaffold
from edgefl.algorithms import coordinator_plugins, load, worker_plugins
from edgefl.algorithms.scaffold.coordinator import ScaffoldCoordinator
from edgefl.algorithms.scaffold.plugin import Scaffold
from edgefl.algorithms.scaffold.worker import ScaffoldWorker

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config
from .test_coordinator import Flat


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
