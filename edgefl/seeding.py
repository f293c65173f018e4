"""Deterministic seed derivation: every random stream is a pure function of the run seed."""

from __future__ import annotations

import numpy as np


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for the stream named by ``parts`` (e.g. (device, round, purpose))."""
    ss = np.random.SeedSequence([int(seed), *(int(p) & 0xFFFFFFFF for p in parts)])
    return int(ss.generate_state(2, np.uint64)[0] >> np.uint64(1))


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx), for derive_seeds
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4


def derive_seeds(seed: int, *parts) -> np.ndarray:
    """:func:`derive_seed` of many keys at once: ``parts`` are equal-length sequences (one
    per key position, e.g. devices, tasks, purposes; a scalar is broadcast); returns the
    seeds as an int64 array, each equal to ``derive_seed(seed, *key)``.

    The same arithmetic as ``np.random.SeedSequence(entropy).generate_state(2, uint64)``,
    vectorized over the keys (numpy's entropy pool of 4 uint32 words, its hash and mix
    functions, in uint32 arithmetic that wraps as theirs does): a stack of 5,000 devices
    needs 5,000 seeds, and one SeedSequence costs about 15 microseconds.
    ``tests/test_seeding.py`` checks it against numpy key by key."""
    n = max((np.size(p) for p in parts), default=1)
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    words = []  # the seed's uint32 words, least significant first (as numpy splits an int)
    while True:
        words.append(np.full(n, seed & 0xFFFFFFFF, np.uint32))
        seed >>= 32
        if not seed:
            break
    for p in parts:
        a = np.asarray(p, dtype=np.int64) & 0xFFFFFFFF
        words.append(np.broadcast_to(a.astype(np.uint32), (n,)))
    u32 = np.uint32
    h = [u32(_INIT_A)]  # (the hash constant, threaded through every hashmix call)

    def hashmix(v: np.ndarray) -> np.ndarray:
        v = v ^ h[0]
        h[0] = u32((int(h[0]) * _MULT_A) & 0xFFFFFFFF)
        v = v * h[0]
        return v ^ (v >> u32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = u32(_MIX_L) * x - u32(_MIX_R) * y
        return r ^ (r >> u32(16))

    with np.errstate(over="ignore"):
        zero = np.zeros(n, np.uint32)
        pool = [hashmix(words[i] if i < len(words) else zero) for i in range(_POOL)]
        for i_src in range(_POOL):
            for i_dst in range(_POOL):
                if i_src != i_dst:
                    pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
        for i_src in range(_POOL, len(words)):
            for i_dst in range(_POOL):
                pool[i_dst] = mix(pool[i_dst], hashmix(words[i_src]))
        out = []
        hb = _INIT_B
        for i in range(2):  # the first uint64 of generate_state: two uint32 words
            v = pool[i] ^ u32(hb)
            hb = (hb * _MULT_B) & 0xFFFFFFFF
            v = v * u32(hb)
            out.append(v ^ (v >> u32(16)))
    state = out[0].astype(np.uint64) | (out[1].astype(np.uint64) << np.uint64(32))
    return (state >> np.uint64(1)).astype(np.int64)


# stream purposes (the last part of derive_seed's key)
TRAIN = 1
SAMPLE = 2
SUBSET = 3  # the seeded subset of a task's samples (a sample budget)
HOLDOUT = 4  # a gated device's held-out split
