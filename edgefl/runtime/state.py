"""Shared runtime pieces: the built task (data + model) and checkpoint state layout."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import dump_config
from ..data import FederatedDataset, load_federated
from ..models import build_model
from ..models.flat import FlatParams, layout_signature


@dataclass
class Task:
    """What every rank builds from the config: the federated data and a model instance."""

    data: FederatedDataset
    model: torch.nn.Module
    flat: FlatParams
    signature: str
    test_set: Any = None  # the test set when already built (rank 0: by its preflight)


def build_task(cfg: dict, torch_device: str = "cpu") -> Task:
    """Build the data (lazily) and the initial model (deterministic in ``cfg['seed']``)."""
    data = load_federated(
        cfg["data"]["source"], dict(cfg["data"]["args"]), cfg["fleet"]["devices"], cfg["seed"]
    )
    model = build_model(cfg["model"]["name"], data.info, dict(cfg["model"]["args"]), cfg["seed"])
    model.to(torch_device)
    flat = FlatParams(model, torch_device)
    return Task(data, model, flat, layout_signature(flat.names, flat.shapes))


# Keys whose values must agree between a checkpoint's config and the resuming config.
RESUME_MUST_MATCH = ("seed", "data", "model", "train", "algorithm", "server", "fleet.devices")


def checkpoint_state(
    cfg: dict,
    round_: int,
    flat: FlatParams,
    global_model: np.ndarray,
    devices: dict[int, dict],
    metrics: Sequence[dict],
    wall_time_s: float,
) -> dict:
    """Everything a resume needs (docs/architecture.md, Checkpoints), as a nested dict for
    :mod:`edgefl.ckpt`."""
    return {
        "round": int(round_),
        "config_toml": dump_config(cfg),
        "seed": int(cfg["seed"]),
        "wall_time_s": float(wall_time_s),
        "model": {
            "flat": np.array(global_model, dtype=np.float32, copy=True),
            "names": list(flat.names),
            "shapes": [list(s) for s in flat.shapes],
            "signature": layout_signature(flat.names, flat.shapes),
        },
        "server": {"optimizer": "none"},
        # Every random stream is derived from (seed, round, device), so the run seed and the
        # round counter are the whole RNG state.
        "rng": {"scheme": "derive_seed(seed, device, round, purpose)", "seed": int(cfg["seed"])},
        "devices": {str(d): _clean(v) for d, v in devices.items()},
        "metrics_jsonl": _lines(metrics),
    }


def _lines(metrics: Sequence[dict]) -> list[str]:
    """The metrics rows as JSON lines: those ``output.Rows`` keeps (not parsed again)."""
    lines = getattr(metrics, "lines", None)
    return list(lines) if lines is not None else [json.dumps(r) for r in metrics]


def _clean(d: dict) -> dict:
    """``d`` with float subclasses (numpy floats) as plain floats; ``d`` itself when it
    holds none (no copy of every device's record at every checkpoint)."""
    if all(type(v) is float or not isinstance(v, float) for v in d.values()):
        return d
    return {k: (float(v) if isinstance(v, float) else v) for k, v in d.items()}
