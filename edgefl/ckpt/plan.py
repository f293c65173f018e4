"""Checkpoint planning: nested state dict <-> ordered list of typed nodes (no file I/O).

Every leaf becomes a contiguous numpy array plus a ``kind`` telling how to turn it back into
the original Python value; nested dicts become groups. Keys are escaped so that any string
(including ``"device/17"``) is a valid HDF5 link name.

``plan_tables`` is the plan ``save_checkpoint`` writes: the same nodes, but a group of many
alike sub-groups (``devices/<id>``) planned as one :class:`Table` whose rows are encoded
chunk by chunk while they are written, never all at once.
"""

from __future__ import annotations

import itertools
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np

#: Leaf kinds written into the ``kind`` attribute of each dataset.
KINDS = ("ndarray", "npscalar", "int", "bigint", "float", "bool", "str", "bytes", "list", "none")
_NUMERIC = "biufc"  # numpy dtype kinds accepted for arrays
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_EMPTY_KEY = "%empty"  # not a valid %XX escape, so it cannot collide with an escaped key


@dataclass(frozen=True)
class Node:
    """One entry of a plan: a group (``kind == "group"``, ``data is None``) or a leaf."""

    names: tuple[str, ...]  # escaped HDF5 link names from the root
    kind: str
    data: np.ndarray | None = None

    @property
    def path(self) -> str:
        """HDF5 path of the node, e.g. ``/devices/device%2F17/params``."""
        return "/" + "/".join(self.names)


_PLAIN = re.compile(r"[^%/\x00-\x1f\x7f\ud800-\udfff]+")  # keys that need no escape


def escape_key(key: str) -> str:
    """HDF5 link name for dict key ``key`` ('%', '/', control chars and '.' escaped)."""
    if key == "":
        return _EMPTY_KEY
    if key == ".":
        return "%2E"
    if _PLAIN.fullmatch(key):
        return key
    out = []
    for ch in key:
        code = ord(ch)
        if ch in "%/" or code < 32 or code == 127 or 0xD800 <= code <= 0xDFFF:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "".join(out)


def unescape_key(name: str) -> str:
    """Inverse of ``escape_key``."""
    if name == _EMPTY_KEY:
        return ""
    return unquote(name, errors="surrogatepass") if "%" in name else name


def crc32(arr: np.ndarray) -> int:
    """CRC-32 of the raw bytes of contiguous array ``arr``."""
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return zlib.crc32(arr.reshape(-1).view(np.uint8)) & 0xFFFFFFFF


def _text(b: bytes) -> np.ndarray:
    """``b`` as a read-only uint8 array over the same memory (no copy: a run's metrics
    history is one list leaf of tens of MB at a large fleet's checkpoint)."""
    return np.frombuffer(b, dtype=np.uint8)


def _jsonable_list(value: list, where: str) -> None:
    for item in value:
        if isinstance(item, list):
            _jsonable_list(item, where)
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            raise TypeError(
                f"checkpoint state {where}: lists may hold only str, int, float, bool, None "
                f"or lists of those, found {type(item).__name__}"
            )


def encode_leaf(value: Any, where: str | tuple[str, ...]) -> tuple[str, np.ndarray]:
    """(kind, contiguous array) for one leaf value; TypeError for unsupported values.
    ``where`` (the key path, or its link names) names the leaf in errors."""
    if isinstance(where, tuple):  # (joined only for an error: this runs for every leaf)
        if isinstance(value, (bool, int, float, str, type(None))):
            return _encode(value, "")
        where = "/" + "/".join(where)
    return _encode(value, where)


