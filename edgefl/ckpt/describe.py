"""Human-readable summary of a checkpoint file (for ``edgefl inspect``)."""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
from typing import Any

from edgefl.ckpt.plan import Node, decode_leaf, short_value, unescape_key
from edgefl.ckpt.store import read_checkpoint
from edgefl.config.code import named_code

MAX_CHILDREN = 8  # entries listed per nested group before eliding the middle
MAX_TOP = 40  # entries listed at the top level before eliding
MAX_LINES = 200  # tree lines before the listing is cut


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    exp = min(int(math.log(nbytes, 1024)), 4)
    return f"{nbytes / 1024**exp:.1f} {'BKMGT'[exp]}iB".replace("BiB", "B")


def _leaf_text(node: Node) -> str:
    data = node.data
    assert data is not None
    if node.kind in ("ndarray", "npscalar"):
        shape = "x".join(str(d) for d in data.shape) if data.ndim else "scalar"
        text = f"{data.dtype.name}[{shape}] {_size(data.nbytes)}"
        if data.size and data.dtype.kind in "biuf" and data.size <= 4:
            text += f" = {short_value(data.tolist(), 40)}"
        elif data.size and data.dtype.kind in "iuf":
            text += f" (min {data.min():.4g}, max {data.max():.4g})"
        return text
    try:
        value = decode_leaf(node.kind, data)
    except ValueError:
        return f"{node.kind} (malformed)"
    if node.kind == "list":
        return f"list[{len(value)}] {short_value(value, 60)}"
    if node.kind in ("str", "bytes"):
        return f"{node.kind}[{len(value)}] {short_value(value, 60)}"
    return f"{node.kind} {short_value(value)}"


def _layouts(nodes: list[Node]) -> list[str]:
    """Lines for groups holding ``names``/``shapes`` lists (a model layout), if any."""
    by_path = {n.names: n for n in nodes}
    lines = []
    for node in nodes:
        if node.names[-1] != "names" or node.kind != "list":
            continue
        shapes = by_path.get((*node.names[:-1], "shapes"))
        if shapes is None or shapes.kind != "list":
            continue
        try:
            names = decode_leaf("list", node.data)  # type: ignore[arg-type]
            dims = decode_leaf("list", shapes.data)  # type: ignore[arg-type]
            params = sum(math.prod(s) for s in dims)
        except (ValueError, TypeError):
            continue
        where = "/" + "/".join(node.names[:-1])
        lines.append(f"model layout at {where}: {len(names)} tensors, {params} parameters")
    return lines


def describe_checkpoint(path: str | os.PathLike, ck: Any = None) -> str:
    """Multi-line summary: header (format version, write time, sizes, counts, what was
    verified), recognised sections (``round``, model layouts) and the key tree with dtypes,
    shapes and scalar values (long groups and strings are elided).

    Everything is verified first, as ``load_checkpoint`` does (commit trailer SHA-256,
    commit marker, format_version, crc32 of every dataset, the resume schema of a run's
    checkpoint): a bad file raises CheckpointError (one line) and nothing is described.
    """
    ck = read_checkpoint(path) if ck is None else ck  # (``ck``: the caller's read of it)
    nodes = ck.nodes
    leaves = [n for n in nodes if n.kind != "group"]
    arrays = [n for n in leaves if n.kind == "ndarray"]
    lines = [f"checkpoint {ck.path}"]
    lines.append(
        f"  format_version {ck.format_version}, complete, written {_when(ck.created_unix_s)}, "
        f"file {_size(ck.size)}, sha256 and crc32 verified"
    )
    lines.append(
        "  verified proves integrity, not origin: the file is intact as sealed, but anyone "
        "can edit a checkpoint and seal it again (the digest is no signature)"
    )
    if ck.content == "run":
        lines.append("  a run's checkpoint: every entry a resume reads is present and well-typed")
        lines += _code_lines(ck.state)
    else:
        lines.append("  a plain state, not a run's checkpoint (--resume refuses it)")
    lines.append(
        f"  {len(nodes) - len(leaves)} groups, {len(arrays)} arrays "
        f"({_size(sum(n.data.nbytes for n in arrays))}), {len(leaves) - len(arrays)} other leaves"
    )
    top = {n.names[0]: n for n in nodes if len(n.names) == 1}
    rnd = top.get("round")
    if rnd is not None and rnd.kind == "int":
        lines.append(f"  round: {decode_leaf('int', rnd.data)}")  # type: ignore[arg-type]
    lines += ["  " + s for s in _layouts(nodes)]
    numerics = checkpoint_numerics(nodes)
    if numerics:
        lines.append(f"  numerics: {numerics_text(numerics)}")
    lines.append("tree:")
    lines += _tree(nodes)
    return "\n".join(lines)


