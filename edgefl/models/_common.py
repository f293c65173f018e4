"""Shared argument/shape checks for the built-in models (internal)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from edgefl.data.base import TASKS
from edgefl.errors import ConfigError


def check_info(info: Any) -> tuple[tuple[int, ...], int, str, str]:
    """Validate a dataset ``info`` object and return (input_shape, num_classes, task, dtype)."""
    try:
        shape = tuple(int(d) for d in info.input_shape)
        classes = int(info.num_classes)
        task = str(info.task)
        dtype = str(info.input_dtype)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"dataset info: needs input_shape, num_classes, task, input_dtype ({exc})"
        ) from None
    if any(d < 1 for d in shape):
        raise ConfigError(f"dataset info: input_shape {shape} has a non-positive dimension")
    if classes < 1:
        raise ConfigError(f"dataset info: num_classes must be >= 1, got {classes}")
    if task not in TASKS:
        raise ConfigError(f"dataset info: task must be one of {', '.join(TASKS)}, got {task!r}")
    return shape, classes, task, dtype


def merge_args(model: str, given: Mapping[str, Any] | None, defaults: dict[str, Any]) -> dict:
    """Return ``defaults`` updated with ``given``; unknown keys raise ConfigError."""
    given = dict(given or {})
    for key in given:
        if key not in defaults:
            accepted = ", ".join(defaults) if defaults else "none"
            raise ConfigError(
                f"model.args: unknown argument {key!r} for {model!r} (accepted: {accepted})"
            )
    merged = dict(defaults)
    merged.update(given)
    return merged


def positive_int(model: str, key: str, value: Any) -> int:
    """Check that ``model.args.<key>`` is a positive int (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"model.args.{key}: expected a positive integer for {model!r}, got {value!r}"
        )
    return value


def int_list(model: str, key: str, value: Any, *, min_len: int = 0) -> list[int]:
    """Check that ``model.args.<key>`` is a list of >= ``min_len`` positive ints."""
    ok = isinstance(value, (list, tuple)) and len(value) >= min_len
    if ok:
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    if not ok:
        need = f" (at least {min_len})" if min_len else ""
        raise ConfigError(
            f"model.args.{key}: expected a list of positive integers{need} for {model!r}, "
            f"got {value!r}"
        )
    return [int(v) for v in value]


def require_classification(model: str, task: str) -> None:
    """Raise ConfigError unless ``task`` maps one example to ``num_classes`` outputs
    (classification logits, regression targets, or one binary logit)."""
    if task not in ("classification", "regression", "binary"):
        raise ConfigError(
            f"model.name {model!r}: is a classifier and cannot train task {task!r} "
            "(use 'lstm' or a custom model)"
        )


def flat_features(shape: tuple[int, ...]) -> int:
    """Number of input features per sample after flattening."""
    return math.prod(shape)
