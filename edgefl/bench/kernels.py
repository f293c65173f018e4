"""``edgefl bench kernels``: what portable kernels (``run.kernels = "portable"``) cost
against this CPU's native ones, side by side in one run.

Three jobs, each run through the real ``edgefl simulate`` (mpiexec, ``fleet.ranks`` auto)
under both modes, alternating (the order swaps every repeat), ``--repeats`` times:

* ``default``: the built-in job (8 devices, MLP [64] on 60 features, 20 rounds);
* ``cnn``: the CNN on scikit-learn's 8x8 digits (8 devices, IID, 20 rounds; needs the
  ``real`` extra);
* ``10k``: the logistic-regression FedAvg job of ``edgefl bench scale`` with 10,000 devices
  for 3 rounds (``--devices`` changes it).

Per job and mode: the median of the whole command's wall time (``cmd_s``) and of the round
rate after round 1 (``rounds_per_s``, wall clock), the final accuracy and the model hash.
``cost`` is native rounds/s over portable rounds/s (1.10: portable is 10% slower);
``cmd_cost`` and ``cpu_cost`` are portable over native whole-command wall time and CPU
seconds of the job's processes (the CPU seconds vary least on a busy machine). Virtual
clock, ``sim.reference_s_per_sample`` fixed: the models do not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import simulate_command

NAME = "kernels"
HELP = "cost of portable kernels (run.kernels) vs native ones: three jobs, side by side"
JOBS = ("default", "cnn", "10k")
FIXED = ["fleet.device=cpu", "sim.reference_s_per_sample=0.0001", "output.progress=quiet"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated: {', '.join(JOBS)}")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs per mode and job")
    p.add_argument("--devices", type=int, default=10_000, help="devices of the 10k job")
    p.add_argument("--seed", type=int, default=0)


def job_sets(job: str, args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of one job (after :data:`FIXED`)."""
    if job == "default":
        return [f"seed={args.seed}"]
    if job == "cnn":
        from .common import real_data_sets

        return [f"seed={args.seed}", *real_data_sets("digits"), "model.name=cnn"]
    if job == "10k":
        from .rounds import bench_config

        ns = argparse.Namespace(seed=args.seed, rounds=3, devices=args.devices, ranks="auto")
        doc = bench_config(ns)
        out = [f"seed={args.seed}"]
        for section, table in doc.items():
            if not isinstance(table, dict):
                continue
            for key, value in table.items():
                text = _toml(value) if isinstance(value, dict) else json.dumps(value)
                out.append(f"{section}.{key}={text}")
        return out
    raise SystemExit(f"edgefl: error: --jobs: unknown job {job!r}; known: {', '.join(JOBS)}")


def _toml(table: dict) -> str:
    """An inline TOML table of plain values."""
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: the whole job's
    (mpiexec and every rank are waited for), less sensitive to a busy machine than its
    wall time."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(sets: list[str], mode: str, out: Path) -> dict:
    """One ``edgefl simulate`` run; its wall time, round rate, accuracy and model hash."""
    from ..api import Result

    cmd = simulate_command(None, out, [*FIXED, *sets, f"run.kernels={mode}",
                                       "run.checkpoint_every=0"])  # fmt: skip
    t0, cpu0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-3000:])
        raise SystemExit(f"edgefl: error: benchmark run failed: {' '.join(cmd)}")
    run = Result(out)
    rows, summary = run.metrics, run.summary
    span = rows[-1]["wall_time_s"] - rows[0]["wall_time_s"]
    return {
        "cmd_s": wall,
        "cpu_s": cpu,
        "rounds_per_s": (len(rows) - 1) / span if len(rows) > 1 and span > 0 else float("nan"),
        "accuracy": summary["final_accuracy"],
        "sha": summary["model_sha256"][:12],
        "capability": summary["numerics"]["cpu_capability"],
        "mkl": summary["numerics"]["mkl_path"],
    }


def main(args: argparse.Namespace) -> int:
    from .common import header, table, write_json

    jobs = [j for j in args.jobs.split(",") if j]
    header(NAME, sys.argv, {"jobs": jobs, "repeats": args.repeats, "devices": args.devices},
           args.seed)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-kernels-") as tmp:
        for job in jobs:
            sets = job_sets(job, args)
            runs: dict[str, list[dict]] = {"portable": [], "native": []}
            for i in range(args.repeats):
                order = ("portable", "native") if i % 2 == 0 else ("native", "portable")
                for mode in order:
                    runs[mode].append(run_one(sets, mode, Path(tmp) / f"{job}-{mode}-{i}"))
            med = {}
            for mode, rs in runs.items():
                med[mode] = {
                    "job": job,
                    "kernels": mode,
                    "capability": rs[0]["capability"],
                    "mkl": rs[0]["mkl"],
                    "cmd_s": statistics.median(r["cmd_s"] for r in rs),
                    "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                    "rounds_per_s": statistics.median(r["rounds_per_s"] for r in rs),
                    "accuracy": rs[0]["accuracy"],
                    "model": rs[0]["sha"],
                    "same_every_run": len({r["sha"] for r in rs}) == 1,
                }
            cost = med["native"]["rounds_per_s"] / med["portable"]["rounds_per_s"]
            med["portable"]["cost"] = cost
            med["portable"]["cmd_cost"] = med["portable"]["cmd_s"] / med["native"]["cmd_s"]
            med["portable"]["cpu_cost"] = med["portable"]["cpu_s"] / med["native"]["cpu_s"]
            rows += [med["portable"], med["native"]]
            print(f"# {job}: native/portable rounds/s {cost:.3f}", flush=True)
    cols = ["job", "kernels", "capability", "mkl", "cmd_s", "cpu_s", "rounds_per_s", "cost",
            "cmd_cost", "cpu_cost", "accuracy", "model", "same_every_run"]  # fmt: skip
    print(table(rows, cols))
    write_json(args.json, rows)
    return 0
