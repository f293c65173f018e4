"""User data plug-ins: ``source = "package.module:function"``.

The function is called as ``function(num_devices=..., seed=..., **args)`` and returns either

* a :class:`~edgefl.data.base.FederatedDataset` with ``num_devices`` devices, or
* a tuple ``(train, test)`` (or ``(train, test, info)`` with a :class:`DataInfo`), where
  ``train`` is a sequence of ``num_devices`` datasets or a mapping ``{device_id: dataset}``
  with keys exactly ``0 .. num_devices - 1``; each dataset (and ``test``) is a map-style
  ``torch.utils.data.Dataset`` of ``(x, y)`` pairs or an ``(x, y)`` pair of arrays.

Without an explicit info, it is inferred from the test set: ``input_shape`` from the first
example, ``num_classes`` = largest test label + 1 (or ``args["num_classes"]``, or a
``DataInfo`` found as ``test.info``), task ``"classification"``, and ``input_dtype`` int64
for integer features, else float32.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from edgefl.data._imports import resolve_callable
from edgefl.data.base import (
    DataInfo,
    FederatedDataset,
    dataset_tensors,
    make_tensor_dataset,
    one_line,
)
from edgefl.errors import DataError

_RETURN_HELP = "a FederatedDataset or a tuple (train, test) with train a list/dict of {n} datasets"


class WrappedFederated(FederatedDataset):
    """Per-device datasets and a test set returned by a plug-in function."""

    def __init__(self, train: list[Dataset], test: Dataset, info: DataInfo) -> None:
        super().__init__(info, len(train))
        self._train_sets = train
        self._test = test

    def num_samples(self, device: int) -> int:
        """Examples in ``device``'s dataset (``len`` of it)."""
        return len(self._train_sets[self.check_device(device)])  # type: ignore[arg-type]

    def train(self, device: int) -> Dataset:
        """The dataset the plug-in returned for ``device``."""
        return self._train_sets[self.check_device(device)]

    def test(self) -> Dataset:
        """The test set the plug-in returned."""
        return self._test


def load_plugin(
    source: str, args: Mapping[str, Any] | None, num_devices: int, seed: int
) -> FederatedDataset:
    """Import and call a ``"package.module:function"`` data plug-in and wrap its result."""
    where = f"data.source {source!r}"
    args = dict(args or {})
    for reserved in ("num_devices", "seed"):
        if reserved in args:
            raise DataError(
                f"data.args.{reserved}: reserved for plug-in {source!r} (it is passed from the "
                "run settings)"
            )
    fn = resolve_callable(source, "data.source")
    try:
        inspect.signature(fn).bind(num_devices=num_devices, seed=seed, **args)
    except TypeError as exc:
        names = ", ".join(["num_devices", "seed", *args])
        raise DataError(f"{where}: cannot be called with ({names}): {one_line(exc)}") from exc
    except ValueError:  # no signature available (builtins): just try the call
        pass
    try:
        result = fn(num_devices=num_devices, seed=seed, **args)
    except DataError:
        raise
    except Exception as exc:  # the user's function failed: one line, before any rank starts
        raise DataError(f"{where}: raised {type(exc).__name__}: {one_line(exc)}") from None
    return wrap_result(result, source, num_devices, args)


def wrap_result(
    result: Any, source: str, num_devices: int, args: Mapping[str, Any]
) -> FederatedDataset:
    """Check a plug-in's return value and turn it into a :class:`FederatedDataset`."""
    where = f"data.source {source!r}"
    expected = _RETURN_HELP.format(n=num_devices)
    if isinstance(result, FederatedDataset):
        if result.num_devices != num_devices:
            raise DataError(
                f"{where}: returned a FederatedDataset with {result.num_devices} devices, "
                f"expected num_devices = {num_devices}"
            )
        return result
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise DataError(f"{where}: returned {_describe(result)}, expected {expected}")
    train_raw, test_raw = result[0], result[1]
    info = result[2] if len(result) == 3 else None
    if info is not None and not isinstance(info, DataInfo):
        raise DataError(
            f"{where}: third element of the returned tuple is {_describe(info)}, "
            "expected a DataInfo"
        )

    if isinstance(train_raw, Mapping):
        keys = list(train_raw.keys())
        bad = [k for k in keys if isinstance(k, bool) or not isinstance(k, int | np.integer)]
        if bad or sorted(int(k) for k in keys) != list(range(num_devices)):
            raise DataError(
                f"{where}: train dict has keys {sorted(map(repr, keys))[:8]}, expected device "
                f"ids 0..{num_devices - 1} (exactly {num_devices} entries)"
            )
        items = [train_raw[k] for k in sorted(keys, key=int)]
    elif isinstance(train_raw, Sequence) and not isinstance(train_raw, str | bytes):
        items = list(train_raw)
        if len(items) != num_devices:
            raise DataError(
                f"{where}: train has {len(items)} entries, expected num_devices = {num_devices}"
            )
    else:
        raise DataError(
            f"{where}: train (first element) is {_describe(train_raw)}, expected a list or dict "
            f"of {num_devices} datasets"
        )
    task = info.task if info is not None else "classification"
    _check_one_dtype([*items, test_raw], where)
    train = [_as_dataset(item, f"{where}: train[{k}]", task) for k, item in enumerate(items)]
    for k, ds in enumerate(train):
        if len(ds) == 0:  # type: ignore[arg-type]
            raise DataError(f"{where}: train[{k}] (device {k}) is empty")
    test = _as_dataset(test_raw, f"{where}: test", task)
    if len(test) == 0:  # type: ignore[arg-type]
        raise DataError(f"{where}: the test set is empty")

    if info is None:
        info = getattr(test_raw, "info", None)
        if not isinstance(info, DataInfo):
            info = _infer_info(test, where, args.get("num_classes"))
    return WrappedFederated(train, test, info)


