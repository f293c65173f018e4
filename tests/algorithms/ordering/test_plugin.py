"""edgefl.algorithms.ordering.plugin: the Ordering plugin class (when it is on, its halves,
what it requires of the other keys, its config check)."""

from __future__ import annotations

import copy

import pytest

from edgefl.algorithms import check_config, check_requirements, load, worker_plugins
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.ordering.coordinator import OrderingCoordinator
from edgefl.algorithms.ordering.orderers import CDGraB, make_cfg_orderer
from edgefl.algorithms.ordering.plugin import Ordering
from edgefl.algorithms.ordering.plugin import make_cfg_orderer as exported
from edgefl.algorithms.ordering.worker import OrderingWorker
from edgefl.errors import ConfigError

from ..fakes import FakeWorkerContext, config

ON = 'algorithm.ordering="cd-grab"'


def test_the_plugin_wires_its_two_halves_and_summary_key():
    assert issubclass(Ordering, Plugin) and Ordering.name == "ordering"
    assert Ordering.coordinator is OrderingCoordinator and Ordering.worker is OrderingWorker
    assert Ordering.summary_keys == {"ordering": None}
    assert exported is make_cfg_orderer


@pytest.mark.parametrize("name", ["rr", "id-grab", "id-grab-bal", "cd-grab"])
def test_it_is_on_for_every_ordering_but_none(name):
    cfg = config(None, f'algorithm.ordering="{name}"')
    assert Ordering.enabled(cfg) and Ordering in load(cfg)
    halves = [p for p in worker_plugins(FakeWorkerContext(cfg, {0: [1]})) if p.name == "ordering"]
    assert len(halves) == 1 and isinstance(halves[0], OrderingWorker)
    assert halves[0].orderer.name == name


def test_it_is_off_by_default():
    assert not Ordering.enabled(config()) and Ordering not in load(config())
    assert make_cfg_orderer(config()) is None


def _own(cfg):
    check_requirements(cfg, [("ordering", r) for r in Ordering.requires])


def test_every_requirement_is_triggered_by_the_ordering_key():
    keys = {r.key for r in Ordering.requires}
    assert keys == {"algorithm.consistency", "server.participation", "train.local_epochs",
                    "train.local_steps", "algorithm.gate", "algorithm.allocation",
                    "train.client"}  # fmt: skip
    assert all(r.when == "algorithm.ordering" for r in Ordering.requires)


@pytest.mark.parametrize(
    "setting, key",
    [
        ('algorithm.consistency="asp"', "algorithm.consistency"),
        ("server.participation=0.5", "server.participation"),
        ("train.local_epochs=2", "train.local_epochs"),
        ("train.local_steps=10", "train.local_steps"),
        ('algorithm.gate="hermes"', "algorithm.gate"),
        ('algorithm.allocation="hermes"', "algorithm.allocation"),
        ('train.client="mypkg:Client"', "train.client"),
    ],
)
def test_a_setting_ordering_cannot_run_with_is_refused_naming_both_keys(setting, key):
    with pytest.raises(ConfigError) as e:
        _own(config(None, ON, setting))
    msg = str(e.value)
    assert msg.startswith("config key 'algorithm.ordering' = 'cd-grab': needs " + key)
    assert "because" in msg
    _own(config(None, setting))  # ordering off: the same setting is fine


def test_the_defaults_meet_every_requirement():
    _own(config(None, ON))
    check_config(config(None, ON))


def test_the_shared_checker_refuses_an_asynchronous_ordered_run():
    with pytest.raises(ConfigError, match=r"needs algorithm\.consistency = 'bsp'"):
        check_config(config(None, ON, 'algorithm.consistency="asp"'))


def test_check_config_builds_the_orderer_and_names_a_bad_key():
    Ordering.check_config(config(None, ON))
    assert isinstance(make_cfg_orderer(config(None, ON)), CDGraB)
    for key, bad in (("unit", "batch"), ("sketch_kind", "srht")):
        cfg = copy.deepcopy(config(None, ON))
        cfg["ordering"][key] = bad  # (past the schema, as a programmatic config may be)
        with pytest.raises(ConfigError, match=f"'ordering.{key}' = '{bad}'"):
            Ordering.check_config(cfg)
    cfg = copy.deepcopy(config(None, ON))
    cfg["algorithm"]["ordering"] = "grab"
    with pytest.raises(ConfigError, match="'grab': expected one of rr, id-grab"):
        Ordering.check_config(cfg)
