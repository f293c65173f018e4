"""Loading plugins by ``algorithm.plugins``: a hostile or broken plug-in is refused before
any rank starts with one line naming the key, never a traceback (no MPI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from edgefl.algorithms import load
from edgefl.comm.wire import DType, register_kind
from edgefl.config import load_config
from edgefl.errors import ConfigError


def _cfg(*plugins: str) -> dict:
    return load_config(overrides=[f"algorithm.plugins={list(plugins)!r}".replace("'", '"')])


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("hostile_")]:
        del sys.modules[name]


def _module(folder, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text), encoding="utf-8")


@pytest.mark.parametrize(
    "body, needle",
    [
        ("raise RuntimeError('boom at import')", "importing 'hostile_a' failed: RuntimeError"),
        ("def broken(:\n    pass\n", "importing 'hostile_a' failed: SyntaxError"),
        ("import no_such_module_here\n", "cannot import 'hostile_a'"),
    ],
)
def test_a_module_failing_at_import_is_one_line(plugin_dir, body, needle):
    _module(plugin_dir, "hostile_a", body)
    with pytest.raises(ConfigError) as e:
        load(_cfg("hostile_a:P"))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "algorithm.plugins[0]" in str(e.value)


def test_reserved_and_duplicate_names_are_refused(plugin_dir):
    _module(
        plugin_dir,
        "hostile_b",
        """
        from edgefl.algorithms import Plugin

        class Runtime(Plugin):
            name = "runtime"

        class Hermes2(Plugin):
            name = "hermes"
    """,
    )
    with pytest.raises(ConfigError, match="reserved for the runtime"):
        load(_cfg("hostile_b:Runtime"))
    with pytest.raises(ConfigError, match=r"\['hermes'\] used twice"):
        load(_cfg("hostile_b:Hermes2"))


def test_two_owners_of_one_message_kind_are_refused(plugin_dir):
    _module(
        plugin_dir,
        "hostile_c",
        """
        from edgefl.algorithms import Plugin, WorkerPlugin
        from edgefl.algorithms.ordering.kinds import ORDER

        class Steal(WorkerPlugin):
            message_kinds = (ORDER,)

        class Thief(Plugin):
            name = "thief"
            worker = Steal
    """,
    )
    cfg = load_config(overrides=['algorithm.ordering="cd-grab"',
                                 'algorithm.plugins=["hostile_c:Thief"]'])  # fmt: skip
    with pytest.raises(ConfigError, match="plugins 'ordering' and 'thief' both handle"):
        load(cfg)
    load(_cfg("hostile_c:Thief"))  # without example ordering nobody else owns ORDER


def test_register_kind_refuses_a_taken_code_or_name_and_is_idempotent():
    k = register_kind("TEST_TALLY", 64, "up", {DType.FLOAT64}, "any")
    assert register_kind("TEST_TALLY", 64, "up", {DType.FLOAT64}, "any") is k
    assert k.name == "TEST_TALLY" and int(k) == 64
    with pytest.raises(ValueError, match="taken by TEST_TALLY"):
        register_kind("OTHER", 64, "up", {DType.FLOAT64}, "any")
    with pytest.raises(ValueError, match="code 7 of X is taken by ORDER"):
        import edgefl.algorithms.ordering.kinds  # noqa: F401

        register_kind("X", 7, "down", {DType.INT32}, "any")
    with pytest.raises(ValueError, match="name TEST_TALLY is taken"):
        register_kind("TEST_TALLY", 65, "up", {DType.FLOAT64}, "any")


def test_every_plugin_module_imports_first_in_a_fresh_interpreter():
    """A user's script may import a built-in's module before anything else of edgefl (e.g.
    ``from edgefl.algorithms.hermes.plugin import Hermes``): that must not meet a
    half-initialised config module (the schema is built from the plugins' sections)."""
    code = (
        "import importlib, sys\n"
        "from edgefl.algorithms import BUILTIN\n"
        "mods = sorted({'edgefl.algorithms.' + s.partition(':')[0] for s in BUILTIN})\n"
        "for m in mods + ['edgefl.config.fields', 'edgefl.algorithms.hooks']:\n"
        "    for k in [k for k in sys.modules if k.startswith('edgefl')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module(m)\n"
        "print(len(mods))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) >= 10
