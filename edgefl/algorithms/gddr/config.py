"""The config section(s) of the gddr plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "gddr": {
        "alpha": field(0.4, "float", "Probability a coordinate is withheld at a step [0, 1)."),
        "tau": field(4, "int", "Most steps a value may wait (start value when adaptive).", min=1),
        "adaptive": field(
            False, "bool", "Let the coordinator adapt tau within [tau_min, tau_max]."
        ),
        "tau_min": field(2, "int", "Lower bound of adaptive tau.", min=1),
        "tau_max": field(8, "int", "Upper bound of adaptive tau.", min=1),
        "installments": field(1, "int", "Installments a released residual is paid in.", min=1),
        "installment_ratio": field(0.5, "float", "Ratio between consecutive installments (0, 1]."),
        "checkpoint_every": field(
            5, "int", "Device steps between residual checkpoints (0 = never).", min=0
        ),
        "replay_decay": field(0.5, "float", "Ratio between consecutive replay amounts (0, 1)."),
        "replay_steps": field(5, "int", "Coordinator steps a dead device's replay spans.", min=1),
    },
}
