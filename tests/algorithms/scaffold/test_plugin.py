"""edgefl.algorithms.scaffold.plugin: the Scaffold class (halves, switch, requirements)."""

from __future__ import annotations

import pytest

from edgefl.algorithms import check_requirements, plugin_requirements
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.scaffold.coordinator import ScaffoldCoordinator
from edgefl.algorithms.scaffold.kinds import CONTROL, CONTROL_UPDATE
from edgefl.algorithms.scaffold.plugin import Scaffold
from edgefl.algorithms.scaffold.worker import ScaffoldWorker
from edgefl.errors import ConfigError

from ..fakes import config

ON = "scaffold.enabled=true"


def test_the_plugin_wires_its_two_halves_and_their_kinds():
    assert issubclass(Scaffold, Plugin) and Scaffold.name == "scaffold"
    assert Scaffold.coordinator is ScaffoldCoordinator and Scaffold.worker is ScaffoldWorker
    assert ScaffoldCoordinator.update_kinds == (CONTROL_UPDATE,)
    assert ScaffoldWorker.message_kinds == (CONTROL,)
    assert Scaffold.summary_keys == {"scaffold": None}


def test_it_is_enabled_by_its_switch_only():
    assert not Scaffold.enabled(config())
    assert Scaffold.enabled(config(None, ON))


def test_every_requirement_is_triggered_by_the_switch_and_met_by_the_defaults():
    keys = [r.key for r in Scaffold.requires]
    assert len(keys) == len(set(keys)) == 7
    for r in Scaffold.requires:
        assert r.when == "scaffold.enabled" and r.because
        assert r.holds(config(None, ON))
    assert ("scaffold", Scaffold.requires[0]) in plugin_requirements(config())


@pytest.mark.parametrize(
    "setting, key",
    [
        ('algorithm.consistency="asp"', "algorithm.consistency"),
        ('algorithm.gate="hermes"', "algorithm.gate"),
        ("fedprox.enabled=true", "fedprox.enabled"),
        ("ps.sparse=true", "ps.sparse"),
        ("ps.servers=2", "ps.servers"),
        ('algorithm.residual="gddr"', "algorithm.residual"),
        ('ps.pull="working-set"', "ps.pull"),
    ],
)
def test_a_conflicting_setting_is_refused_naming_both_keys(setting, key):
    cfg = config(None, ON, setting)
    with pytest.raises(ConfigError) as e:
        check_requirements(cfg, [("scaffold", r) for r in Scaffold.requires])
    msg = str(e.value)
    assert "'scaffold.enabled' = true" in msg and f"needs {key}" in msg and "because" in msg


def test_the_same_settings_are_fine_with_scaffold_off():
    cfg = config(None, 'algorithm.consistency="asp"', "fedprox.enabled=true")
    check_requirements(cfg, [("scaffold", r) for r in Scaffold.requires])  # no error
    assert not any(r.applies(cfg) for r in Scaffold.requires)
