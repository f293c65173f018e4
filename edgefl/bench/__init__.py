"""``edgefl bench``: benchmarks that measure edgefl against a baseline in the same run."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints ratios measured side by side)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    from . import rounds, transport

    for mod in (transport, rounds):
        q = bsub.add_parser(mod.NAME, help=mod.HELP)
        q.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
        mod.add_args(q)
        q.set_defaults(func=_runner(mod))


def _runner(mod):
    def run(args: argparse.Namespace) -> int:
        return mod.main(args)

    return run
