"""edgefl.algorithms.gddr (the package): its documented modules exist; it is a built-in."""

from __future__ import annotations

import importlib

import edgefl.algorithms.gddr
from edgefl.algorithms import BUILTIN, builtin_classes


def test_every_module_the_package_docstring_names_imports():
    doc = edgefl.algorithms.gddr.__doc__
    assert 'algorithm.residual = "gddr"' in doc
    for mod in ("residual", "tau", "replay", "store", "coordinator", "worker"):
        assert f":mod:`.{mod}`" in doc
        importlib.import_module(f"edgefl.algorithms.gddr.{mod}")


def test_the_package_provides_a_built_in_plugin():
    assert "gddr.plugin:GDDR" in BUILTIN
    cls = next(c for c in builtin_classes() if c.name == "gddr")
    assert cls.__module__ == "edgefl.algorithms.gddr.plugin"
