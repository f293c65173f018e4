"""Layering of the edgefl package, checked on its import graph.

Every module under ``edgefl/`` is parsed with :mod:`ast` (nothing is imported); every
``import`` / ``from ... import`` statement counts, also inside functions and under
``if TYPE_CHECKING:``, with relative imports resolved. ``from X import name`` is an edge
to ``X.name`` when that is a module, else to ``X``. Edges are between modules (a package is
its ``__init__``); importing ``a.b.c`` does not count as importing the packages ``a.b``.

Rules:

(a) no import cycle among edgefl modules (an import under ``if TYPE_CHECKING:`` is for
    annotations only and does not count here; it counts for every other rule);
(b) ``edgefl.ckpt`` (the bottom layer) imports nothing from edgefl but ``edgefl.errors``,
    ``edgefl.config`` and itself;
(c) the pure algorithm modules ``edgefl.policies`` never reach ``edgefl.comm``,
    ``edgefl.runtime`` or ``mpi4py``, directly or through other edgefl modules;
(d) no module imports a ``_private`` name from another edgefl module;
(e) ``edgefl.config`` never reaches the launch layers (``edgefl.api``, ``edgefl.cli``,
    ``edgefl.launching``, ``edgefl.preflight``, ``edgefl.launcher``), directly or through
    other edgefl modules;
(f) ``edgefl.launcher`` (mpiexec, the exit statuses; imported by the runtime and the
    benches) never reaches the launch layers above it;
(g) plugins see the run only through their context: no module under
    ``edgefl.algorithms`` imports from ``edgefl.runtime`` (but ``compose``, the
    composition matrix, its policy checks) or reaches the runtime core (coordinator,
    worker, their contexts), and none reads an attribute named ``core``;
(h) the runtime's helper modules call no private method of the object they serve
    (``core._x(...)``);
(i) ``edgefl.config`` imports nothing from ``edgefl.algorithms`` (the plugins' sections come
    through the registry's entry point).

Known violations of the runtime restructure in progress are allowed edge by edge in
:data:`KNOWN_RUNTIME_EDGES`; any other violation fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "edgefl"

# (importer, imported) edges that break a rule today, outside the pure layers (policies,
# ckpt) and owned by the runtime restructure in progress, which removes them. Do not add to
# this list: fix the import instead. An entry whose edge is gone is harmless (delete it).
KNOWN_RUNTIME_EDGES: frozenset[tuple[str, str]] = frozenset()


# -- the graph ----------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every edgefl module name -> its file."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package(name: str) -> str:
    """The package a module's relative imports start from."""
    return name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]


def _resolve(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(name).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _owner(target: str) -> str | None:
    """The edgefl module a dotted name lives in (the longest module prefix), or None."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules():
            return cand
    return None


@cache
def imports_of(name: str) -> tuple[tuple[str, str | None, int], ...]:
    """(imported module or dotted name, name imported from it or None, line) of every
    import statement of module ``name``; targets outside edgefl are kept as written."""
    return parse_imports(name, modules()[name].read_text(encoding="utf-8"))


def parse_imports(name: str, source: str) -> tuple[tuple[str, str | None, int], ...]:
    """:func:`imports_of` for ``source`` as the text of module ``name``."""
    tree = ast.parse(source, str(modules()[name]))
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(name, node)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if a.name != "*" and sub in modules():
                    out.append((sub, None, node.lineno))  # a submodule
                else:
                    out.append((src, a.name, node.lineno))
    return tuple(sorted(set(out), key=lambda t: (t[2], t[0], t[1] or "")))


@cache
def type_only_lines(name: str) -> frozenset[int]:
    """Lines of module ``name``'s imports under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(modules()[name].read_text(encoding="utf-8"), str(modules()[name]))
    out: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
            for sub in node.body:
                out |= {
                    n.lineno for n in ast.walk(sub) if isinstance(n, ast.Import | ast.ImportFrom)
                }
    return frozenset(out)


@cache
def graph(annotations: bool = True) -> dict[str, dict[str, int]]:
    """module -> {imported edgefl module: first line}, self-imports left out (without the
    annotation-only imports unless ``annotations``)."""
    g: dict[str, dict[str, int]] = {}
    for name in modules():
        edges: dict[str, int] = {}
        skip = frozenset() if annotations else type_only_lines(name)
        for target, _, line in imports_of(name):
            if line in skip:
                continue
            owner = _owner(target) if target.split(".")[0] == "edgefl" else None
            if owner is not None and owner != name:
                edges.setdefault(owner, line)
        g[name] = edges
    return g


def checked_graph(annotations: bool = True) -> dict[str, dict[str, int]]:
    """:func:`graph` without the allowed known edges."""
    return {
        m: {t: ln for t, ln in e.items() if (m, t) not in KNOWN_RUNTIME_EDGES}
        for m, e in graph(annotations).items()
    }


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _where(m: str, t: str) -> str:
    return f"{m} -> {t} ({modules()[m].relative_to(ROOT.parent)}:{graph()[m][t]})"


# -- (a) cycles ---------------------------------------------------------------------------
def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (m0, m1, ..., m0) per strongly connected component with a cycle
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))
    return [_cycle_in(g, comp) for comp in sorted(sccs)]


