"""The robust package (edgefl.algorithms.robust) as the runtime finds it: the norm-bound
plugin, on only when a bound is set."""

from __future__ import annotations

import edgefl.algorithms.robust as robust_pkg
from edgefl.algorithms import BUILTIN, builtin_classes, load
from edgefl.algorithms.robust.plugin import NormBound

from ..fakes import config


def test_the_package_is_the_builtin_norm_bound_plugin():
    assert "robust.plugin:NormBound" in BUILTIN
    (cls,) = [c for c in builtin_classes() if c.name == "norm_bound"]
    assert cls is NormBound and cls.__module__.startswith(robust_pkg.__name__ + ".")
    assert "robust.norm_bound" in robust_pkg.__doc__


def test_the_runtime_loads_it_only_when_a_bound_is_set():
    assert NormBound not in load(config())
    assert NormBound not in load(config(None, "algorithm.aggregation=median"))
    assert NormBound in load(config(None, "robust.norm_bound=2.0"))
    assert NormBound in load(config(None, "robust.norm_bound_relative=3.0"))
