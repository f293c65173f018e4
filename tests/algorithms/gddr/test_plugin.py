"""edgefl.algorithms.gddr.plugin: the GDDR plugin class (halves, when it is on, config
check)."""

from __future__ import annotations

import pytest

from edgefl.algorithms import check_config, coordinator_plugins, load, worker_plugins
from edgefl.algorithms.base import Plugin
from edgefl.algorithms.gddr.coordinator import GDDRCoordinator
from edgefl.algorithms.gddr.kinds import RESIDUAL
from edgefl.algorithms.gddr.plugin import GDDR
from edgefl.algorithms.gddr.worker import GDDRWorker
from edgefl.errors import ConfigError

from ..fakes import FakeCoordinatorContext, FakeWorkerContext, config

ON = 'algorithm.residual="gddr"'


def test_the_plugin_wires_its_two_halves_and_summary_key():
    assert issubclass(GDDR, Plugin) and GDDR.name == "gddr"
    assert GDDR.coordinator is GDDRCoordinator and GDDR.worker is GDDRWorker
    assert GDDR.summary_keys == {"gddr": None}
    assert GDDR.requires == ()


def test_the_coordinator_half_decodes_residual_messages_and_always_applies_its_flush():
    assert GDDRCoordinator.update_kinds == (RESIDUAL,)
    assert GDDRCoordinator.message_kinds == ()
    assert GDDRCoordinator.flush_always_applies is True


def test_it_is_on_only_with_algorithm_residual_gddr():
    assert not GDDR.enabled(config())
    assert GDDR not in load(config())
    cfg = config(None, ON)
    assert GDDR.enabled(cfg) and GDDR in load(cfg)


def test_the_runtime_builds_each_half_with_its_context_and_name():
    cfg = config(None, ON)
    c = FakeCoordinatorContext(cfg, {0: 4})
    w = FakeWorkerContext(cfg, {0: list(range(4))})
    [ch] = [p for p in coordinator_plugins(c) if isinstance(p, GDDRCoordinator)]
    [wh] = [p for p in worker_plugins(w) if isinstance(p, GDDRWorker)]
    assert ch.ctx is c and wh.ctx is w and ch.name == wh.name == "gddr"


def test_the_default_gddr_settings_pass_the_check():
    GDDR.check_config(config(None, ON))
    check_config(config(None, ON))


@pytest.mark.parametrize(
    "setting, key",
    [
        ("gddr.alpha=1.0", "gddr.alpha"),
        ("gddr.alpha=-0.1", "gddr.alpha"),
        ("gddr.installment_ratio=0", "gddr.installment_ratio"),
        ("gddr.installment_ratio=1.5", "gddr.installment_ratio"),
        ("gddr.installments=200", "gddr.installments"),
        ("gddr.tau=2000000", "gddr.tau"),
    ],
)
def test_a_bad_value_of_the_rule_is_refused_naming_its_key(setting, key):
    cfg = config(None, ON, setting)  # the schema lets these through; the plugin does not
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        GDDR.check_config(cfg)
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check_config(cfg)


def test_the_check_is_skipped_when_gddr_is_off():
    check_config(config(None, "gddr.alpha=1.0"))  # residual = none: the section is unused


@pytest.mark.parametrize(
    "sets",
    [("gddr.replay_decay=1.0",), ("gddr.adaptive=true", "gddr.tau_min=9", "gddr.tau_max=8")],
)
def test_check_config_refuses_what_the_coordinator_half_refuses(sets):
    cfg = config(None, ON, *sets)
    with pytest.raises(ConfigError):
        GDDRCoordinator(FakeCoordinatorContext(cfg, {0: 4}), "gddr")
    with pytest.raises(ConfigError):
        GDDR.check_config(cfg)
