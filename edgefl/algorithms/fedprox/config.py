"""The config section of the fedprox plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "fedprox": {
        "enabled": field(
            False, "bool", "FedProx: add the proximal term mu/2 ||w - w_global||^2 locally."
        ),
        "mu": field(
            0.01,
            "float",
            "Proximal coefficient mu (0 = FedAvg, bit for bit); Li et al. use 0.001 to 1.",
            min=0.0,
        ),
    },
}
