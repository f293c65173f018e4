"""Checkpoint planning: nested state dict <-> ordered list of typed nodes (no file I/O).

Every leaf becomes a contiguous numpy array plus a ``kind`` telling how to turn it back into
the original Python value; nested dicts become groups. Keys are escaped so that any string
(including ``"device/17"``) is a valid HDF5 link name.
"""

from __future__ import annotations

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
    return np.frombuffer(b, dtype=np.uint8).copy()


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
    for key, value in d.items():
        if not isinstance(key, str):
            where = "/" + "/".join((*names, repr(key)))
            raise TypeError(f"checkpoint state {where}: keys must be str")
        child = (*names, escape_key(key))
        if isinstance(value, dict):
            yield Node(child, "group")
            yield from _walk(value, child)
        else:
            kind, arr = encode_leaf(value, child)
            yield Node(child, kind, arr)


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
