"""edgefl.algorithms.dp.config: the [dp] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.dp.config import SECTIONS, Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_dp_made_of_fields():
    assert set(SECTIONS) == {"dp"}
    assert set(SECTIONS["dp"]) == {"enabled", "clip", "noise_multiplier", "delta", "sampling"}
    assert all(isinstance(f, Field) for f in SECTIONS["dp"].values())


def test_off_by_default_and_the_effective_config_takes_the_declared_defaults():
    cfg = config()
    assert cfg["dp"] == {k: f.default for k, f in SECTIONS["dp"].items()}
    assert cfg["dp"]["enabled"] is False
    assert cfg["dp"]["clip"] == 1.0 and cfg["dp"]["noise_multiplier"] == 1.0
    assert 0 < cfg["dp"]["delta"] < 1e-3 and cfg["dp"]["sampling"] == "fixed"


def test_the_declared_bounds():
    f = SECTIONS["dp"]
    assert f["clip"].min == 0.0 and f["clip"].exclusive_min  # a clip norm of 0 is nothing
    assert f["noise_multiplier"].min == 0.0 and not f["noise_multiplier"].exclusive_min
    assert (f["delta"].min, f["delta"].max, f["delta"].exclusive_min) == (0.0, 1.0, True)
    assert f["sampling"].choices == ("fixed", "poisson")


@pytest.mark.parametrize(
    "setting, key",
    [
        ("dp.clip=0", "dp.clip"),
        ("dp.clip=-1", "dp.clip"),
        ("dp.noise_multiplier=-0.5", "dp.noise_multiplier"),
        ("dp.delta=0", "dp.delta"),
        ("dp.delta=1.5", "dp.delta"),
        ('dp.sampling="replace"', "dp.sampling"),
        ("dp.enabled=1", "dp.enabled"),
        ("dp.epsilon=1", "dp.epsilon"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_non_default_values_are_taken():
    cfg = config(None, "dp.enabled=true", "dp.noise_multiplier=0", "dp.delta=1",
                 'dp.sampling="poisson"', "dp.clip=0.1")  # fmt: skip
    assert cfg["dp"] == {"enabled": True, "clip": 0.1, "noise_multiplier": 0.0, "delta": 1.0,
                         "sampling": "poisson"}  # fmt: skip
