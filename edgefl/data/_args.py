"""Validation of ``[data.args]`` tables: typed getters that raise one-line DataErrors."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgefl.errors import DataError

_MISSING = object()


class Args:
    """Typed, checked access to one source's args; unknown names are rejected on creation.

    Error messages name the arg as ``<prefix>.<name>`` (default prefix ``data.args``).
    """

    def __init__(
        self,
        source: str,
        args: Mapping[str, Any] | None,
        accepted: list[str],
        prefix: str = "data.args",
    ) -> None:
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise DataError(
                f"{prefix} for source {source!r} must be a table/dict, got {type(args).__name__}"
            )
        self.source = source
        self.prefix = prefix
        self.args = dict(args)
        self.accepted = list(accepted)
        for key in self.args:
            if not isinstance(key, str) or key not in self.accepted:
                raise DataError(
                    f"{prefix}.{key}: unknown arg for source {source!r} "
                    f"(accepted: {', '.join(self.accepted)})"
                )

    def has(self, name: str) -> bool:
        return name in self.args

    def _raw(self, name: str, default: Any) -> Any:
        assert name in self.accepted, name
        value = self.args.get(name, default)
        if value is _MISSING:
            raise DataError(f"{self.prefix}.{name} is required for source {self.source!r}")
        return value

    def _fail(self, name: str, need: str, value: Any) -> DataError:
        return DataError(f"{self.prefix}.{name} must be {need}, got {value!r}")

    def number(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
        hi_open: bool = False,
    ) -> float:
        value = self._raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise self._fail(name, "a number", value)
        f = float(value)
        if not math.isfinite(f):
            raise self._fail(name, "a finite number", value)
        if lo is not None and (f < lo or (lo_open and f == lo)):
            raise self._fail(name, f"{'>' if lo_open else '>='} {lo}", value)
        if hi is not None and (f > hi or (hi_open and f == hi)):
            raise self._fail(name, f"{'<' if hi_open else '<='} {hi}", value)
        return f

    def integer(
        self, name: str, default: Any = _MISSING, *, lo: int | None = None, hi: int | None = None
    ) -> int:
        value = self._raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise self._fail(name, "an integer", value)
        i = int(value)
        if lo is not None and i < lo:
            raise self._fail(name, f"an integer >= {lo}", value)
        if hi is not None and i > hi:
            raise self._fail(name, f"an integer <= {hi}", value)
        return i

    def optional_int(self, name: str, *, lo: int | None = None) -> int | None:
        if self.args.get(name) is None:
            return None
        return self.integer(name, lo=lo)

    def flag(self, name: str, default: Any = _MISSING) -> bool:
        value = self._raw(name, default)
        if not isinstance(value, bool | np.bool_):
            raise self._fail(name, "true or false", value)
        return bool(value)

    def text(self, name: str, default: Any = _MISSING, *, choices: list[str] | None = None) -> str:
        value = self._raw(name, default)
        if not isinstance(value, str) or not value:
            raise self._fail(name, "a non-empty string", value)
        if choices is not None and value not in choices:
            raise DataError(
                f"{self.prefix}.{name} must be one of {', '.join(repr(c) for c in choices)}, "
                f"got {value!r}"
            )
        return value

    def table(self, name: str, default: Any = _MISSING) -> dict[str, Any]:
        value = self._raw(name, default)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise self._fail(name, "a table/dict with string keys", value)
        return dict(value)


def check_run_params(num_devices: Any, seed: Any) -> tuple[int, int]:
    """Validate the ``num_devices`` and ``seed`` given to :func:`load_federated`."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int | np.integer):
        raise DataError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if int(num_devices) < 1:
        raise DataError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or int(seed) < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed!r}")
    return int(num_devices), int(seed)
