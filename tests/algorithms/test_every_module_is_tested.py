"""Every module under edgefl/algorithms is named (imported by its dotted name) by a unit test
that runs without MPI: a plugin half can be tested alone (tests/algorithms/fakes.py), so
none is left to whole runs only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "edgefl" / "algorithms"


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _unit_test_sources() -> str:
    """The text of every test module with tests that launch no MPI job (not every test of
    it marked ``mpi``)."""
    texts = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        tests = len(re.findall(r"^def test_", text, re.M))
        mpi = len(re.findall(r"^@(MPI|pytest\.mark\.mpi)\b", text, re.M))
        if tests > mpi and not re.search(r"^pytestmark\s*=.*mark\.mpi", text, re.M):
            texts.append(text)
    return "\n".join(texts)


def _named(module: str, text: str) -> bool:
    parent, _, leaf = module.rpartition(".")
    direct = rf"^\s*(from|import)\s+{re.escape(module)}(\s|$)"
    via_parent = rf"^\s*from\s+{re.escape(parent)}\s+import\s+\(?[^)]*?\b{re.escape(leaf)}\b"
    return bool(re.search(direct, text, re.M) or re.search(via_parent, text, re.M | re.S))


def test_every_module_under_edgefl_algorithms_is_named_by_a_unit_test():
    text = _unit_test_sources()
    missing = [m for m in _modules() if not _named(m, text)]
    assert not missing, f"modules no unit test imports by name: {missing}"


def test_the_check_finds_what_it_looks_for():
    assert "edgefl.algorithms.hooks" in _modules() and "edgefl.algorithms" in _modules()
    assert _named("edgefl.algorithms.ps.worker", "from edgefl.algorithms.ps.worker import X")
    assert _named(
        "edgefl.algorithms.ps.worker", "from edgefl.algorithms.ps import (\n a,\n worker,\n)"
    )
    assert not _named("edgefl.algorithms.ps.worker", "from edgefl.algorithms.ps.workset import X")
