"""The config section(s) of the hermes plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "hermes": {
        "alpha": field(-1.3, "float", "Z-score threshold of a major update (< 0)."),
        "window": field(10, "int", "Losses in the window, the current one included (>= 2).", min=2),
        "lam": field(5, "int", "Minor updates before the threshold starts relaxing.", min=0),
        "beta": field(0.1, "float", "Relaxation per minor update beyond lam, in [0, 1).", min=0.0),
        "reset_alpha": field(False, "bool", "Restore alpha after each major update."),
        "test": field(
            "zscore",
            "str",
            "Significance test: zscore or percentile.",
            choices=("zscore", "percentile"),
        ),
        "percentile": field(10.0, "float", "p of the percentile test, in percent (0, 50]."),
        "wait_for_model": field(
            True, "bool", "After a push, wait for the new global model (only true is supported)."
        ),
        "broadcast": field(
            "pusher",
            "str",
            "Who gets the new global model after a push: pusher, or all (every gated device "
            "adopts it at its next local iteration).",
            choices=("pusher", "all"),
        ),
        "softmax_temperature": field(0.5, "float", "Temperature of loss-softmax aggregation."),
        "softmax_buffer": field(4, "int", "Major updates kept by loss-softmax.", min=1),
        "holdout_fraction": field(
            0.2,
            "float",
            "Fraction of each device's samples held out for its local loss (the GUP signal).",
            min=0.0,
            max=0.9,
            exclusive_min=True,
        ),
        "max_local_iterations": field(
            100,
            "int",
            "A device pushes anyway after this many local iterations without a major update "
            "(0 = never).",
            min=0,
        ),
    },
    "allocation": {
        "warmup": field(1, "int", "Measurements before a device can be re-allocated.", min=1),
        "initial_fraction": field(
            0.3,
            "float",
            "hermes: a device's first D as a fraction of its training samples (room to grow).",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "smoothing": field(0.3, "float", "EMA weight of the newest step-time estimate (0, 1]."),
        "max_change": field(0.5, "float", "Largest relative change of D per step (0, 1]."),
        "tolerance": field(0.1, "float", "Relative distance to T* that counts as on target."),
        "fence": field(1.5, "float", "Tukey fence multiplier of the IQR.", min=0.0),
        "trigger": field(
            "fences",
            "str",
            "Who is re-allocated: fences (outliers only) or always.",
            choices=("fences", "always"),
        ),
    },
}
