"""``edgefl bench gddr``: dense BSP against GDDR residual buffers, same task and seed.

Every row is one ``edgefl simulate`` run (real mpiexec, virtual clock) of ``--rounds`` BSP
rounds with the same data, model, seed and device profiles; only ``algorithm.residual``
(and GDDR's alpha / tau / adaptive) changes. Uplink bytes are what the devices' update
messages really carried (80-byte header + payload: the released values and one norm for
GDDR), so they include the end-of-training flush of the residuals.

Row fields: ``system``, ``bytes_up``, ``payload_density`` (released values / model size,
mean over GDDR messages; 1 for dense), ``time_to_target_s`` (virtual seconds until the test
accuracy first reached ``--target``), ``final_accuracy``; plus ``uplink_saving`` (1 - bytes /
dense bytes), ``expected_density`` (the stationary density (1 - a) / (1 - a^(tau+1)) of the
withhold-with-forced-release rule; see docs/gddr.md) and ``tau_end``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_data_arg

NAME = "gddr"
HELP = "dense BSP vs GDDR (alpha 0.4, tau 4; adaptive tau): uplink bytes and accuracy"
# --data digits: scikit-learn's 8x8 digits split IID over the devices and the built-in CNN
# (the recipe of ``edgefl bench hermes --data digits``)
DIGITS = ["model.name=cnn", "train.lr=0.1", "train.momentum=0.9", "train.batch_size=16",
          "train.local_epochs=2"]  # fmt: skip
PAPER = (
    "GDDR at alpha 0.4, tau 4: 38% fewer uplink bytes than dense; the rule's exact "
    "stationary density (1 - alpha) / (1 - alpha^(tau + 1)) = 0.606 bounds it at 39.4%"
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--alpha", type=float, default=0.4)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument(
        "--target", type=float, default=None, help="accuracy (default 0.75; 0.95 on digits)"
    )
    p.add_argument("--profiles", default="uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="", help="keep the run directories here")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    add_data_arg(p, ("synthetic", "digits"))


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

    data = [] if args.data == "synthetic" else [*real_data_sets(args.data), *DIGITS]
    if args.target is None:
        args.target = 0.75 if args.data == "synthetic" else 0.95
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    cfg["data_sets"] = data
    header(NAME, sys.argv, cfg, args.seed)
    paper_line(PAPER)
    root = runs_root(args.runs, NAME)
    common = [*fleet_sets(args), f"run.rounds={args.rounds}", *data, *args.overrides]
    g = [
        "algorithm.residual=gddr",
        f"gddr.alpha={args.alpha}",
        f"gddr.tau={args.tau}",
    ]
    systems = {
        "dense": [],
        f"gddr-a{args.alpha:g}-tau{args.tau}": g,
        "gddr-adaptive": [*g, "gddr.adaptive=true"],
    }
    a = args.alpha
    expected = (1 - a) / (1 - a ** (args.tau + 1))
    rows = []
    for name, extra in systems.items():
        run_simulate(root / name, [*common, *extra])
        rows.append(_row(name, root / name, args.target, expected if extra else 1.0))
        print(f"# {name}: {rows[-1]}", flush=True)
    dense = rows[0]["bytes_up"]
    for r in rows:
        r["uplink_saving"] = 1.0 - r["bytes_up"] / dense
    cols = ["system", "bytes_up", "payload_density", "expected_density", "time_to_target_s",
            "final_accuracy", "uplink_saving", "tau_end"]  # fmt: skip
    print(table(rows, cols))
    for r in rows[1:]:
        drop = rows[0]["final_accuracy"] - r["final_accuracy"]
        ok = r["uplink_saving"] >= 0.35 and drop <= 0.003
        print(f"# {r['system']}: {100 * r['uplink_saving']:.1f}% fewer uplink bytes (paper 38%, "
              f"bound {100 * (1 - r['expected_density']):.1f}%), accuracy "
              f"{-100 * drop:+.2f} points vs dense (target >= 35% and >= -0.3 points: "
              f"{'yes' if ok else 'NO'})")  # fmt: skip
    write_json(args.json, rows)
    return 0


def _row(name: str, out: Path, target: float, expected: float) -> dict:
    from ..api import Result

    run = Result(out)
    rows, s = run.metrics, run.summary
    to_target = next((r["time_s"] for r in rows if r.get("test_accuracy", 0.0) >= target), None)
    g = s.get("gddr") or {}
    return {
        "system": name,
        "bytes_up": sum(d["bytes_up"] for d in s["devices"].values()),
        "payload_density": g.get("payload_density") or 1.0,
        "expected_density": expected,
        "time_to_target_s": to_target,
        "final_accuracy": s["final_accuracy"],
        "tau_end": g.get("tau"),
        "run_dir": str(out),
    }
