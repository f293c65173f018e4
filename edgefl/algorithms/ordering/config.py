"""The config section(s) of the ordering plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "ordering": {
        "sketch_dim": field(
            0, "int", "Project each gradient to this many dimensions (0 = exact).", min=0
        ),
        "sketch_kind": field(
            "countsketch",
            "str",
            "Projection: countsketch or gaussian.",
            choices=("countsketch", "gaussian"),
        ),
        "unit": field(
            "example",
            "str",
            "Unit of ordering: example or microbatch.",
            choices=("example", "microbatch"),
        ),
        "microbatch": field(1, "int", "Examples per unit when unit = microbatch.", min=1),
        "ship": field(
            "step",
            "str",
            "When workers send their gradient rows: step (after every step, balanced as they "
            "arrive) or epoch (one message at the end; always so for microbatch units).",
            choices=("step", "epoch"),
        ),
        "save_debug": field(
            False, "bool", "Rank 0 saves each epoch's gradients and orders (ordering/*.npz)."
        ),
    },
}
