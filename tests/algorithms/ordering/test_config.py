"""edgefl.algorithms.ordering.config: the [ordering] section."""

from __future__ import annotations

import pytest

from edgefl.algorithms.ordering.config import SECTIONS, Field
from edgefl.algorithms.ordering.orderers import SKETCH_KINDS, UNITS
from edgefl.errors import ConfigError

from ..fakes import config


def test_one_ordering_section_of_fields_whose_defaults_the_config_takes():
    assert set(SECTIONS) == {"ordering"}
    table = SECTIONS["ordering"]
    assert all(isinstance(f, Field) for f in table.values())
    assert config()["ordering"] == {k: f.default for k, f in table.items()}


def test_defaults_are_exact_streamed_per_example_ordering():
    t = SECTIONS["ordering"]
    assert t["sketch_dim"].default == 0 and t["unit"].default == "example"
    assert t["ship"].default == "step" and t["microbatch"].default == 1
    assert t["save_debug"].default is False


def test_the_choices_are_those_the_orderers_implement():
    t = SECTIONS["ordering"]
    assert t["unit"].choices == UNITS and t["sketch_kind"].choices == SKETCH_KINDS
    assert t["ship"].choices == ("step", "epoch")


@pytest.mark.parametrize(
    "setting, key",
    [
        ("ordering.sketch_dim=-1", "ordering.sketch_dim"),
        ('ordering.sketch_kind="srht"', "ordering.sketch_kind"),
        ('ordering.unit="batch"', "ordering.unit"),
        ("ordering.microbatch=0", "ordering.microbatch"),
        ('ordering.ship="never"', "ordering.ship"),
        ("ordering.sketch_dim=1.5", "ordering.sketch_dim"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_values_are_taken():
    o = config(None, "ordering.sketch_dim=16", 'ordering.sketch_kind="gaussian"',
               'ordering.unit="microbatch"', "ordering.microbatch=4",
               'ordering.ship="epoch"')["ordering"]  # fmt: skip
    assert (o["sketch_dim"], o["sketch_kind"], o["unit"], o["microbatch"], o["ship"]) == (
        16, "gaussian", "microbatch", 4, "epoch",
    )  # fmt: skip
