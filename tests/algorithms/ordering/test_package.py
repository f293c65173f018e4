"""edgefl.algorithms.ordering (the package): documented and a built-in plugin package."""

from __future__ import annotations

import edgefl.algorithms.ordering
from edgefl.algorithms import BUILTIN, builtin_classes


def test_the_package_documents_its_orderings_and_messages():
    doc = edgefl.algorithms.ordering.__doc__
    for part in ("CD-GraB", "D-RR", "ID-GraB", "algorithm.ordering", "ORDER", "GRADS"):
        assert part in doc


def test_the_package_is_a_built_in_plugin_package():
    assert "ordering.plugin:Ordering" in BUILTIN
    cls = next(c for c in builtin_classes() if c.name == "ordering")
    assert cls.__module__ == "edgefl.algorithms.ordering.plugin"
    # after hermes: its allocation and gate are what ordering refuses
    assert BUILTIN.index("ordering.plugin:Ordering") > BUILTIN.index("hermes.plugin:Hermes")
