"""edgefl.algorithms.hermes.plugin: the Hermes plugin class (halves, requirements, config
check)."""

from __future__ import annotations

import pytest

from edgefl.algorithms import check_config, check_requirements, coordinator_plugins, load
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.hermes.coordinator import HermesCoordinator
from edgefl.algorithms.hermes.plugin import Hermes
from edgefl.algorithms.hermes.worker import HermesWorker
from edgefl.errors import ConfigError

from ..fakes import FakeCoordinatorContext, config


def test_the_plugin_wires_its_two_halves_and_summary_key():
    assert issubclass(Hermes, Plugin) and Hermes.name == "hermes"
    assert Hermes.coordinator is HermesCoordinator and Hermes.worker is HermesWorker
    assert Hermes.summary_keys == {"hermes": None}


def test_it_is_on_in_every_run():
    assert Hermes.enabled(config())
    assert Hermes in load(config())
    ctx = FakeCoordinatorContext(config(), {0: 5})
    halves = [p for p in coordinator_plugins(ctx) if isinstance(p, HermesCoordinator)]
    assert len(halves) == 1 and halves[0].name == "hermes" and halves[0].ctx is ctx


def _own(cfg):
    check_requirements(cfg, [("hermes", r) for r in Hermes.requires])


def test_the_gate_needs_wait_for_model():
    bad = config(None, 'algorithm.gate="hermes"', "hermes.wait_for_model=false")
    with pytest.raises(ConfigError, match=r"'algorithm.gate' = 'hermes'.*hermes\.wait_for_model"):
        _own(bad)
    _own(config(None, 'algorithm.gate="hermes"'))
    # without the gate the key does not matter
    _own(config(None, "hermes.wait_for_model=false"))


@pytest.mark.parametrize("agg", ["loss-weighted", "loss-softmax"])
def test_loss_aggregations_refuse_fedasync(agg):
    bad = config(None, f'algorithm.aggregation="{agg}"', 'algorithm.consistency="fedasync"')
    with pytest.raises(ConfigError, match=r"algorithm\.consistency != 'fedasync'"):
        _own(bad)
    _own(config(None, f'algorithm.aggregation="{agg}"', 'algorithm.consistency="asp"'))
    _own(config(None, 'algorithm.consistency="fedasync"'))  # sample-weighted: fine


def test_the_shared_checker_sees_the_requirements():
    with pytest.raises(ConfigError, match="wait_for_model"):
        check_config(config(None, 'algorithm.gate="hermes"', "hermes.wait_for_model=false"))


def test_check_config_accepts_the_defaults_and_the_hermes_choices():
    Hermes.check_config(config())
    Hermes.check_config(config(None, 'algorithm.gate="hermes"', 'algorithm.allocation="hermes"'))


@pytest.mark.parametrize(
    "sets, key",
    [
        (('algorithm.gate="hermes"', "hermes.alpha=0.5"), "hermes.alpha"),
        (('algorithm.gate="hermes"', "hermes.beta=1.0"), "hermes.beta"),
        (('algorithm.allocation="hermes"', "allocation.smoothing=0"), "allocation.smoothing"),
        (('algorithm.allocation="hermes"', "allocation.max_change=2"), "allocation.max_change"),
        (("train.local_epochs=0",), "train.local_epochs"),
    ],
)
def test_check_config_refuses_bad_gate_and_allocation_values(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Hermes.check_config(config(None, *sets))


def test_check_config_ignores_gate_values_when_no_gate_is_on():
    Hermes.check_config(config(None, "hermes.alpha=0.5"))  # algorithm.gate = always
