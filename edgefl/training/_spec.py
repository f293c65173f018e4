"""Importing a user's ``package.module:name`` from a config key (one-line errors)."""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError


def import_spec(spec: str, key: str) -> Any:
    """The object ``spec`` ("package.module:name") names; ConfigError naming ``key`` if not."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ConfigError(f"config key '{key}': {spec!r} is not 'package.module:name'")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ConfigError(f"config key '{key}': cannot import {mod!r}: {e}") from None
    except Exception as e:  # a module that fails while importing: one line
        raise ConfigError(
            f"config key '{key}': importing {mod!r} failed: {type(e).__name__}: {e}"
        ) from None
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"config key '{key}': module {mod!r} has no {name!r}") from None
    if not callable(obj):
        raise ConfigError(f"config key '{key}': {spec!r} is not callable")
    return obj
