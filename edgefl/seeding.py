"""Deterministic seed derivation: every random stream is a pure function of the run seed."""

from __future__ import annotations

import numpy as np


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for the stream named by ``parts`` (e.g. (device, round, purpose))."""
    ss = np.random.SeedSequence([int(seed), *(int(p) & 0xFFFFFFFF for p in parts)])
    return int(ss.generate_state(2, np.uint64)[0] >> np.uint64(1))


# stream purposes (the last part of derive_seed's key)
TRAIN = 1
SAMPLE = 2
SUBSET = 3  # the seeded subset of a task's samples (a sample budget)
HOLDOUT = 4  # a gated device's held-out split
