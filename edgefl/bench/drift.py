"""``edgefl bench drift``: FedAvg, FedProx and SCAFFOLD on non-IID data, rounds to a target.

Client drift: with many local steps on heterogeneous devices, each device's model walks
toward its own optimum and FedAvg's average converges slowly or to a worse point. FedProx
(Li et al., MLSys 2020) pulls local training back toward the global model; SCAFFOLD
(Karimireddy et al., ICML 2020) corrects each local gradient by control variates. The
three run the same job here (LEAF synthetic(alpha, beta) data, each device with its own
model and feature distribution; the default job of this toolkit, edgefl simulate's data),
in one process through the inline backend of :func:`edgefl.simulate` (the same arithmetic
as over MPI: tests/test_api.py), on the virtual clock, for each seed.

Reported per algorithm: the first round whose test accuracy reaches ``--target`` (the
median over seeds; ``-`` if a seed never reached it), the final accuracy (mean over seeds)
and the bytes moved per round (SCAFFOLD also sends the control variates both ways).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from .common import header, table, write_json

NAME = "drift"
HELP = "FedAvg vs FedProx vs SCAFFOLD on non-IID data: rounds to a target accuracy"

ALGORITHMS = {
    "fedavg": {},
    "fedprox": {"fedprox.enabled": True},
    "scaffold": {"scaffold.enabled": True},
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--local-steps", type=int, default=20, help="local SGD steps per round")
    p.add_argument("--batch", type=int, default=10, help="local mini-batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--mu", type=float, default=0.1, help="FedProx's mu")
    p.add_argument("--participation", type=float, default=0.5, help="devices per round")
    p.add_argument("--target", type=float, default=0.7, help="test accuracy to reach")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])


def bench_overrides(args: argparse.Namespace) -> dict:
    """The job every algorithm runs (dotted keys, as ``edgefl.simulate`` takes them)."""
    return {
        "fleet.devices": args.devices,
        "fleet.ranks": 3,
        "fleet.device": "cpu",
        "run.rounds": args.rounds,
        "run.checkpoint_every": 0,
        "data.source": "synthetic",
        "data.args": {"alpha": 1.0, "beta": 1.0, "dim": 60, "classes": 10},
        "model.name": "logreg",
        "model.args": {},
        "train.local_steps": args.local_steps,
        "train.batch_size": args.batch,
        "train.lr": args.lr,
        "server.participation": args.participation,
        "fedprox.mu": args.mu,
        "sim.reference_s_per_sample": 0.0001,
        "output.progress": "quiet",
    }


def run_one(overrides: dict, out: Path) -> dict:
    """One job inline; its per-round accuracies and bytes."""
    import contextlib
    import io

    import edgefl

    with contextlib.redirect_stdout(io.StringIO()):
        r = edgefl.simulate(overrides=overrides, out=out, backend="inline")
    accs = [m.get("test_accuracy") for m in r.metrics]
    moved = sum(m.get("bytes_up", 0) + m.get("bytes_down", 0) for m in r.metrics)
    return {"accs": accs, "bytes_per_round": moved / max(len(r.metrics), 1)}


def first_round(accs: list, target: float) -> int | None:
    """The first round (1-based) whose accuracy reaches ``target``, or None."""
    for i, a in enumerate(accs):
        if a is not None and a >= target:
            return i + 1
    return None


def main(args: argparse.Namespace) -> int:
    base = bench_overrides(args)
    header(NAME, ["edgefl", "bench", NAME, *sys.argv[3:]], base, None)
    print(f"# seeds: {args.seeds}  target accuracy: {args.target}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-drift-") as tmp:
        runs = {name: [] for name in ALGORITHMS}
        for seed in args.seeds:  # algorithms side by side for each seed
            for name, extra in ALGORITHMS.items():
                out = Path(tmp) / f"{name}-{seed}"
                runs[name].append(run_one({**base, **extra, "seed": seed}, out))
        for name, got in runs.items():
            reach = [first_round(g["accs"], args.target) for g in got]
            done = sorted(r for r in reach if r is not None)
            rows.append({
                "algorithm": name,
                "rounds_to_target": statistics.median(done) if len(done) == len(reach) else "-",
                "reached": f"{len(done)}/{len(reach)}",
                "final_accuracy": statistics.mean(g["accs"][-1] for g in got),
                "best_accuracy": statistics.mean(max(a for a in g["accs"] if a is not None)
                                                 for g in got),
                "kb_per_round": statistics.mean(g["bytes_per_round"] for g in got) / 1000,
            })  # fmt: skip
    fedavg = rows[0]["rounds_to_target"]
    for r in rows:
        ok = isinstance(fedavg, (int, float)) and isinstance(r["rounds_to_target"], (int, float))
        r["speedup_vs_fedavg"] = fedavg / r["rounds_to_target"] if ok else "-"
    cols = ["algorithm", "rounds_to_target", "reached", "speedup_vs_fedavg", "final_accuracy",
            "best_accuracy", "kb_per_round"]  # fmt: skip
    print(table(rows, cols))
    write_json(args.json, rows)
    return 0
