"""Which values of a config name code: ``'package.module:attr'`` specs.

Every key that takes a user hook (``data.source``, ``model.name``, ``train.client``,
``train.loss``, ``train.optimizer``, ``server.optimizer``, ``algorithm.plugins``,
``evaluation.metrics``, a data plug-in's own ``args`` ...) takes it as such a string, and
edgefl imports the module and calls the attribute (:mod:`edgefl.specs`,
:mod:`edgefl.data._imports`, :mod:`edgefl.models.build`). Built-in names have no ``:``.
:func:`named_code` finds them all by their shape, not from a list of keys, so a key added
later (or a spec nested in a plug-in's free ``args`` table) is found as well. A string of
that shape that is not code (``output.mlflow_uri = "sqlite:x.db"``) is found too: the
callers ask for the user's say-so, which is the safe side.

Pure: no imports from edgefl (``edgefl.ckpt`` and ``edgefl.trust`` use it).
"""

from __future__ import annotations

import re
from typing import Any

# a dotted module path (Python identifiers, also non-ASCII ones), one colon, an attribute
# path: what importlib could import and getattr walk
SPEC = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*:[^\W\d][\w.]*")


def is_code_spec(value: Any) -> bool:
    """Whether ``value`` is a string of the shape ``'package.module:attr'``."""
    return isinstance(value, str) and SPEC.fullmatch(value) is not None


def _part(key: Any) -> str:
    text = str(key)
    return text if text.isprintable() and text and "." not in text else repr(text)


def named_code(doc: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every string in the config ``doc`` (nested dicts and lists,
    as TOML gives them) shaped like ``'package.module:attr'``, in document order; a list
    item's key ends in ``[i]`` (``algorithm.plugins[0]``)."""
    found: list[tuple[str, str]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            found += named_code(v, f"{prefix}.{_part(k)}" if prefix else _part(k))
    elif isinstance(doc, (list, tuple)):
        for i, v in enumerate(doc):
            found += named_code(v, f"{prefix}[{i}]")
    elif is_code_spec(doc):
        found.append((prefix, doc))
    return found
