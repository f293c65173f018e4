"""The config section(s) of the dp plugin (merged into the schema, edgefl/config/schema.py;
documented in docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "dp": {
        "enabled": field(False, "bool", "Client-level DP (DP-FedAvg) on the aggregated mean."),
        "clip": field(1.0, "float", "Per-update L2 clip norm C.", min=0.0, exclusive_min=True),
        "noise_multiplier": field(1.0, "float", "z: noise std on the mean is z C / n.", min=0.0),
        "delta": field(
            1e-5,
            "float",
            "delta at which epsilon is reported.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
    },
}
