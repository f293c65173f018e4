"""Importing the object a config value ``"package.module:name"`` names (one-line errors).

Used for every user hook named in config that is a plain callable: ``train.client``,
``train.loss``, ``train.optimizer``, ``evaluation.metrics``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigError


def import_spec(spec: Any, key: str) -> Any:
    """The callable ``spec`` ("package.module:name"; ``name`` may be dotted) names; a
    ConfigError naming ``key`` and the value when it is not such a string, cannot be
    imported (or raises while importing), lacks the name or is not callable."""
    where = f"config key '{key}' = {spec!r}"
    if not isinstance(spec, str):
        raise ConfigError(f"{where}: expected 'package.module:name'")
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ConfigError(f"{where}: expected 'package.module:name'")
    try:
        obj: Any = importlib.import_module(mod)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import {mod!r}: {e}") from None
    except Exception as e:  # a module that fails while importing: one line
        raise ConfigError(f"{where}: importing {mod!r} failed: {type(e).__name__}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {mod!r} has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {name!r} is not callable")
    return obj
