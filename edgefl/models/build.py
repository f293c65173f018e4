"""Model construction: built-in names and ``package.module:Class`` plug-ins."""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from edgefl.errors import ConfigError
from edgefl.models import cnn, logreg, lstm, mlp

_BUILTINS: dict[str, Callable[[Any, dict[str, Any] | None], nn.Module]] = {
    "logreg": logreg.build,
    "mlp": mlp.build,
    "cnn": cnn.build,
    "lstm": lstm.build,
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILTINS)


_INIT_LOCK = threading.Lock()


def build_model(name: str, info: Any, args: Mapping[str, Any] | None, seed: int) -> nn.Module:
    """Build model ``name`` for dataset ``info`` with parameters initialised from ``seed``.

    ``name`` is a built-in (see ``MODEL_NAMES``) or ``"package.module:Class"``, which is
    called as ``Class(**args)`` (plus ``info=info`` if its ``__init__`` takes an ``info``
    parameter). Initialisation runs under a forked CPU RNG seeded with ``seed``, so the
    caller's global RNG state is left untouched and equal seeds give identical parameters.
    The model is returned on the CPU. Bad names, arguments or plug-ins raise ConfigError.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"model.name: expected a non-empty string, got {name!r}")
    if args is not None and not isinstance(args, Mapping):
        raise ConfigError(f"model.args: expected a mapping, got {type(args).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed: expected an integer, got {seed!r}")
    builder = _BUILTINS.get(name)
    if builder is None and ":" not in name:
        raise ConfigError(
            f"model.name {name!r}: unknown model (built-ins: {', '.join(MODEL_NAMES)}; "
            "or 'package.module:Class' for a custom model)"
        )
    # Module constructors draw from torch's global RNG: seed it inside fork_rng, and hold a
    # lock so models built concurrently in threads cannot interleave their draws.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        if builder is not None:
            model = builder(info, dict(args or {})).to(torch.float32)
        else:
            model = _build_custom(name, info, dict(args or {}))
    return model


def _load_class(name: str) -> Any:
    """Resolve ``"package.module:Attr[.Inner]"`` to the named object."""
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"model.name {name!r}: custom models are written 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # a broken plug-in is a user error: report it on one line
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"model.name {name!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {detail})"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"model.name {name!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"model.name {name!r}: {attr_path!r} is not a class or callable")
    return obj


def _build_custom(name: str, info: Any, args: dict[str, Any]) -> nn.Module:
    cls = _load_class(name)
    kwargs = dict(args)
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        info_param = sig.parameters.get("info")
        if (
            info_param is not None
            and info_param.kind in (info_param.POSITIONAL_OR_KEYWORD, info_param.KEYWORD_ONLY)
            and "info" not in kwargs
        ):
            kwargs["info"] = info
        try:
            sig.bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"model.args: cannot construct {name!r} ({exc})") from None
    model = cls(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name {name!r}: returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
