"""Loading, overriding, validating and printing configurations (TOML)."""

from __future__ import annotations

import difflib
import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import ConfigError
from .schema import DEFAULT_ARGS, SCHEMA, Field, defaults, iter_fields

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "list[int]": "a list of integers",
    "list[str]": "a list of strings",
    "table": "a table",
}


def _where(source: str | None) -> str:
    return f" (in {source})" if source else ""


def _unknown_key(path: str, source: str | None) -> ConfigError:
    valid = [p for p, _ in iter_fields()]
    sections = sorted({p.rsplit(".", 1)[0] for p in valid if "." in p})
    close = difflib.get_close_matches(path, valid + sections, n=1, cutoff=0.6)
    if not close:
        leaf = path.rsplit(".", 1)[-1]
        close = [p for p in valid if p.rsplit(".", 1)[-1] == leaf][:1]
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"config key '{path}'{_where(source)}: unknown key{hint}")


def _check_value(path: str, f: Field, value: Any, source: str | None) -> Any:
    """Return the value coerced to the field's type, or raise ConfigError naming key and value."""

    def bad(expect: str) -> ConfigError:
        return ConfigError(f"config key '{path}' = {value!r}{_where(source)}: expected {expect}")

    t = f.type
    if f.auto and value == "auto":
        return value
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(_TYPE_WORDS[t] + (' or "auto"' if f.auto else ""))
    elif t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(_TYPE_WORDS[t])
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range
            raise bad("a finite number") from None
        if not math.isfinite(value):
            raise bad("a finite number")
    elif t == "bool":
        if not isinstance(value, bool):
            raise bad(_TYPE_WORDS[t])
    elif t == "str":
        if not isinstance(value, str):
            raise bad(_TYPE_WORDS[t])
    elif t.startswith("list["):
        inner = t[5:-1]
        ok = isinstance(value, list) and all(
            (isinstance(v, int) and not isinstance(v, bool))
            if inner == "int"
            else isinstance(v, str)
            for v in value
        )
        if not ok:
            raise bad(_TYPE_WORDS[t])
    elif t == "table":
        if not isinstance(value, dict):
            raise bad(_TYPE_WORDS[t])
        odd = _unwritable(value)
        if odd is not None:
            raise bad(f"plain values (string, number, boolean, list, table), not {odd}")
    if f.choices is not None:
        items = value if isinstance(value, list) else [value]
        for v in items:
            if v not in f.choices:
                raise bad("one of " + ", ".join(f.choices))
    if t in ("int", "float"):
        if f.min is not None and (value < f.min or (f.exclusive_min and value == f.min)):
            raise bad(f"a value {'>' if f.exclusive_min else '>='} {f.min:g}")
        if f.max is not None and value > f.max:
            raise bad(f"a value <= {f.max:g}")
    return value


def _unwritable(value: Any) -> str | None:
    """Name the first value inside a free table that edgefl cannot write back (e.g. a date)."""
    if isinstance(value, dict):
        for v in value.values():
            odd = _unwritable(v)
            if odd:
                return odd
        return None
    if isinstance(value, list):
        for v in value:
            odd = _unwritable(v)
            if odd:
                return odd
        return None
    if isinstance(value, (bool, int, float, str)):
        return None
    return f"a {type(value).__name__}"


def _merge(
    cfg: dict, doc: dict, schema: dict, prefix: str, source: str | None, seen: set[str]
) -> None:
    for key, value in doc.items():
        path = f"{prefix}{key}"
        seen.add(path)
        spec = schema.get(key)
        if spec is None:
            raise _unknown_key(path, source)
        if isinstance(spec, Field):
            cfg[key] = _check_value(path, spec, value, source)
        else:
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{path}' = {value!r}{_where(source)}: expected a table [{path}]"
                )
            _merge(cfg[key], value, spec, path + ".", source, seen)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``--set a.b=value`` override. The value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=0.1")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except ValueError:  # TOMLDecodeError, or an integer of over 4300 digits
        value = raw
    return key, value


