"""The CLIENT_METRICS payload: encoding and checked decoding (pure; no MPI)."""

from __future__ import annotations

import json
import math

import numpy as np

MAX_METRICS = 64  # names per task (a bigger message is refused)


def encode(samples: int, metrics: dict[str, float]) -> np.ndarray:
    """UTF-8 JSON ``{"samples": n, <name>: value, ...}`` as uint8."""
    body = {"samples": int(samples), **metrics}
    return np.frombuffer(json.dumps(body).encode("utf-8"), np.uint8).copy()


def decode(payload: np.ndarray) -> dict[str, float]:
    """The metrics of a CLIENT_METRICS payload; ValueError for anything malformed."""
    try:
        body = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not UTF-8 JSON ({e})") from None
    if not isinstance(body, dict) or len(body) - ("samples" in body) > MAX_METRICS:
        raise ValueError(f"not an object of at most {MAX_METRICS} metrics")
    out = {}
    for k, v in body.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"metric {k!r} is not a number")
        if not math.isfinite(v):
            raise ValueError(f"metric {k!r} is not finite")
        out[k] = float(v)
    return out