def _encode(value: Any, where: str) -> tuple[str, np.ndarray]:
    if value is None:
        return "none", np.zeros(0, dtype=np.uint8)
    if isinstance(value, bool):
        return "bool", np.array(value, dtype=np.bool_)
    if isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            return "int", np.array(value, dtype=np.int64)
        return "bigint", _text(str(int(value)).encode("ascii"))
    if isinstance(value, float):
        return "float", np.array(value, dtype=np.float64)
    if isinstance(value, str):
        return "str", _text(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", _text(bytes(value))
    if isinstance(value, list):
        _jsonable_list(value, where)
        return "list", _text(json.dumps(value, allow_nan=True).encode("ascii"))
    if isinstance(value, (np.ndarray, np.generic)):
        kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
        arr = np.asarray(value)  # keeps 0-d shape, unlike np.ascontiguousarray
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        if arr.dtype.kind not in _NUMERIC or arr.dtype.fields is not None:
            raise TypeError(
                f"checkpoint state {where}: numpy dtype {arr.dtype} is not numeric "
                "(bool/int/uint/float/complex)"
            )
        return kind, arr
    raise TypeError(f"checkpoint state {where}: unsupported value type {type(value).__name__}")


def decode_leaf(kind: str, data: np.ndarray) -> Any:
    """Python value for a stored leaf (inverse of ``encode_leaf``); ValueError if malformed."""
    if kind == "ndarray":
        return data
    if kind == "npscalar":
        return data[()]
    if kind == "none":
        return None
    if kind in ("int", "float", "bool"):
        if data.shape != ():
            raise ValueError(f"{kind} leaf has shape {data.shape}, expected a scalar")
        return {"int": int, "float": float, "bool": bool}[kind](data[()])
    raw = data.tobytes()
    if kind == "bigint":
        return int(raw.decode("ascii"))
    if kind == "str":
        return raw.decode("utf-8", "surrogatepass")
    if kind == "bytes":
        return raw
    if kind == "list":
        return json.loads(raw.decode("ascii"))
    raise ValueError(f"unknown leaf kind {kind!r}")


def plan_state(state: dict[str, Any]) -> list[Node]:
    """Flatten ``state`` into nodes in depth-first dict order (groups before their children).

    TypeError names the key path of any non-str key or unsupported leaf.
    """
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
    return list(_walk(state, ()))


def _walk(d: dict[str, Any], names: tuple[str, ...]) -> Iterator[Node]:
    for child, kind, arr in _entries(d, names):
        yield Node(child, kind, arr)


def _child(names: tuple[str, ...], key: Any) -> tuple[str, ...]:
    """The link names of ``key`` below ``names`` (keys of a checkpoint state must be str)."""
    if not isinstance(key, str):
        where = "/" + "/".join((*names, repr(key)))
        raise TypeError(f"checkpoint state {where}: keys must be str")
    return (*names, escape_key(key))


def _entries(
    d: dict[str, Any], names: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], str, np.ndarray | None]]:
    """(link names, kind, data) of every entry below ``d`` in depth-first dict order (groups,
    with data None, before their children): :func:`plan_state`'s walk, without the nodes."""
    for key, value in d.items():
        child = _child(names, key)
        if isinstance(value, dict):
            yield child, "group", None
            yield from _entries(value, child)
        else:
            kind, arr = encode_leaf(value, child)
            yield child, kind, arr


# ------------------------------------------------------------------------ tables, planned

#: leaf kinds stored in a table column as bytes of any length (the rest: fixed-size values)
VARIABLE = ("str", "bytes", "list", "bigint")
#: one column of a table: (names below the row, kind, "fixed" | "var" | "none", dtype str,
#: shape); dtype and shape are None unless "fixed"
Column = tuple[tuple[str, ...], str, str, "str | None", "tuple[int, ...] | None"]


def _column(rel: tuple[str, ...], kind: str, arr: np.ndarray | None) -> Column:
    if kind == "group" or kind == "none":
        return (rel, kind, "none", None, None)
    if kind in VARIABLE:
        return (rel, kind, "var", None, None)
    assert arr is not None
    return (rel, kind, "fixed", arr.dtype.str, arr.shape)


