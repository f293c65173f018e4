"""Record the golden final-model hashes into tests/golden/models.json.

    python tests/golden/record.py [--only NAME ...] [--repeat N]

For every config of configs.CONFIGS (or the --only ones) it runs the real CLI,
``python -m edgefl simulate --out DIR --set ...`` (real mpiexec), reads ``model_sha256``
from DIR/summary.json, runs the same effective config in this process over the loopback
transport (configs.run_loopback), and requires the two hashes to be equal (configs.MPI_ONLY
are recorded over MPI only, with the reason). ``--repeat N`` runs each MPI job N times and
requires one hash. models.json is written only when every config recorded agreed; with
--only the other entries are kept.

The edgefl that runs is the one ``import edgefl`` finds: to record a baseline from another
checkout, e.g. a worktree of the baseline commit, run
``PYTHONPATH=/path/to/worktree python tests/golden/record.py`` (the CLI runs in a temporary
directory, so the current directory's edgefl cannot shadow it; both are checked to match).
Re-record only for an intentional behaviour change, never to make a failing test pass.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from conftest import run_edgefl  # noqa: E402

from golden.configs import (  # noqa: E402
    CONFIGS,
    MODELS_JSON,
    MPI_ONLY,
    check_deterministic,
    effective_config,
    run_loopback,
    simulate_argv,
)


def edgefl_location(cwd: str | None = None) -> str:
    """Where ``import edgefl`` resolves, in this process (cwd None) or in a fresh Python
    started in ``cwd`` (what ``python -m edgefl`` and the MPI ranks import)."""
    if cwd is None:
        import edgefl

        return str(Path(edgefl.__file__).resolve().parent)
    code = "import edgefl, pathlib; print(pathlib.Path(edgefl.__file__).resolve().parent)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def run_mpi(name: str, sets: list[str]) -> dict:
    """``edgefl simulate`` of the config (real mpiexec); its summary.json."""
    with tempfile.TemporaryDirectory(prefix=f"edgefl-golden-{name}-") as tmp:
        out = Path(tmp) / "run"
        proc = run_edgefl(*simulate_argv(sets, out), cwd=Path(tmp), timeout=600)
        if proc.returncode != 0:
            raise SystemExit(
                f"{name}: edgefl simulate exited {proc.returncode}\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            )
        return json.loads((out / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="repeatable")
    p.add_argument("--repeat", type=int, default=1, help="MPI runs per config (default 1)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.only) - set(CONFIGS))
    if unknown:
        p.error(f"unknown config(s): {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    names = args.only or list(CONFIGS)

    here = edgefl_location()
    with tempfile.TemporaryDirectory() as tmp:
        there = edgefl_location(tmp)
    print(f"# edgefl in this process: {here}", flush=True)
    print(f"# edgefl of the CLI and its ranks: {there}", flush=True)
    if here != there:
        raise SystemExit("the CLI would run another edgefl than this process; fix PYTHONPATH")

    models = json.loads(MODELS_JSON.read_text()) if args.only and MODELS_JSON.exists() else {}
    failed = []
    for name in names:
        sets = CONFIGS[name]
        cfg, ranks = effective_config(sets)
        check_deterministic(name, cfg)
        t0 = time.monotonic()
        mpi = [run_mpi(name, sets) for _ in range(args.repeat)]
        t_mpi = time.monotonic() - t0
        shas = {s["model_sha256"] for s in mpi}
        s = mpi[0]
        notes = []
        if len(shas) > 1:
            notes.append(f"MPI runs disagree: {sorted(shas)}")
        if s["clock"] != "virtual" or s["reference_s_per_sample"] != 1e-4:
            notes.append(
                f"clock {s['clock']}, reference_s_per_sample {s['reference_s_per_sample']}"
            )
        if s["workers"] != ranks - 1 - cfg["ps"]["servers"]:
            notes.append(
                f"{s['workers']} worker ranks, expected {ranks - 1 - cfg['ps']['servers']}"
            )
        entry = {
            "set": list(sets),
            "ranks": "auto" if cfg["fleet"]["ranks"] == "auto" else ranks,
            "model_sha256": s["model_sha256"],
        }
        t0 = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):  # the coordinator's summary table
            lb, lb_ranks = run_loopback(sets)
        t_lb = time.monotonic() - t0
        if name in MPI_ONLY:
            entry["backend"] = "mpi"
            entry["why"] = MPI_ONLY[name]
            if lb["model_sha256"] == s["model_sha256"]:
                notes.append("listed in MPI_ONLY but the loopback run gives the MPI model")
        elif lb["model_sha256"] != s["model_sha256"] or lb_ranks != ranks:
            notes.append(f"loopback {lb['model_sha256']} != mpi {s['model_sha256']}")
        status = "FAIL " + "; ".join(notes) if notes else "ok"
        print(
            f"{name:34s} {s['model_sha256'][:16]} ranks={ranks} rounds={s['rounds_done']} "
            f"mpi {t_mpi:5.1f}s loopback {t_lb:5.2f}s{' (mpi only)' if name in MPI_ONLY else ''}"
            f"  {status}",
            flush=True,
        )
        if notes:
            failed.append(name)
        else:
            models[name] = entry
    if failed:
        print(f"# not written: {', '.join(failed)} did not agree", file=sys.stderr)
        return 1
    MODELS_JSON.write_text(json.dumps(models, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"# wrote {len(models)} configs to {MODELS_JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
