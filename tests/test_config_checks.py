"""edgefl.config.checks: the one validator of config values the policies check themselves."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from edgefl.config import checks
from edgefl.errors import ConfigError


@pytest.mark.parametrize("value", [0, 2, -1.5, np.float32(0.25), np.int64(3), Fraction(1, 4)])
def test_number_accepts_finite_reals(value):
    x = checks.number("k", value)
    assert type(x) is float and x == float(value)


@pytest.mark.parametrize(
    "value, what",
    [
        (True, "must be a number"),
        (np.True_, "must be a number"),
        ("1", "must be a number"),
        (None, "must be a number"),
        (math.nan, "must be finite"),
        (-math.inf, "must be finite"),
        (10**400, "must be finite"),
    ],
)
def test_number_rejects(value, what):
    with pytest.raises(ConfigError) as e:
        checks.number("a.b", value)
    assert str(e.value) == f"config key 'a.b' = {value!r}: {what}"


def test_positive_and_non_negative():
    assert checks.positive("k", 1) == 1.0 and checks.non_negative("k", 0) == 0.0
    with pytest.raises(ConfigError, match=r"^config key 'server.lr' = 0.0: must be > 0$"):
        checks.positive("server.lr", 0.0)
    with pytest.raises(ConfigError, match=r"^config key 'server.l1' = -1: must be >= 0$"):
        checks.non_negative("server.l1", -1)
    with pytest.raises(ConfigError, match="must be finite"):
        checks.non_negative("k", math.inf)


def test_integer():
    assert checks.integer("k", np.int32(4)) == 4 and type(checks.integer("k", 4)) is int
    assert checks.integer("k", 2.0, allow_float=True) == 2
    for bad in (True, 2.0, "2", None):
        with pytest.raises(ConfigError, match=r"'k' = .*: must be an integer$"):
            checks.integer("k", bad)
    for bad in (2.5, math.inf, math.nan, False):
        with pytest.raises(ConfigError, match="must be an integer"):
            checks.integer("k", bad, allow_float=True)
    assert checks.integer("k", 2, minimum=2) == 2
    for bad in (1, 1.0, "x"):
        with pytest.raises(ConfigError, match=r"^config key 'hermes.window' = .*: must be an "):
            checks.integer("hermes.window", bad, minimum=2)
    with pytest.raises(ConfigError, match=r"= 1: must be an integer >= 2$"):
        checks.integer("hermes.window", 1, minimum=2)


def test_boolean_and_pick():
    assert checks.boolean("k", True) is True and checks.boolean("k", np.False_) is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(ConfigError, match="must be true or false"):
            checks.boolean("k", bad)
    table = {"b": 2, "a": 1, "other": 3}
    assert list(checks.pick(table, ("a", "b", "c")).items()) == [("a", 1), ("b", 2)]
    assert checks.pick(None, ("a",)) == {}
