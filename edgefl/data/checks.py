"""Checks of a data source before the job starts (``edgefl simulate``: in rank 0 while the
other ranks wait, see :func:`edgefl.launching.launch_checked`): a memory estimate, then
every device's training data and the test set.

:func:`edgefl.preflight.preflight` calls, in this order:

1. :func:`estimate_memory` and :func:`check_memory`: a few devices are built and measured,
   so a fleet that cannot fit is refused (one line naming ``fleet.devices``) before
   anything of the size of the fleet is built;
2. :func:`scan_devices`: each checked device's training data must be non-empty, match the
   data's :class:`~edgefl.data.base.DataInfo` (feature shape and dtype, the task's target
   shape and dtype), be finite, and hold labels in range (classification: int64 in
   ``[0, num_classes)``; binary: 0 or 1; lm: token ids in ``[0, vocab)``; regression:
   finite floats);
3. :func:`check_test`: the same for the test set.

Every failure is one :class:`~edgefl.errors.DataError` line naming the device (or the test
set), the example and the value where that is cheap, and ``data.source``, e.g.
``device 3: label 12 at example 40 is outside [0, 10) (data.source = 'mydata:make')``.

A device with no training examples is refused for every source (the ``(train, test)``
plug-in form, ``partition`` and ``fedh5`` already refuse one while building; this catches
the ``FederatedDataset`` plug-ins, whose devices are built lazily).

No MPI calls and nothing written; the only outside reads are the data source itself and
``/proc/meminfo`` (plus the cgroup memory files) for :func:`available_memory`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from edgefl.data.base import DataInfo, FederatedDataset, one_line
from edgefl.errors import ConfigError, DataError

#: values of ``run.preflight``
MODES = ("auto", "full", "sample", "off")
#: devices checked by ``run.preflight = "sample"`` (and first, by ``auto``)
SAMPLE_SIZE = 16
#: devices built for the memory estimate: 0, 1, the middle one and the last one
ESTIMATE_SIZE = 4
#: ``auto`` checks every device when the sample projects a full check under this (seconds)
AUTO_FULL_S = 3.0
#: memory of one process of the job before its data (bytes): a worker rank of the default
#: job measured 257 MiB proportional set size (230 MiB of it private; RSS 340 MiB, which
#: counts the shared libraries once per rank) with torch 2 (CPU) and Open MPI 5.0.11
RANK_BYTES = 270_000_000
#: per-device records of the coordinator and the workers besides the data (bytes): the
#: inline backend grew by 86 KB per device on the default synthetic job, about 46 KB of it
#: the data (training set, its test share, the source's per-device parameters)
DEVICE_RECORD_BYTES = 40_000
#: copies of the model a process holds (parameters, gradients, the global model, a delta)
MODEL_COPIES = 4


def sample_ids(num_devices: int, size: int = SAMPLE_SIZE) -> list[int]:
    """Device ids to check when not checking all: the first ``size // 2``, the last one
    and the rest evenly spaced in between (every id when ``num_devices <= size``)."""
    if num_devices <= size:
        return list(range(num_devices))
    head = size // 2
    ids = set(range(head)) | {num_devices - 1}
    inner = np.linspace(head, num_devices - 1, size - len(ids) + 2)[1:-1]
    ids |= {int(round(v)) for v in inner}
    return sorted(ids)


# -- memory ---------------------------------------------------------------------------------
def data_bytes(ds: Dataset) -> int:
    """Bytes a device's dataset holds: its tensors for a TensorDataset, the CSR arrays and
    labels of a sparse one (``clicks``), else ``len(ds)`` times the bytes of example 0."""
    if isinstance(ds, TensorDataset):
        return sum(t.element_size() * t.nelement() for t in ds.tensors)
    csr = getattr(ds, "csr", None)
    if csr is not None and all(hasattr(csr, a) for a in ("data", "indices", "indptr")):
        labels = np.asarray(getattr(ds, "labels", ()))
        return int(csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes + labels.nbytes)
    n = len(ds)  # type: ignore[arg-type]
    if n == 0:
        return 0
    first = ds[0]
    parts = first if isinstance(first, (tuple, list)) else (first,)
    one = 0
    for part in parts:
        t = torch.as_tensor(np.asarray(part)) if not isinstance(part, torch.Tensor) else part
        one += t.element_size() * t.nelement()
    return one * n


def fmt_bytes(n: float) -> str:
    """``n`` bytes as text in decimal units (``91.5 KB``; 1 KB = 1000 bytes)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass
