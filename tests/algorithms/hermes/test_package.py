"""edgefl.algorithms.hermes (the package): importable, documented, and a built-in plugin."""

from __future__ import annotations

import edgefl.algorithms.hermes
from edgefl.algorithms import BUILTIN, builtin_classes


def test_the_package_documents_its_modules():
    doc = edgefl.algorithms.hermes.__doc__
    for part in ("algorithm.gate", "algorithm.allocation", ".coordinator", ".worker"):
        assert part in doc


def test_the_package_is_a_built_in_plugin_package():
    assert "hermes.plugin:Hermes" in BUILTIN
    names = [c.name for c in builtin_classes()]
    assert "hermes" in names
    cls = next(c for c in builtin_classes() if c.name == "hermes")
    assert cls.__module__ == "edgefl.algorithms.hermes.plugin"
