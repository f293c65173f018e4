"""The config section of federated evaluation (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import field

SECTIONS = {
    "evaluation": {
        "every": field(
            0,
            "int",
            "Federated evaluation every K global versions: each device evaluates the global "
            "model its task starts from on its own held-out split (0 = off).",
            min=0,
        ),
        "holdout": field(
            0.2,
            "float",
            "Fraction of each device's samples held out from training for federated "
            "evaluation, in (0, 1) (with a gate, hermes.holdout_fraction is used instead).",
            min=0.0,
            exclusive_min=True,
        ),
        "final": field(
            True,
            "bool",
            "With federated evaluation on (every > 0): at the end, every live device also "
            "evaluates the final global model on its held-out split (summary.json "
            "fed_eval.final, per device), whatever every divides.",
        ),
        "metrics": field(
            [],
            "list[str]",
            "User metrics, each 'package.module:function' (output, target) -> per-example "
            "values; reported as their sample-weighted mean (docs/evaluation.md).",
        ),
    },
}
