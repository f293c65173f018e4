"""Resolve ``"package.module:function"`` strings to callables with clear DataErrors."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from edgefl.data.base import one_line
from edgefl.errors import DataError

_SPEC = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$")


def resolve_callable(spec: str, where: str) -> Callable[..., Any]:
    """Import ``"pkg.module:function"`` and return the function.

    ``where`` names the config key in messages, e.g. ``"data.source"``. The function part may
    be dotted (``module:Class.method``).
    """
    if not _SPEC.match(spec):
        raise DataError(
            f"{where} {spec!r}: expected 'package.module:function' "
            "(a dotted module path, one colon, a function name)"
        )
    module_name, func_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DataError(
            f"{where} {spec!r}: cannot import module {module_name!r} ({one_line(exc)})"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - an error while importing user code
        raise DataError(
            f"{where} {spec!r}: importing module {module_name!r} failed "
            f"({type(exc).__name__}: {one_line(exc)})"
        ) from exc
    obj: Any = module
    for part in func_name.split("."):
        if not hasattr(obj, part):
            raise DataError(
                f"{where} {spec!r}: module {module_name!r} has no function {func_name!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise DataError(
            f"{where} {spec!r}: {module_name}.{func_name} is a {type(obj).__name__}, not a function"
        )
    return obj