def _nest(path: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = path.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def _check_override_path(path: str) -> None:
    node: Any = SCHEMA
    for i, part in enumerate(path.split(".")):
        if isinstance(node, Field):
            if node.type == "table":  # a key inside a free-form table
                return
            raise _unknown_key(path, "--set")
        if part not in node:
            raise _unknown_key(path, "--set")
        node = node[part]
        if i == len(path.split(".")) - 1 and not isinstance(node, Field):
            raise ConfigError(f"--set {path}: '{path}' is a section, not a key")


def read_toml(path: str | Path) -> dict:
    """Read a TOML file; missing file, a directory or bad syntax gives a ConfigError naming
    the file. A file without any setting warns on stderr (the run is the built-in job).
    ``recipe:<name>`` reads the shipped recipe of that name (:mod:`edgefl.recipes`)."""
    from .. import recipes

    p = recipes.path(path) if recipes.is_recipe(path) else Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{path}' is a directory, not a TOML file")
    if not p.is_file():
        raise ConfigError(f"config file '{path}' not found")
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
        if not doc:
            print(
                f"edgefl: warning: config file '{path}' sets nothing: the built-in defaults "
                "apply (edgefl config show prints them)",
                file=sys.stderr,
            )
        return doc
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}': invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}': not UTF-8 text") from None
    except ValueError as e:  # tomllib: an integer of over 4300 digits
        raise ConfigError(f"config file '{path}': invalid TOML: {e}") from None


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    doc: dict | None = None,
) -> dict:
    """Build the effective config: defaults, then the file (or ``doc``), then ``--set`` overrides.

    Raises ConfigError naming the key path for unknown keys, wrong types and out-of-range
    values.
    """
    cfg = defaults()
    seen: set[str] = set()
    if path is not None:
        _merge(cfg, read_toml(path), SCHEMA, "", str(path), seen)
    if doc is not None:
        _merge(cfg, doc, SCHEMA, "", "config", seen)
    overrides = list(overrides or [])
    for section, key in (("data", "source"), ("model", "name")):
        # a free args table starts from the named source's/model's edgefl defaults
        name = cfg[section][key]
        for text in overrides:
            k, v = parse_override(text)
            if k == f"{section}.{key}":
                name = v
        given = cfg[section]["args"] if f"{section}.args" in seen else {}
        cfg[section]["args"] = {**DEFAULT_ARGS[section].get(name, {}), **given}
    for text in overrides:
        key, value = parse_override(text)
        _check_override_path(key)
        top = key.split(".")
        node: Any = SCHEMA
        for part in top:
            node = node[part] if isinstance(node, dict) else node
            if isinstance(node, Field):
                break
        if isinstance(node, Field) and node.type == "table" and len(top) > 2:
            # --set data.args.alpha=0.3 sets one key of a free table
            table_path = ".".join(top[:2])
            sub = cfg[top[0]][top[1]]
            for part in top[2:-1]:
                sub = sub.setdefault(part, {})
                if not isinstance(sub, dict):
                    raise ConfigError(
                        f"--set {key}: '{part}' in '{table_path}' is a value, not a table"
                    )
            sub[top[-1]] = value
            _check_value(table_path, node, cfg[top[0]][top[1]], "--set")
        else:
            _merge(cfg, _nest(key, value), SCHEMA, "", "--set", seen)
    _cross_checks(cfg)
    return cfg


def config_from_toml(text: str, source: str = "config") -> dict:
    """Validate a config given as TOML text (e.g. the copy stored in a checkpoint)."""
    try:
        doc = tomllib.loads(text)
    except ValueError as e:  # TOMLDecodeError, or an integer of over 4300 digits
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    return load_config(doc=doc)


def _is_torch_device(d: str) -> bool:
    return d in ("cpu", "cuda") or (d.startswith("cuda:") and _ascii_digits(d[5:]))


def _ascii_digits(s: str) -> bool:
    """True for a non-empty run of 0-9 (str.isdigit() also accepts e.g. superscripts)."""
    return s.isascii() and s.isdigit()


def _cross_checks(cfg: dict) -> None:
    dev = cfg["fleet"]["device"]
    if not (dev == "auto" or _is_torch_device(dev)):
        raise ConfigError(
            f"config key 'fleet.device' = {dev!r}: expected auto, cpu, cuda or cuda:N"
        )
    for k, v in cfg["fleet"]["device_map"].items():
        if not _ascii_digits(str(k)) or int(k) >= cfg["fleet"]["devices"]:
            raise ConfigError(
                f"config key 'fleet.device_map' has key {k!r}: expected a device id in "
                f"0..{cfg['fleet']['devices'] - 1}"
            )
        if not isinstance(v, str) or not _is_torch_device(v):
            raise ConfigError(
                f"config key 'fleet.device_map.{k}' = {v!r}: expected cpu, cuda or cuda:N"
            )


# -- writing ------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        r = repr(v)
        return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"
    if isinstance(v, str):
        return '"' + "".join(_escape(c) for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


_BARE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ESC = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(c: str) -> str:
    """One character of a TOML basic string (control characters as \\uXXXX)."""
    if c in _ESC:
        return _ESC[c]
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04x}"
    return c


def _toml_key(k: str) -> str:
    k = str(k)
    return k if k and set(k) <= _BARE else _toml_value(k)


def dump_config(cfg: dict) -> str:
    """Render a config dict as TOML text (readable back by :func:`load_config`)."""
    lines = []
    tables = []
    for key, val in cfg.items():
        if isinstance(val, dict) and isinstance(SCHEMA.get(key), dict):
            tables.append((key, val))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(val)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{name}]")
        for key, val in table.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(val)}")
    return "\n".join(lines) + "\n"


def with_values(cfg: dict, changes: dict[str, Any]) -> dict:
    """A copy of config ``cfg`` with dotted ``changes`` (``{"sim.clock": "wall"}``) applied;
    ``cfg`` itself is left as it was. The commands use it to resolve what the config leaves
    open ("auto") into the effective config the ranks run with."""
    import copy

    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node[part]
        if last not in node:
            raise KeyError(f"config key '{key}' does not exist")
        node[last] = value
    return out
