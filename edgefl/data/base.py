"""Core types of the data layer: :class:`DataInfo`, :class:`FederatedDataset` and helpers.

Conventions shared by every source:

* features ``x`` are ``float32`` (or ``int64`` token ids), labels ``y`` are ``int64``;
* a device's training set is a :class:`torch.utils.data.TensorDataset` ``(x, y)`` where
  possible, so the trainer can use ``.tensors`` directly;
* everything is a pure function of ``(seed, device)``: random streams come from
  :func:`stream_rng`, keyed on fixed-length integer tuples so no two streams collide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from edgefl.errors import DataError

TASKS = ("classification", "lm", "regression", "binary")
INPUT_DTYPES = ("float32", "int64")

# Domain tags: the second word of every random-stream key, one per source, so that two
# sources built from the same seed never share a stream.
DOMAIN_SYNTHETIC = 1
DOMAIN_TEXT = 2
DOMAIN_PARTITION = 3
DOMAIN_FEDH5 = 4
DOMAIN_MIXTURE = 5


@dataclass
class DataInfo:
    """What a model needs to know about the data.

    Attributes:
        input_shape: shape of one example's features, without the batch dimension, e.g.
            ``(60,)``, ``(1, 8, 8)``, or ``(T,)`` for a token sequence of length ``T``.
        num_classes: number of classes (vocabulary size for language modelling).
        task: ``"classification"`` (``y`` is one int64 label per example), ``"lm"``
            (next-token prediction; ``y`` has the same shape as ``x``, int64 tokens),
            ``"regression"`` (``y`` float32 of shape ``(num_classes,)`` per example, or a
            scalar when num_classes is 1) or ``"binary"`` (one 0/1 label per example; the
            model emits one logit, num_classes 1).
        input_dtype: ``"float32"`` or ``"int64"`` (token ids).
    """

    input_shape: tuple[int, ...]
    num_classes: int
    task: str = "classification"
    input_dtype: str = "float32"

    def __post_init__(self) -> None:
        try:
            self.input_shape = tuple(int(d) for d in self.input_shape)
        except (TypeError, ValueError) as exc:
            raise DataError(
                f"DataInfo.input_shape must be a tuple of ints, got {self.input_shape!r}"
            ) from exc
        if any(d < 1 for d in self.input_shape):
            raise DataError(f"DataInfo.input_shape has a non-positive size: {self.input_shape}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int | np.integer):
            raise DataError(f"DataInfo.num_classes must be an int, got {self.num_classes!r}")
        self.num_classes = int(self.num_classes)
        if self.num_classes < 1:
            raise DataError(f"DataInfo.num_classes must be >= 1, got {self.num_classes}")
        if self.task not in TASKS:
            raise DataError(f"DataInfo.task must be one of {TASKS}, got {self.task!r}")
        if self.input_dtype not in INPUT_DTYPES:
            raise DataError(
                f"DataInfo.input_dtype must be one of {INPUT_DTYPES}, got {self.input_dtype!r}"
            )


class FederatedDataset(ABC):
    """Training data split over ``num_devices`` devices plus one shared test set.

    Subclasses build a device's data lazily on the first :meth:`train` call and cache it.
    Device ids are ``0 .. num_devices - 1``.
    """

    info: DataInfo
    num_devices: int

    def __init__(self, info: DataInfo, num_devices: int) -> None:
        self.info = info
        self.num_devices = int(num_devices)

    @abstractmethod
    def train(self, device: int) -> Dataset:
        """Device ``device``'s own training data. Raises :class:`DataError` on a bad id."""

    @abstractmethod
    def test(self) -> Dataset:
        """The shared test set (built by the coordinator)."""

    @abstractmethod
    def num_samples(self, device: int) -> int:
        """Number of training examples held by ``device`` (cheap: no data is generated)."""

    def test_nbytes(self) -> int | None:
        """Bytes of :meth:`test` before it is built (cheap), or None when unknown (the
        default). With a size over ``run.test_memory_mb``, rank 0 builds the test set with
        :meth:`test_parts` into a temporary file instead (:mod:`edgefl.data.spill`)."""
        return None

    def test_parts(self, rows: int) -> Iterator[Dataset]:
        """The test set in consecutive parts of about ``rows`` examples each (TensorDatasets
        of (features, targets)): their concatenation is :meth:`test`, and no part is kept
        here. The default yields :meth:`test` whole."""
        yield self.test()

    def forget(self, device: int) -> None:
        """Drop what this object keeps of ``device``'s training data; a later :meth:`train`
        builds it again (the same data: it is a pure function of ``(seed, device)``). The
        pre-launch check builds every device once and forgets each, so rank 0 never holds
        the fleet's training data. The default keeps everything (a source that cannot
        build a device again); the built-in sources drop their cached copy."""

    def check_device(self, device: int) -> int:
        """Return ``device`` as an int, or raise :class:`DataError` if it is not a valid id."""
        if isinstance(device, bool) or not isinstance(device, int | np.integer):
            raise DataError(
                f"device id must be an int in 0..{self.num_devices - 1}, got {device!r}"
            )
        device = int(device)
        if not 0 <= device < self.num_devices:
            raise DataError(
                f"device id {device} out of range: this dataset has {self.num_devices} "
                f"devices (ids 0..{self.num_devices - 1})"
            )
        return device

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_devices={self.num_devices}, info={self.info})"


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (for embedding in a DataError)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def stream_rng(seed: int, domain: int, stream: int, device: int = 0) -> np.random.Generator:
    """A numpy generator for one named random stream.

    The key always has four words ``[seed, domain, stream, device]``: keys of one length
    never collide in :class:`numpy.random.SeedSequence`, unlike keys that differ only by
    trailing zeros.
    """
    return np.random.default_rng([int(seed), int(domain), int(stream), int(device)])


