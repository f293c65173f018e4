"""The resume schema: every entry a resume reads from a run's checkpoint, with its type.

Derived from what ``edgefl.runtime`` writes (``state.checkpoint_state`` and
``checkpointing.save``) and reads back (``checkpointing.restore``, ``resume_flight``,
``devstate.restore``). :func:`check_run_state` runs on every load of a file sealed as a run
checkpoint (``load_checkpoint``, ``edgefl inspect``, ``--resume`` before MPI starts), so a
missing or mistyped entry is one line naming it instead of a KeyError inside a rank.

Checked: presence and type of every entry read, the shape of ``model/flat`` (1-D float32,
its length matching ``model/shapes``), that ``config_toml`` parses as TOML and that the
JSON-encoded entries (``metrics_jsonl`` lines, ``clock/*``, ``flight/*``) parse to the
expected kind of value. Not checked: what a plugin's ``load_state_dict`` wants from its own
``plugins/<name>/state`` (the plugin reports that), or that the config matches this run's
(``restore`` does, naming the key).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from edgefl.errors import CheckpointError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Check = Callable[[Any], "str | None"]  # None if fine, else the problem ("is a str, ...")
Path = tuple[str, ...]  # keys from the root (a key may hold "/": plugin names are free)
_MISSING = object()
_INT_KEY = re.compile(r"-?[0-9]+")
_TASK_KEY = re.compile(r"-?[0-9]+:-?[0-9]+")  # "device:task"
_RUN_ID = re.compile(r"[0-9a-f]{32}")  # edgefl.runtime.rundir: the run directory's id
_COUNTERS = ("rounds", "bytes_up", "bytes_down", "msgs_up", "msgs_down", "time_s",
             "requests", "iterations")  # fmt: skip
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}  # fmt: skip


def _what(v: Any) -> str:
    """How a loaded value reads in a message: 'a str', 'a group', 'a float64[3] array'."""
    if isinstance(v, dict):
        return "a group"
    if isinstance(v, np.ndarray):
        return f"a {v.dtype.name}[{'x'.join(map(str, v.shape)) or 'scalar'}] array"
    if isinstance(v, np.generic):
        return f"a numpy {v.dtype.name}"
    if v is None:
        return "None"
    name = type(v).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    return _is_int(v) or isinstance(v, (float, np.floating))


def _expect(test: Callable[[Any], bool], expected: str) -> Check:
    return lambda v: None if test(v) else f"is {_what(v)}, expected {expected}"


INT = _expect(_is_int, "an int")
REAL = _expect(_is_real, "a number")
STR = _expect(lambda v: isinstance(v, str), "a str")
GROUP = _expect(lambda v: isinstance(v, dict), "a group")
ARRAY = _expect(lambda v: isinstance(v, np.ndarray), "an array")
INT_LIST = _expect(lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of ints")
STR_LIST = _expect(lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                   "a list of str")  # fmt: skip
RUN_ID = _expect(lambda v: isinstance(v, str) and _RUN_ID.fullmatch(v) is not None,
                 "a run id (32 hex digits)")  # fmt: skip
REAL_LIST = _expect(lambda v: isinstance(v, list) and all(map(_is_real, v)), "a list of numbers")


def _round(v: Any) -> str | None:
    return INT(v) or (f"is {v}, expected a round >= 0" if v < 0 else None)


def _toml(v: Any) -> str | None:
    if not isinstance(v, str):
        return STR(v)
    try:
        tomllib.loads(v)
    except (ValueError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"is not valid TOML ({first})"
    return None


def _flat(v: Any) -> str | None:
    if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.ndim != 1:
        return f"is {_what(v)}, expected a 1-D float32 array"
    return None


def _shapes(v: Any) -> str | None:
    ok = isinstance(v, list) and all(
        isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in v
    )
    return None if ok else f"is {_what(v)}, expected a list of shapes (lists of ints >= 0)"


def _json(kind: type, int_keys: bool = False, value: Callable[[Any], bool] | None = None) -> Check:
    """A str holding JSON of type ``kind``; for objects, device-id keys if ``int_keys`` and
    every value passing ``value``."""

    def check(v: Any) -> str | None:
        if not isinstance(v, str):
            return STR(v)
        try:
            doc = json.loads(v)
        except (ValueError, RecursionError):
            return "is not valid JSON"
        if not isinstance(doc, kind):
            got = _JSON_NAMES.get(type(doc), "value")
            return f"holds a JSON {got}, expected a JSON {_JSON_NAMES[kind]}"
        if isinstance(doc, dict):
            for k, item in doc.items():
                if int_keys and not _INT_KEY.fullmatch(k):
                    return f"has key {k!r}, expected device ids"
                if value is not None and not value(item):
                    return f"has a bad value at key {k!r}: {json.dumps(item)[:40]}"
        return None

    return check


def _jsonl(v: Any) -> str | None:
    if not isinstance(v, list):
        return f"is {_what(v)}, expected a list of JSON lines"
    for i, line in enumerate(v):
        if _json(dict)(line) is not None:
            return f"line {i + 1} is not a JSON object"
    return None


def _pending(v: Any) -> str | None:
    problem = _json(dict)(v)
    if problem is None and not {"dispatch", "dropped", "timer"} <= set(json.loads(v)):
        return "lacks one of 'dispatch', 'dropped', 'timer'"
    return problem


def _is_list(n: int | None = None) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and (len(x) == n if n is not None else len(x) > 0)


# (name, check, required) below a base path; parents before children
TOP: tuple[tuple[str, Check, bool], ...] = (
    ("round", _round, True),
    ("config_toml", _toml, True),
    ("seed", INT, False),
    ("wall_time_s", REAL, True),
    ("model", GROUP, True),
    ("devices", GROUP, True),
    ("metrics_jsonl", _jsonl, True),
    ("clock", GROUP, True),
    ("server_optimizer", GROUP, True),
    ("aggregation", GROUP, False),
    ("plugins", GROUP, True),
    ("flight", GROUP, False),
    ("numerics", _json(dict), False),
    ("run_id", RUN_ID, False),  # (edgefl.runtime.rundir: the run directory's identity)
)
MODEL = (
    ("flat", _flat, True),
    ("signature", STR, True),
    ("names", STR_LIST, False),
    ("shapes", _shapes, False),
)
CLOCK = (
    ("mode", _expect(lambda v: v in ("virtual", "wall"), "'virtual' or 'wall'"), False),
    ("time_s", REAL, False),
    ("reference_s_per_sample", REAL, False),
    ("policy", _json(dict), True),
    ("tasks", _json(dict, True, _is_int), True),
    ("staleness", _json(dict, False, _is_int), True),
    ("lost_tasks", INT, False),
)
FLIGHT = (
    ("pending", _pending, True),
    ("inflight", _json(dict, True, _is_list(3)), True),
    ("sent", _json(dict, True, _is_list()), True),
    ("online_pending", INT_LIST, True),
    ("refresh", INT_LIST, True),
    ("iter_time", _json(dict, True, _is_real), True),
    ("failed", _json(dict, True, _is_real), True),
    ("bases", GROUP, True),
    ("pushes", GROUP, True),
    ("buffered", GROUP, False),
    (
        "heap",
        _expect(
            lambda v: isinstance(v, np.ndarray) and v.size % 6 == 0, "an array of 6-number rows"
        ),
        False,
    ),  # fmt: skip
    ("heap_n", INT, False),
)
PUSH = (("kind", INT, True), ("src", INT, True), ("device", INT, True), ("seq", INT, True),
        ("round", INT, True), ("aux", REAL_LIST, True), ("nbytes", INT, True),
        ("payload", _expect(lambda v: v is None or isinstance(v, np.ndarray), "an array or None"),
         True))  # fmt: skip
BUFFERED = (("delta", ARRAY, True), ("seconds", REAL, True), ("nbytes", INT, True),
            ("src", INT, True))  # fmt: skip


RUN_KEYS = ("config_toml", "round", "model")  # a state holding all three is a run's


def is_run_state(state: dict) -> bool:
    """True for a run's checkpoint state (``save_checkpoint`` then seals it as one, and
    every load checks it with :func:`check_run_state`)."""
    return all(k in state for k in RUN_KEYS)


class _Checker:
    def __init__(self, state: dict, where: str) -> None:
        self.state, self.where = state, where

    def fail(self, path: Path, problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint '{self.where}': entry '/{'/'.join(path)}' {problem}")

    def get(self, path: Path) -> Any:
        node: Any = self.state
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return _MISSING
            node = node[key]
        return node

    def entries(self, base: Path, table: Any) -> None:
        """Every (name, check, required) of ``table`` below group ``base``."""
        for name, check, required in table:
            value = self.get((*base, name))
            if value is _MISSING:
                if required:
                    raise self.fail((*base, name), "is missing (a resume reads it)")
            elif (problem := check(value)) is not None:
                raise self.fail((*base, name), problem)

    def groups(self, base: Path, key: re.Pattern | None, what: str) -> dict[str, dict]:
        """The children of group ``base``, each a group, named to match ``key``."""
        children = self.get(base)
        for name, value in children.items():
            if key is not None and not key.fullmatch(name):
                raise self.fail((*base, name), f"is not named by {what}")
            if not isinstance(value, dict):
                raise self.fail((*base, name), f"is {_what(value)}, expected a group")
        return children


def check_run_state(state: dict, where: str) -> None:
    """Raise CheckpointError (one line naming the file ``where`` and the entry) unless the
    loaded ``state`` holds everything a resume reads, each of the right type."""
    c = _Checker(state, where)
    c.entries((), TOP)
    c.entries(("model",), MODEL)
    c.entries(("clock",), CLOCK)
    if "aggregation" in state:
        c.entries(("aggregation",), (("state", GROUP, False),))
    flat, shapes = state["model"]["flat"], state["model"].get("shapes")
    if shapes is not None and sum(math.prod(s) for s in shapes) != flat.size:
        raise c.fail(("model", "flat"), f"holds {flat.size} parameters, model/shapes more or less")
    for d in c.groups(("devices",), _INT_KEY, "a device id"):
        c.entries(("devices", d), [(k, REAL, False) for k in _COUNTERS])
    for name, saved in c.groups(("plugins",), None, "").items():
        c.entries(("plugins", name), (("state", GROUP, False), ("devices", GROUP, False)))
        if "devices" in saved:
            c.groups(("plugins", name, "devices"), _INT_KEY, "a device id")
    if "flight" not in state:
        return
    fl = ("flight",)
    c.entries(fl, FLIGHT)
    if state["clock"].get("mode") == "virtual":  # resume_flight reads the event heap
        c.entries(fl, (("heap", ARRAY, True), ("heap_n", INT, True)))
    for v in state["flight"]["bases"]:
        if not _INT_KEY.fullmatch(v):
            raise c.fail((*fl, "bases", v), "is not named by a model version")
        c.entries((*fl, "bases"), ((v, ARRAY, True),))
    for key in c.groups((*fl, "pushes"), _TASK_KEY, "'device:task'"):
        c.entries((*fl, "pushes", key), PUSH)
    if "buffered" in state["flight"]:
        for key in c.groups((*fl, "buffered"), _TASK_KEY, "'device:task'"):
            c.entries((*fl, "buffered", key), BUFFERED)
