"""Algorithms as plugins: one package or module per algorithm, loaded by the runtime core.

A big built-in algorithm lives in its own package here, with its pure modules (no MPI),
its coordinator half, its worker half and its config check side by side; a small one is
one module holding both halves, its config section and its plugin class:

- :mod:`edgefl.algorithms.hermes`: HermesGUP gate, dynamic allocation, loss-weighted
  aggregation, the WI / API metrics;
- :mod:`edgefl.algorithms.gddr`: residual buffers, adaptive tau, replay of dead devices;
- :mod:`edgefl.algorithms.ordering`: CD-GraB, D-RR, ID-GraB example orders;
- :mod:`edgefl.algorithms.ps`: parameter-server pushes and pulls (filters, compression,
  key caching, working-set pulls);
- :mod:`edgefl.algorithms.robust`: the norm-bound update filter;
- :mod:`edgefl.algorithms.fedprox`: FedProx's proximal term on local training (one module:
  a small algorithm holds both halves and its config section in one file);
- :mod:`edgefl.algorithms.scaffold`: SCAFFOLD's server and client control variates;
- :mod:`edgefl.algorithms.fedeval`: federated (per-device) evaluation with user metrics.

A user's plugin is a :class:`~edgefl.algorithms.base.Plugin` subclass named in
``algorithm.plugins = ["module:Class"]`` (docs/write-your-own-algorithm.md).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from .base import CoordinatorPlugin, Plugin, Requirement, WorkerPlugin
from .context import CoordinatorContext, WorkerContext
from .hooks import check_owners

# The registry: the built-in plugins, "module:Class" under edgefl.algorithms. Adding a
# built-in is its package (or module) and one line here: its config section (a package's
# config.py SECTIONS, a one-module algorithm's own) reaches the schema through
# config_sections. The order of the lines gives the
# order of the config sections (docs/configuration.md) and nothing else: hooks run in
# each class's declared ``order`` (tests/test_builtin_order.py shuffles this tuple and
# checks that no golden model changes).
BUILTIN = (
    "hermes.plugin:Hermes",
    "gddr.plugin:GDDR",
    "ordering.plugin:Ordering",
    "ps.plugin:ParameterServer",
    "robust.plugin:NormBound",
    "dp.plugin:DP",
    "fedeval.plugin:FederatedEvaluation",
    "fedprox:FedProx",
    "scaffold:Scaffold",
    "fedbn:ModelBuffers",
    "fedbn:FedBN",
    "clientmetrics:ClientMetrics",
)


def _config_module(spec: str) -> str | None:
    """Where a built-in's ``SECTIONS`` live: a package's ``config`` module, or the module
    itself for a one-module algorithm (``"fedprox:FedProx"``)."""
    mod = spec.partition(":")[0]
    if "." in mod:
        return f"{__name__}.{mod.partition('.')[0]}.config"
    return f"{__name__}.{mod}"


def config_sections() -> dict[str, Any]:
    """The config sections of the built-in plugins: each package's ``config.py``
    ``SECTIONS`` (a package without one has none), or a one-module algorithm's own
    ``SECTIONS``, in BUILTIN order. The schema takes them through the entry point
    ``edgefl.config_sections`` (setup.cfg), so the config layer names no plugin; only
    light modules are imported here (no torch: a one-module algorithm imports it where a
    task needs it)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(_config_module(spec) for spec in BUILTIN):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        if not hasattr(mod, "SECTIONS"):
            continue
        for section, fields in mod.SECTIONS.items():
            if section in out:
                raise ImportError(f"config section [{section}] is declared by two packages")
            out[section] = fields
    return out


def _import(spec: str, where: str) -> type[Plugin]:
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ConfigError(f"config key '{where}': {spec!r} is not 'module:Class'")
    try:
        obj = getattr(importlib.import_module(mod), name)
    except ImportError as e:
        raise ConfigError(f"config key '{where}': cannot import {mod!r}: {e}") from None
    except AttributeError:
        raise ConfigError(f"config key '{where}': module {mod!r} has no {name!r}") from None
    except Exception as e:  # a plugin module that fails while importing: one line
        raise ConfigError(
            f"config key '{where}': importing {mod!r} failed: {type(e).__name__}: {e}"
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, Plugin)):
        raise ConfigError(
            f"config key '{where}': {spec!r} is not a subclass of edgefl.algorithms.Plugin"
        )
    return obj


def builtin_classes() -> list[type[Plugin]]:
    """Every built-in plugin class, in plugin order (:attr:`Plugin.order`)."""
    classes = [_import(f"{__name__}.{s}", "algorithm (built-in)") for s in BUILTIN]
    return sorted(classes, key=lambda c: (c.order, c.name))


