"""edgefl.algorithms.dp (the package): documented, its modules importable, no plugin of its
own (DP-FedAvg is a choice of the aggregation axis)."""

from __future__ import annotations

import importlib

import edgefl.algorithms.dp
from edgefl.algorithms import BUILTIN


def test_every_module_the_package_docstring_names_imports():
    doc = edgefl.algorithms.dp.__doc__
    assert "dp.enabled" in doc and "dp.sampling" in doc
    for mod in ("dpfedavg", "accounting"):
        assert f":mod:`.{mod}`" in doc
        importlib.import_module(f"edgefl.algorithms.dp.{mod}")
    importlib.import_module("edgefl.algorithms.dp.config")


def test_dp_is_not_a_built_in_plugin():
    assert not any(spec.startswith("dp.") for spec in BUILTIN)
