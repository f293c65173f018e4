"""edgefl.algorithms.fedeval.config: the [evaluation] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.fedeval.config import SECTIONS
from edgefl.config.fields import Field
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_section_is_evaluation_with_every_holdout_metrics_and_final():
    assert set(SECTIONS) == {"evaluation"}
    table = SECTIONS["evaluation"]
    assert set(table) == {"every", "holdout", "metrics", "final"}
    assert all(isinstance(f, Field) and f.doc for f in table.values())


def test_federated_evaluation_is_off_by_default():
    e = SECTIONS["evaluation"]
    assert e["every"].default == 0 and e["every"].type == "int" and e["every"].min == 0
    assert e["metrics"].default == [] and e["metrics"].type == "list[str]"
    h = e["holdout"]
    assert h.type == "float" and 0 < h.default < 1 and h.min == 0.0 and h.exclusive_min


def test_the_effective_config_takes_the_defaults_and_overrides():
    assert config()["evaluation"] == {"every": 0, "holdout": 0.2, "metrics": [], "final": True}
    cfg = config(None, "evaluation.every=3", "evaluation.holdout=0.5",
                 'evaluation.metrics=["a.b:c"]', "evaluation.final=false")  # fmt: skip
    assert cfg["evaluation"] == {"every": 3, "holdout": 0.5, "metrics": ["a.b:c"], "final": False}


@pytest.mark.parametrize(
    "setting, key",
    [
        ("evaluation.every=-1", "evaluation.every"),
        ("evaluation.every=1.5", "evaluation.every"),
        ("evaluation.holdout=0", "evaluation.holdout"),
        ("evaluation.holdout=-0.1", "evaluation.holdout"),
        ("evaluation.metrics=3", "evaluation.metrics"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)
