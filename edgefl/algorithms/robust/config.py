"""The config section(s) of the robust plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "robust": {
        "trim_fraction": field(
            0.1, "float", "trimmed-mean: fraction dropped at each end of every coordinate."
        ),
        "krum_f": field(-1, "int", "krum/multi-krum: assumed Byzantine devices f (-1 = unset)."),
        "multi_krum_m": field(0, "int", "multi-krum: updates averaged (0 = n - f).", min=0),
        "clip_norm": field(
            0.0, "float", "norm-clip: clip norm C (0 = the round's median norm).", min=0.0
        ),
        "norm_bound": field(
            0.0, "float", "Update filter: absolute L2 bound on an update (0 = off).", min=0.0
        ),
        "norm_bound_relative": field(
            0.0,
            "float",
            "Update filter: bound as a multiple (>= 1) of the round's median norm (0 = off).",
            min=0.0,
        ),
        "norm_bound_mode": field(
            "reject",
            "str",
            "Update filter: reject or clip an update above the bound.",
            choices=("reject", "clip"),
        ),
    },
}
