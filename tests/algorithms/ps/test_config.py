"""The [ps] config section (edgefl.algorithms.ps.config): its keys, defaults and checks."""

from __future__ import annotations

import pytest

from edgefl.algorithms.ps.config import SECTIONS
from edgefl.config.fields import Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_the_effective_ps_table_with_its_defaults():
    ps = SECTIONS["ps"]
    assert all(isinstance(f, Field) for f in ps.values())
    cfg = config()
    assert set(cfg["ps"]) == set(ps)
    assert {k: f.default for k, f in ps.items()} == cfg["ps"]


def test_defaults_leave_the_plugin_off():
    ps = SECTIONS["ps"]
    assert ps["sparse"].default is False
    assert ps["pull"].default == "full"
    assert ps["filters"].default == []
    assert ps["servers"].default == 0 and ps["replicas"].default == 1


def test_choices_are_the_documented_ones():
    ps = SECTIONS["ps"]
    assert ps["filters"].choices == ("significant", "kkt")
    assert ps["pull"].choices == ("full", "working-set")
    assert ps["value_dtype"].choices == ("float32", "float16", "bfloat16")
    assert ps["debug_bad_working_set"].choices == (
        "none",
        "unsorted",
        "out-of-range",
        "duplicate",
    )


@pytest.mark.parametrize(
    "setting,key",
    [
        ("ps.pull=partial", "ps.pull"),
        ("ps.value_dtype=int8", "ps.value_dtype"),
        ('ps.filters=["topk"]', "ps.filters"),
        ("ps.cache_entries=0", "ps.cache_entries"),
        ("ps.sig_threshold=-0.5", "ps.sig_threshold"),
        ("ps.kkt_margin=-1.0", "ps.kkt_margin"),
        ("ps.servers=-1", "ps.servers"),
        ("ps.replicas=0", "ps.replicas"),
        ("ps.sparse=3", "ps.sparse"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_values_load():
    cfg = config(
        None,
        "ps.sparse=true",
        'ps.filters=["significant", "kkt"]',
        "ps.value_dtype=bfloat16",
        "ps.cache_entries=1",
    )
    assert cfg["ps"]["filters"] == ["significant", "kkt"]
    assert cfg["ps"]["value_dtype"] == "bfloat16" and cfg["ps"]["cache_entries"] == 1
