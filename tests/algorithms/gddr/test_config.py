"""edgefl.algorithms.gddr.config: the [gddr] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.gddr.config import SECTIONS, Field
from edgefl.algorithms.gddr.replay import check_replay
from edgefl.algorithms.gddr.residual import check_alpha, check_installments, check_tau
from edgefl.algorithms.gddr.store import check_checkpoint_every
from edgefl.algorithms.gddr.tau import check_tau_bounds
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_gddr_made_of_fields():
    assert set(SECTIONS) == {"gddr"}
    assert SECTIONS["gddr"] and all(isinstance(f, Field) for f in SECTIONS["gddr"].values())


def test_the_effective_config_takes_the_declared_defaults():
    cfg = config()
    assert cfg["gddr"] == {k: f.default for k, f in SECTIONS["gddr"].items()}


def test_the_defaults_pass_the_validators_of_the_rule():
    g = {k: f.default for k, f in SECTIONS["gddr"].items()}
    assert check_alpha(g["alpha"]) == 0.4
    assert check_tau(g["tau"]) == 4 and g["adaptive"] is False
    lo, hi = check_tau_bounds(g["tau_min"], g["tau_max"])
    assert lo <= g["tau"] <= hi
    assert check_installments(g["installments"], g["installment_ratio"]) == (1, 0.5)
    assert check_checkpoint_every(g["checkpoint_every"]) == 5
    assert check_replay(g["replay_decay"], g["replay_steps"]) == (0.5, 5)


def test_the_declared_types_and_bounds():
    g = SECTIONS["gddr"]
    assert {k for k, f in g.items() if f.type == "int"} == {
        "tau", "tau_min", "tau_max", "installments", "checkpoint_every", "replay_steps"
    }  # fmt: skip
    assert g["adaptive"].type == "bool"
    assert g["checkpoint_every"].min == 0  # 0 = never
    assert all(g[k].min == 1 for k in ("tau", "tau_min", "tau_max", "installments"))


@pytest.mark.parametrize(
    "setting, key",
    [
        ("gddr.tau=0", "gddr.tau"),
        ("gddr.tau_min=0", "gddr.tau_min"),
        ("gddr.tau_max=0", "gddr.tau_max"),
        ("gddr.installments=0", "gddr.installments"),
        ("gddr.checkpoint_every=-1", "gddr.checkpoint_every"),
        ("gddr.replay_steps=0", "gddr.replay_steps"),
        ("gddr.adaptive=1", "gddr.adaptive"),
        ('gddr.alpha="high"', "gddr.alpha"),
        ("gddr.no_such_key=1", "gddr.no_such_key"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_non_default_values_are_taken():
    cfg = config(None, "gddr.alpha=0.0", "gddr.adaptive=true", "gddr.checkpoint_every=0",
                 "gddr.installments=3")  # fmt: skip
    g = cfg["gddr"]
    assert g["alpha"] == 0.0 and g["adaptive"] is True
    assert g["checkpoint_every"] == 0 and g["installments"] == 3