def _cycle_in(g: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {comp}")


def test_no_import_cycles():
    found = cycles(checked_graph(annotations=False))
    lines = [
        " -> ".join(c) + "\n    " + "\n    ".join(_where(a, b) for a, b in zip(c, c[1:]))
        for c in found
    ]
    assert not found, "import cycles among edgefl modules:\n  " + "\n  ".join(lines)


# -- (b) ckpt at the bottom ---------------------------------------------------------------
CKPT_MAY_IMPORT = ("edgefl.errors", "edgefl.config", "edgefl.ckpt")


def test_ckpt_imports_only_errors_config_and_itself():
    bad = [
        _where(m, t)
        for m, edges in checked_graph().items()
        if _in(m, "edgefl.ckpt")
        for t in edges
        if not any(_in(t, ok) for ok in CKPT_MAY_IMPORT)
    ]
    assert not bad, "edgefl.ckpt imports from higher layers:\n  " + "\n  ".join(bad)


# -- (c) pure policies --------------------------------------------------------------------
POLICIES_MAY_NOT_REACH = ("edgefl.comm", "edgefl.runtime")
FORBIDDEN_THIRD_PARTY = ("mpi4py",)


def _path_to(g: dict[str, dict[str, int]], start: str, goal) -> list[str] | None:
    """A shortest import chain from ``start`` to a module for which ``goal`` holds."""
    prev: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            if goal(v) and v != start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])  # type: ignore[arg-type]
                return path[::-1]
            for w in sorted(g[v]):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def _imports_third_party(m: str, top: str) -> bool:
    return any(t.split(".")[0] == top for t, _, _ in imports_of(m))


def test_policies_never_reach_comm_runtime_or_mpi():
    g = checked_graph()
    bad = []
    for m in sorted(g):
        if not _pure(m):
            continue
        for pkg in POLICIES_MAY_NOT_REACH:
            path = _path_to(g, m, lambda v, pkg=pkg: _in(v, pkg))
            if path:
                bad.append(" -> ".join(path))
        for top in FORBIDDEN_THIRD_PARTY:
            path = _path_to(g, m, lambda v, top=top: _imports_third_party(v, top))
            if path or _imports_third_party(m, top):
                bad.append(" -> ".join([*(path or [m]), top]))
    assert not bad, "a pure module reaches the runtime layers:\n  " + "\n  ".join(bad)


def _pure(m: str) -> bool:
    """edgefl.policies and the algorithm packages' own modules (not their plugin halves,
    ``coordinator`` / ``worker``, nor the packages' ``__init__`` that wires them)."""
    if _in(m, "edgefl.policies"):
        return True
    parts = m.split(".")
    return (
        len(parts) == 4
        and parts[:2] == ["edgefl", "algorithms"]
        and parts[3] not in ("coordinator", "worker", "kinds", "plugin")
    )


def test_the_pure_modules_include_the_algorithm_packages():
    g = checked_graph()
    pure = {m for m in g if _pure(m)}
    assert "edgefl.algorithms.gddr.residual" in pure and "edgefl.policies.consistency" in pure
    assert "edgefl.algorithms.gddr.coordinator" not in pure and "edgefl.algorithms" not in pure


# -- (d) private names --------------------------------------------------------------------
def private_imports() -> list[tuple[str, str, str, int]]:
    """(importer, module, name, line) of every ``from X import _name`` with X another
    edgefl module (dunder names and submodules are not private names)."""
    out = []
    for m in modules():
        for target, name, line in imports_of(m):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            owner = _owner(target) if target.split(".")[0] == "edgefl" else None
            if owner is not None and owner != m:
                out.append((m, owner, name, line))
    return out


