"""The type of one config key (:class:`Field`); the schema and the algorithm packages' config
sections are built from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    """One config key.

    Args:
        default: value when the key is absent.
        type: one of ``int``, ``float``, ``bool``, ``str``, ``list[int]``, ``list[str]``,
            ``table`` (a free-form table passed through, e.g. plug-in keyword arguments).
        doc: one sentence; units in the text (seconds, bytes, samples).
        min / max: inclusive numeric bounds (None = unbounded).
        choices: allowed string values (None = any).
        auto: an ``int`` key that also takes the string ``"auto"`` (resolved at launch).
    """

    default: Any
    type: str
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    exclusive_min: bool = False
    auto: bool = False


def field(default, type_, doc, **kw) -> Field:
    return Field(default, type_, doc, **kw)
