"""edgefl.algorithms.scaffold.config: the [scaffold] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.scaffold.config import SECTIONS, Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_one_boolean_switch_off_by_default():
    assert set(SECTIONS) == {"scaffold"}
    (key,) = SECTIONS["scaffold"]
    f = SECTIONS["scaffold"][key]
    assert key == "enabled" and isinstance(f, Field)
    assert f.type == "bool" and f.default is False and f.doc


def test_the_effective_config_has_the_default_and_takes_an_override():
    assert config()["scaffold"] == {"enabled": False}
    assert config(None, "scaffold.enabled=true")["scaffold"]["enabled"] is True
    assert config({"scaffold": {"enabled": True}})["scaffold"]["enabled"] is True


@pytest.mark.parametrize("setting", ['scaffold.enabled="yes"', "scaffold.enabled=1"])
def test_a_non_boolean_is_refused_naming_the_key(setting):
    with pytest.raises(ConfigError, match="scaffold.enabled"):
        config(None, setting)


def test_an_unknown_key_of_the_section_is_refused():
    with pytest.raises(ConfigError, match="scaffold"):
        config({"scaffold": {"option": 2}})
