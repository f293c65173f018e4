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
import json
import sys
from pathlib import Path

NAME = "gddr"
HELP = "dense BSP vs GDDR (alpha 0.4, tau 4; adaptive tau): uplink bytes and accuracy"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--alpha", type=float, default=0.4)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--target", type=float, default=0.75)
    p.add_argument("--profiles", default="uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="", help="keep the run directories here")
    p.add_argument("--set", dest="overrides", action="append", default=[])


def main(args: argparse.Namespace) -> int:
    from .common import fleet_sets, header, run_simulate, runs_root, table, write_json

    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
    header(NAME, sys.argv, cfg, args.seed)
    root = runs_root(args.runs, NAME)
    common = [*fleet_sets(args), f"run.rounds={args.rounds}", *args.overrides]
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
        print(f"# {r['system']}: {100 * r['uplink_saving']:.1f}% fewer uplink bytes, accuracy "
              f"{-100 * drop:+.2f} points vs dense (target >= 35% and >= -0.3 points: "
              f"{'yes' if ok else 'NO'})")  # fmt: skip
    write_json(args.json, rows)
    return 0


def _row(name: str, out: Path, target: float, expected: float) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    s = json.loads((out / "summary.json").read_text())
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
