"""edgefl.algorithms.fedprox.config: the [fedprox] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.fedprox.config import SECTIONS, Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_fedprox_made_of_fields():
    assert set(SECTIONS) == {"fedprox"} and set(SECTIONS["fedprox"]) == {"enabled", "mu"}
    assert all(isinstance(f, Field) for f in SECTIONS["fedprox"].values())


def test_off_by_default_with_a_small_mu():
    cfg = config()
    assert cfg["fedprox"] == {"enabled": False, "mu": 0.01}
    f = SECTIONS["fedprox"]
    assert f["enabled"].type == "bool" and f["mu"].type == "float"
    assert f["mu"].min == 0.0 and not f["mu"].exclusive_min  # mu = 0 is FedAvg, allowed


@pytest.mark.parametrize(
    "setting, key",
    [
        ("fedprox.mu=-0.1", "fedprox.mu"),
        ('fedprox.mu="big"', "fedprox.mu"),
        ("fedprox.enabled=1", "fedprox.enabled"),
        ("fedprox.lam=1", "fedprox.lam"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_values_are_taken():
    cfg = config(None, "fedprox.enabled=true", "fedprox.mu=0")
    assert cfg["fedprox"] == {"enabled": True, "mu": 0.0}
    assert config(None, "fedprox.mu=1")["fedprox"]["mu"] == 1.0
