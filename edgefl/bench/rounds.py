"""``edgefl bench rounds``: FedAvg rounds per second, edgefl over MPI vs a plain loop.

Task (from the issue): 10 devices x 20 rounds of logistic regression on synthetic data
(dimension 20, 200 samples per device), 5 local full-batch SGD steps at lr 0.5, sample-
weighted FedAvg, test evaluation every round. The plain loop does the same arithmetic in one
process with no messaging; edgefl runs the real job through ``edgefl simulate`` (real
``mpiexec``). Both use the same data, initial model and seed.

Each system runs ``--repeats`` times, alternating, and the median run is reported. Rates
exclude round 1 (both systems pay one-time start-up costs there: process launch and
imports for edgefl, first-touch allocations for both), i.e. rounds_per_s = (T - 1) /
(time at the end of round T - time at the end of round 1).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import simulate_command

NAME = "rounds"
HELP = "FedAvg rounds/s: edgefl over mpiexec vs a plain in-process loop"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--ranks", type=int, default=3, help="MPI ranks for edgefl (incl. rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs of each system; the median rate is reported",
    )


def bench_config(args: argparse.Namespace) -> dict:
    """The job both systems run, as an edgefl config document."""
    return {
        "seed": args.seed,
        "run": {"rounds": args.rounds, "checkpoint_every": 0},
        "fleet": {"devices": args.devices, "ranks": args.ranks},
        "data": {
            "source": "synthetic",
            "args": {
                "alpha": 0.0,
                "beta": 0.0,
                "dim": 20,
                "classes": 10,
                "iid": True,
                "min_samples": 200,
                "samples_mean_log": 0.0,
                "samples_sigma": 0.0,
                "test_samples_per_device": 100,
            },
        },
        "model": {"name": "logreg", "args": {}},
        "train": {"local_steps": 5, "batch_size": 0, "lr": 0.5},
        "output": {"progress": "quiet"},
    }


def plain_loop(cfg: dict) -> dict:
    """The same FedAvg arithmetic as a plain Python/torch loop in this process: rounds per
    second and CPU seconds per round after the first round, and the final accuracy."""
    import torch

    from ..config import load_config
    from ..data import load_federated
    from ..models import build_model

    c = load_config(doc=cfg)
    n_dev = c["fleet"]["devices"]
    data = load_federated(c["data"]["source"], c["data"]["args"], n_dev, c["seed"])
    model = build_model("logreg", data.info, {}, c["seed"])
    params = list(model.parameters())
    glob = [p.detach().clone() for p in params]
    xs, ys = zip(*(data.train(d).tensors for d in range(n_dev)))
    ns = [len(y) for y in ys]
    xt, yt = data.test().tensors
    lr, steps = c["train"]["lr"], c["train"]["local_steps"]
    marks, cpu = [], []

    def train(d: int) -> None:
        opt = torch.optim.SGD(params, lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(xs[d]), ys[d]).backward()
            opt.step()

    acc = float("nan")
    for _r in range(c["run"]["rounds"]):
        acc = fedavg_round(model, glob, ns, train, (xt, yt))
        marks.append(time.perf_counter())
        cpu.append(time.process_time())
    rounds = len(marks) - 1
    return {
        "rounds_per_s": rounds / (marks[-1] - marks[0]),
        "cpu_s_per_round": (cpu[-1] - cpu[0]) / rounds,
        "final_accuracy": acc,
    }


def fedavg_round(model, glob: list, ns: list[int], train, test: tuple) -> float:
    """One round of the benches' plain FedAvg loops: each device ``d`` starts from the global
    model ``glob`` (a tensor per parameter), ``train(d)`` trains ``model`` in place, and the
    sample-weighted mean of the devices' deltas (``ns``: samples per device; summed in
    float64) is added to ``glob``. Returns the test accuracy of the new global model on
    ``test`` = (X, y)."""
    import torch

    params = list(model.parameters())
    deltas = []
    for d in range(len(ns)):
        with torch.no_grad():
            for p, g in zip(params, glob):
                p.copy_(g)
        train(d)
        deltas.append([(p.detach() - g).numpy().astype(np.float64) for p, g in zip(params, glob)])
    total = float(sum(ns))
    with torch.no_grad():
        for i, g in enumerate(glob):
            agg = sum((ns[d] / total) * deltas[d][i] for d in range(len(ns)))
            g += torch.from_numpy(agg.astype(np.float32))
            params[i].copy_(g)
        return (model(test[0]).argmax(1) == test[1]).float().mean().item()


def edgefl_job(cfg: dict) -> dict:
    """Run the job through ``edgefl simulate`` and read its metrics."""
    from ..api import Result
    from ..config import dump_config, load_config

    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "bench.toml"
        conf.write_text(dump_config(load_config(doc=cfg)))
        out = Path(tmp) / "run"
        cmd = simulate_command(conf, out)
        print(f"# edgefl: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        total = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"edgefl run failed:\n{proc.stdout}\n{proc.stderr}")
        rows = Result(out).metrics
    w = [r["wall_time_s"] for r in rows]
    return {
        "rounds_per_s": (len(w) - 1) / (w[-1] - w[0]),
        "final_accuracy": rows[-1]["test_accuracy"],
        "job_wall_s": round(total, 2),
    }


def _median_row(rows: list[dict]) -> dict:
    """The run with the median rounds/s (its accuracy comes with it)."""
    return sorted(rows, key=lambda r: r["rounds_per_s"])[len(rows) // 2]


def main(args: argparse.Namespace) -> int:
    from .common import header, table, write_json

    cfg = bench_config(args)
    header(NAME, sys.argv, cfg, args.seed)
    loops, jobs = [], []
    for _ in range(args.repeats):  # alternate, so load on the box hits both alike
        loops.append(plain_loop(cfg))
        jobs.append(edgefl_job(cfg))
    loop = _median_row(loops)
    ours = _median_row(jobs)
    print(f"# plain-loop rounds/s per repeat: {[round(x['rounds_per_s'], 1) for x in loops]}")
    print(f"# edgefl rounds/s per repeat: {[round(x['rounds_per_s'], 1) for x in jobs]}")
    rows = [
        {"system": "plain-loop", **loop},
        {"system": "edgefl", **ours, "ratio_vs_loop": ours["rounds_per_s"] / loop["rounds_per_s"]},
    ]
    print(table(rows, ["system", "rounds_per_s", "final_accuracy", "ratio_vs_loop", "job_wall_s"]))
    same = math.isclose(ours["final_accuracy"], loop["final_accuracy"], abs_tol=1e-6)
    print(
        f"# edgefl / loop rounds per second: {rows[1]['ratio_vs_loop']:.3f} (target >= 0.5); "
        f"final accuracy {'identical' if same else 'DIFFERS'}"
    )
    write_json(args.json, rows)
    return 0