def test_no_private_names_imported_across_modules():
    bad = [
        f"{m}:{line} imports {name} from {owner}"
        for m, owner, name, line in private_imports()
        if (m, owner) not in KNOWN_RUNTIME_EDGES
    ]
    assert not bad, "private names imported from other modules:\n  " + "\n  ".join(bad)


# -- (e), (f) the launch layers on top ----------------------------------------------------
LAUNCH_LAYERS = (
    "edgefl.api",
    "edgefl.cli",
    "edgefl.launching",
    "edgefl.preflight",
    "edgefl.launcher",
)


def _reaching(g: dict[str, dict[str, int]], package: str, targets: tuple[str, ...]) -> list[str]:
    """Import chains from a module of ``package`` to one of ``targets``."""
    bad = []
    for m in sorted(g):
        if _in(m, package):
            path = _path_to(g, m, lambda v: v in targets and not _in(v, package))
            if path:
                bad.append(" -> ".join(path))
    return bad


def test_config_never_reaches_the_launch_layers():
    bad = _reaching(checked_graph(), "edgefl.config", LAUNCH_LAYERS)
    assert not bad, "edgefl.config reaches the launch layers:\n  " + "\n  ".join(bad)


def test_config_imports_no_plugin():
    """(i) The schema takes the plugins' sections from the registry through an entry point
    (config/schema.py: plugin_sections): no config module imports edgefl.algorithms."""
    g = checked_graph()
    bad = [_where(m, t) for m in sorted(g) if _in(m, "edgefl.config")
           for t in g[m] if _in(t, "edgefl.algorithms")]  # fmt: skip
    assert not bad, "edgefl.config imports plugins:\n  " + "\n  ".join(bad)


def test_launcher_never_reaches_the_layers_above_it():
    above = tuple(m for m in LAUNCH_LAYERS if m != "edgefl.launcher")
    bad = _reaching(checked_graph(), "edgefl.launcher", above)
    assert not bad, "edgefl.launcher reaches the launch layers:\n  " + "\n  ".join(bad)


# -- the checker itself -------------------------------------------------------------------
def test_the_graph_sees_relative_lazy_and_submodule_imports():
    g = graph()
    assert "edgefl.policies.aggregation" in g["edgefl.algorithms.robust.rules"]  # from .aggregation
    assert "edgefl.ckpt.store" in g["edgefl.algorithms.gddr.store"]  # absolute
    lazy = "import numpy\ndef f():\n    if x:\n        from ..ckpt import store\n"
    assert parse_imports("edgefl.policies.consistency", lazy) == (
        ("numpy", None, 1),
        ("edgefl.ckpt.store", None, 4),  # inside a function, relative, a submodule
    )
    assert "edgefl.ckpt.describe" in g["edgefl.ckpt"]  # a package's __init__
    assert (
        "edgefl.config.checks" in g["edgefl.algorithms.hermes.gate"]
    )  # from ..config import checks
    assert "edgefl.config" not in g["edgefl.algorithms.hermes.gate"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c", "a"]
    ]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


# -- (g), (h) plugins and their context -----------------------------------------------------
RUNTIME_CORE = ("edgefl.runtime.coordinator", "edgefl.runtime.worker", "edgefl.runtime.contexts")


def test_plugins_never_import_the_runtime():
    g = checked_graph()
    bad = []
    for m in sorted(g):
        if not _in(m, "edgefl.algorithms"):
            continue
        direct = sorted(v for v in g[m] if _in(v, "edgefl.runtime"))
        if direct and m != "edgefl.algorithms.compose":
            bad += [f"{m} -> {v}" for v in direct]
        path = _path_to(g, m, lambda v: v in RUNTIME_CORE)
        if path:
            bad.append(" -> ".join(path))
    assert not bad, "a plugin module reaches the runtime:\n  " + "\n  ".join(bad)


def _attribute_reads(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == name]


def test_plugins_hold_a_context_not_the_core():
    bad = [
        f"{p.relative_to(ROOT.parent)}:{line}"
        for m, p in modules().items()
        if _in(m, "edgefl.algorithms")
        for line in _attribute_reads(p, "core")
    ]
    assert not bad, "plugin code reads an attribute named core:\n  " + "\n  ".join(bad)


def test_runtime_helpers_call_no_private_method_of_the_core():
    bad = []
    for m, p in modules().items():
        if not _in(m, "edgefl.runtime"):
            continue
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id == "core"
                and n.func.attr.startswith("_")
            ):
                bad.append(f"{p.relative_to(ROOT.parent)}:{n.lineno} core.{n.func.attr}()")
    assert not bad, "runtime helpers call private methods:\n  " + "\n  ".join(bad)
