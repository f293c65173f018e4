"""Where the config of a simulation comes from: :func:`config_source` and
:func:`config_doc` turn :func:`edgefl.simulate`'s ``config`` (a path, a dict with dotted
keys or sections, None) into what :func:`edgefl.config.load_config` reads;
:func:`override_list` its ``overrides`` into ``--set`` texts; :func:`simulation_config`
the effective config ``edgefl simulate`` and :func:`edgefl.simulate` run, and its rank
count; :func:`main_specs` the values naming objects of ``__main__``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .ranks import rank_count

# how a config value names an object of the caller's __main__ ("__main__:Net"; any key)
_MAIN = "__main__:"


def config_source(config: Any) -> tuple[str | None, dict | None, str]:
    """(path, doc, name for the default run directory) of ``simulate``'s ``config``."""
    if config is None:
        return None, None, "default"
    if isinstance(config, str) and config.startswith("recipe:"):  # (edgefl.recipes)
        return config, None, config[len("recipe:") :]
    if isinstance(config, (str, os.PathLike)):
        return str(config), None, Path(config).stem
    if isinstance(config, Mapping):
        return None, config_doc(config), "config"
    raise TypeError(f"config: expected a path, a dict or None, not {type(config).__name__}")


def config_doc(config: Mapping[str, Any]) -> dict:
    """A config dict with dotted keys expanded into sections (``{"a.b": 1}`` ->
    ``{"a": {"b": 1}}``) and classes/functions replaced by their ``'module:qualname'``.
    A key given twice (dotted and nested) is a ConfigError."""
    doc: dict = {}

    def put(node: dict, parts: list[str], value: Any, where: str) -> None:
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"config key '{where}': '{part}' is a value, not a table")
            node = nxt
        last = parts[-1]
        if isinstance(value, Mapping):
            sub = node.setdefault(last, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"config key '{where}' is given twice")
            for k, v in value.items():
                _check_key(k, f"{where}.")
                put(sub, str(k).split("."), v, f"{where}.{k}")
        else:
            if last in node:
                raise ConfigError(f"config key '{where}' is given twice")
            node[last] = python_value(value, where)

    for key, value in config.items():
        _check_key(key, "")
        put(doc, key.split("."), value, key)
    return doc


def _check_key(key: Any, prefix: str) -> None:
    if not isinstance(key, str) or not key or "" in key.split("."):
        raise ConfigError(f"config key {prefix}{key!r}: expected a dotted name like 'run.rounds'")


def python_value(value: Any, key: str) -> Any:
    """``value`` with every class or function (also inside lists and dicts) replaced by
    its ``'module:qualname'`` spec; ConfigError naming ``key`` for one that cannot be
    imported by name (defined inside a function)."""
    if isinstance(value, type) or inspect.isfunction(value):
        qual = value.__qualname__
        if "<" in qual:  # <locals>, <lambda>
            raise ConfigError(
                f"config key '{key}': {qual} cannot be imported by name (defined inside a "
                "function or a lambda); define it at the top level of a module or notebook"
            )
        return f"{value.__module__}:{qual}"
    if isinstance(value, (list, tuple)):
        return [python_value(v, key) for v in value]
    if isinstance(value, Mapping):
        return {k: python_value(v, f"{key}.{k}") for k, v in value.items()}
    return value


def override_list(overrides: Mapping[str, Any] | None) -> list[str]:
    """``{"run.rounds": 3}`` as ``--set`` texts (``["run.rounds=3"]``), so they go through
    exactly the CLI's validation. A value TOML cannot hold (None, an object) is a
    ConfigError naming the key."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides: expected a dict of dotted keys, not {type(overrides).__name__}"
        )
    from .load import dump_config

    out = []
    for key, value in overrides.items():
        _check_key(key, "")
        value = python_value(value, key)
        try:  # (dump_config writes a key outside the schema as one TOML line)
            text = dump_config({"v": value}).split("=", 1)[1].strip()
        except TypeError:
            raise ConfigError(
                f"config key '{key}' = {value!r}: expected a string, number, boolean, list or dict"
            ) from None
        out.append(f"{key}={text}")
    return out


def simulation_config(
    path: str | None, overrides: list[str], doc: dict | None = None
) -> tuple[dict, int]:
    """The effective config ``edgefl simulate`` runs (``sim.clock`` auto -> virtual,
    relative profile files made absolute) and its MPI rank count (``fleet.ranks``, capped so
    that no worker rank is idle). Raises ConfigError for a bad config.

    Also pins ``run.kernels`` in this process's environment (:func:`edgefl.kernels.pin`),
    before anything here loads torch: the pre-launch check, the in-process backend and
    every rank launched from here (they inherit the environment) compute alike."""
    from .. import kernels
    from .load import load_config, with_values

    cfg = load_config(path, overrides, doc=doc)
    kernels.pin(cfg["run"]["kernels"])  # (a line if torch already ran: run_inline says it)
    effective: dict = {}
    if cfg["sim"]["clock"] == "auto":
        effective["sim.clock"] = "virtual"
    prof = cfg["sim"]["profiles"]
    if prof.endswith((".toml", ".csv")) and not Path(prof).is_absolute():
        effective["sim.profiles"] = str(Path(prof).resolve())  # the ranks read the run's copy
    cfg = with_values(cfg, effective)
    ranks = rank_count(cfg)  # (server shard ranks 1..servers: docs/parameter-server.md)
    if cfg["ps"]["servers"]:
        from ..runtime.policies import check_shards

        check_shards(cfg, ranks)
    return cfg, ranks


def main_specs(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(config key, value) of every string in ``cfg`` naming an object of ``__main__``."""
    found: list[tuple[str, str]] = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            found += main_specs(v, f"{prefix}{k}.")
    elif isinstance(cfg, list):
        for v in cfg:
            found += main_specs(v, prefix)
    elif isinstance(cfg, str) and cfg.startswith(_MAIN):
        found.append((prefix.rstrip("."), cfg))
    return found
