"""The one hold-out split of a device's samples: Hermes' gate measures its loss on it, federated
evaluation scores the model on it, and rank 0 sizes the devices' training sets with the
same rule (:func:`holdout_size`), so both sides agree without a message."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset

from ..seeding import HOLDOUT, derive_seed


def holdout_size(n: int, fraction: float) -> int:
    """Held-out examples of a device with ``n`` samples: round(fraction * n), at least 1 and
    leaving at least 1 to train on (0 when n < 2). Rank 0 cuts its training sizes with the
    same rule, so both sides agree."""
    if n < 2:
        return 0
    return min(n - 1, max(1, int(round(fraction * n))))


def holdout_split(dataset: Dataset, fraction: float, seed: int, device: int) -> tuple:
    """(training split, held-out split) of a device's samples: a permutation seeded from the
    run seed and the device id (``derive_seed(seed, device, HOLDOUT)``, the stream Hermes'
    gate uses too), its first :func:`holdout_size` positions held out, both in sample order.
    Deterministic; draws from no global random stream."""
    n = len(dataset)  # type: ignore[arg-type]
    h = holdout_size(n, fraction)
    if h == 0:
        return dataset, Subset(dataset, [])
    g = torch.Generator().manual_seed(derive_seed(seed, device, HOLDOUT))
    perm = torch.randperm(n, generator=g).tolist()
    return Subset(dataset, sorted(perm[h:])), Subset(dataset, sorted(perm[:h]))


__all__ = ["holdout_size", "holdout_split"]
