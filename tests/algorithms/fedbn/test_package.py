"""edgefl.algorithms.fedbn (the package): documented, and its two built-in plugins."""

from __future__ import annotations

import importlib

import edgefl.algorithms.fedbn
from edgefl.algorithms import BUILTIN, builtin_classes


def test_every_module_the_package_docstring_names_imports():
    doc = edgefl.algorithms.fedbn.__doc__
    assert 'model.buffers = "local"' in doc
    for mod in ("checks", "worker", "plugin"):
        assert f":mod:`.{mod}`" in doc
        importlib.import_module(f"edgefl.algorithms.fedbn.{mod}")


def test_the_package_provides_two_built_in_plugins_first_in_hook_order():
    assert {"fedbn.plugin:ModelBuffers", "fedbn.plugin:FedBN"} <= set(BUILTIN)
    names = [c.name for c in builtin_classes()]
    assert names[:2] == ["model_buffers", "fedbn"]