class MemoryEstimate:
    """What a job needs in memory (bytes), from a few of its devices.

    Attributes:
        devices: fleet size.
        processes: processes of the job on this machine (the ranks and the launching one).
        device_bytes: per device: the mean data bytes of the sampled devices plus
            :data:`DEVICE_RECORD_BYTES`.
        model_bytes: bytes of the model's float32 parameters.
        test_bytes: bytes of the test set (0 until it is built).
        sampled: the devices that were built and measured.
    """

    devices: int
    processes: int
    device_bytes: int
    model_bytes: int
    test_bytes: int = 0
    sampled: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Estimated bytes of the whole job."""
        per_process = RANK_BYTES + MODEL_COPIES * self.model_bytes
        return self.devices * self.device_bytes + self.test_bytes + self.processes * per_process

    def breakdown(self) -> str:
        """The terms of :attr:`total`, as text."""
        shown = ", ".join(map(str, self.sampled[:ESTIMATE_SIZE]))
        text = (
            f"{self.devices} devices x {fmt_bytes(self.device_bytes)} (data of devices "
            f"{shown} + {fmt_bytes(DEVICE_RECORD_BYTES)} of records each) + {self.processes} "
            f"processes x {fmt_bytes(RANK_BYTES + MODEL_COPIES * self.model_bytes)}"
        )
        if self.test_bytes:
            text += f" + test set {fmt_bytes(self.test_bytes)}"
        return text


def estimate_memory(
    data: FederatedDataset, processes: int, model_bytes: int, size: int = ESTIMATE_SIZE
) -> MemoryEstimate:
    """Estimate the job's memory from ``size`` devices (:func:`sample_ids`: the first ones,
    the middle and the last), each built and measured with :func:`data_bytes`; the test
    set is not built (add it with ``test_bytes`` once it is). ``processes``: the ranks plus
    the launching process; ``model_bytes``: the model's parameters in bytes."""
    ids = sample_ids(data.num_devices, size)
    total = 0
    for k in ids:
        total += data_bytes(_train(data, k, ""))
    per_device = math.ceil(total / len(ids)) + DEVICE_RECORD_BYTES
    return MemoryEstimate(data.num_devices, processes, per_device, model_bytes, 0, ids)


