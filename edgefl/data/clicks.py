"""``clicks``: synthetic click-like sparse binary classification data (about 10^6 features).

Built for the parameter-server mechanisms (:mod:`edgefl.policies.keyrange`, ``filters``,
``compress``): each example references a handful of features out of a huge vocabulary whose
frequencies follow a power law, so a device's data touches only a small working set of the
model, and that share shrinks as the same data is spread over more devices.

Generative model (every draw keyed on ``(seed, device)``, so any rank can build any device
alone, identically):

* feature popularity: rank ``r = 0, 1, ...`` is drawn with probability proportional to
  ``(r + 1) ** -zipf`` (a Zipf law over ``features`` ranks);
* non-IID features: device ``k`` has a random offset ``o_k``; each of an example's
  ``nnz_per_example`` feature draws is, with probability ``noniid``, the device-local feature
  ``(r + o_k) mod features`` and otherwise the global feature ``r``. Duplicate draws within an
  example collapse to one, so a row has at most ``nnz_per_example`` nonzeros, all equal to 1;
* labels: a shared sparse true weight vector ``w*`` (each feature informative with
  probability ``informative``, weight ``~ N(0, weight_scale^2)``), a device label shift
  ``s_k ~ N(0, label_skew^2)``, and ``y ~ Bernoulli(sigmoid(x . w* + base_logit + s_k))``;
* ``samples_per_device`` training examples per device; the shared test set has
  ``test_samples_per_device`` examples from each device's distribution.

Storage is sparse: ``train(k)`` returns a :class:`SparseExamples` holding a
``scipy.sparse.csr_matrix`` (float32, ``n x features``) and int64 labels, about 8 bytes per
nonzero; nothing of size ``features`` is kept per device. ``DataInfo`` is
``input_shape = (features,)``, ``num_classes = 2``.

How a sparse model consumes it: a linear model ``p = sigmoid(X w + b)`` computes ``X @ w``
with the CSR matrix directly (``ex.csr @ w``) and its gradient ``X.T @ (p - y) / n``;
the columns with a nonzero (:func:`edgefl.policies.keyrange.csr_columns`) are the device's
working set, so it can pull and push only those keys. ``ex.torch_sparse()`` gives a torch
sparse COO tensor for ``torch.sparse.mm``. Indexing ``ex[i]`` returns a dense float32 row (for
generic code paths only; it is ``4 * features`` bytes per example).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from edgefl.data._args import Args
from edgefl.data.base import DataInfo, FederatedDataset, stream_rng

if TYPE_CHECKING:  # (imported where used: every process loads this module, few use scipy)
    import scipy.sparse as sp

ACCEPTED_ARGS = [
    "features",
    "samples_per_device",
    "nnz_per_example",
    "zipf",
    "noniid",
    "label_skew",
    "informative",
    "weight_scale",
    "base_logit",
    "test_samples_per_device",
]

# Domain tag of this source's random streams (edgefl.data.base keeps 1..5 for the others).
DOMAIN_CLICKS = 11
_TRUTH, _DEVICE, _TRAIN, _TEST = 1, 2, 3, 4


@lru_cache(maxsize=4)
def zipf_cdf(features: int, zipf: float) -> np.ndarray:
    """Cumulative probabilities (float64, ``features`` entries) of ranks under the Zipf law."""
    p = np.arange(1, features + 1, dtype=np.float64) ** -float(zipf)
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    cdf.flags.writeable = False
    return cdf


class SparseExamples(Dataset):
    """A device's examples: ``csr`` (scipy CSR float32, ``n x features``) and ``labels``
    (int64 numpy, ``n``). ``ex[i]`` is ``(dense float32 row tensor, int64 label tensor)``."""

    def __init__(self, csr: sp.csr_matrix, labels: np.ndarray) -> None:
        self.csr = csr
        self.labels = labels

    def __len__(self) -> int:
        return int(self.csr.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = np.asarray(self.csr[i].todense(), dtype=np.float32).reshape(-1)
        return torch.from_numpy(row), torch.tensor(int(self.labels[i]), dtype=torch.int64)

    @property
    def nnz(self) -> int:
        """Stored nonzeros."""
        return int(self.csr.nnz)

    def torch_sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: x a coalesced torch sparse COO float32 tensor (for ``torch.sparse.mm``),
        y int64 labels."""
        coo = self.csr.tocoo()
        idx = torch.from_numpy(np.vstack([coo.row, coo.col]).astype(np.int64))
        x = torch.sparse_coo_tensor(
            idx,
            torch.from_numpy(coo.data.astype(np.float32)),
            size=self.csr.shape,
            is_coalesced=True,
            check_invariants=True,
        )
        return x, torch.from_numpy(self.labels)


