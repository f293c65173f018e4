"""``edgefl bench fedavg``: FedAvg on an IID partition against centralized training.

For each seed, one ``edgefl simulate`` run (real mpiexec, virtual clock, BSP, sample-weighted
FedAvg) trains the model federated over ``--devices`` devices for ``--rounds`` rounds of
``--local-epochs`` local epochs; then the same model (same initial weights: the run seed
builds both) is trained centralized in this process on the pooled training data of the same
devices for ``rounds * local_epochs`` epochs with the same optimizer settings (one optimizer
for the whole run, where FedAvg makes a fresh one every round). Both are evaluated on the
same held-out test set. The target (issue 17) is FedAvg within 3 points of centralized.

Row fields: ``seed``, ``fedavg_accuracy``, ``centralized_accuracy``, ``gap_points``
(100 * (centralized - FedAvg)), ``fedavg_run``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from .common import add_data_arg

NAME = "fedavg"
HELP = "FedAvg (IID partition) vs centralized training of the same model, same epochs"

# the recipes of --data: model and optimizer settings for each dataset
RECIPES = {
    "digits": ["model.name=cnn", "train.lr=0.1", "train.momentum=0.9", "train.batch_size=16"],
    "mnist1d": [
        "model.name=mlp",
        "model.args={hidden = [256, 128]}",
        "train.lr=0.1",
        "train.momentum=0.9",
        "train.batch_size=32",
    ],
}
GAP_TARGET = 3.0  # points
PAPER = (
    "FedAvg (McMahan et al., AISTATS 2017) on IID MNIST partitions reaches the accuracy of "
    "centralized training of the same model; target here: within 3 points"
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_data_arg(p, ("digits", "mnist1d"), default="digits")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--profiles", default="uniform")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. seeds-1 (from --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="", help="keep the run directories here")
    p.add_argument("--set", dest="overrides", action="append", default=[])


def centralized_accuracy(run_dir, rounds: int, local_epochs: int) -> float:
    """Train the run's model centralized on its devices' pooled training data, with the
    run's config (seed, model, optimizer settings), for ``rounds * local_epochs`` epochs,
    and return its test accuracy (fraction)."""
    import torch

    from ..config import load_config
    from ..data import load_federated, pooled
    from ..models import build_model
    from ..models.train import evaluate, local_train

    cfg = load_config(run_dir / "config.toml")
    fd = load_federated(
        cfg["data"]["source"], cfg["data"]["args"], cfg["fleet"]["devices"], cfg["seed"]
    )
    model = build_model(cfg["model"]["name"], fd.info, cfg["model"]["args"], cfg["seed"])
    t = cfg["train"]
    local_train(
        model,
        pooled(fd),
        epochs=rounds * local_epochs,
        steps=0,
        batch_size=t["batch_size"],
        lr=t["lr"],
        momentum=t["momentum"],
        weight_decay=t["weight_decay"],
        generator=torch.Generator().manual_seed(cfg["seed"]),
        task=fd.info.task,
    )
    return float(evaluate(model, fd.test(), fd.info.task)[1])


def main(args: argparse.Namespace) -> int:
    from ..api import Result
    from .common import (
        fleet_sets,
        header,
        paper_line,
        real_data_sets,
        run_simulate,
        runs_root,
        table,
        write_json,
    )

    data = [*real_data_sets(args.data, "iid"), *RECIPES[args.data]]
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    cfg["data_sets"] = data
    header(NAME, sys.argv, cfg, args.seed)
    paper_line(PAPER)
    root = runs_root(args.runs, NAME)
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        args_s = argparse.Namespace(**{**vars(args), "seed": seed})
        out = root / f"{args.data}-seed{seed}"
        run_simulate(
            out,
            [
                *fleet_sets(args_s),
                *data,
                f"run.rounds={args.rounds}",
                f"train.local_epochs={args.local_epochs}",
                f"run.eval_every={args.rounds}",
                *args.overrides,
            ],
        )
        fed = Result(out).summary["final_accuracy"]
        central = centralized_accuracy(out, args.rounds, args.local_epochs)
        rows.append(
            {
                "seed": seed,
                "fedavg_accuracy": fed,
                "centralized_accuracy": central,
                "gap_points": 100 * (central - fed),
                "fedavg_run": str(out),
            }
        )
        print(f"# seed {seed}: {rows[-1]}", flush=True)
    print(table(rows, ["seed", "fedavg_accuracy", "centralized_accuracy", "gap_points"]))
    worst = max(abs(r["gap_points"]) for r in rows)
    mean = statistics.fmean(r["gap_points"] for r in rows)
    ok = worst <= GAP_TARGET
    print(
        f"# {args.data}: FedAvg - centralized, mean {-mean:+.2f} points, largest gap {worst:.2f} "
        f"points over {len(rows)} seeds (target within {GAP_TARGET:g}: "
        f"{'MET' if ok else 'NOT MET'})"
    )
    write_json(args.json, rows)
    return 0
