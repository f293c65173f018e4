"""``derive_seeds`` (a stack's training seeds at once) equals ``derive_seed`` key by key:
numpy's SeedSequence arithmetic, vectorized."""

from __future__ import annotations

import random

import numpy as np
import pytest

from edgefl.seeding import TRAIN, derive_seed, derive_seeds


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40 + 5, 2**64 + 3])
def test_derive_seeds_equals_derive_seed_key_by_key(seed):
    rng = random.Random(seed % 1000)
    devices = [rng.getrandbits(31) for _ in range(40)] + [0, 1, 2**32 + 3, -1]
    tasks = [rng.randrange(0, 10_000) for _ in devices]
    got = derive_seeds(seed, devices, tasks, TRAIN)
    assert got.dtype == np.int64
    assert got.tolist() == [derive_seed(seed, d, t, TRAIN) for d, t in zip(devices, tasks)]


@pytest.mark.parametrize("nparts", [0, 1, 2, 5])
def test_derive_seeds_takes_any_number_of_parts(nparts):
    """Fewer words than numpy's pool of 4 (padding), and more (the extra words mixed in)."""
    parts = [[3, 4, 5]] * nparts
    want = [derive_seed(12345, *key) for key in zip(*parts)] if nparts else [derive_seed(12345)]
    assert derive_seeds(12345, *parts).tolist() == want


def test_derive_seeds_refuses_a_negative_seed_as_numpy_does():
    with pytest.raises(ValueError):
        derive_seeds(-1, [1])
    with pytest.raises(ValueError):
        derive_seed(-1, 1)