def _feature_dtype(obj: Any) -> str | None:
    """The dtype of a dataset's features as the plug-in gave them (before edgefl converts
    floats to float32), where it can be read without indexing: an ``(x, y)`` pair of
    arrays or a two-tensor TensorDataset; else None."""
    if isinstance(obj, TensorDataset) and len(obj.tensors) == 2:
        return str(obj.tensors[0].dtype).replace("torch.", "")
    if isinstance(obj, tuple | list) and len(obj) == 2:
        dtype = getattr(obj[0], "dtype", None)
        return str(dtype).replace("torch.", "") if dtype is not None else None
    return None


def _check_one_dtype(datasets: list, where: str) -> None:
    """Every device's features (and the test set's) come in one dtype: a device whose
    features are float64 among float32 ones (or integers among floats) is most likely a
    bug in the plug-in, which converting them all to float32 would hide."""
    seen: dict[str, int] = {}
    for k, ds in enumerate(datasets):
        dtype = _feature_dtype(ds)
        if dtype is not None:
            seen.setdefault(dtype, k)
    if len(seen) > 1:
        (a, i), (b, j) = sorted(seen.items(), key=lambda kv: kv[1])[:2]

        def name(n: int) -> str:
            return "the test set" if n == len(datasets) - 1 else f"train[{n}] (device {n})"

        raise DataError(
            f"{where}: {name(j)} has {b} features, {name(i)} {a}: every device and the test "
            "set must give features of one dtype (cast them in the data source)"
        )


def _describe(obj: Any) -> str:
    if isinstance(obj, tuple):
        return f"a tuple of {len(obj)}"
    return f"an object of type {type(obj).__name__}"


def _as_dataset(obj: Any, where: str, task: str = "classification") -> Dataset:
    if isinstance(obj, TensorDataset) and len(obj.tensors) == 2:
        x, y = obj.tensors
        want = torch.int64 if task in ("classification", "lm") else torch.float32
        if (x.is_floating_point() and x.dtype != torch.float32) or y.dtype != want:
            return make_tensor_dataset(x, y, where, task)
        return obj
    if isinstance(obj, Dataset):
        try:
            len(obj)  # type: ignore[arg-type]
        except TypeError as exc:
            raise DataError(f"{where}: dataset has no length (need a map-style Dataset)") from exc
        return obj
    if isinstance(obj, tuple | list) and len(obj) == 2:
        return make_tensor_dataset(obj[0], obj[1], where, task)
    raise DataError(
        f"{where} is {_describe(obj)}, expected a torch Dataset or an (x, y) pair of arrays"
    )


def _infer_info(test: Dataset, where: str, num_classes: Any) -> DataInfo:
    x0, _ = test[0]
    x0 = torch.as_tensor(x0)
    if num_classes is None:
        _, y = dataset_tensors(test, f"{where}: test")
        num_classes = int(y.max()) + 1
    elif isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise DataError(f"data.args.num_classes must be an integer >= 1, got {num_classes!r}")
    int_input = not x0.is_floating_point() and x0.dtype not in (torch.uint8, torch.bool)
    return DataInfo(
        input_shape=tuple(x0.shape),
        num_classes=num_classes,
        task="classification",
        input_dtype="int64" if int_input else "float32",
    )
