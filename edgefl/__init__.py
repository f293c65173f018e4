"""edgefl: federated / edge training over MPI.

Rank 0 coordinates; ranks >= 1 host edge devices. See ``docs/architecture.md``.
From Python: ``edgefl.simulate(...)`` returns an ``edgefl.Result`` (docs/python-api.md).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Result", "RunFailed", "__version__", "simulate"]

_API = ("Result", "RunFailed", "simulate")


def __getattr__(name: str) -> Any:
    """``simulate``, ``Result`` and ``RunFailed`` from :mod:`edgefl.api`, imported on first
    use so that ``import edgefl`` stays cheap."""
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgefl' has no attribute {name!r}")
