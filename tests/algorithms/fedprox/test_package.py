"""edgefl.algorithms.fedprox (the package): documented, and a built-in plugin."""

from __future__ import annotations

import importlib

import edgefl.algorithms.fedprox
from edgefl.algorithms import BUILTIN, builtin_classes


def test_the_package_documents_its_rule_and_the_hook_it_uses():
    doc = edgefl.algorithms.fedprox.__doc__
    assert "mu * (w - w_global)" in doc and "FitContext.grad_hooks" in doc
    for mod in ("config", "plugin", "proximal", "worker"):
        importlib.import_module(f"edgefl.algorithms.fedprox.{mod}")


def test_the_package_provides_a_built_in_plugin():
    assert "fedprox.plugin:FedProx" in BUILTIN
    cls = next(c for c in builtin_classes() if c.name == "fedprox")
    assert cls.__module__ == "edgefl.algorithms.fedprox.plugin"
