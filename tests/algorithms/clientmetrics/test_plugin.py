"""edgefl.algorithms.clientmetrics.plugin: the ClientMetrics class."""

from __future__ import annotations

from edgefl.algorithms import load
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.clientmetrics.coordinator import ClientMetricsCoordinator
from edgefl.algorithms.clientmetrics.kinds import CLIENT_METRICS
from edgefl.algorithms.clientmetrics.plugin import ClientMetrics
from edgefl.algorithms.clientmetrics.worker import ClientMetricsWorker
from edgefl.algorithms.scaffold.plugin import Scaffold

from ..fakes import config

CLIENT = 'train.client="my_pkg.clients:fit"'


def test_the_plugin_wires_its_halves_and_the_kind_rank_0_handles():
    assert issubclass(ClientMetrics, Plugin) and ClientMetrics.name == "client_metrics"
    assert ClientMetrics.coordinator is ClientMetricsCoordinator
    assert ClientMetrics.worker is ClientMetricsWorker
    assert ClientMetricsCoordinator.message_kinds == (CLIENT_METRICS,)
    assert ClientMetricsWorker.message_kinds == ()  # it only sends
    assert ClientMetrics.requires == ()


def test_it_is_on_exactly_when_a_user_client_is_configured():
    assert not ClientMetrics.enabled(config())
    assert ClientMetrics.enabled(config(None, CLIENT))


def test_its_worker_half_runs_before_a_plugin_that_sends_the_update_itself():
    classes = load(config(None, CLIENT, "scaffold.enabled=true"))
    assert classes.index(ClientMetrics) < classes.index(Scaffold)
