"""Validated TOML configuration. See ``docs/configuration.md`` for every key.

The names below are loaded on first use (PEP 562): the schema is built from the plugins'
config sections, and a plugin's config module imports :mod:`edgefl.config.fields`, so
importing this package must not build the schema (a plugin module imported first, e.g.
``from edgefl.algorithms.hermes.plugin import Hermes`` in a fresh interpreter, would
otherwise meet its own half-initialised config module)."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "config_from_toml": "load",
    "dump_config": "load",
    "load_config": "load",
    "parse_override": "load",
    "read_toml": "load",
    "with_values": "load",
    "SCHEMA": "schema",
    "Field": "fields",
    "defaults": "schema",
    "iter_fields": "schema",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
