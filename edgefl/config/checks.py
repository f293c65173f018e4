"""Validators for config values that the policies check themselves (one copy for all).

Each function takes the config key path (``"hermes.alpha"``) and the value, returns the value
converted (``float``, ``int``, ``bool``) when it is acceptable, and otherwise raises
:class:`~edgefl.errors.ConfigError` with a one-line message naming the key and the value::

    config key 'server.lr' = 0.0: must be > 0

The policies (``edgefl.policies``) call these when they are built, from the config or from
Python, so that a bad value fails the same way whatever the caller. The TOML loader
(:mod:`edgefl.config.load`) checks types and ranges against the schema before that.

This module imports nothing from edgefl but :mod:`edgefl.errors` (and numpy), so every layer
may use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError


def _fail(key: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"config key {key!r} = {value!r}: {what}")


def number(key: str, value: Any) -> float:
    """A finite real number, as ``float``.

    Accepts Python and numpy ints and floats (any :class:`numbers.Real`), not booleans.
    Messages: ``must be a number`` (wrong type), ``must be finite`` (NaN, inf, or an
    integer beyond the float range).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(key, value, "must be a number")
    try:
        x = float(value)
    except OverflowError:  # an int beyond the float range
        raise _fail(key, value, "must be finite") from None
    if not math.isfinite(x):
        raise _fail(key, value, "must be finite")
    return x


def positive(key: str, value: Any) -> float:
    """A finite number > 0, as ``float`` (:func:`number`, then ``must be > 0``)."""
    x = number(key, value)
    if x <= 0:
        raise _fail(key, value, "must be > 0")
    return x


def non_negative(key: str, value: Any) -> float:
    """A finite number >= 0, as ``float`` (:func:`number`, then ``must be >= 0``)."""
    x = number(key, value)
    if x < 0:
        raise _fail(key, value, "must be >= 0")
    return x


def integer(key: str, value: Any, minimum: int | None = None, allow_float: bool = False) -> int:
    """An integer, as ``int``; at least ``minimum`` when given.

    Accepts Python and numpy ints (any :class:`numbers.Integral`), not booleans; with
    ``allow_float`` also any other real number with a finite integral value (``2.0``). Message:
    ``must be an integer``, or ``must be an integer >= {minimum}`` when a minimum is given
    (for a value of the wrong type as well as for one below the minimum).
    """
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok and allow_float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = float(value)
        ok = math.isfinite(x) and x.is_integer()
    what = "must be an integer" if minimum is None else f"must be an integer >= {minimum}"
    if not ok or (minimum is not None and value < minimum):
        raise _fail(key, value, what)
    return int(value)


def boolean(key: str, value: Any) -> bool:
    """``True`` or ``False`` (also numpy's ``bool_``), as ``bool``; ints are refused.
    Message: ``must be true or false``."""
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(key, value, "must be true or false")
    return bool(value)


def pick(table: Mapping[str, Any] | None, keys: tuple[str, ...]) -> dict[str, Any]:
    """The entries of ``table`` named in ``keys``, in the order of ``keys`` (the other keys of
    a shared config table belong to other modules); ``{}`` for a missing table."""
    return {k: table[k] for k in keys if table is not None and k in table}


__all__ = ["boolean", "integer", "non_negative", "number", "pick", "positive"]
