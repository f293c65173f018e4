"""``edgefl bench consistency``: BSP vs SSP(s) vs ASP vs FedBuff on an unequal fleet.

Every row is one ``edgefl simulate`` run over real mpiexec on the virtual clock, with the
same data, model, seed and device profiles (``edge-mix`` by default: a 500x speed spread);
only ``algorithm.consistency`` (and s / K) changes. Each run gets the same virtual-time
budget; the global model is evaluated every ``budget / evals`` virtual seconds.

``--data mnist`` (or ``digits``, ``mnist1d``) runs the comparison on a real dataset split
IID over the fleet, with the MLP recipe of ``edgefl bench hermes`` for it: sync (BSP) vs
async (FedBuff, FedAsync) on the virtual clock, FedScale's template (FedScale PR #197:
FEMNIST, sync 100 rounds 27,618 s at 0.914 top-5 vs FedBuff 180 rounds 18,913 s at 0.92).

Row fields: ``policy``, ``time_to_target_s`` (virtual seconds until the test accuracy first
reached the target; null if never), ``final_accuracy`` (at the end of the budget),
``updates`` (device updates applied in the budget), ``updates_to_target``, ``versions``
(global model versions), ``idle_fraction`` (time devices spent waiting on the coordinator
over their online time), ``run_dir``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NAME = "consistency"
HELP = "BSP / SSP(s) / ASP / FedBuff on edge-mix: time to target, accuracy, idle fraction"

DEFAULT_POLICIES = "bsp,ssp:2,ssp:4,ssp:8,ssp:16,asp,fedbuff:4"
# --data DATASET: sync vs async (FedScale's template); target accuracy and virtual budget
REAL_POLICIES = "bsp,fedbuff:4,fedasync"
REAL_TARGET = {"mnist": 0.93, "digits": 0.97, "mnist1d": 0.85}
FEDSCALE = (
    "FedScale (PR #197, FEMNIST, virtual clock): sync 100 rounds 27,618 s, 0.914 top-5; "
    "FedBuff 180 rounds 18,913 s, 0.92 top-5 (async 1.46x faster to a higher accuracy)"
)


def add_args(p: argparse.ArgumentParser) -> None:
    from .common import add_data_arg

    p.add_argument(
        "--policies", default=None,
        help=f"comma list (ssp:S, fedbuff:K, fedasync); default {DEFAULT_POLICIES} "
        f"(with --data: {REAL_POLICIES})",
    )  # fmt: skip
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--ranks", type=int, default=3, help="MPI ranks incl. the coordinator")
    p.add_argument("--profiles", default="edge-mix")
    p.add_argument("--budget-s", type=float, default=60.0, help="virtual seconds per run")
    p.add_argument(
        "--target", type=float, default=None,
        help="target test accuracy (default 0.75; with --data: "
        + ", ".join(f"{k} {v}" for k, v in REAL_TARGET.items()) + ")",
    )  # fmt: skip
    p.add_argument("--evals", type=int, default=40, help="evaluations per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="", help="keep the run directories here")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config override"
    )
    add_data_arg(p, ("synthetic", "digits", "mnist1d", "mnist"))


def _policy_args(spec: str) -> tuple[str, list[str]]:
    name, _, arg = spec.partition(":")
    sets = [f"algorithm.consistency={name}"]
    if name == "ssp":
        sets.append(f"algorithm.staleness={int(arg or 4)}")
    elif name == "fedbuff":
        sets.append(f"algorithm.buffer_k={int(arg or 4)}")
    elif arg:
        raise SystemExit(f"edgefl: error: policy {spec!r} takes no argument")
    return spec.replace(":", "-s" if name == "ssp" else "-k"), sets


def main(args: argparse.Namespace) -> int:
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
    from .hermes import REAL

    real = args.data != "synthetic"
    if args.policies is None:
        args.policies = REAL_POLICIES if real else DEFAULT_POLICIES
    if args.target is None:
        args.target = REAL_TARGET[args.data] if real else 0.75
    data = [*real_data_sets(args.data), *REAL[args.data]] if real else []
    cfg = {
        "data": args.data,
        "data_sets": data,
        "policies": args.policies,
        "devices": args.devices,
        "ranks": args.ranks,
        "profiles": args.profiles,
        "budget_s": args.budget_s,
        "target": args.target,
        "evals": args.evals,
        "overrides": args.overrides,
    }
    header(NAME, sys.argv, cfg, args.seed)
    if real:
        paper_line(FEDSCALE)
    root = runs_root(args.runs, NAME)
    rows = []
    for spec in args.policies.split(","):
        label, sets = _policy_args(spec.strip())
        out = root / label
        sets += [
            *fleet_sets(args),
            *data,
            "run.rounds=1000000",
            f"run.max_virtual_s={args.budget_s}",
            "run.eval_every=1000000",
            f"run.eval_every_s={args.budget_s / args.evals}",
            *args.overrides,
        ]
        t0 = time.monotonic()
        run_simulate(out, sets)
        wall = time.monotonic() - t0
        rows.append(_row(label, out, args.target, wall))
        r = rows[-1]
        print(
            f"# {label}: final acc {r['final_accuracy']}, to target {r['time_to_target_s']}, "
            f"updates {r['updates']}, idle {r['idle_fraction']:.3f} ({wall:.0f} s wall)",
            flush=True,
        )
    cols = [
        "policy",
        "time_to_target_s",
        "final_accuracy",
        "updates",
        "updates_to_target",
        "versions",
        "idle_fraction",
    ]
    print(table(rows, cols))
    if real:
        _sync_vs_async(rows, args.target)
    else:  # (the idle-fraction expectations are edge-mix's, on the synthetic task)
        _verdict(rows)
    dirs = " ".join(str(root / r["policy"]) for r in rows)
    print(f"# plots: edgefl report {dirs} --out {root / 'report'}")
    write_json(args.json, rows)
    return 0


def _row(label: str, out: Path, target: float, wall: float) -> dict:
    from ..api import Result

    run = Result(out)
    rows, summary = run.metrics, run.summary
    evals = [r for r in rows if r.get("test_accuracy") is not None]
    to_target = None
    updates_to_target = None
    done = 0
    for r in rows:
        done += r["updates"]
        if r.get("test_accuracy") is not None and r["test_accuracy"] >= target:
            to_target = r["time_s"]
            updates_to_target = done
            break
    return {
        "policy": label,
        "time_to_target_s": to_target,
        "final_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "updates": sum(r["updates"] for r in rows),
        "updates_to_target": updates_to_target,
        "versions": len(rows),
        "idle_fraction": summary["idle_fraction"],
        "wall_s": round(wall, 1),
        "run_dir": str(out),
    }


def _verdict(rows: list[dict]) -> None:
    by = {r["policy"]: r for r in rows}
    if "bsp" in by:
        idle = by["bsp"]["idle_fraction"]
        print(
            f"# BSP idle fraction {idle:.3f} (expected >= 0.40): {'yes' if idle >= 0.4 else 'NO'}"
        )
    ssp = sorted((int(p.split("-s")[1]), r) for p, r in by.items() if p.startswith("ssp-s"))
    if len(ssp) > 1:
        idles = [r["idle_fraction"] for _, r in ssp]
        falls = all(b <= a + 1e-9 for a, b in zip(idles, idles[1:]))
        print(f"# SSP idle fraction by s {[s for s, _ in ssp]}: {[round(x, 3) for x in idles]}"
              f" (falls as s grows: {'yes' if falls else 'NO'})")  # fmt: skip
        upd = [r["updates_to_target"] for _, r in ssp]
        print(f"# SSP updates to target by s: {upd}")
        reached = [(r["time_to_target_s"], s) for s, r in ssp if r["time_to_target_s"]]
        if reached:
            t, s = min(reached)
            print(f"# fastest SSP to target: s = {s} ({t:.2f} virtual s)")


def _sync_vs_async(rows: list[dict], target: float) -> None:
    """One line per asynchronous policy against BSP, FedScale's comparison: virtual time to
    the target (how many times faster) and final accuracy."""
    by = {r["policy"]: r for r in rows}
    bsp = by.get("bsp")
    if bsp is None:
        return
    for r in rows:
        if r["policy"] == "bsp" or not r["policy"].startswith(("fedbuff", "fedasync", "asp")):
            continue
        t, tb = r["time_to_target_s"], bsp["time_to_target_s"]
        speed = f"{tb / t:.2f}x BSP's speed" if t and tb else "-"
        print(
            f"# {r['policy']} vs bsp to {target}: {t if t is None else round(t, 2)} vs "
            f"{tb if tb is None else round(tb, 2)} virtual s ({speed}); final accuracy "
            f"{r['final_accuracy']:.4f} vs {bsp['final_accuracy']:.4f} (FedScale: FedBuff "
            "1.46x, +0.6 points)"
        )
