"""The config section of the scaffold plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "scaffold": {
        "enabled": field(
            False,
            "bool",
            "SCAFFOLD: server and client control variates correct each local gradient.",
        ),
    },
}
