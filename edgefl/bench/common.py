"""Helpers shared by the benchmarks: printing tables, writing JSON, launching MPI."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path


def header(name: str, argv: list[str], config: dict, seed: int | None) -> None:
    """Print what a benchmark run is: command, config, seed, machine."""
    print(f"# edgefl bench {name}")
    print(f"# command: {' '.join(shlex.quote(a) for a in argv)}")
    print(f"# config: {json.dumps(config, sort_keys=True)}")
    if seed is not None:
        print(f"# seed: {seed}")
    import os

    print(
        f"# machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}"
    )
    sys.stdout.flush()


def table(rows: list[dict], cols: list[str]) -> str:
    """Render rows as an aligned text table (floats with 4 significant digits)."""

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [
        max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)
    ]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_json(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as a JSON list (the ``--json FILE`` of every bench)."""
    if path:
        Path(path).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        print(f"# rows written to {path}")


def simulate_command(
    config: Path | None = None,
    out: Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    *extra: str,
) -> list[str]:
    """The one way a benchmark starts a job: ``python -P -m edgefl simulate [CONFIG]
    [--out OUT] [EXTRA ...] [--set KEY=VALUE ...]`` with this environment's interpreter
    (``-P``: the working directory cannot shadow edgefl). ``extra``: more options, e.g.
    ``"--backend", "inline"`` or ``"--resume", CKPT``."""
    from ..launcher import rank_python

    cmd = [*rank_python(), "-m", "edgefl", "simulate"]
    if config is not None:
        cmd.append(str(config))
    if out is not None:
        cmd += ["--out", str(out)]
    cmd += [str(e) for e in extra]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def finished_with(out: Path, sets: list[str]) -> bool:
    """Whether ``out`` holds a finished run (exit status 0, summary.json) of exactly the
    effective config that ``edgefl simulate --set SETS`` would run now (its config.toml
    compared key by key): what ``--reuse`` may take instead of running it again."""
    from ..config.load import tomllib
    from ..config.sources import simulation_config
    from ..errors import ConfigError

    try:
        if (out / "exit_status").read_text().strip() != "0":
            return False
        if not (out / "summary.json").is_file():
            return False
        recorded = tomllib.loads((out / "config.toml").read_text(encoding="utf-8"))
        cfg, _ = simulation_config(None, list(sets))
    except (OSError, ValueError, ConfigError):
        return False
    return recorded == cfg


def run_simulate(out: Path, sets: list[str], timeout: float = 3600, reuse: bool = False) -> None:
    """Run ``edgefl simulate --out OUT --set ...`` (real mpiexec) and fail loudly.

    ``reuse``: when OUT already holds a finished run of the same effective config
    (:func:`finished_with`), keep it and say so in one line instead of running again (a
    benchmark interrupted or re-tabulated; the virtual clock makes the rerun identical)."""
    import subprocess

    if reuse and finished_with(out, sets):
        print(f"# reused {out} (a finished run of the same config)", flush=True)
        return
    if reuse and out.exists() and any(out.iterdir()):
        raise SystemExit(
            f"edgefl: error: --reuse: {out} holds another config's run, or one that did not "
            "finish; remove it (or choose another --runs) to run it again"
        )
    cmd = simulate_command(None, out, sets)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"edgefl: error: benchmark run failed: {' '.join(cmd)}")


def runs_root(runs: str, name: str) -> Path:
    """Where a benchmark keeps its run directories: ``--runs`` or runs/bench-NAME-<time>."""
    import time

    root = Path(runs or f"runs/bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    root.mkdir(parents=True, exist_ok=True)
    return root


def fleet_sets(args) -> list[str]:
    """The ``--set`` overrides every simulate-based benchmark run shares (seed, fleet,
    profiles; no checkpoints, quiet output) from its ``--seed --devices --ranks
    --profiles`` options."""
    return [
        f"seed={args.seed}",
        f"fleet.devices={args.devices}",
        f"fleet.ranks={args.ranks}",
        f"sim.profiles={args.profiles}",
        "run.checkpoint_every=0",
        "output.progress=quiet",
    ]


# the real datasets of the ``partition`` source (docs/real-data.md) that benchmarks accept
# as ``--data``; "synthetic" keeps each benchmark's generated task
DATA_CHOICES = ("synthetic", "digits", "mnist1d")


def add_data_arg(p, choices: tuple[str, ...] = DATA_CHOICES, default: str = "synthetic") -> None:
    """The ``--data`` option: the benchmark's generated task or a real dataset."""
    p.add_argument(
        "--data",
        choices=choices,
        default=default,
        help=f"dataset: {', '.join(choices)} (real ones need pip install 'edgefl[real]')",
    )


def real_data_sets(dataset: str, scheme: str = "iid", samples: int | None = None) -> list[str]:
    """``--set`` overrides selecting a real dataset of the ``partition`` source.

    Replaces the whole ``data.args`` table (the default synthetic source's arguments mean
    nothing to ``partition``). ``samples``: MNIST-1D's ``num_samples`` (generated
    examples, train and test together). Fails with one line before anything launches when
    the extra ``edgefl[real]`` is missing.
    """
    from ..data.real import load_real
    from ..errors import DataError

    extra = {"num_samples": int(samples)} if samples and dataset == "mnist1d" else {}
    try:
        load_real(dataset, extra)
    except DataError as e:
        raise SystemExit(f"edgefl: error: {e}") from None
    inner = f", dataset_args = {{num_samples = {int(samples)}}}" if extra else ""
    return [
        "data.source=partition",
        f'data.args={{dataset = "{dataset}", scheme = "{scheme}"{inner}}}',
    ]


def paper_line(text: str) -> None:
    """Print the paper's figure that a benchmark row stands beside."""
    print(f"# paper: {text}", flush=True)
