"""edgefl.algorithms.fedeval: the package is a built-in plugin the loader finds."""

from __future__ import annotations

import edgefl.algorithms.fedeval
from edgefl.algorithms import coordinator_plugins, load, worker_plugins
from edgefl.algorithms.fedeval.coordinator import FedEvalCoordinator
from edgefl.algorithms.fedeval.plugin import FederatedEvaluation
from edgefl.algorithms.fedeval.worker import FedEvalWorker

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config


def test_the_package_names_its_switch_and_its_parts():
    doc = edgefl.algorithms.fedeval.__doc__
    assert "evaluation.every = K > 0" in doc and ":mod:`.coordinator`" in doc


def test_the_loader_runs_it_only_when_every_is_positive():
    assert FederatedEvaluation not in load(config())
    assert FederatedEvaluation in load(config(None, "evaluation.every=1"))


def test_the_runtime_builders_give_both_halves_the_same_holdout():
    cfg = config(None, "evaluation.every=2", "evaluation.holdout=0.25")
    c = FakeCoordinatorContext(cfg, {0: 8, 1: 12})
    w = FakeWorkerContext(cfg, {0: list(range(8))})
    (co,) = [p for p in coordinator_plugins(c) if isinstance(p, FedEvalCoordinator)]
    (wo,) = [p for p in worker_plugins(w) if isinstance(p, FedEvalWorker)]
    assert co.ctx is c and wo.ctx is w and co.every == wo.every == 2
    assert c.holdout == w.holdout == 0.25
    assert [c.train_size(0), c.train_size(1)] == [6, 9]
    train, held = w.split(0)
    assert len(train) == c.train_size(0) and len(held) == 2
