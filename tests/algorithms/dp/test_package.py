"""edgefl.algorithms.dp (the package): documented, its modules importable; its plugin only
registers the [dp] section (DP-FedAvg is a choice of the aggregation axis)."""

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


def test_the_dp_plugin_has_no_halves_and_owns_the_dp_section():
    from edgefl.algorithms.dp.config import SECTIONS
    from edgefl.algorithms.dp.plugin import DP

    from ..fakes import config

    assert "dp.plugin:DP" in BUILTIN
    assert DP.coordinator is None and DP.worker is None and DP.sections is SECTIONS
    assert not DP.enabled(config()) and DP.enabled(config(None, "dp.enabled=true"))