def load(cfg: dict) -> list[type[Plugin]]:
    """The plugin classes a job runs, in plugin order: the enabled built-ins and
    ``algorithm.plugins``, sorted by :attr:`Plugin.order` (a tie keeps the listed order,
    the built-ins first). Refuses two plugins of one name, a reserved name, two handlers of
    one message kind and two owners of one decision (:func:`hooks.check_owners`)."""
    out = [c for c in builtin_classes() if c.enabled(cfg)]
    for i, spec in enumerate(cfg["algorithm"].get("plugins", [])):
        c = _import(spec, f"algorithm.plugins[{i}]")
        if not isinstance(getattr(c, "order", None), int) or isinstance(c.order, bool):
            raise ConfigError(
                f"config key 'algorithm.plugins[{i}]': {spec!r}: order must be an int, "
                f"not {c.order!r}"
            )
        out.append(c)
    out.sort(key=lambda c: c.order)  # (stable: ties keep their place)
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"config key 'algorithm.plugins': plugin name(s) {dup} used twice")
    if RESERVED & set(names):
        raise ConfigError(
            f"config key 'algorithm.plugins': plugin name(s) {sorted(RESERVED & set(names))} "
            "are reserved for the runtime"
        )
    _check_kinds(out)
    check_owners(out)
    return out


RESERVED = frozenset({"runtime"})  # names the runtime's own checkpoint entries use


def _check_kinds(classes: list[type[Plugin]]) -> None:
    """Two plugins must not handle the same message kind (one would silently win)."""
    seen: dict[tuple[bool, int], str] = {}
    for c in classes:
        for half in (c.coordinator, c.worker):
            if half is None:
                continue
            kinds = (*getattr(half, "update_kinds", ()), *half.message_kinds)
            for k in kinds:
                key = (half is c.worker, int(k))
                other = seen.get(key)
                if other is not None and other != c.name:
                    raise ConfigError(
                        f"config key 'algorithm.plugins': plugins '{other}' and '{c.name}' "
                        f"both handle message kind {k!r}"
                    )
                seen[key] = c.name


def plugin_requirements(cfg: dict) -> list[tuple[str, Requirement]]:
    """(plugin name, requirement) of every built-in plugin, on or off (each requirement
    has its own trigger key, e.g. ``ps.filters`` without ``ps.sparse``), then of every
    plugin listed in ``algorithm.plugins``."""
    classes = builtin_classes()
    for i, spec in enumerate(cfg["algorithm"].get("plugins", [])):
        classes.append(_import(spec, f"algorithm.plugins[{i}]"))
    return [(c.name, r) for c in classes for r in getattr(c, "requires", ())]


def check_requirements(cfg: dict, requirements: list[tuple[str, Requirement]]) -> None:
    """The shared checker of declared requirements: the first one ``cfg`` breaks raises a
    one-line ConfigError naming its trigger key, the key it needs and why
    (:meth:`Requirement.error`)."""
    for _owner, r in requirements:
        if not r.holds(cfg):
            raise ConfigError(r.error(cfg))


def check_config(cfg: dict) -> None:
    """Every plugin's declared requirements, then its own config check (ConfigError naming
    the key)."""
    check_requirements(cfg, plugin_requirements(cfg))
    for c in load(cfg):
        try:
            c.check_config(cfg)
        except ConfigError:
            raise
        except Exception as e:  # a user's plugin: one line, not a traceback
            raise ConfigError(f"plugin '{c.name}': check_config failed: {e}") from None


def coordinator_plugins(ctx: CoordinatorContext) -> list[CoordinatorPlugin]:
    """The coordinator halves of the job whose config is ``ctx.cfg``, each handed ``ctx``."""
    return [c.coordinator(ctx, c.name) for c in load(dict(ctx.cfg)) if c.coordinator is not None]


def worker_plugins(ctx: WorkerContext) -> list[WorkerPlugin]:
    """The worker halves of the job whose config is ``ctx.cfg``, each handed ``ctx``."""
    return [c.worker(ctx, c.name) for c in load(dict(ctx.cfg)) if c.worker is not None]


def worker_keeps_state(cfg: dict) -> bool:
    """Does some worker half of the job keep per-device state for checkpoints?"""
    return any(
        c.worker is not None and c.worker.device_state is not WorkerPlugin.device_state
        for c in load(cfg)
    )


def summary_defaults() -> dict[str, Any]:
    """summary.json keys of the built-in plugins when they are off (so every summary has
    the same keys)."""
    out: dict[str, Any] = {}
    for c in builtin_classes():
        out.update(getattr(c, "summary_keys", {}))
    return out


__all__ = [
    "BUILTIN",
    "CoordinatorContext",
    "CoordinatorPlugin",
    "Plugin",
    "WorkerContext",
    "WorkerPlugin",
    "builtin_classes",
    "check_config",
    "config_sections",
    "check_requirements",
    "coordinator_plugins",
    "load",
    "plugin_requirements",
    "summary_defaults",
    "worker_keeps_state",
    "worker_plugins",
]
