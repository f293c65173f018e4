"""Generate a small federated HDF5 sample: 8x8 "glyph" images of 10 classes.

    python datasets/make_fed_h5.py OUT.h5 --clients 20 --seed 0 [--test-out TEST.h5]

Each client is a "writer" with its own style: a shift, stroke thickening, ink intensity,
background noise level, a label mix (Dirichlet) and a number of examples (lognormal).
Features per client: ``pixels`` float32 ``(n, 8, 8)`` in [0, 1] and ``label`` int64 ``(n,)``.
Client ids are ``f0000_00``, ``f0001_07`` ... (index, then a writer-group tag).
With ``--test-out``, a second file with the same layout and ``--test-clients`` fresh
writers is written (use it as ``test_path``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

try:
    from edgefl.data import write_fedh5
except ImportError:  # run from a checkout without installing edgefl
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from edgefl.data import write_fedh5

GLYPHS = [
    # 0
    "..####.. .##..##. .##..##. .##..##. .##..##. .##..##. ..####.. ........",
    # 1
    "...##... ..###... ...##... ...##... ...##... ...##... ..####.. ........",
    # 2
    "..####.. .##..##. .....##. ....##.. ...##... ..##.... .######. ........",
    # 3
    ".#####.. .....##. .....##. ..####.. .....##. .....##. .#####.. ........",
    # 4
    "....##.. ...###.. ..#.##.. .#..##.. .######. ....##.. ....##.. ........",
    # 5
    ".######. .##..... .#####.. .....##. .....##. .##..##. ..####.. ........",
    # 6
    "..####.. .##..... .##..... .#####.. .##..##. .##..##. ..####.. ........",
    # 7
    ".######. .....##. ....##.. ...##... ...##... ...##... ...##... ........",
    # 8
    "..####.. .##..##. .##..##. ..####.. .##..##. .##..##. ..####.. ........",
    # 9
    "..####.. .##..##. .##..##. ..#####. .....##. ....##.. ..###... ........",
]


def glyph_prototypes() -> np.ndarray:
    """The 10 class prototypes, float32 ``(10, 8, 8)`` with ink = 1."""
    rows = [[[1.0 if c == "#" else 0.0 for c in row] for row in g.split()] for g in GLYPHS]
    return np.array(rows, dtype=np.float32)


def make_client(rng: np.random.Generator, samples_mean_log: float) -> dict[str, np.ndarray]:
    """One writer's examples: ``pixels`` float32 (n, 8, 8) in [0, 1], ``label`` int64 (n,)."""
    protos = glyph_prototypes()
    n = max(5, int(rng.lognormal(samples_mean_log, 0.5)))
    mix = rng.dirichlet(np.full(10, 0.8))
    labels = rng.choice(10, size=n, p=mix).astype(np.int64)
    shift = rng.integers(-1, 2, size=2)
    thick = rng.random() < 0.5
    ink = rng.uniform(0.6, 1.0)
    noise = rng.uniform(0.05, 0.25)
    images = protos[labels]
    images = np.roll(images, shift=(int(shift[0]), int(shift[1])), axis=(1, 2))
    if thick:
        images = np.maximum(images, np.roll(images, 1, axis=2))
    jitter = rng.integers(-1, 2, size=(n, 2))
    for i in range(n):  # per-example wobble of one pixel, on top of the writer's shift
        if rng.random() < 0.3:
            images[i] = np.roll(
                images[i], shift=(int(jitter[i, 0]), int(jitter[i, 1])), axis=(0, 1)
            )
    images = images * ink + rng.normal(0.0, noise, size=images.shape)
    pixels = np.clip(images, 0.0, 1.0).astype(np.float32)
    return {"pixels": pixels, "label": labels}


def make_clients(
    num_clients: int, seed: int, samples_mean_log: float = 3.5, stream: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """``num_clients`` writers; client ``i`` uses random stream ``[seed, stream, i]``."""
    clients = {}
    for i in range(num_clients):
        rng = np.random.default_rng([seed, stream, i])
        group = int(rng.integers(0, 100))
        clients[f"f{i:04d}_{group:02d}"] = make_client(rng, samples_mean_log)
    return clients


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output .h5 file (written atomically)")
    parser.add_argument("--clients", type=int, default=20, help="number of writers (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--samples-mean-log",
        type=float,
        default=3.5,
        help="mean of log(examples per client) (default 3.5, about 33 examples)",
    )
    parser.add_argument("--test-out", help="also write a test file with fresh writers here")
    parser.add_argument("--test-clients", type=int, default=5, help="writers in --test-out")
    ns = parser.parse_args(argv)
    if ns.clients < 1 or ns.test_clients < 1 or ns.seed < 0:
        parser.error("--clients and --test-clients must be >= 1 and --seed >= 0")
    for path in (ns.out, ns.test_out):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_fedh5(ns.out, make_clients(ns.clients, ns.seed, ns.samples_mean_log))
    print(f"wrote {ns.clients} clients to {ns.out}")
    if ns.test_out:
        write_fedh5(ns.test_out, make_clients(ns.test_clients, ns.seed, ns.samples_mean_log, 1))
        print(f"wrote {ns.test_clients} test clients to {ns.test_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
