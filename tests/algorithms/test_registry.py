"""One registry (issue 26): BUILTIN lists the built-in plugins; their config sections reach
the schema through an entry point, so the config layer names no plugin."""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint

import pytest

import edgefl.algorithms as algorithms
from edgefl.config import SCHEMA
from edgefl.config import schema as schema_module


def test_the_schema_holds_every_builtin_section_after_algorithm_in_builtin_order():
    sections = algorithms.config_sections()
    keys = list(SCHEMA)
    at = keys.index("algorithm") + 1
    assert keys[at : at + len(sections)] == list(sections)
    assert all(SCHEMA[k] is sections[k] for k in sections)


def test_each_builtin_class_declares_the_sections_of_its_package_or_module():
    for spec in algorithms.BUILTIN:
        mod, _, name = f"edgefl.algorithms.{spec}".partition(":")
        cls = getattr(importlib.import_module(mod), name)
        where = algorithms._config_module(spec)
        try:
            want = getattr(importlib.import_module(where), "SECTIONS", {})
        except ModuleNotFoundError:
            want = {}
        if spec.startswith("fedbn") or not want:
            assert cls.sections == {}, spec
        else:
            assert cls.sections is want, spec


def test_a_one_module_algorithm_is_its_own_config_module():
    assert algorithms._config_module("fedprox:FedProx") == "edgefl.algorithms.fedprox"
    assert algorithms._config_module("gddr.plugin:GDDR") == "edgefl.algorithms.gddr.config"


def test_the_builtin_sections_come_through_the_installed_entry_point():
    eps = {
        e.name: e.value for e in importlib.metadata.entry_points(group=schema_module.SECTIONS_GROUP)
    }
    assert eps.get("builtin") == "edgefl.algorithms:config_sections"


def _with(monkeypatch, *eps: tuple[str, str]) -> None:
    fake = [EntryPoint(n, v, schema_module.SECTIONS_GROUP) for n, v in eps]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: fake)


def _extra():
    return {"mytool": {}}


def _clash():
    return {"run": {}}


def test_another_package_may_add_a_section_after_the_builtins(monkeypatch):
    _with(
        monkeypatch, ("zz", f"{__name__}:_extra"), ("builtin", "edgefl.algorithms:config_sections")
    )
    got = schema_module.plugin_sections()
    assert list(got)[-1] == "mytool" and list(got)[:-1] == list(algorithms.config_sections())


def test_a_section_that_shadows_a_core_one_is_refused_in_one_line(monkeypatch):
    _with(
        monkeypatch, ("builtin", "edgefl.algorithms:config_sections"), ("x", f"{__name__}:_clash")
    )
    with pytest.raises(ImportError) as e:
        schema_module.plugin_sections()
    assert "\n" not in str(e.value) and "[run]" in str(e.value) and "core" in str(e.value)


def test_without_edgefls_own_entry_point_the_error_says_to_reinstall(monkeypatch):
    _with(monkeypatch)
    with pytest.raises(ImportError, match=r"\(re\)install edgefl"):
        schema_module.plugin_sections()