def _code_lines(state: dict) -> list[str]:
    """The line naming the code a run's config names (``'package.module:attr'`` values a
    resume imports and calls: ``edgefl.trust``), if any."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    try:
        found = named_code(tomllib.loads(state["config_toml"]))
    except (KeyError, TypeError, ValueError):
        return []
    if not found:
        return []
    listed = ", ".join(f"{k} = {short_value(v, 60)}" for k, v in found[:MAX_CHILDREN])
    more = f" and {len(found) - MAX_CHILDREN} more" if len(found) > MAX_CHILDREN else ""
    return [
        f"  its config names code a resume imports and calls: {listed}{more} (--resume "
        "without a config file refuses it: pass the config file or --trust-checkpoint)"
    ]


def checkpoint_numerics(nodes: list) -> dict | None:
    """The fingerprint of the numerics a run's checkpoint was written with (the rank 0
    record of :func:`edgefl.kernels.fingerprint`), or None (an older checkpoint)."""
    import json

    node = next((n for n in nodes if n.names == ("numerics",) and n.kind == "str"), None)
    if node is None:
        return None
    try:
        doc = json.loads(decode_leaf("str", node.data))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return None
    return doc if isinstance(doc, dict) else None


def numerics_text(f: dict) -> str:
    """A fingerprint in one line."""
    threads = f.get("threads")
    return (
        f"kernels {f.get('kernels')}, torch {f.get('torch')}, CPU capability "
        f"{f.get('cpu_capability')}, MKL path {f.get('mkl_path')}, "
        + (f"BLAS {f['blas']}, " if f.get("blas") else "")
        + f"{threads} "
        f"thread{'s' if threads != 1 else ''}, {f.get('platform')} ({f.get('cpu')}), probe "
        f"{f.get('probe')}"
    )


def _when(created: float | None) -> str:
    try:
        stamp = dt.datetime.fromtimestamp(float(created), dt.timezone.utc)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, OSError):
        return "unknown time"
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def _tree(nodes: list[Node]) -> list[str]:
    children: dict[tuple[str, ...], list[Node]] = {}
    for n in nodes:
        children.setdefault(n.names[:-1], []).append(n)
    out: list[str] = []

    def key_text(name: str) -> str:
        key = unescape_key(name)
        return key if key.isprintable() and key.strip() == key and key else repr(key)

    def emit(parent: tuple[str, ...], depth: int) -> None:
        kids = children.get(parent, [])
        shown: list[Node | int] = list(kids)
        limit = MAX_TOP if depth == 0 else MAX_CHILDREN
        if len(kids) > limit:
            head = limit - 2
            shown = [*kids[:head], len(kids) - head - 2, *kids[-2:]]
        for item in shown:
            if len(out) >= MAX_LINES:
                return
            pad = "  " * (depth + 1)
            if isinstance(item, int):
                out.append(f"{pad}... {item} more entries")
            elif item.kind == "group":
                n_kids = len(children.get(item.names, []))
                out.append(f"{pad}{key_text(item.names[-1])}/ ({n_kids} entries)")
                emit(item.names, depth + 1)
            else:
                out.append(f"{pad}{key_text(item.names[-1])}: {_leaf_text(item)}")

    emit((), 0)
    if len(out) >= MAX_LINES:
        out.append(f"  ... listing cut at {MAX_LINES} lines")
    return out
