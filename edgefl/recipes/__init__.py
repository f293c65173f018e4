"""Shipped configs that train real data well, with the accuracy each one reaches.

Each recipe is a TOML file in this package (``edgefl/recipes/<name>.toml``). Run one with
``edgefl simulate recipe:<name>`` (any command or function that takes a config file takes
``recipe:<name>``, e.g. ``edgefl.simulate("recipe:digits-cnn-iid")``), or copy it with
``edgefl recipes show <name> > my.toml`` and edit it. :data:`RECIPES` records what each one
reached on the virtual clock of ``edgefl simulate`` (seed 0; the same figures on every
x86-64 machine with AVX2, portable kernels); ``tests/test_recipes.py`` holds them within
one point, and docs/real-data.md prints :func:`table_markdown`.

Pure: no torch, no MPI (the config loader imports it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
PREFIX = "recipe:"


@dataclass(frozen=True)
class Recipe:
    """One shipped config and what it reached.

    Args:
        name: the file's stem (``recipe:<name>``).
        accuracy: final test accuracy (fraction) of the run, seed 0.
        best: the best test accuracy of any round, and that round.
        virtual_s: virtual seconds the run's clock reached at its last round.
        heavy: a minute or more of CPU on one core (the CNN on 28x28 images): its test in
            ``tests/test_recipes.py`` runs only with ``EDGEFL_SLOW=1``.
    """

    name: str
    accuracy: float
    best: tuple[float, int]
    virtual_s: float
    heavy: bool = False

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.toml"

    @property
    def what(self) -> str:
        """The description in the file's first line."""
        first = self.path.read_text(encoding="utf-8").splitlines()[0]
        return first.split(": ", 1)[1] if ": " in first else first

    @property
    def rounds(self) -> int:
        return int(_toml(self.path)["run"]["rounds"])


# measured with `edgefl simulate recipe:NAME` (seed 0, portable kernels; the test re-runs
# each one in one process, the same model as over MPI)
RECIPES: tuple[Recipe, ...] = (
    Recipe("digits-cnn-dirichlet", 0.9359, (0.9387, 29), 3.760),
    Recipe("digits-cnn-iid", 0.9582, (0.9582, 25), 1.678),
    Recipe("digits-mlp-dirichlet", 0.9276, (0.9276, 28), 1.707),
    Recipe("digits-mlp-iid", 0.9248, (0.9248, 29), 1.125),
    Recipe("mnist-cnn-dirichlet", 0.9500, (0.9500, 30), 8.620, heavy=True),
    Recipe("mnist-cnn-iid", 0.9480, (0.9490, 23), 3.598, heavy=True),
    Recipe("mnist-mlp-dirichlet", 0.9080, (0.9190, 19), 2.81),
    Recipe("mnist-mlp-iid", 0.9180, (0.9180, 18), 1.85),
    Recipe("mnist1d-mlp-dirichlet", 0.6070, (0.6200, 17), 8.347),
    Recipe("mnist1d-mlp-iid", 0.6220, (0.6280, 21), 4.762),
)


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def names() -> list[str]:
    """The recipes' names, sorted."""
    return sorted(p.stem for p in HERE.glob("*.toml"))


def path(spec: str) -> Path:
    """The file of ``recipe:<name>`` (or of a bare name); an unknown one is a ConfigError
    listing the recipes."""
    name = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    found = HERE / f"{name}.toml"
    if name not in names():
        raise ConfigError(f"no recipe '{name}' (recipes: {', '.join(names())}; edgefl recipes)")
    return found


def is_recipe(spec: object) -> bool:
    """Whether a config argument names a recipe (``recipe:<name>``)."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def stem(spec: str) -> str:
    """The run directory's name part of a recipe spec: its name."""
    return spec[len(PREFIX) :]


def table_markdown() -> str:
    """The recipes as a Markdown table (docs/real-data.md)."""
    lines = [
        "| recipe | what | rounds | final accuracy | best (round) | virtual s |",
        "|---|---|---|---|---|---|",
    ]
    for r in RECIPES:
        lines.append(
            f"| `recipe:{r.name}` | {r.what} | {r.rounds} | {r.accuracy:.4f} | "
            f"{r.best[0]:.4f} ({r.best[1]}) | {r.virtual_s:.1f} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["RECIPES", "Recipe", "is_recipe", "names", "path", "stem", "table_markdown"]
