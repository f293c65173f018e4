"""The ps package (edgefl.algorithms.ps) as the runtime finds it: a built-in plugin that
is on only for sparse pushes or working-set pulls."""

from __future__ import annotations

import edgefl.algorithms.ps as ps_pkg
from edgefl.algorithms import BUILTIN, builtin_classes, load
from edgefl.algorithms.ps.plugin import ParameterServer

from ..fakes import config


def test_the_package_is_the_builtin_ps_plugin():
    assert "ps.plugin:ParameterServer" in BUILTIN
    (cls,) = [c for c in builtin_classes() if c.name == "ps"]
    assert cls is ParameterServer
    assert cls.__module__.startswith(ps_pkg.__name__ + ".")


def test_the_package_documents_its_modules():
    for mod in (":mod:`.compress`", ":mod:`.filters`", ":mod:`.workset`", ":mod:`.coordinator`"):
        assert mod in ps_pkg.__doc__


def test_the_runtime_loads_it_only_when_a_ps_option_is_on():
    assert ParameterServer not in load(config())
    assert ParameterServer in load(config(None, "ps.sparse=true"))
    assert ParameterServer in load(config(None, "ps.pull=working-set", "model.name=logreg"))