def as_feature_tensor(x: Any, where: str) -> torch.Tensor:
    """Convert features to a tensor: floats -> float32, integers -> int64 token ids.

    ``uint8`` and ``bool`` arrays are treated as pixel/indicator values and become float32.
    """
    t = _to_tensor(x, where, "features")
    if t.dtype in (torch.uint8, torch.bool) or t.is_floating_point():
        return t.to(torch.float32).contiguous()
    if t.is_complex():
        raise DataError(f"{where}: features must be real numbers, got dtype {t.dtype}")
    return t.to(torch.int64).contiguous()


def as_label_tensor(y: Any, where: str) -> torch.Tensor:
    """Convert labels to an int64 tensor; float labels must hold whole numbers, none < 0."""
    t = _to_tensor(y, where, "labels")
    if t.is_floating_point():
        if t.numel() and not torch.isfinite(t).all():
            bad = t[~torch.isfinite(t)][0].item()
            raise DataError(f"{where}: labels must be whole numbers, found {bad}")
        if t.numel() and not torch.equal(t, torch.round(t)):
            raise DataError(f"{where}: labels must be whole numbers, got non-integer floats")
    elif t.dtype == torch.bool or t.is_complex():
        raise DataError(f"{where}: labels must be integers, got dtype {t.dtype}")
    t = t.to(torch.int64).contiguous()
    if t.numel() and int(t.min()) < 0:
        raise DataError(f"{where}: labels must be >= 0, found {int(t.min())}")
    return t


def _to_tensor(a: Any, where: str, what: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    try:
        arr = np.asarray(a)
    except Exception as exc:  # noqa: BLE001 - any conversion failure is a data problem
        raise DataError(f"{where}: cannot convert {what} to an array ({one_line(exc)})") from exc
    if arr.dtype == object or arr.dtype.kind in "SUVMm":
        raise DataError(f"{where}: {what} must be numeric, got dtype {arr.dtype}")
    return torch.from_numpy(np.ascontiguousarray(arr))


def as_target_tensor(y: Any, where: str, task: str) -> torch.Tensor:
    """Targets of ``task``: int64 labels (classification, lm), float32 values (regression)
    or float32 0/1 labels (binary)."""
    if task in ("classification", "lm"):
        return as_label_tensor(y, where)
    t = _to_tensor(y, where, "targets")
    if t.is_complex():
        raise DataError(f"{where}: targets must be real numbers, got dtype {t.dtype}")
    t = t.to(torch.float32).contiguous()
    if t.numel() and not torch.isfinite(t).all():
        raise DataError(f"{where}: targets contain NaN or inf")
    if task == "binary" and t.numel() and not ((t == 0) | (t == 1)).all():
        raise DataError(f"{where}: binary labels must be 0 or 1")
    return t


def make_tensor_dataset(x: Any, y: Any, where: str, task: str = "classification") -> TensorDataset:
    """Build a ``TensorDataset(x, y)`` with the standard dtypes and matching lengths (the
    targets' dtype follows ``task``: see :func:`as_target_tensor`)."""
    xt = as_feature_tensor(x, where)
    yt = as_target_tensor(y, where, task)
    if xt.dim() == 0 or yt.dim() == 0:
        raise DataError(f"{where}: features and labels need a leading example dimension")
    if xt.shape[0] != yt.shape[0]:
        raise DataError(
            f"{where}: {xt.shape[0]} feature rows but {yt.shape[0]} labels (lengths differ)"
        )
    return TensorDataset(xt, yt)


def dataset_tensors(ds: Dataset, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, y)`` tensors of a dataset of ``(x, y)`` pairs (fast path for TensorDataset)."""
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        return ds.tensors[0], ds.tensors[1]
    try:
        n = len(ds)  # type: ignore[arg-type]
    except TypeError as exc:
        raise DataError(f"{where}: dataset has no length (need a map-style Dataset)") from exc
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for i in range(n):
        item = ds[i]
        if not isinstance(item, Sequence) or len(item) != 2:
            raise DataError(f"{where}: example {i} is not an (x, y) pair")
        xs.append(torch.as_tensor(item[0]))
        ys.append(torch.as_tensor(item[1]))
    if not xs:
        raise DataError(f"{where}: dataset is empty")
    return torch.stack(xs), torch.stack(ys)


def pooled(fd: FederatedDataset) -> TensorDataset:
    """All devices' training data concatenated in device order (centralized baseline).

    This builds every device's data.
    """
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for k in range(fd.num_devices):
        x, y = dataset_tensors(fd.train(k), f"device {k} training data")
        xs.append(x)
        ys.append(y)
    return TensorDataset(torch.cat(xs), torch.cat(ys))
