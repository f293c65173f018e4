"""Fixtures of the plugin unit tests: fake contexts (tests/algorithms/fakes.py) so a plugin
half runs alone, without MPI, a worker or a run."""

from __future__ import annotations

import pytest

from .fakes import FakeCoordinatorContext, FakeWorkerContext, config


@pytest.fixture
def coordinator_ctx():
    """``coordinator_ctx(samples, *sets, doc=None, **kw)``: a FakeCoordinatorContext over
    devices with ``samples`` ({device: samples}) and the config the ``--set`` strings make."""

    def make(samples=None, *sets: str, doc: dict | None = None, **kw) -> FakeCoordinatorContext:
        return FakeCoordinatorContext(config(doc, *sets), samples or {0: 10, 1: 20}, **kw)

    return make


@pytest.fixture
def worker_ctx():
    """``worker_ctx(data, *sets, doc=None, **kw)``: a FakeWorkerContext over ``data``
    ({device: dataset}) and the config the ``--set`` strings make."""

    def make(data, *sets: str, doc: dict | None = None, **kw) -> FakeWorkerContext:
        return FakeWorkerContext(config(doc, *sets), data, **kw)

    return make
