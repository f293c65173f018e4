"""Validated TOML configuration. See ``docs/configuration.md`` for every key."""

from .load import (
    config_from_toml,
    dump_config,
    load_config,
    parse_override,
    read_toml,
    with_values,
)
from .schema import SCHEMA, Field, defaults, iter_fields

__all__ = [
    "SCHEMA",
    "config_from_toml",
    "Field",
    "defaults",
    "dump_config",
    "iter_fields",
    "load_config",
    "parse_override",
    "read_toml",
    "with_values",
]
