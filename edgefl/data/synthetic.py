"""LEAF-style ``synthetic(alpha, beta)`` federated classification data.

Following Li et al. (FedProx) / Caldas et al. (LEAF), device ``k`` has its own model and
feature distribution:

* ``u_k ~ N(0, alpha)`` and ``B_k ~ N(0, beta)`` (second argument = standard deviation, as in
  the reference generator);
* ``W_k ~ N(u_k, 1)`` of shape ``(classes, dim)``, ``b_k ~ N(u_k, 1)`` of shape ``(classes,)``;
* feature mean ``v_k`` with entries ``~ N(B_k, 1)``;
* ``x ~ N(v_k, Sigma)`` with diagonal covariance ``Sigma_jj = j ** -1.2`` (``j`` from 1);
* ``y = argmax(W_k x + b_k)``.

``n_k = max(min_samples, int(lognormal(samples_mean_log, samples_sigma)))`` examples.
With ``iid = true`` every device shares one ``(W, b)`` and ``v_k = 0``.

Each device draws from its own random streams keyed on ``(seed, k)``, so a worker can build
device ``k`` without building any other device, on any rank, with identical results.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from edgefl.data._args import Args
from edgefl.data.base import DOMAIN_SYNTHETIC, DataInfo, FederatedDataset, stream_rng

ACCEPTED_ARGS = [
    "alpha",
    "beta",
    "dim",
    "classes",
    "samples_mean_log",
    "samples_sigma",
    "min_samples",
    "iid",
    "test_samples_per_device",
]

_PARAMS, _TRAIN, _TEST, _SHARED = 1, 2, 3, 4


class SyntheticFederated(FederatedDataset):
    """LEAF synthetic(alpha, beta) data; see the module docstring for the generative model."""

    def __init__(self, args: dict[str, Any] | None, num_devices: int, seed: int) -> None:
        a = Args("synthetic", args, ACCEPTED_ARGS)
        self.alpha = a.number("alpha", 1.0, lo=0.0)
        self.beta = a.number("beta", 1.0, lo=0.0)
        self.dim = a.integer("dim", 60, lo=1)
        self.classes = a.integer("classes", 10, lo=2)
        self.samples_mean_log = a.number("samples_mean_log", 4.5, lo=-50.0, hi=20.0)
        self.samples_sigma = a.number("samples_sigma", 0.5, lo=0.0, hi=10.0)
        self.min_samples = a.integer("min_samples", 20, lo=1)
        self.iid = a.flag("iid", False)
        self.test_samples_per_device = a.integer("test_samples_per_device", 20, lo=1)
        super().__init__(DataInfo(input_shape=(self.dim,), num_classes=self.classes), num_devices)
        self.seed = seed
        # Per-coordinate standard deviation: sqrt(Sigma_jj) = j ** -0.6.
        self._std = np.arange(1, self.dim + 1, dtype=np.float64) ** -0.6
        self._zeros = np.zeros(self.dim)  # (v_k of every IID device)
        self._sizes: dict[int, int] = {}  # n_k (the parameters are drawn again when needed)
        self._shared: tuple[np.ndarray, np.ndarray] | None = None
        self._train: dict[int, TensorDataset] = {}
        self._test: TensorDataset | None = None

    def _device_params(self, k: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``(n_k, W_k, b_k, v_k)`` of device ``k`` (draws only device k's stream). Not
        cached: a device's data is built once per split, and a cache would hold every
        device's parameters on rank 0 (which builds the test share of all of them)."""
        rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, _PARAMS, k)
        n = self._size(rng)
        u = rng.normal(0.0, self.alpha)
        big_b = rng.normal(0.0, self.beta)
        w = rng.normal(u, 1.0, size=(self.classes, self.dim))
        b = rng.normal(u, 1.0, size=self.classes)
        v = rng.normal(big_b, 1.0, size=self.dim)
        if self.iid:
            w, b = self._shared_model()
            v = np.zeros(self.dim)
        self._sizes[k] = n
        return n, w, b, v

    def _size(self, rng: np.random.Generator) -> int:
        """n_k: the first draw of device k's parameter stream."""
        size = rng.lognormal(mean=self.samples_mean_log, sigma=self.samples_sigma)
        return max(self.min_samples, int(size))

    def _shared_model(self) -> tuple[np.ndarray, np.ndarray]:
        if self._shared is None:
            rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, _SHARED, 0)
            w = rng.normal(0.0, 1.0, size=(self.classes, self.dim))
            b = rng.normal(0.0, 1.0, size=self.classes)
            self._shared = (w, b)
        return self._shared

    def _sample(self, k: int, stream: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.empty((n, self.dim), np.float32)
        y = np.empty(n, np.int64)
        self._sample_into(k, stream, x, y)
        return torch.from_numpy(x), torch.from_numpy(y)

    def _sample_into(self, k: int, stream: int, x_out: np.ndarray, y_out: np.ndarray) -> None:
        """Draw ``len(y_out)`` examples of device ``k`` from ``stream`` into the float32 /
        int64 arrays given (drawn in float64, then rounded to float32)."""
        if self.iid:  # (every device's model is the shared one: its own draws unused)
            w, b = self._shared_model()
            v = self._zeros
        else:
            _, w, b, v = self._device_params(k)
        rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, stream, k)
        x = v + rng.standard_normal((len(y_out), self.dim)) * self._std
        np.argmax(x @ w.T + b, axis=1, out=y_out)
        x_out[...] = x

    def num_samples(self, device: int) -> int:
        """Training examples of ``device`` (count of examples, no data generated)."""
        k = self.check_device(device)
        n = self._sizes.get(k)
        if n is None:
            n = self._sizes[k] = self._size(stream_rng(self.seed, DOMAIN_SYNTHETIC, _PARAMS, k))
        return n

    def train(self, device: int) -> TensorDataset:
        """Device ``device``'s training set: x float32 ``(n_k, dim)``, y int64 ``(n_k,)``."""
        k = self.check_device(device)
        if k not in self._train:
            x, y = self._sample(k, _TRAIN, self.num_samples(k))
            self._train[k] = TensorDataset(x, y)
        return self._train[k]

    def forget(self, device: int) -> None:
        """Drop the cached training set of ``device`` (:meth:`train` builds it again)."""
        self._train.pop(self.check_device(device), None)

    def test(self) -> TensorDataset:
        """``test_samples_per_device`` held-out examples from every device's distribution."""
        if self._test is None:
            self._test = self._test_of(0, self.num_devices)
        return self._test

    def test_nbytes(self) -> int:
        """Bytes of :meth:`test` (float32 features, int64 labels), without building it."""
        return self.num_devices * self.test_samples_per_device * (4 * self.dim + 8)

    def test_parts(self, rows: int) -> Iterator[TensorDataset]:
        """:meth:`test` in parts of whole devices' shares (about ``rows`` examples each),
        built one at a time and not kept."""
        per = max(1, rows // self.test_samples_per_device)
        for k in range(0, self.num_devices, per):
            yield self._test_of(k, min(k + per, self.num_devices))

    def _test_of(self, first: int, stop: int) -> TensorDataset:
        """The test examples of devices ``first .. stop - 1``, in device order."""
        m = self.test_samples_per_device
        x = np.empty(((stop - first) * m, self.dim), np.float32)  # (filled in place: a
        y = np.empty((stop - first) * m, np.int64)  # large fleet's test set is large)
        for i, k in enumerate(range(first, stop)):
            self._sample_into(k, _TEST, x[i * m : (i + 1) * m], y[i * m : (i + 1) * m])
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
