"""The config section(s) of the dp plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "dp": {
        "enabled": field(False, "bool", "Client-level DP (DP-FedAvg) on the aggregated mean."),
        "clip": field(1.0, "float", "Per-update L2 clip norm C.", min=0.0, exclusive_min=True),
        "noise_multiplier": field(
            1.0,
            "float",
            "z: noise std on the sum of clipped updates is z C (z C / m on the mean of m).",
            min=0.0,
        ),
        "delta": field(
            1e-5,
            "float",
            "delta at which epsilon is reported.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "sampling": field(
            "fixed",
            "str",
            "How a round's devices are drawn and accounted (dp-accounting): fixed = "
            "round(q N) of the N devices without replacement, replace-one adjacency; poisson "
            "= each device independently with probability q = server.participation, "
            "add/remove-one adjacency (docs/robustness.md).",
            choices=("fixed", "poisson"),
        ),
    },
}
