"""``edgefl bench``: benchmarks that measure edgefl against a baseline in the same run.

Each benchmark is a module of this package exposing ``NAME``, ``HELP``, ``add_args(parser)``
and ``main(args) -> int``; it is listed in :data:`BENCHES`.
"""

from __future__ import annotations

import argparse
import importlib

# module names, in the order ``edgefl bench --help`` lists them
BENCHES = (
    "transport",
    "staging",
    "rounds",
    "consistency",
    "hermes",
    "hermes_sweep",
    "gddr",
    "cdgrab",
    "fedavg",
    "faults",
    "ps",
    "drift",
    "startup",
    "scale",
    "kernels",
    "stacked",
)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints ratios measured side by side)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    for name in BENCHES:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            continue  # not built yet
        q = bsub.add_parser(mod.NAME, help=mod.HELP)
        q.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
        mod.add_args(q)
        q.set_defaults(func=_runner(mod))


def _runner(mod):
    def run(args: argparse.Namespace) -> int:
        return mod.main(args)

    return run