class ClicksFederated(FederatedDataset):
    """Synthetic sparse click data; see the module docstring for the model.

    Args (``[data.args]``, defaults in brackets): ``features`` [1_000_000] vocabulary size;
    ``samples_per_device`` [1000]; ``nnz_per_example`` [20] feature draws per example;
    ``zipf`` [1.1] power-law exponent (> 0); ``noniid`` [0.5] share of device-local feature
    draws (0 = IID features); ``label_skew`` [0.5] std of the per-device logit shift;
    ``informative`` [0.1] share of features with a nonzero true weight; ``weight_scale`` [1.0]
    std of those weights; ``base_logit`` [-1.0] logit offset (about 27% positives when the
    weights cancel); ``test_samples_per_device`` [100].
    """

    def __init__(self, args: dict[str, Any] | None, num_devices: int, seed: int) -> None:
        a = Args("clicks", args, ACCEPTED_ARGS)
        self.features = a.integer("features", 1_000_000, lo=2, hi=2**31 - 1)
        self.samples_per_device = a.integer("samples_per_device", 1000, lo=1)
        self.nnz_per_example = a.integer("nnz_per_example", 20, lo=1, hi=self.features)
        self.zipf = a.number("zipf", 1.1, lo=0.0, lo_open=True, hi=10.0)
        self.noniid = a.number("noniid", 0.5, lo=0.0, hi=1.0)
        self.label_skew = a.number("label_skew", 0.5, lo=0.0)
        self.informative = a.number("informative", 0.1, lo=0.0, hi=1.0)
        self.weight_scale = a.number("weight_scale", 1.0, lo=0.0)
        self.base_logit = a.number("base_logit", -1.0, lo=-50.0, hi=50.0)
        self.test_samples_per_device = a.integer("test_samples_per_device", 100, lo=1)
        super().__init__(DataInfo(input_shape=(self.features,), num_classes=2), num_devices)
        self.seed = seed
        self._truth: np.ndarray | None = None
        self._dev: dict[int, tuple[int, float]] = {}
        self._train: dict[int, SparseExamples] = {}
        self._test: SparseExamples | None = None

    def true_weights(self) -> np.ndarray:
        """The shared true weight vector ``w*`` (float32, ``features``; mostly zeros)."""
        if self._truth is None:
            rng = stream_rng(self.seed, DOMAIN_CLICKS, _TRUTH, 0)
            on = rng.random(self.features) < self.informative
            w = rng.normal(0.0, self.weight_scale, size=self.features)
            self._truth = np.where(on, w, 0.0).astype(np.float32)
        return self._truth

    def device_params(self, device: int) -> tuple[int, float]:
        """``(feature offset o_k, label shift s_k)`` of ``device``."""
        k = self.check_device(device)
        if k not in self._dev:
            rng = stream_rng(self.seed, DOMAIN_CLICKS, _DEVICE, k)
            offset = int(rng.integers(0, self.features))
            shift = float(rng.normal(0.0, self.label_skew))
            self._dev[k] = (offset, shift)
        return self._dev[k]

    def _sample(self, k: int, stream: int, n: int) -> SparseExamples:
        offset, shift = self.device_params(k)
        rng = stream_rng(self.seed, DOMAIN_CLICKS, stream, k)
        draws = n * self.nnz_per_example
        ranks = np.searchsorted(zipf_cdf(self.features, self.zipf), rng.random(draws), "right")
        ranks = np.minimum(ranks, self.features - 1)
        local = rng.random(draws) < self.noniid
        feats = np.where(local, (ranks + offset) % self.features, ranks).astype(np.int32)
        rows = np.repeat(np.arange(n, dtype=np.int32), self.nnz_per_example)
        ones = np.ones(draws, np.float32)
        import scipy.sparse as sp

        csr = sp.csr_matrix((ones, (rows, feats)), shape=(n, self.features), dtype=np.float32)
        csr.sum_duplicates()
        csr.data[:] = 1.0
        csr.sort_indices()
        logits = csr @ self.true_weights().astype(np.float64) + self.base_logit + shift
        y = (rng.random(n) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
        return SparseExamples(csr, y)

    def num_samples(self, device: int) -> int:
        """Training examples of ``device`` (``samples_per_device``; nothing is generated)."""
        self.check_device(device)
        return self.samples_per_device

    def train(self, device: int) -> SparseExamples:
        """Device ``device``'s training examples (sparse; built once, then cached)."""
        k = self.check_device(device)
        if k not in self._train:
            self._train[k] = self._sample(k, _TRAIN, self.samples_per_device)
        return self._train[k]

    def forget(self, device: int) -> None:
        """Drop the cached training set of ``device`` (:meth:`train` builds it again)."""
        self._train.pop(self.check_device(device), None)

    def test(self) -> SparseExamples:
        """``test_samples_per_device`` held-out examples from every device's distribution."""
        if self._test is None:
            import scipy.sparse as sp

            parts = [
                self._sample(k, _TEST, self.test_samples_per_device)
                for k in range(self.num_devices)
            ]
            self._test = SparseExamples(
                sp.vstack([p.csr for p in parts], format="csr"),
                np.concatenate([p.labels for p in parts]),
            )
        return self._test
