"""Pure parts of federated evaluation: user metrics, one evaluation (on the held-out split of
:mod:`edgefl.data.holdout`) and
the sample-weighted aggregation of device results (torch and numpy only, no MPI).

The metric contract (``evaluation.metrics = ["package.module:function"]``)::

    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

``output`` is the model's output on a batch of B examples (logits, shape (B, classes) for
classification, (B, T, vocab) for lm), ``target`` the batch's labels, both on the
evaluating torch device. It returns one value per example (shape (B,) or (B, 1)). A device
reports the mean over its held-out examples; rank 0 reports the sample-weighted mean over
devices, which is exactly the mean over every held-out example of the fleet. The metric's
name in the rows is the function's name (``fed_<name>``, ``test_<name>``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ...errors import ConfigError
from ...models.train import evaluate
from ...specs import import_spec
from ...training.trainer import ordered_batches

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# keys of a device result that are not metric names
RESERVED = frozenset({"version", "device", "samples", "loss", "accuracy"})
BATCH = 1024  # examples per evaluation batch


def load_metric(spec: Any, key: str) -> tuple[str, Metric]:
    """(name, function) of one ``"package.module:function"``; ConfigError naming ``key``
    when it is not such a string, cannot be imported or is not callable."""
    obj = import_spec(spec, key)
    name = spec.partition(":")[2]
    return name.rsplit(".", 1)[-1], obj


def load_metrics(specs: Any, key: str = "evaluation.metrics") -> dict[str, Metric]:
    """Every metric of ``evaluation.metrics`` by name, in the listed order (ConfigError for
    a bad spec, a name used twice or a reserved name)."""
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"config key '{key}' = {specs!r}: expected a list of strings")
    out: dict[str, Metric] = {}
    for i, spec in enumerate(specs):
        name, fn = load_metric(spec, f"{key}[{i}]")
        if name in out or name in RESERVED:
            why = "used twice" if name in out else "reserved"
            raise ConfigError(f"config key '{key}[{i}]' = {spec!r}: metric name {name!r} is {why}")
        out[name] = fn
    return out


def _batches(dataset: Dataset, bs: int):
    """(inputs, targets) batches in order, without a DataLoader (which draws a seed from
    torch's global random stream)."""
    batches = ordered_batches(dataset, bs)  # (tensors in memory, or a test set on disk)
    if batches is not None:
        yield from batches
        return
    n = len(dataset)  # type: ignore[arg-type]
    for i in range(0, n, bs):
        yield default_collate([dataset[j] for j in range(i, min(i + bs, n))])


@torch.no_grad()
def metric_means(
    model: torch.nn.Module,
    dataset: Dataset,
    metrics: Mapping[str, Metric],
    device: str = "cpu",
    batch_size: int = BATCH,
) -> dict[str, float]:
    """Mean of every metric's per-example values over ``dataset`` (nan when it is empty).
    The model's train/eval mode is restored afterwards."""
    if not metrics:
        return {}
    sums = dict.fromkeys(metrics, 0.0)
    count = 0
    was_training = model.training
    model.eval()
    try:
        for xb, yb in _batches(dataset, batch_size):
            xb, yb = xb.to(device), yb.to(device)
            out = model(xb)
            b = int(yb.shape[0])
            for name, fn in metrics.items():
                v = torch.as_tensor(fn(out, yb)).reshape(-1)
                if v.numel() != b:
                    raise ValueError(
                        f"evaluation metric {name!r} returned {v.numel()} values for a batch "
                        f"of {b} examples (expected one per example)"
                    )
                sums[name] += float(v.double().sum())
            count += b
    finally:
        model.train(was_training)
    return {k: (s / count if count else math.nan) for k, s in sums.items()}


def evaluate_on(
    model: torch.nn.Module,
    dataset: Dataset,
    task: str,
    metrics: Mapping[str, Metric],
    device: str = "cpu",
    loss: Any = None,
) -> dict[str, float | int]:
    """One evaluation: ``{"samples", "loss", "accuracy", <metric>: mean}`` of ``model`` on
    ``dataset`` (loss in nats per example, or per token for lm; accuracy a fraction).
    ``loss``: the run's training loss object, passed on to ``evaluate`` when given (None:
    ``evaluate``'s default).

    The one place that calls :func:`edgefl.models.train.evaluate` (update it here when that
    function's signature changes). Torch's global random streams (CPU and the evaluating
    CUDA device) are saved and restored, so an evaluation never shifts training's draws.
    """
    n = len(dataset)  # type: ignore[arg-type]
    devices = [torch.device(device).index or 0] if str(device).startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        if n == 0:
            mean, acc = math.nan, math.nan
        else:
            kw = {"loss": loss} if loss is not None else {}
            mean, acc = evaluate(model, dataset, task, device=device, **kw)
        out: dict[str, float | int] = {"samples": n, "loss": float(mean), "accuracy": float(acc)}
        out.update(metric_means(model, dataset, metrics, device) if n else
                   dict.fromkeys(metrics, math.nan))  # fmt: skip
    return out


def weighted_means(results: Mapping[str, Mapping[str, Any]], keys: list[str]) -> dict:
    """Sample-weighted mean of each of ``keys`` over device results ``{device: {"samples":
    n, key: value}}``: sum(n_d * v_d) / sum(n_d) over the devices with n_d > 0 and a finite
    value (None when there is none)."""
    out: dict[str, float | None] = {}
    for k in keys:
        num = den = 0.0
        for r in results.values():
            n, v = r.get("samples", 0), r.get(k)
            if n and isinstance(v, (int, float)) and math.isfinite(v):
                num += n * v
                den += n
        out[k] = num / den if den else None
    return out


def encode(result: Mapping[str, Any]) -> np.ndarray:
    """A result as a FED_EVAL payload (UTF-8 JSON bytes, uint8)."""
    return np.frombuffer(json.dumps(dict(result)).encode("utf-8"), np.uint8).copy()


def decode(payload: np.ndarray, metrics: list[str]) -> dict:
    """A FED_EVAL payload as a result dict; ValueError when it is not one (not JSON, or
    ``samples``, ``loss``, ``accuracy`` or a metric missing)."""
    try:
        r = json.loads(np.asarray(payload, np.uint8).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a JSON evaluation result: {e}") from None
    need = ["version", "samples", "loss", "accuracy", *metrics]
    if not isinstance(r, dict) or any(k not in r for k in need):
        raise ValueError(f"an evaluation result needs the keys {need}")
    if not isinstance(r["samples"], int) or r["samples"] < 0:
        raise ValueError(f"bad sample count {r['samples']!r}")
    return r
