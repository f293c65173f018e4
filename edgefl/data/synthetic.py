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
        self._params: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._shared: tuple[np.ndarray, np.ndarray] | None = None
        self._train: dict[int, TensorDataset] = {}
        self._test: TensorDataset | None = None

    def _device_params(self, k: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """``(n_k, W_k, b_k, v_k)`` of device ``k`` (cached; draws only device k's stream)."""
        if k not in self._params:
            rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, _PARAMS, k)
            size = rng.lognormal(mean=self.samples_mean_log, sigma=self.samples_sigma)
            n = max(self.min_samples, int(size))
            u = rng.normal(0.0, self.alpha)
            big_b = rng.normal(0.0, self.beta)
            w = rng.normal(u, 1.0, size=(self.classes, self.dim))
            b = rng.normal(u, 1.0, size=self.classes)
            v = rng.normal(big_b, 1.0, size=self.dim)
            if self.iid:
                w, b = self._shared_model()
                v = np.zeros(self.dim)
            self._params[k] = (n, w, b, v)
        return self._params[k]

    def _shared_model(self) -> tuple[np.ndarray, np.ndarray]:
        if self._shared is None:
            rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, _SHARED, 0)
            w = rng.normal(0.0, 1.0, size=(self.classes, self.dim))
            b = rng.normal(0.0, 1.0, size=self.classes)
            self._shared = (w, b)
        return self._shared

    def _sample(self, k: int, stream: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, w, b, v = self._device_params(k)
        rng = stream_rng(self.seed, DOMAIN_SYNTHETIC, stream, k)
        x = v + rng.standard_normal((n, self.dim)) * self._std
        y = np.argmax(x @ w.T + b, axis=1)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))

    def num_samples(self, device: int) -> int:
        """Training examples of ``device`` (count of examples, no data generated)."""
        return self._device_params(self.check_device(device))[0]

    def train(self, device: int) -> TensorDataset:
        """Device ``device``'s training set: x float32 ``(n_k, dim)``, y int64 ``(n_k,)``."""
        k = self.check_device(device)
        if k not in self._train:
            x, y = self._sample(k, _TRAIN, self._device_params(k)[0])
            self._train[k] = TensorDataset(x, y)
        return self._train[k]

    def test(self) -> TensorDataset:
        """``test_samples_per_device`` held-out examples from every device's distribution."""
        if self._test is None:
            parts = [
                self._sample(k, _TEST, self.test_samples_per_device)
                for k in range(self.num_devices)
            ]
            self._test = TensorDataset(
                torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            )
        return self._test
