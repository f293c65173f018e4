"""Generates the configuration reference (``docs/configuration.md``) from the schema."""

from __future__ import annotations

import json

from .schema import DEFAULT_ARGS, SCHEMA, Field

HEADER = """# Configuration reference

Generated from `edgefl/config/schema.py` by `edgefl config docs`; a test fails when this page
and the schema disagree. A config is a TOML file; every key is optional and falls back to the
default below. Override any key on the command line with `--set section.key=value` (the value
is read as TOML, e.g. `--set model.args.hidden=[128,64]`), and print the effective config
with `edgefl config show [CONFIG]`.

Errors name the key: an unknown key suggests the closest valid one, a wrong type or range
states the expectation, and the command exits with status 2 (`edgefl simulate` checks the
config, data source and model in a pre-launch check, before the job starts or writes
anything).
"""


def _default(f: Field) -> str:
    if f.type == "table" and not f.default:
        return "`{}`"
    return "`" + json.dumps(f.default) + "`"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range(f: Field) -> str:
    parts = []
    if f.auto:
        parts.append("auto")
    if f.choices:
        parts.append(" \\| ".join(f.choices))
    if f.min is not None:
        parts.append(f"{'>' if f.exclusive_min else '>='} {_num(f.min)}")
    if f.max is not None:
        parts.append(f"<= {_num(f.max)}")
    return ", ".join(parts)


def reference_markdown() -> str:
    """The whole reference page as Markdown."""
    out = [HEADER]
    top = [(k, v) for k, v in SCHEMA.items() if isinstance(v, Field)]
    sections = [(k, v) for k, v in SCHEMA.items() if not isinstance(v, Field)]
    for name, fields in [("(top level)", dict(top))] + sections:
        title = name if name.startswith("(") else f"[{name}]"
        out.append(f"\n## {title}\n")
        out.append("| key | type | default | allowed | meaning |")
        out.append("|---|---|---|---|---|")
        for key, f in fields.items():
            out.append(f"| `{key}` | {f.type} | {_default(f)} | {_range(f)} | {f.doc} |")
    out.append("\n## Default arguments of built-in sources and models\n")
    out.append(
        "Keys of `[data.args]` / `[model.args]` that a config does not give take these "
        "values (then the source's or model's own defaults).\n"
    )
    for section, table in DEFAULT_ARGS.items():
        for name, args in table.items():
            out.append(f"- `{section}` `{name}`: `{json.dumps(args)}`")
    return "\n".join(out) + "\n"