@dataclass(frozen=True)
class Table:
    """A group planned as a table (``edgefl.ckpt.store``): its rows are the sub-groups of
    the state's own dict ``rows``, all with the same entries (``columns``). Nothing of a row
    is kept: :meth:`chunks` encodes the rows again, a chunk at a time, when they are written,
    so writing needs memory for one chunk of rows, not for a node of every entry."""

    names: tuple[str, ...]  # the group's link names (its group node comes just before)
    rows: dict[str, dict]  # (the state's dict, not a copy)
    columns: tuple[Column, ...]
    var_bytes: tuple[int, ...]  # total bytes of each "var" column (0 for the others)

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' leaves (as a group per row would hold them)."""
        fixed = sum(
            np.dtype(c[3]).itemsize * int(np.prod(c[4], dtype=np.int64))
            for c in self.columns
            if c[2] == "fixed"
        )
        return fixed * self.n + sum(self.var_bytes)

    def row_names(self) -> list[str]:
        return [escape_key(k) for k in self.rows]

    def column_specs(self) -> list[list]:
        """The columns as the file's ``%columns`` lists them: [names, kind, "fixed", dtype,
        shape], [names, kind, "var"] or [names, kind, "none"]."""
        return [
            [list(rel), kind, how, dtype, list(shape)] if how == "fixed" else [list(rel), kind, how]
            for rel, kind, how, dtype, shape in self.columns
        ]

    def chunks(self, size: int) -> Iterator[tuple[int, list[Any]]]:
        """(first row, columns) for each run of ``size`` rows: a "fixed" column as one
        array (a row per row), a "var" one as (its rows' bytes concatenated, each row's byte
        count), a "none" one as None. ValueError if a row no longer matches the plan."""
        depth = len(self.names) + 1
        items = iter(self.rows.items())
        for start in range(0, self.n, size):
            batch = list(itertools.islice(items, size))
            cols: list[Any] = []
            for _rel, _kind, how, dtype, shape in self.columns:
                if how == "fixed":
                    assert dtype is not None and shape is not None
                    cols.append(np.empty((len(batch), *shape), np.dtype(dtype)))
                else:
                    cols.append([] if how == "var" else None)
            for r, (key, row) in enumerate(batch):
                j = -1
                for j, (child, kind, arr) in enumerate(_entries(row, (*self.names, key))):
                    if j >= len(self.columns) or self.columns[j][:2] != (child[depth:], kind):
                        raise ValueError(f"checkpoint table /{'/'.join(self.names)}: row "
                                         f"{key!r} changed while it was written")  # fmt: skip
                    col = cols[j]
                    if col is None:
                        continue
                    if isinstance(col, list):
                        col.append(arr)
                    else:
                        col[r] = arr
                if j != len(self.columns) - 1:
                    raise ValueError(f"checkpoint table /{'/'.join(self.names)}: row {key!r} "
                                     "changed while it was written")  # fmt: skip
            for j, col in enumerate(cols):
                if isinstance(col, list):
                    sizes = np.fromiter((p.size for p in col), np.int64, len(col))
                    data = np.concatenate(col) if col else np.zeros(0, np.uint8)
                    cols[j] = (data, sizes)
            yield start, cols


def _as_table(rows: dict, names: tuple[str, ...], min_rows: int) -> Table | None:
    """Group ``names`` (the state's dict ``rows``) planned as a :class:`Table` if it has at
    least ``min_rows`` children, all groups with the same entries (names, kinds, dtype and
    shape of fixed-size values); else None. Encodes every row once to check (validating it:
    TypeError as :func:`plan_state`), keeping only the first row's columns."""
    if len(rows) < min_rows or not all(isinstance(v, dict) for v in rows.values()):
        return None
    depth = len(names) + 1
    columns: tuple[Column, ...] | None = None
    var: list[int] = []
    for key, row in rows.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint state /{'/'.join((*names, repr(key)))}: keys must be str")
        spec, sizes = [], []  # (sizes: (column, bytes) of the row's variable-size leaves)
        for child, kind, arr in _entries(row, (*names, escape_key(key))):
            if kind in VARIABLE:
                sizes.append((len(spec), arr.size))  # type: ignore[union-attr]
            spec.append(_column(child[depth:], kind, arr))
        if columns is None:
            columns, var = tuple(spec), [0] * len(spec)
        elif tuple(spec) != columns:
            return None
        for j, size in sizes:
            var[j] += size
    assert columns is not None
    return Table(names, rows, columns, tuple(var))


def plan_tables(state: dict[str, Any], min_rows: int) -> list[Node | Table]:
    """:func:`plan_state`'s nodes, except that a group below the root that can be a table
    (:func:`_as_table`) is its group node followed by one :class:`Table` instead of its
    subtree: what ``save_checkpoint`` writes. Every leaf is validated (TypeError naming its
    key path), but a table's rows keep no node."""
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint state must be a dict, got {type(state).__name__}")
    out: list[Node | Table] = []
    _plan(state, (), min_rows, out)
    return out


def _plan(d: dict[str, Any], names: tuple[str, ...], min_rows: int, out: list) -> None:
    for key, value in d.items():
        child = _child(names, key)
        if isinstance(value, dict):
            out.append(Node(child, "group"))
            table = _as_table(value, child, min_rows)
            if table is not None:
                out.append(table)
            else:
                _plan(value, child, min_rows, out)
        else:
            kind, arr = encode_leaf(value, child)
            out.append(Node(child, kind, arr))


def rebuild_state(nodes: list[Node]) -> dict[str, Any]:
    """Nested dict from nodes (parents before children), decoding leaves."""
    root: dict[str, Any] = {}
    groups: dict[tuple[str, ...], dict[str, Any]] = {(): root}
    for node in nodes:
        parent = groups[node.names[:-1]]
        key = unescape_key(node.names[-1])
        if node.kind == "group":
            parent[key] = groups[node.names] = {}
        else:
            assert node.data is not None
            parent[key] = decode_leaf(node.kind, node.data)
    return root


def short_value(value: Any, width: int = 60) -> str:
    """One-line rendering of a scalar-ish value, cut to about ``width`` characters."""
    text = repr(value).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."
