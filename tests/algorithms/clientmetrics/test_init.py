"""edgefl.algorithms.clientmetrics: the package is a built-in plugin the loader finds."""

from __future__ import annotations

import edgefl.algorithms.clientmetrics
from edgefl.algorithms import coordinator_plugins, load, worker_plugins
from edgefl.algorithms.clientmetrics.coordinator import ClientMetricsCoordinator
from edgefl.algorithms.clientmetrics.plugin import ClientMetrics
from edgefl.algorithms.clientmetrics.worker import ClientMetricsWorker

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config

CLIENT = 'train.client="my_pkg.clients:fit"'


def test_the_package_names_where_the_metrics_land():
    doc = edgefl.algorithms.clientmetrics.__doc__
    assert "devices/<id>/client/<name>" in doc and "client/<name>" in doc


def test_the_loader_runs_it_only_with_a_user_client():
    assert ClientMetrics not in load(config())
    assert ClientMetrics in load(config(None, CLIENT))


def test_the_runtime_builders_hand_each_half_its_context():
    cfg = config(None, CLIENT)
    c = FakeCoordinatorContext(cfg, {0: 3})
    w = FakeWorkerContext(cfg, {0: [1, 2, 3]})
    (co,) = [p for p in coordinator_plugins(c) if isinstance(p, ClientMetricsCoordinator)]
    (wo,) = [p for p in worker_plugins(w) if isinstance(p, ClientMetricsWorker)]
    assert co.ctx is c and wo.ctx is w and co.name == wo.name == "client_metrics"
    assert co.latest == {}
