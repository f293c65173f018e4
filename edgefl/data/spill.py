"""A large test set kept on disk instead of in rank 0's memory (``run.test_memory_mb``).

Rank 0 evaluates the global model on the fleet's test set, and the synthetic source draws
a share of it from every device's distribution: 100 examples of dimension 20 a device are
880 MB at 100,000 devices, the largest thing rank 0 holds. Evaluation reads the test set in
order, one batch at a time, so it need not be in memory: :func:`load_test` builds it part by
part (:meth:`edgefl.data.base.FederatedDataset.test_parts`) and, when the source says it is
larger than the budget (:meth:`~edgefl.data.base.FederatedDataset.test_nbytes`: the synthetic
source and ``fedh5`` know it), writes each part to a temporary file and keeps only the file
(:class:`SpilledTensors`). The evaluation
reads the same batches from it (:meth:`SpilledTensors.batches`: the same rows, the same
order, the same boundaries), so the loss and accuracy are bit for bit those of the test set
in memory.

The files are unlinked as soon as they are created (``tempfile.TemporaryFile``: in
``$TMPDIR``, default ``/tmp``), so nothing is left behind by a process that ends in any way,
SIGKILL included. Their pages live in the operating system's page cache, which gives them
back under memory pressure (then an evaluation reads them from disk again): a ``/tmp`` on
tmpfs keeps them in memory after all; point ``TMPDIR`` at a disk there.

A source that builds its test set only whole (the default ``test_parts``), or does not know
its size beforehand (``test_nbytes`` None), keeps it in memory as before.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError

PART_ROWS = 1 << 18  # examples a source builds at a time for a spilled test set
BLOCK_BYTES = 8 << 20  # bytes read from the files at a time by :meth:`SpilledTensors.batches`


class SpilledTensors(Dataset):
    """Features and targets (two tensors of ``n`` rows) in two unlinked temporary files.

    A map-style dataset (``len``, ``ds[i]`` -> ``(x_i, y_i)``) whose :meth:`batches` reads
    consecutive rows in blocks; :func:`edgefl.models.train.evaluate` and the evaluation
    metrics iterate it that way. Rows are appended part by part with :meth:`append`; every
    part must have the first part's dtypes and per-row shapes.
    """

    def __init__(self, directory: str | None = None) -> None:
        self._files = (tempfile.TemporaryFile(dir=directory), tempfile.TemporaryFile(dir=directory))
        self._lock = threading.Lock()  # (a file's position is shared: one reader at a time)
        self.n = 0
        self._rows: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # per-row shapes
        self._dtypes: tuple[np.dtype, np.dtype] | None = None

    def append(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Write ``len(x)`` more rows (``x`` and ``y`` of equal length, CPU tensors)."""
        xs, ys = _numpy(x, "features"), _numpy(y, "targets")
        if len(xs) != len(ys):
            raise DataError(f"test set: a part has {len(xs)} feature rows and {len(ys)} targets")
        rows, dtypes = (xs.shape[1:], ys.shape[1:]), (xs.dtype, ys.dtype)
        if self._rows is None:
            self._rows, self._dtypes = rows, dtypes
        elif (rows, dtypes) != (self._rows, self._dtypes):
            raise DataError(
                f"test set: a part of {_kind(rows, dtypes)} after parts of "
                f"{_kind(self._rows, self._dtypes)}"
            )
        with self._lock:
            for f, a in zip(self._files, (xs, ys)):
                f.seek(0, 2)
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        self.n += len(xs)

    def __len__(self) -> int:
        return self.n

    def _read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, stop)`` as two new tensors."""
        assert self._rows is not None and self._dtypes is not None
        out = []
        with self._lock:
            for f, shape, dtype in zip(self._files, self._rows, self._dtypes):
                a = np.empty((stop - start, *shape), dtype)
                f.seek(start * a.itemsize * int(np.prod(shape, dtype=np.int64)))
                if f.readinto(memoryview(a).cast("B")) != a.nbytes:
                    raise DataError("test set: its temporary file is shorter than written")
                out.append(torch.from_numpy(a))
        return out[0], out[1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"test set index {i} out of range for {self.n} examples")
        x, y = self._read(i, i + 1)
        return x[0], y[0]

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Rows ``[0, bs), [bs, 2 bs), ...`` in order (the last one shorter), read a few
        megabytes at a time: the batches a slicing of the tensors in memory gives."""
        if self.n == 0 or self._rows is None or self._dtypes is None:
            return
        row = sum(
            d.itemsize * int(np.prod(s, dtype=np.int64)) for s, d in zip(self._rows, self._dtypes)
        )
        per = max(1, BLOCK_BYTES // max(row * batch_size, 1)) * batch_size  # rows a block
        for start in range(0, self.n, per):
            x, y = self._read(start, min(start + per, self.n))
            for i in range(0, len(x), batch_size):
                yield x[i : i + batch_size], y[i : i + batch_size]

    @property
    def nbytes(self) -> int:
        """Bytes in the files (not in memory)."""
        return sum(f.seek(0, 2) for f in self._files)

    def close(self) -> None:
        """Drop the files (the dataset is empty afterwards)."""
        for f in self._files:
            f.close()
        self.n = 0


def _kind(rows: tuple, dtypes: tuple) -> str:
    """'features float32 (3,) and targets int64 ()': dtypes and shapes of one example."""
    return f"features {dtypes[0]} {tuple(rows[0])} and targets {dtypes[1]} {tuple(rows[1])}"


def _numpy(t: Any, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise DataError(f"test set: a part's {what} are not a CPU tensor ({type(t).__name__})")
    try:
        return t.detach().numpy()
    except TypeError as e:  # (bfloat16 and other dtypes numpy lacks)
        raise DataError(
            f"test set: a part's {what} of dtype {t.dtype} cannot be spilled: {e}"
        ) from None


def spill_budget(cfg: dict) -> int:
    """``run.test_memory_mb`` in bytes (0: no limit)."""
    return int(cfg["run"]["test_memory_mb"] * (1 << 20))


def load_test(
    data: Any, memory_bytes: int, check: Callable[[Dataset], None] | None = None
) -> Dataset:
    """``data``'s test set: ``data.test()`` (in memory) unless the source knows its size
    (``data.test_nbytes()``) and it is over ``memory_bytes`` (0: no limit); then a
    :class:`SpilledTensors` written from ``data.test_parts(PART_ROWS)``, each part given to
    ``check`` (the pre-launch check's) before it is written."""
    size = data.test_nbytes()
    if not memory_bytes or size is None or size <= memory_bytes:
        return data.test()
    spilled = None
    try:
        spilled = SpilledTensors()
        for part in data.test_parts(PART_ROWS):
            if check is not None:
                check(part)
            tensors = getattr(part, "tensors", None)
            if tensors is None or len(tensors) != 2:
                raise DataError(
                    f"test set: a part of type {type(part).__name__} is not a TensorDataset of "
                    "(features, targets)"
                )
            spilled.append(*tensors)
    except BaseException as e:
        if spilled is not None:
            spilled.close()
        if isinstance(e, OSError):  # (no such directory, no room, no permission)
            raise DataError(
                f"test set: its {size / 1e6:.1f} MB (over run.test_memory_mb = "
                f"{memory_bytes / (1 << 20):g}) go to a temporary file in "
                f"{tempfile.gettempdir()}, which failed: {e.strerror or e}; set TMPDIR to a "
                "directory with room, or raise run.test_memory_mb to keep it in memory"
            ) from None
        raise
    return spilled