def available_memory() -> tuple[int, str] | None:
    """(bytes this job can use, where the figure comes from): ``MemAvailable`` of
    /proc/meminfo (else ``os.sysconf`` free pages), lowered to a cgroup's memory limit
    minus its working set (usage less inactive file cache) where one is set; None when
    neither can be read."""
    found: tuple[int, str] | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = (int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found = (int(pages), "free pages (os.sysconf)")
        except (ValueError, OSError, AttributeError):
            pass
    room = _cgroup_room()
    if room is not None and (found is None or room < found[0]):
        found = (room, "the cgroup memory limit")
    return found


def _cgroup_room() -> int | None:
    """Bytes left under this container's cgroup memory limit; None if unlimited/unknown."""
    for limit_f, usage_f, stat_f, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        root = Path("/sys/fs/cgroup")
        try:
            raw = (root / limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            usage = int((root / usage_f).read_text())
            stats = dict(line.split()[:2] for line in (root / stat_f).read_text().splitlines())
            return max(0, int(raw) - (usage - int(stats.get(inactive, 0))))
        except (OSError, ValueError):
            continue
    return None


def check_memory(est: MemoryEstimate, available: tuple[int, str] | None) -> None:
    """ConfigError naming ``fleet.devices`` when the estimate exceeds ``available``."""
    if available is None or est.total <= available[0]:
        return
    raise ConfigError(
        f"config key 'fleet.devices' = {est.devices}: the job needs about "
        f"{fmt_bytes(est.total)} of memory and {fmt_bytes(available[0])} is available "
        f"({available[1]}): {est.breakdown()}; use fewer devices or less data per device, "
        'or skip this estimate with run.preflight = "off"'
    )


# -- the scan -------------------------------------------------------------------------------
@dataclass
class ScanReport:
    """What :func:`scan_devices` checked.

    Attributes:
        checked: devices checked. devices: fleet size. seconds: time taken (seconds).
        projected_s: seconds a check of every device would take (the sample's median
            time per device times the devices).
    """

    checked: int
    devices: int
    seconds: float
    projected_s: float


def scan_devices(
    data: FederatedDataset,
    mode: str,
    source: str,
    *,
    budget_s: float = AUTO_FULL_S,
    clock: Callable[[], float] = time.perf_counter,
) -> ScanReport:
    """Check devices' training data (:func:`check_device`): ``sample``: those of
    :func:`sample_ids`; ``full``: every device; ``auto``: the sample, then every device
    when the sample's median time per device, times the devices, is under ``budget_s``
    seconds. Each device is forgotten once checked (:meth:`FederatedDataset.forget`): the
    scan holds one device's data at a time. Raises DataError (one line) at the first bad
    device."""
    if mode not in ("auto", "full", "sample"):
        raise ValueError(f"mode must be auto, full or sample, not {mode!r}")
    n = data.num_devices
    first = sample_ids(n)
    t0 = clock()
    times = []
    for k in first:
        t = clock()
        check_device(data, k, source)
        times.append(clock() - t)
        data.forget(k)  # (one device at a time: the fleet's data is never held here)
    spent = clock() - t0
    # the median: devices the memory estimate already built are quick, a first one slow
    projected = float(np.median(times)) * n
    if mode == "sample" or (mode == "auto" and projected > budget_s):
        return ScanReport(len(first), n, spent, projected)
    done = set(first)
    for k in range(n):
        if k not in done:
            check_device(data, k, source)
            data.forget(k)
    return ScanReport(n, n, clock() - t0, projected)


def check_device(data: FederatedDataset, device: int, source: str) -> None:
    """Device ``device``'s training data: at least one example, as many as
    ``num_samples()`` says, and :func:`check_examples`. DataError naming the device."""
    where = f"device {device}"
    ds = _train(data, device, source)
    try:
        claimed = int(data.num_samples(device))
        held = len(ds)  # type: ignore[arg-type]
    except DataError as e:
        raise DataError(f"{e} (data.source = {source!r})") from None
    except Exception as e:  # the user's dataset failed: one line
        raise DataError(
            f"{where}: num_samples() or len() raised {type(e).__name__}: {one_line(e)} "
            f"(data.source = {source!r})"
        ) from None
    if claimed == 0 or held == 0:
        raise DataError(
            f"{where}: no training examples (num_samples() = {claimed}, {held} in train()); "
            f"every device needs at least one (data.source = {source!r})"
        )
    if claimed != held:
        raise DataError(
            f"{where}: num_samples() = {claimed} but train() holds {held} examples "
            f"(data.source = {source!r})"
        )
    check_examples(ds, data.info, where, source)


def check_test(data: FederatedDataset, source: str, memory_bytes: int = 0) -> tuple[Dataset, int]:
    """The test set, built (in memory, or over ``memory_bytes`` to a temporary file part by
    part, each part checked before it is written: :func:`edgefl.data.spill.load_test`),
    non-empty and :func:`check_examples`; returns it and the bytes it holds in memory (0 for
    a spilled one)."""
    from .spill import SpilledTensors, load_test

    def check(part: Dataset) -> None:
        check_examples(part, data.info, "test set", source)

    try:
        test = load_test(data, memory_bytes, check)
        n = len(test)  # type: ignore[arg-type]
    except DataError:
        raise
    except Exception as e:  # the user's dataset failed: one line
        raise DataError(
            f"test set: test() raised {type(e).__name__}: {one_line(e)} (data.source = {source!r})"
        ) from None
    if n == 0:
        raise DataError(f"test set: no examples (data.source = {source!r})")
    if isinstance(test, SpilledTensors):
        return test, 0
    check_examples(test, data.info, "test set", source)
    return test, data_bytes(test)


def check_examples(ds: Dataset, info: DataInfo, where: str, source: str) -> None:
    """Features and targets of ``ds`` against ``info`` (module docstring); DataError
    ``"<where>: ... (data.source = '<source>')"`` at the first problem."""
    try:
        csr = getattr(ds, "csr", None)
        if csr is not None and hasattr(csr, "indptr") and hasattr(ds, "labels"):
            _check_sparse(csr, info)
            y = torch.as_tensor(np.asarray(ds.labels))
            _check_targets(y, (len(y), *info.input_shape), info)
        else:
            x, y = _tensors(ds, info)
            _check_features(x, info)
            _check_targets(y, tuple(x.shape), info)
    except _Bad as e:
        raise DataError(f"{where}: {e} (data.source = {source!r})") from None


class _Bad(Exception):
    """A problem found in one dataset (the message without where / source)."""


def _train(data: FederatedDataset, device: int, source: str) -> Dataset:
    try:
        return data.train(device)
    except DataError:
        raise
    except Exception as e:  # the user's dataset failed: one line
        raise DataError(
            f"device {device}: train() raised {type(e).__name__}: {one_line(e)} "
            f"(data.source = {source!r})"
        ) from None


def _tensors(ds: Dataset, info: DataInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of a dataset of (x, y) pairs, stacked; a bad example is named."""
    if isinstance(ds, TensorDataset) and len(ds.tensors) == 2:
        return ds.tensors[0], ds.tensors[1]
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for i in range(len(ds)):  # type: ignore[arg-type]
        try:
            item = ds[i]
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise _Bad(f"example {i} is not an (x, y) pair")
            x, y = torch.as_tensor(item[0]), torch.as_tensor(item[1])
        except _Bad:
            raise
        except Exception as e:  # the user's dataset failed: one line
            raise _Bad(f"example {i}: {type(e).__name__}: {one_line(e)}") from None
        if tuple(x.shape) != info.input_shape:
            raise _Bad(
                f"example {i} has feature shape {tuple(x.shape)}, the data's input_shape is "
                f"{info.input_shape}"
            )
        if ys and (y.shape != ys[0].shape or y.dtype != ys[0].dtype):
            raise _Bad(
                f"example {i} has a target of shape {tuple(y.shape)} {y.dtype}, example 0 "
                f"{tuple(ys[0].shape)} {ys[0].dtype}"
            )
        if xs and x.dtype != xs[0].dtype:
            raise _Bad(f"example {i} has features of dtype {x.dtype}, example 0 {xs[0].dtype}")
        xs.append(x)
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def _first(bad: torch.Tensor, values: torch.Tensor) -> tuple[int, Any]:
    """(example index, value) of the first True in ``bad`` (shape of ``values``)."""
    flat = bad.reshape(-1)
    pos = int(torch.argmax(flat.to(torch.uint8)))
    per_example = max(1, flat.numel() // max(1, values.shape[0])) if values.dim() else 1
    return pos // per_example, values.reshape(-1)[pos].item()


#: features checked for NaN/inf at a time (their temporaries: a few MB, not the set's size)
CHECK_ELEMENTS = 1 << 20


def _check_features(x: torch.Tensor, info: DataInfo) -> None:
    shape = tuple(x.shape[1:])
    if shape != info.input_shape:
        raise _Bad(
            f"feature shape {shape} per example, the data's input_shape is {info.input_shape}"
        )
    want = torch.float32 if info.input_dtype == "float32" else torch.int64
    if x.dtype != want:
        raise _Bad(f"features are {x.dtype}, the data's input_dtype is {info.input_dtype}")
    if x.is_floating_point():  # (a part at a time: isfinite of a whole test set took 1.7x
        step = max(1, CHECK_ELEMENTS // max(1, x[:1].numel()))  # its size more)
        for lo in range(0, x.shape[0], step):
            part = x[lo : lo + step]
            bad = ~torch.isfinite(part)
            if bool(bad.any()):
                i, v = _first(bad, part)
                raise _Bad(f"feature value {v} at example {lo + i} is not finite")
        return
    if x.numel() and int(x.min()) < 0:
        i, v = _first(x < 0, x)
        raise _Bad(f"token id {v} at example {i} is negative")
    if info.task == "lm" and x.numel() and int(x.max()) >= info.num_classes:
        i, v = _first(x >= info.num_classes, x)
        raise _Bad(f"token id {v} at example {i} is outside [0, {info.num_classes})")


def _check_targets(y: torch.Tensor, x_shape: Sequence[int], info: DataInfo) -> None:
    task, c = info.task, info.num_classes
    if y.dim() == 0:
        raise _Bad("targets have no example dimension")
    per = tuple(y.shape[1:])
    if task in ("classification", "lm"):
        if y.dtype != torch.int64:
            raise _Bad(f"labels are {y.dtype}, expected int64 class ids (task {task!r})")
        if task == "classification" and per != ():
            raise _Bad(f"labels have shape {per} per example, expected one class id each")
        if task == "lm" and tuple(y.shape) != tuple(x_shape):
            raise _Bad(f"targets have shape {per} per example, expected the feature shape")
        bad = (y < 0) | (y >= c)
        if bool(bad.any()):
            i, v = _first(bad, y)
            what = "label" if task == "classification" else "target token id"
            raise _Bad(f"{what} {v} at example {i} is outside [0, {c})")
        return
    if y.is_complex() or y.dtype == torch.bool:
        raise _Bad(f"targets are {y.dtype}, expected real numbers (task {task!r})")
    if y.is_floating_point():
        bad = ~torch.isfinite(y)
        if bool(bad.any()):
            i, v = _first(bad, y)
            raise _Bad(f"target {v} at example {i} is not finite")
    width = int(np.prod(per)) if per else 1
    if task == "binary":
        if width != 1:
            raise _Bad(f"labels have shape {per} per example, expected one 0/1 label each")
        bad = (y != 0) & (y != 1)
        if bool(bad.any()):
            i, v = _first(bad, y)
            raise _Bad(f"label {v} at example {i} is not 0 or 1 (task 'binary')")
        return
    if not y.is_floating_point():
        raise _Bad(f"targets are {y.dtype}, expected floats (task 'regression')")
    if width != c:
        raise _Bad(f"targets have shape {per} per example, expected num_classes = {c} values each")


def _check_sparse(csr: Any, info: DataInfo) -> None:
    shape = tuple(int(d) for d in csr.shape[1:])
    if shape != info.input_shape:
        raise _Bad(
            f"feature shape {shape} per example, the data's input_shape is {info.input_shape}"
        )
    values = np.asarray(csr.data)
    finite = np.isfinite(values)
    if not finite.all():
        pos = int(np.argmin(finite))
        row = int(np.searchsorted(np.asarray(csr.indptr), pos, side="right")) - 1
        raise _Bad(f"feature value {values[pos]} at example {row} is not finite")
