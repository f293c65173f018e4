"""edgefl.algorithms.hermes.config: the [hermes] and [allocation] sections."""

from __future__ import annotations

import pytest

from edgefl.algorithms.hermes.config import SECTIONS, Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_sections_are_hermes_and_allocation_made_of_fields():
    assert set(SECTIONS) == {"hermes", "allocation"}
    for table in SECTIONS.values():
        assert table and all(isinstance(f, Field) for f in table.values())


def test_the_effective_config_takes_the_declared_defaults():
    cfg = config()
    for section, table in SECTIONS.items():
        assert cfg[section] == {k: f.default for k, f in table.items()}


def test_key_defaults_the_plugin_relies_on():
    h, a = SECTIONS["hermes"], SECTIONS["allocation"]
    assert h["alpha"].default < 0  # a major update is a z-score below a negative threshold
    assert h["wait_for_model"].default is True  # the only supported value
    assert h["broadcast"].choices == ("pusher", "all") and h["broadcast"].default == "pusher"
    assert 0 < h["holdout_fraction"].default <= h["holdout_fraction"].max
    assert h["holdout_fraction"].exclusive_min and h["holdout_fraction"].min == 0.0
    assert a["trigger"].choices == ("fences", "always")
    assert 0 < a["initial_fraction"].default <= 1


@pytest.mark.parametrize(
    "setting, key",
    [
        ("hermes.window=1", "hermes.window"),
        ("hermes.lam=-1", "hermes.lam"),
        ('hermes.test="median"', "hermes.test"),
        ('hermes.broadcast="some"', "hermes.broadcast"),
        ("hermes.holdout_fraction=0", "hermes.holdout_fraction"),
        ("hermes.holdout_fraction=0.95", "hermes.holdout_fraction"),
        ("hermes.softmax_buffer=0", "hermes.softmax_buffer"),
        ("hermes.max_local_iterations=-1", "hermes.max_local_iterations"),
        ("allocation.warmup=0", "allocation.warmup"),
        ("allocation.initial_fraction=0", "allocation.initial_fraction"),
        ("allocation.initial_fraction=1.5", "allocation.initial_fraction"),
        ('allocation.trigger="never"', "allocation.trigger"),
        ("allocation.fence=-1", "allocation.fence"),
        ("hermes.no_such_key=1", "hermes.no_such_key"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_non_default_values_are_taken():
    cfg = config(None, 'hermes.test="percentile"', 'hermes.broadcast="all"',
                 "hermes.holdout_fraction=0.9", "allocation.initial_fraction=1.0")  # fmt: skip
    assert cfg["hermes"]["test"] == "percentile" and cfg["hermes"]["broadcast"] == "all"
    assert cfg["hermes"]["holdout_fraction"] == 0.9
    assert cfg["allocation"]["initial_fraction"] == 1.0
