"""The [robust] config section (edgefl.algorithms.robust.config): keys, defaults, checks."""

from __future__ import annotations

import pytest

from edgefl.algorithms.robust.config import SECTIONS
from edgefl.algorithms.robust.rules import ROBUST_KEYS
from edgefl.config.fields import Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_the_effective_robust_table_with_its_defaults():
    robust = SECTIONS["robust"]
    assert all(isinstance(f, Field) for f in robust.values())
    cfg = config()
    assert {k: f.default for k, f in robust.items()} == cfg["robust"]
    assert set(robust) == set(ROBUST_KEYS)  # every key the rules read, nothing else


def test_the_norm_bound_is_off_by_default():
    robust = SECTIONS["robust"]
    assert robust["norm_bound"].default == 0.0
    assert robust["norm_bound_relative"].default == 0.0
    assert robust["norm_bound_mode"].default == "reject"
    assert robust["norm_bound_mode"].choices == ("reject", "clip")
    assert robust["krum_f"].default == -1  # unset


@pytest.mark.parametrize(
    "setting,key",
    [
        ("robust.norm_bound=-1.0", "robust.norm_bound"),
        ("robust.norm_bound_relative=-2.0", "robust.norm_bound_relative"),
        ("robust.norm_bound_mode=drop", "robust.norm_bound_mode"),
        ("robust.multi_krum_m=-1", "robust.multi_krum_m"),
        ("robust.clip_norm=-0.5", "robust.clip_norm"),
        ("robust.krum_f=two", "robust.krum_f"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_values_load():
    cfg = config(None, "robust.norm_bound=1.5", "robust.norm_bound_mode=clip")
    assert cfg["robust"]["norm_bound"] == 1.5 and cfg["robust"]["norm_bound_mode"] == "clip"
