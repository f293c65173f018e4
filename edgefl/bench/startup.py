"""``edgefl bench startup``: the whole ``edgefl simulate`` command, phase by phase, and the
peak memory of its process tree, against a plain single-process loop doing the same job.

Two jobs, each run ``--repeats`` times with the two systems alternating (load on the box
hits both alike), medians reported:

- ``rounds``: the job of ``edgefl bench rounds`` (10 devices x 20 rounds of logistic
  regression, 5 local full-batch steps, sample-weighted FedAvg, test evaluation every
  round), at the default rank count (``--ranks`` to change it);
- ``default``: the built-in job, ``edgefl simulate`` with no config at all (8 devices x 20
  rounds of an MLP, one local epoch of mini-batches of 32, a checkpoint every 5 rounds).

edgefl runs as a user runs it, ``python -m edgefl simulate [CONFIG] --out DIR`` (real
``mpiexec``). The plain loop is a fresh ``python`` process doing the same arithmetic with
no messaging (``python -m edgefl.bench.startup --loop CONFIG``, the loop of ``edgefl bench
rounds`` generalised to mini-batches): the same data, initial model and seed; torch gets the
threads of one edgefl rank (``fleet.threads``), and it saves the final model as edgefl does.

Phases of edgefl, from timestamps the run already leaves (process start times from /proc,
the time the banner line came out, file modification times in the run directory, the
``wall_time_s`` of metrics.jsonl, which the file's modification time anchors to the wall
clock). Each phase is the time from the end of the phase that ended before it (the
command start for the first) to its own end, so the phases add up to the whole command;
``edgefl simulate`` starts the ranks before its check is done, so ``launch`` ends first:

- ``launch``: -> the first rank process starts (the launcher's imports and config,
  ``mpiexec --version``, mpiexec's start);
- ``pre-check``: -> the banner line: the job was checked (data, model, memory, policies,
  training hooks, profiles) and the run directory written (rank 0's imports, torch and
  ``MPI_Init`` included: rank 0 checks while the others wait; where the launcher checks
  before it starts mpiexec, this comes first and ``launch`` follows);
- ``imports``: -> rank 0 is ready (rank 0 rewrites config.toml; where the check ran
  before the launch, this holds rank 0's imports);
- ``registration``: -> every worker registered (ranks.json): their imports, devices' data
  and models, warm-up step (the first optimizer step; edgefl's ranks do not load
  torch._dynamo, see edgefl.training.eager, the loop's first step does);
- ``warm-up``: -> the end of round 1 (the coordinator's set-up, the first dispatch and
  round);
- ``rounds``: round 1 -> the last round's metrics row;
- ``final checkpoint``: -> summary.json and final_model.pt written (the last checkpoint,
  timeline.csv, summary);
- ``finalize``: -> the command returned (STOP to the workers, ``MPI_Finalize``, the ranks'
  and mpiexec's exit, the launcher's exit).

The plain loop's marks are its own timestamps: ``imports`` (command start -> torch and the
data/model code imported), ``registration`` (data and model built), ``warm-up`` (round 1),
``rounds``, ``final checkpoint`` (the final model saved), ``finalize`` (-> the process
exited).

Memory: the process tree of each command (the launcher, mpiexec, every rank and anything
they start) is sampled every ``--interval`` seconds from /proc; ``peak_rss_mib`` is the
largest sum of the tree's resident set sizes (what the target is about: shared library
pages count once per process), ``peak_anon_mib`` the same without file-backed and shared
pages (what the processes allocated themselves). A fork that has not exec'd (same argv as
its parent) shares its parent's pages and is left out. ``cpu_s`` is user + system CPU time
of the command's whole tree (``wait4``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..procfs import Proc, TreeSampler
from .common import simulate_command

NAME = "startup"
HELP = "start-up, shutdown and peak memory of edgefl simulate vs a plain single-process loop"

JOBS = ("rounds", "default")
PHASES = (
    "pre-check",
    "launch",
    "imports",
    "registration",
    "warm-up",
    "rounds",
    "final checkpoint",
    "finalize",
)
MIB = 1 << 20
MPI_LAUNCHERS = ("mpiexec", "mpirun", "prterun")
# Open MPI sometimes fails to start at all on a busy box (tests/conftest.py): run again
LAUNCH_FLAKE = "The PMIx server's listener thread failed to start"
TARGET_RATIO = 2.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each system")
    p.add_argument(
        "--jobs",
        default=",".join(JOBS),
        help="comma-separated jobs to run: rounds, default (default: both)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="fleet.ranks of both jobs (edgefl simulate --ranks N; default: the config "
        "default, what a user gets)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds job")
    p.add_argument(
        "--interval", type=float, default=0.02, help="seconds between samples of the tree"
    )
    p.add_argument("--runs", default="", help="keep the run directories here (default: temp)")


# -- measuring a command (its process tree: Proc, TreeSampler of edgefl.procfs) -------------
def run_measured(cmd: list[str], interval: float, log: Path, env=None) -> dict:
    """Run ``cmd`` (stdout and stderr to ``log``, each line's arrival time noted), sampling
    its tree; wall and CPU seconds, exit status, peak tree memory, the processes seen and
    the output lines as (unix time, text)."""
    lines: list[tuple[float, str]] = []
    with open(log, "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        sampler = TreeSampler(proc.pid, interval).start()

        def copy() -> None:
            for raw in iter(proc.stdout.readline, b""):
                lines.append((time.time(), raw.decode("utf-8", "replace")))
                out.write(raw)

        reader = threading.Thread(target=copy, name="edgefl-output", daemon=True)
        reader.start()
        _, status, usage = os.wait4(proc.pid, 0)
        t_end = time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
        reader.join(timeout=10)
        proc.stdout.close()
    return {
        "t0": t0,
        "t_end": t_end,
        "wall_s": t_end - t0,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "status": proc.returncode,
        "peak_rss_mib": sampler.peak_rss / MIB,
        "peak_anon_mib": sampler.peak_anon / MIB,
        "max_process_rss_mib": usage.ru_maxrss * 1024 / MIB,  # (kB; a single process's)
        "procs": list(sampler.procs.values()),
        "lines": lines,
    }


# -- phases ---------------------------------------------------------------------------------
def is_rank(p: Proc) -> bool:
    """A rank of an edgefl job: ``... -m edgefl run CONFIG`` (also through rankwrap; not a
    fork of a rank)."""
    a = p.argv
    if p.fork or p.exe in MPI_LAUNCHERS or "edgefl.rankwrap" in a:
        return False
    return any(x == "edgefl" and a[i + 1 : i + 2] == ["run"] for i, x in enumerate(a))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def round_marks(run_dir: Path) -> tuple[float | None, float | None, int]:
    """Unix times of the end of round 1 and of the last round, from metrics.jsonl: its
    ``wall_time_s`` (rank 0's clock since its loop started) anchored by the file's
    modification time (the append of the last row); and the number of rows."""
    from ..api import Result

    mtime = _mtime(run_dir / "metrics.jsonl")
    rows = Result.rows_so_far(run_dir)
    if mtime is None or not rows:
        return None, None, len(rows)
    last = rows[-1]["wall_time_s"]
    return mtime - (last - rows[0]["wall_time_s"]), mtime, len(rows)


def banner_time(lines: list[tuple[float, str]]) -> float | None:
    """When ``edgefl simulate`` printed its banner (``... run directory DIR``): its
    pre-launch check had passed and the run directory was written."""
    for t, text in lines:
        if text.startswith("edgefl simulate: ") and ", run directory " in text:
            return t
    return None


def edgefl_marks(
    t0: float, t_end: float, procs: list[Proc], run_dir: Path, banner: float | None = None
) -> dict:
    """The moments each phase of an ``edgefl simulate`` command ends (unix seconds, None
    where not found), from the tree's processes, the run directory and the time the banner
    was printed (``banner``)."""
    ranks = [p for p in procs if is_rank(p)]
    launchers = [p for p in procs if p.exe in MPI_LAUNCHERS and "--version" not in p.argv]
    parents = {p.ppid for p in ranks}
    mpi = [p for p in launchers if p.pid in parents] or launchers
    first_rank = min((p.start for p in ranks), default=None)
    t_mpi = min((p.start for p in mpi), default=first_rank)
    ready = _mtime(run_dir / "config.toml")
    if ready is not None and ((t_mpi is not None and ready < t_mpi) or
                              (banner is not None and ready < banner)):  # fmt: skip
        ready = None  # (the launcher's copy: rank 0 never rewrote it)
    r1, rn, _ = round_marks(run_dir)
    finals = [m for m in (_mtime(run_dir / "summary.json"), _mtime(run_dir / "final_model.pt"))
              if m is not None]  # fmt: skip
    return {
        "pre-check": banner,
        "launch": first_rank,
        "imports": ready,
        "registration": _mtime(run_dir / "ranks.json"),
        "warm-up": r1,
        "rounds": rn,
        "final checkpoint": max(finals) if finals else None,
        "finalize": t_end,
        "ranks_exited": max((p.last_seen for p in ranks), default=None),
        "t0": t0,
    }


def loop_marks(t0: float, t_end: float, marks: dict) -> dict:
    """The plain loop's phase ends (its own timestamps; no pre-check nor launch)."""
    return {
        "pre-check": t0,
        "launch": t0,
        "imports": marks.get("imported"),
        "registration": marks.get("built"),
        "warm-up": marks.get("round1"),
        "rounds": marks.get("last_round"),
        "final checkpoint": marks.get("saved"),
        "finalize": t_end,
        "t0": t0,
    }


def phase_order(marks: dict) -> list[str]:
    """The phases whose end is known, in the order they ended (``edgefl simulate`` starts
    its ranks before its check is done: ``launch`` ends before ``pre-check``)."""
    known = [ph for ph in PHASES if marks.get(ph) is not None]
    return sorted(known, key=lambda ph: (marks[ph], PHASES.index(ph)))


def phase_seconds(marks: dict) -> dict[str, float | None]:
    """Seconds of each phase: from the end of the phase that ended before it (the command
    start, or the launcher's own start-up ``start``, for the first) to its own end, so the
    phases add up to the whole command; a phase whose end is unknown is None."""
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    prev = marks["t0"]
    for ph in phase_order(marks):
        out[ph] = max(marks[ph] - prev, 0.0)
        prev = max(prev, marks[ph])
    return out


# -- the two systems ------------------------------------------------------------------------
def rounds_doc(seed: int, ranks: int | None) -> dict:
    """The rounds job (edgefl bench rounds) as a config document; the rank count of the
    config default unless ``ranks`` is given."""
    from .rounds import bench_config

    doc = bench_config(argparse.Namespace(devices=10, rounds=20, ranks=ranks or 2, seed=seed))
    if ranks is None:
        del doc["fleet"]["ranks"]
    return doc


def run_edgefl(
    job: str, conf: Path | None, out: Path, interval: float, log: Path, ranks: int | None = None
) -> dict:
    from ..api import Result

    cmd = simulate_command(conf, out, (), *(["--ranks", str(ranks)] if ranks and not conf else []))
    for _attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        m = run_measured(cmd, interval, log)
        if m["status"] == 0 or LAUNCH_FLAKE not in log.read_text(errors="replace"):
            break
        print("# Open MPI failed to start the job (its PMIx listener): run again", flush=True)
    if m["status"] != 0:
        raise SystemExit(f"edgefl: error: {' '.join(cmd)} failed (status {m['status']}):\n"
                         + log.read_text(errors="replace")[-4000:])  # fmt: skip
    marks = edgefl_marks(m["t0"], m["t_end"], m["procs"], out, banner_time(m["lines"]))
    summary = Result(out).summary
    ranks = [p for p in m["procs"] if is_rank(p)]
    return {
        "job": job,
        "system": "edgefl",
        **_common(m),
        **phase_seconds(marks),
        "ranks": len(ranks),
        "order": phase_order(marks),
        "ranks_exit_s": (marks["ranks_exited"] - marks["final checkpoint"])
        if marks["ranks_exited"] and marks["final checkpoint"]
        else None,
        "final_accuracy": summary.get("final_accuracy"),
        "command": " ".join(cmd),
    }


def run_loop(job: str, conf: Path, out: Path, interval: float, log: Path) -> dict:
    from ..launcher import rank_python

    out.mkdir(parents=True, exist_ok=True)
    marks_file = out / "marks.json"
    cmd = [*rank_python(), "-m", "edgefl.bench.startup", "--loop", str(conf), str(marks_file)]
    m = run_measured(cmd, interval, log)
    if m["status"] != 0:
        raise SystemExit(f"edgefl: error: the plain loop failed (status {m['status']}):\n"
                         + log.read_text(errors="replace")[-4000:])  # fmt: skip
    marks = json.loads(marks_file.read_text())
    return {
        "job": job,
        "system": "loop",
        **_common(m),
        **phase_seconds(loop_marks(m["t0"], m["t_end"], marks)),
        "final_accuracy": marks.get("accuracy"),
        "command": " ".join(cmd),
    }


def _common(m: dict) -> dict:
    keys = ("wall_s", "cpu_s", "peak_rss_mib", "peak_anon_mib", "max_process_rss_mib")
    return {k: m[k] for k in keys}


# -- the plain loop (a child process) -------------------------------------------------------
def loop_main(conf: str, marks_file: str) -> int:
    """The plain loop: FedAvg of the config's job in this process, no messaging; writes its
    timestamps (and final accuracy) to ``marks_file`` as JSON."""
    marks: dict = {}
    import torch

    from ..config import load_config

    marks["imported"] = time.time()
    c = load_config(conf)

    def on_round(r: int) -> None:
        marks["built" if r < 0 else "round1" if r == 0 else "last_round"] = time.time()

    model, acc = fedavg_loop(c, on_round)
    marks.setdefault("last_round", marks["round1"])
    torch.save(model.state_dict(), Path(marks_file).with_name("final_model.pt"))
    marks["saved"] = time.time()
    marks["accuracy"] = acc
    Path(marks_file).write_text(json.dumps(marks))
    return 0


def fedavg_loop(c: dict, on_round) -> tuple:
    """The plain loop's job: FedAvg of the effective config ``c`` (a classification job
    trained with SGD: ``train.lr``, ``momentum``, ``weight_decay``, ``batch_size``,
    ``local_epochs``/``local_steps``) in this process on ``fleet.threads`` threads, every
    device every round. ``on_round(r)`` is called once the data and model are built (``r``
    = -1) and after each round ``r`` (0-based). Returns (the model, the final test
    accuracy)."""
    import torch

    from ..data import load_federated
    from ..models import build_model
    from .rounds import fedavg_round

    torch.set_num_threads(c["fleet"]["threads"])
    n_dev, seed, tr = c["fleet"]["devices"], c["seed"], c["train"]
    data = load_federated(c["data"]["source"], dict(c["data"]["args"]), n_dev, seed)
    if data.info.task != "classification":
        raise SystemExit("the plain loop runs classification jobs only")
    model = build_model(c["model"]["name"], data.info, dict(c["model"]["args"]), seed)
    params = list(model.parameters())
    glob = [p.detach().clone() for p in params]
    xs, ys = zip(*(data.train(d).tensors for d in range(n_dev)))
    ns = [len(y) for y in ys]
    xt, yt = data.test().tensors
    gen = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.functional.cross_entropy
    on_round(-1)

    def train(d: int) -> None:
        opt = torch.optim.SGD(
            params, lr=tr["lr"], momentum=tr["momentum"], weight_decay=tr["weight_decay"]
        )
        for idx in _batches(ns[d], tr["batch_size"], tr["local_epochs"], tr["local_steps"], gen):
            x, y = (xs[d], ys[d]) if idx is None else (xs[d][idx], ys[d][idx])
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

    acc = float("nan")
    for r in range(c["run"]["rounds"]):
        acc = fedavg_round(model, glob, ns, train, (xt, yt))
        on_round(r)
    return model, acc


def _batches(n: int, batch_size: int, epochs: int, steps: int, gen):
    """Index tensors of the local mini-batches (None: the whole set, full batch): ``steps``
    batches through freshly shuffled epochs when ``steps`` > 0, else ``epochs`` passes."""
    import torch

    if batch_size <= 0 or batch_size >= n:
        yield from [None] * (steps if steps > 0 else epochs)
        return
    done = 0
    for _ in range(epochs if steps <= 0 else 1 << 30):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            if steps > 0 and done >= steps:
                return
            yield perm[i : i + batch_size]
            done += 1


# -- the report -----------------------------------------------------------------------------
def _median(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def summarize(rows: list[dict], jobs: list[str]) -> tuple[str, list[str], dict]:
    """The table (medians per job and system, edgefl/loop ratios), the verdict lines, and
    the medians as a dict ``{(job, system): {key: median}}``. A phase the loop spends
    under 0.05 s in gets no ratio."""
    keys = [*PHASES, "wall_s", "cpu_s", "peak_rss_mib", "peak_anon_mib", "final_accuracy"]
    med: dict = {}
    for job in jobs:
        for system in ("edgefl", "loop"):
            sel = [r for r in rows if r["job"] == job and r["system"] == system]
            med[(job, system)] = {k: _median([r.get(k) for r in sel]) for k in keys}
    labels = {
        "wall_s": "whole command (s)",
        "cpu_s": "CPU, whole tree (s)",
        "peak_rss_mib": "peak RSS, tree (MiB)",
        "peak_anon_mib": "peak anon RSS, tree (MiB)",
        "final_accuracy": "final accuracy",
    }
    head = ["phase"]
    for job in jobs:
        head += [f"{job}:edgefl", f"{job}:loop", f"{job}:ratio"]
    lines = []
    for k in keys:
        cells = [labels.get(k, f"{k} (s)")]
        for job in jobs:
            e, lo = med[(job, "edgefl")][k], med[(job, "loop")][k]
            digits = 4 if k == "final_accuracy" else (0 if "mib" in k else 2)
            # (no ratio over a phase the loop hardly has: registration's 0.01 s, ...)
            ratio = (
                e / lo if e is not None and lo and lo >= 0.05 and k != "final_accuracy" else None
            )
            cells += [_fmt(e, digits), _fmt(lo, digits), _fmt(ratio)]
        lines.append(cells)
    widths = [max(len(head[i]), *(len(c[i]) for c in lines)) for i in range(len(head))]
    text = [head[0].ljust(widths[0]) + "  " + "  ".join(
        h.rjust(w) for h, w in zip(head[1:], widths[1:]))]  # fmt: skip
    for c in lines:
        text.append(c[0].ljust(widths[0]) + "  " + "  ".join(
            x.rjust(w) for x, w in zip(c[1:], widths[1:])))  # fmt: skip
    verdicts = []
    for key, what in (("wall_s", "whole command"), ("peak_rss_mib", "peak RSS of the tree")):
        parts = []
        for job in jobs:
            e, lo = med[(job, "edgefl")][key], med[(job, "loop")][key]
            ratio = e / lo if e is not None and lo else float("nan")
            ok = "met" if ratio <= TARGET_RATIO else "NOT met"
            parts.append(f"{job} job {ratio:.2f} ({ok})")
        n = 1 if key == "wall_s" else 2
        verdicts.append(
            f"# target {n} ({what}: edgefl <= {TARGET_RATIO:g}x the plain loop): "
            + "; ".join(parts)
        )
    return "\n".join(text), verdicts, med


def main(args: argparse.Namespace) -> int:
    from ..config import dump_config, load_config
    from .common import header, write_json

    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    bad = [j for j in jobs if j not in JOBS]
    if bad or not jobs:
        raise SystemExit(f"edgefl: error: --jobs: expected some of {', '.join(JOBS)}")
    if not sys.platform.startswith("linux"):
        raise SystemExit("edgefl: error: edgefl bench startup samples /proc (Linux only)")
    doc = rounds_doc(args.seed, args.ranks)
    header(NAME, sys.argv, {"rounds": doc, "default": {}}, args.seed)
    more = f" --ranks {args.ranks}" if args.ranks else ""
    print(f"# default job: `edgefl simulate{more}` with no config (built-in defaults, seed 0)")
    keep = Path(args.runs) if args.runs else None
    tmp = tempfile.TemporaryDirectory(prefix="edgefl-bench-startup-")
    root = keep or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    confs = {"rounds": root / "rounds.toml", "default": root / "default.toml"}
    confs["rounds"].write_text(dump_config(load_config(doc=doc)))
    confs["default"].write_text(dump_config(load_config(None)))
    rows: list[dict] = []
    try:
        for i in range(args.repeats):
            for job in jobs:
                # alternate which system goes first, so neither always runs on a cold cache
                order = ("loop", "edgefl") if i % 2 == 0 else ("edgefl", "loop")
                for system in order:
                    out = root / f"{job}-{system}-{i}"
                    log = root / f"{job}-{system}-{i}.log"
                    if system == "edgefl":
                        conf = confs[job] if job == "rounds" else None
                        row = run_edgefl(job, conf, out, args.interval, log, args.ranks)
                    else:
                        row = run_loop(job, confs[job], out, args.interval, log)
                    row["repeat"] = i
                    rows.append(row)
                    print(
                        f"# {job:7s} {system:6s} repeat {i}: {row['wall_s']:.2f} s, peak RSS "
                        f"{row['peak_rss_mib']:.0f} MiB, CPU {row['cpu_s']:.2f} s",
                        flush=True,
                    )
    finally:
        if keep is None:
            tmp.cleanup()
    for r in rows:
        if r["system"] == "edgefl" and r["repeat"] == 0:
            print(f"# {r['job']} job edgefl command: {r['command']} ({r['ranks']} ranks; "
                  f"phases in the order they end: {', '.join(r['order'])})")  # fmt: skip
        if r["system"] == "loop" and r["repeat"] == 0:
            print(f"# {r['job']} job plain-loop command: {r['command']}")
    text, verdicts, med = summarize(rows, jobs)
    print(f"# medians of {args.repeats} alternating runs; ratio = edgefl / loop")
    print(text)
    exits = [r["ranks_exit_s"] for r in rows if r.get("ranks_exit_s") is not None]
    if exits:
        print(
            f"# of finalize: the last rank process was gone {_median(exits):.2f} s after the "
            "final checkpoint (median over all edgefl runs; the rest is mpiexec and the "
            "launcher leaving)"
        )
    for v in verdicts:
        print(v)
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"] and len(sys.argv) == 4:
        sys.exit(loop_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m edgefl.bench.startup --loop CONFIG.toml MARKS.json", file=sys.stderr)
    sys.exit(2)
