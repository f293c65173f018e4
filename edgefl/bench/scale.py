"""``edgefl bench scale``: 1,000 and 10,000 simulated devices, rounds/s and peak memory.

Task (from the issue): the logistic-regression FedAvg job of ``edgefl bench rounds``
(synthetic IID data of dimension 20, 200 training and 100 test samples per device, 5 local
full-batch SGD steps at lr 0.5, sample-weighted FedAvg, test evaluation every round; BSP,
every device every round) with ``--sizes`` devices for ``--rounds`` rounds. ``--systems``
(default ``mpi,inline,loop``):

* ``mpi`` (row ``edgefl``): the real job through ``edgefl simulate`` (real ``mpiexec``,
  ``--ranks`` ranks: a coordinator and workers, default settings otherwise: events.jsonl,
  the final checkpoint, summary.json);
* ``inline`` (row ``edgefl-inline``): the same command with ``--backend inline``: the same
  ranks as threads of one process, no MPI (the same run directory and final model);
* ``loop`` (row ``plain-loop``): the baseline, a plain single-process loop doing the same
  arithmetic (no messaging, one core);
* ``mpi-vec``, ``inline-vec`` (rows ``edgefl-vec``, ``edgefl-inline-vec``, not in the
  default): the ``mpi`` and ``inline`` commands with ``--set train.vectorize="auto"``
  (each worker trains its queued tasks as one stacked computation; the model equals the
  one-by-one model within float32 rounding, not bit for bit);
* ``pfl`` (row ``pfl``, not in the default): the same job in Apple's pfl (pfl-research 0.6,
  ``pip install 'pfl[pytorch]==0.6.0'``) in one process, one torch thread, run by
  ``--pfl-python`` (default: this interpreter; pfl's venv need not have edgefl): a child
  process of this script (:mod:`edgefl.bench.pfl_job`) trains on the same data and from the
  same initial model, both written by edgefl's generator to an ``.npz`` in the temporary
  directory beforehand (its writing is not timed; the child's loading is, in ``cmd_wall_s``).
  The job in pfl's terms: ``torch.nn.Linear`` with cross-entropy, ``FederatedAveraging`` on
  a ``SimulatedBackend``, local SGD at lr 0.5 for 5 full-batch epochs (a batch is the
  device's whole dataset), central SGD at lr 1.0 (plain FedAvg), cohort = every device,
  ``WeightByDatapoints`` (pfl's default weight is 1 per user), ``CentralEvaluationCallback``
  on the test set every round. pfl's own order differs in two places that the rates do not
  see: it also evaluates the initial model before round 1 and skips the central evaluation
  after round 1, and its per-device evaluation before and after local training runs in
  round 1 only (it is not part of the job).

``--job`` picks the job (default ``logreg``, the one above): ``mlp`` is the built-in job
(``edgefl simulate`` with no config: an MLP on non-IID synthetic data whose devices hold
different numbers of examples, one epoch of mini-batches of 32) and ``cnn`` the CNN on the
digits (IID shares, recipe ``digits-cnn-iid``); their plain loop is
:func:`edgefl.bench.startup.fedavg_loop` (the same FedAvg with SGD mini-batches). The
targets of issue 27 for ``edgefl-vec`` / loop: 10x for logreg at 10,000 devices, 5x for
mlp and 3x for cnn at 1,000. ``--kernels`` (default ``portable``, edgefl's default) sets
``run.kernels`` of the edgefl systems and pins the same kernels in the plain loop's
environment, so both sides run the same CPU kernels (``native``: each CPU's fastest).

Reported per size and system (with ``--repeats`` the systems alternate and the run with
the median rate is reported):

* ``rounds_per_s``: rounds between the end of round 1 and the end of the last round, over
  the wall time between them (start-up excluded: launch, imports, data, registration);
  ``ratio_vs_loop`` = edgefl (either backend) or pfl / loop at the same size;
* ``cpu_s_per_round``: CPU seconds per round over the same rounds (edgefl: all processes,
  sampled when each metrics row appears; the breakdown by process is printed above the
  table) and ``cpu_ratio``: the loop's CPU seconds per round over the least wall time
  edgefl's allow on this box (its busiest process, or its total over the cores): what an
  otherwise idle box would give (on a shared one wall-clock rates follow the others' load);
* ``cmd_wall_s``: the whole command, start-up and the end (summary, checkpoint) included;
* ``peak_rss_mb``: peak resident memory of the whole process tree (the sum over the command
  and every descendant: mpiexec and every rank), sampled from /proc every 50 ms.

Then the per-device memory (the slope of peak RSS between the smallest and the largest
size, and what remains beyond the device's own data) and an extrapolation to
``--extrapolate`` devices from the measured sizes (linear fits of peak RSS and of seconds
per round), each printed as its own line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import procfs
from .common import simulate_command

NAME = "scale"
HELP = (
    "1,000 and 10,000 devices: rounds/s and peak RSS, edgefl over mpiexec and in-process vs a "
    "plain loop"
)
SYSTEMS = {
    "mpi": "edgefl",
    "inline": "edgefl-inline",
    "mpi-vec": "edgefl-vec",
    "inline-vec": "edgefl-inline-vec",
    "loop": "plain-loop",
    "pfl": "pfl",
}  # (-> row name; pfl is not in the default --systems)
VECTORIZE = 'train.vectorize="auto"'  # the -vec systems: a worker trains its tasks stacked
VEC_TARGET = 10.0  # edgefl-vec / loop rounds/s at 10,000 devices (issue 27)
# --job: the job, and the edgefl-vec / loop target at 1,000 devices and more (issue 27)
JOBS = {
    "logreg": "the FedAvg logistic-regression job of edgefl bench rounds",
    "mlp": "the built-in job (edgefl simulate with no config: an MLP on synthetic(0.5, 0.5), "
    "one epoch of mini-batches of 32)",
    "cnn": "the CNN on digits (recipe digits-cnn-iid: IID shares of the 1,797 digits, 3 "
    "epochs, SGD lr 0.05 with momentum 0.9)",
}
JOB_TARGETS = {"mlp": 5.0, "cnn": 3.0}

RSS_TARGET_MB = 2500.0
# 100,000 devices x 2 rounds of the logreg job within 4 GB of peak RSS (issue 27), taken
# as 4 x 10^9 bytes: the unit of peak_rss_mb
BIG_FLEET, BIG_RSS_TARGET_MB = 100_000, 4000.0
RATIO_TARGET = 1.8
INLINE_TARGET = 1.0  # the in-process backend: at least the plain loop's rounds/s


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1000,10000", help="fleet sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=3, help="MPI ranks for edgefl (incl. rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extrapolate", type=int, default=100_000, help="fleet size to extrapolate to")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternating runs of each system per size; the median rate is reported",
    )
    p.add_argument(
        "--systems",
        default="mpi,inline,loop",
        help="what to run, comma-separated: mpi (edgefl simulate), inline (edgefl simulate "
        "--backend inline), mpi-vec and inline-vec (the same with train.vectorize = 'auto'), "
        "loop (the plain loop), pfl (the same job in Apple's pfl 0.6, run by --pfl-python)",
    )
    p.add_argument(
        "--pfl-python",
        metavar="PATH",
        default=sys.executable,
        help="the Python interpreter that has pfl[pytorch] installed, for --systems pfl "
        "(default: this one)",
    )
    p.add_argument(
        "--kernels",
        choices=("portable", "native"),
        default="portable",
        help="CPU kernels of every system: edgefl's run.kernels, and the same pinned in the "
        "plain loop's environment (default portable, edgefl's default)",
    )
    p.add_argument(
        "--job",
        choices=tuple(JOBS),
        default="logreg",
        help="the job: " + "; ".join(f"{k}: {v}" for k, v in JOBS.items()),
    )
    p.add_argument("--no-loop", action="store_true", help="run edgefl only (no ratio)")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")


def bench_config(args: argparse.Namespace, devices: int) -> dict:
    """The job of ``edgefl bench rounds`` with ``devices`` devices and ``--rounds`` rounds."""
    from .rounds import bench_config as rounds_config

    ns = argparse.Namespace(seed=args.seed, rounds=args.rounds, devices=devices, ranks=args.ranks)
    cfg = rounds_config(ns)
    job = getattr(args, "job", "logreg")
    if job != "logreg":  # (the same run, fleet and output settings; the job's own parts)
        del cfg["data"], cfg["model"], cfg["train"]
    if job == "cnn":
        cfg["data"] = {"source": "partition", "args": {"dataset": "digits", "scheme": "iid"}}
        cfg["model"] = {"name": "cnn"}
        cfg["train"] = {"lr": 0.05, "momentum": 0.9, "local_epochs": 3}
    cfg["run"]["kernels"] = getattr(args, "kernels", "portable")
    return cfg


def data_bytes_per_device(cfg: dict) -> int:
    """Bytes of one device's own data: its training set and its share of the test set
    (float32 features, int64 labels); the logreg job's from its arguments, another job's
    measured on its data (the mean over the devices)."""
    if cfg.get("model", {}).get("name") == "logreg":
        a = cfg["data"]["args"]
        row = 4 * a["dim"] + 8
        return row * (a["min_samples"] + a["test_samples_per_device"])
    from ..config import load_config
    from ..data import load_federated

    c = load_config(doc=cfg)
    n = c["fleet"]["devices"]
    data = load_federated(c["data"]["source"], dict(c["data"]["args"]), n, c["seed"])
    total = sum(t.nbytes for d in range(n) for t in data.train(d).tensors)
    total += sum(t.nbytes for t in data.test().tensors)
    return total // n


# -- peak RSS and CPU of a process tree: edgefl.procfs.TreeSampler ----------------------
def _label(pid: int) -> str:
    """What process ``pid`` is: ``rank N`` (an MPI rank), else its program's name."""
    env = procfs.environ(pid)
    if env is None:
        return "?"
    for name, value in env.items():
        if name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
            try:
                return f"rank {int(value)}"
            except ValueError:
                return "?"
    argv = procfs.cmdline(pid)
    if argv is None:
        return "?"
    if "simulate" in argv:
        return "edgefl simulate"
    return os.path.basename(argv[0]) if argv else "?"


class Measured:
    """A finished command: exit status, wall seconds, peak RSS of its process tree (the
    largest sum over one sample), each process's own peak RSS and CPU seconds (by label),
    and ``marks``: for each line that appeared in the watched file, the CPU seconds of each
    process (by label) when it was seen."""

    def __init__(self, rc, wall, peak, each, cpu, marks) -> None:
        self.rc, self.wall, self.peak, self.each, self.cpu = rc, wall, peak, each, cpu
        self.marks: list[dict[str, float]] = marks


def run_measured(cmd: list[str], interval: float = 0.05, watch: Path | None = None,
                 **popen) -> Measured:  # fmt: skip
    """Run ``cmd``, sampling RSS and CPU time of its process tree every ``interval`` s (the
    one tree sampler, :class:`edgefl.procfs.TreeSampler`); with ``watch``, the CPU seconds
    by process label each time a line is added to that file (``marks``)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, **popen)
    sampler = procfs.TreeSampler(proc.pid, interval).start()
    labels: dict[int, str] = {}
    marks: list[dict[str, float]] = []
    size = -1
    while proc.poll() is None:
        seen = dict(sampler.procs)
        for p in seen:
            if p not in labels:
                labels[p] = _label(p)
        if watch is not None and watch.exists() and watch.stat().st_size != size:
            size = watch.stat().st_size
            lines = watch.read_bytes().count(b"\n")
            now = _by_label(labels, {p: q.cpu_s for p, q in seen.items() if not q.fork})
            marks += [now] * (lines - len(marks))
        time.sleep(interval)
    wall = time.perf_counter() - t0
    sampler.stop()
    procs = {p: q for p, q in sampler.procs.items() if not q.fork}
    cpu = _by_label(labels, {p: q.cpu_s for p, q in procs.items()})
    each = _peaks_by_label(labels, {p: q.peak_rss for p, q in procs.items()})
    return Measured(proc.returncode, wall, sampler.peak_rss, each, cpu, marks)


def _peaks_by_label(labels: dict[int, str], peaks: dict[int, int]) -> dict[str, int]:
    """The largest peak RSS (bytes) of the processes of each label; a process whose memory
    no sample read (gone before one did: peak 0) is left out, not shown as 0."""
    out: dict[str, int] = {}
    for p, peak in peaks.items():
        if peak:
            name = labels.get(p, "?")
            out[name] = max(out.get(name, 0), peak)
    return out


def _by_label(labels: dict[int, str], cpu: dict[int, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p, c in cpu.items():
        name = labels.get(p, "?")
        out[name] = out.get(name, 0.0) + c
    return out


# -- the two systems ------------------------------------------------------------------------
def plain_loop(cfg: dict) -> dict:
    """The FedAvg arithmetic of the job as a plain Python/torch loop in this process (the
    loop of ``edgefl bench rounds``, with its CPU seconds per round)."""
    from .rounds import plain_loop as rounds_loop

    if cfg.get("model", {}).get("name") == "logreg":
        return rounds_loop(cfg)
    return generic_loop(cfg)


def generic_loop(cfg: dict) -> dict:
    """The plain loop of any other job (:func:`edgefl.bench.startup.fedavg_loop`: FedAvg
    with SGD mini-batches, as the config says): rounds per second and CPU seconds per round
    after the first round, and the final accuracy."""
    from ..config import load_config
    from .startup import fedavg_loop

    marks: list[tuple[float, float]] = []

    def on_round(r: int) -> None:
        if r >= 0:
            marks.append((time.perf_counter(), time.process_time()))

    _, acc = fedavg_loop(load_config(doc=cfg), on_round)
    rounds = len(marks) - 1
    return {
        "rounds_per_s": rounds / (marks[-1][0] - marks[0][0]),
        "cpu_s_per_round": (marks[-1][1] - marks[0][1]) / rounds,
        "final_accuracy": acc,
    }


def _loop_child() -> None:  # python -c: the plain loop in a process of its own
    import torch

    torch.set_num_threads(1)  # one core (as every edgefl rank: fleet.threads = 1)
    print(json.dumps(plain_loop(json.loads(sys.stdin.read()))))


def loop_env(mode: str) -> dict[str, str]:
    """The plain loop's environment: this one, with the CPU kernels of ``mode`` pinned as
    an edgefl rank pins them (``run.kernels``): the same kernels on both sides."""
    from .. import kernels

    env = {k: v for k, v in os.environ.items() if k not in kernels.portable_env()}
    if mode == "portable":
        env.update(kernels.portable_env())
    return env


def loop_run(cfg: dict, tmp: Path) -> dict:
    """The plain loop in a fresh process (its memory measured alone)."""
    conf = tmp / f"loop-{cfg['fleet']['devices']}.json"
    conf.write_text(json.dumps(cfg))
    res = tmp / f"loop-{cfg['fleet']['devices']}.out"
    cmd = [sys.executable, "-c", "from edgefl.bench.scale import _loop_child; _loop_child()"]
    env = loop_env(cfg["run"].get("kernels", "portable"))
    with open(conf) as fin, open(res, "w") as fout:
        m = run_measured(cmd, stdin=fin, stdout=fout, env=env)
    if m.rc != 0:
        raise SystemExit(f"edgefl: error: plain loop failed (status {m.rc})")
    got = json.loads(res.read_text().splitlines()[-1])
    return {
        "rounds_per_s": got["rounds_per_s"],
        "s_per_round": 1.0 / got["rounds_per_s"],
        "cpu_s_per_round": got["cpu_s_per_round"],
        "final_accuracy": got["final_accuracy"],
        "cmd_wall_s": m.wall,
        "cmd_cpu_s": sum(m.cpu.values()),
        "overhead_s": m.wall - cfg["run"]["rounds"] / got["rounds_per_s"],
        "peak_rss_mb": m.peak / 1e6,
    }


PFL_JOB = Path(__file__).with_name("pfl_job.py")


def check_pfl(python: str) -> None:
    """Exit with one line unless ``python`` can import pfl with its PyTorch support."""
    try:
        ok = subprocess.run([python, "-c", "import pfl.model.pytorch"], capture_output=True,
                            timeout=300).returncode == 0  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        raise SystemExit(
            f"edgefl: error: --systems pfl: pfl is not importable by {python} "
            "(pip install 'pfl[pytorch]==0.6.0' there, or pass --pfl-python)"
        )


def _pfl_data_child() -> None:  # python -c: the job's data and initial model as an .npz
    import numpy as np
    import torch

    from ..config import load_config
    from ..data import load_federated
    from ..models import build_model

    torch.set_num_threads(1)
    c = load_config(doc=json.loads(sys.stdin.read()))
    n = c["fleet"]["devices"]
    data = load_federated(c["data"]["source"], c["data"]["args"], n, c["seed"])
    state = build_model("logreg", data.info, {}, c["seed"]).state_dict()
    (weight,) = (v for k, v in state.items() if k.endswith("weight"))
    (bias,) = (v for k, v in state.items() if k.endswith("bias"))
    xs, ys = zip(*(data.train(d).tensors for d in range(n)))
    xt, yt = data.test().tensors
    np.savez(sys.argv[1], x=torch.cat(xs).numpy(), y=torch.cat(ys).numpy(),
             offsets=np.cumsum([0, *(len(v) for v in ys)]), x_test=xt.numpy(),
             y_test=yt.numpy(), weight=weight.numpy(), bias=bias.numpy())  # fmt: skip


def pfl_run(cfg: dict, tmp: Path, python: str) -> dict:
    """The job in pfl (:mod:`edgefl.bench.pfl_job`) in a fresh process run by ``python``, on
    the data and initial model that edgefl's generator writes to an .npz first (untimed)."""
    n = cfg["fleet"]["devices"]
    data = tmp / f"pfl-{n}.npz"
    if not data.exists():  # (once per size: the repeats share it)
        cmd = [sys.executable, "-c", "from edgefl.bench.scale import _pfl_data_child; "
               "_pfl_data_child()", str(data)]  # fmt: skip
        with open(tmp / f"pfl-{n}.json", "w") as f:
            f.write(json.dumps(cfg))
        with open(tmp / f"pfl-{n}.json") as fin:
            if subprocess.run(cmd, stdin=fin).returncode != 0:
                raise SystemExit("edgefl: error: writing the data for pfl failed")
    t = cfg["train"]
    opts = {"rounds": cfg["run"]["rounds"], "lr": t["lr"], "local_steps": t["local_steps"],
            "seed": cfg["seed"]}  # fmt: skip
    cmd = [python, str(PFL_JOB), str(data), json.dumps(opts)]
    print(f"# pfl: {' '.join(cmd)}", flush=True)
    res, log = tmp / f"pfl-{n}.out", tmp / f"pfl-{n}.log"
    with open(res, "w") as fout, open(log, "w") as ferr:
        m = run_measured(cmd, stdout=fout, stderr=ferr)
    if m.rc != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"edgefl: error: pfl run failed (status {m.rc}): {' '.join(cmd)}")
    got = json.loads(res.read_text().splitlines()[-1])
    print(f"# {n} devices, pfl: setup {got['setup_s']:.2f} s (load the .npz, build the "
          f"datasets and the model), test accuracy per round "
          f"{got['test_accuracy_per_round']}", flush=True)  # fmt: skip
    return {
        "rounds_per_s": got["rounds_per_s"],
        "s_per_round": 1.0 / got["rounds_per_s"],
        "cpu_s_per_round": got["cpu_s_per_round"],
        "cpu_bound_s": got["cpu_s_per_round"],  # (one process, one thread)
        "final_accuracy": got["final_accuracy"],
        "cmd_wall_s": m.wall,
        "cmd_cpu_s": sum(m.cpu.values()),
        "overhead_s": m.wall - cfg["run"]["rounds"] / got["rounds_per_s"],
        "peak_rss_mb": m.peak / 1e6,
    }


def edgefl_run(cfg: dict, root: Path, rep: int = 0, backend: str = "mpi") -> dict:
    """The job through ``edgefl simulate --backend BACKEND`` (``mpi-vec``, ``inline-vec``:
    that backend with ``train.vectorize = "auto"``); rates from metrics.jsonl's
    ``wall_time_s`` (``rep``: the repeat, which names its run directory after the first)."""
    from ..api import Result
    from ..config import dump_config, load_config

    n = cfg["fleet"]["devices"]
    conf = root / f"scale-{n}.toml"
    conf.write_text(dump_config(load_config(doc=cfg)))
    name = f"{'run' if backend == 'mpi' else backend}-{n}" + (f"-{rep}" if rep else "")
    out = root / name
    vec = backend.endswith("-vec")
    cmd = simulate_command(conf, out, (VECTORIZE,) if vec else (), "--backend",
                           backend.removesuffix("-vec"))  # fmt: skip
    print(f"# edgefl: {' '.join(cmd)}", flush=True)
    log = root / f"{name}.log"
    with open(log, "w") as f:
        m = run_measured(cmd, watch=out / "metrics.jsonl", stdout=f, stderr=subprocess.STDOUT)
    if m.rc != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"edgefl: error: edgefl run failed (status {m.rc}): {' '.join(cmd)}")
    run = Result(out)
    rows = run.metrics
    w = [r["wall_time_s"] for r in rows]
    rate = (len(w) - 1) / (w[-1] - w[0])
    # CPU seconds per round of each process between the end of round 1 and the last one
    # (as seen by the 50 ms sampler)
    per_round = {}
    if len(m.marks) >= 2:
        a, b = m.marks[0], m.marks[-1]
        per_round = {k: (b.get(k, 0.0) - a.get(k, 0.0)) / (len(m.marks) - 1) for k in b}
    each = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(m.each.items()) if v)
    print(f"# {n} devices, {backend}: peak RSS by process (MB): {each}", flush=True)
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_round.items()) if v)
    print(f"# {n} devices, {backend}: CPU seconds per round by process (rounds 2..): {cpu}",
          flush=True)  # fmt: skip
    busiest = max(per_round.values(), default=0.0)
    total = sum(per_round.values())
    return {
        "rounds_per_s": rate,
        "s_per_round": 1.0 / rate,
        "cpu_s_per_round": total,
        # the least wall time per round those CPU seconds allow on idle cores
        "cpu_bound_s": max(busiest, total / (os.cpu_count() or 1)),
        "final_accuracy": rows[-1].get("test_accuracy"),
        "cmd_wall_s": m.wall,
        "cmd_cpu_s": sum(m.cpu.values()),
        "overhead_s": m.wall - len(w) / rate,  # start-up and the end, beyond steady rounds
        "peak_rss_mb": m.peak / 1e6,
        "events_mb": _mb(out / "events.jsonl"),
        "ckpt_mb": sum(_mb(p) for p in out.rglob("*.h5")),
        "summary_kb": _mb(out / "summary.json") * 1000,
        "model_sha256": run.summary["model_sha256"],
        "stacked_tasks": run.summary.get("stacked_tasks", 0),
    }


def _mb(p: Path) -> float:
    return p.stat().st_size / 1e6 if p.exists() else 0.0


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares line (intercept, slope) through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def main(args: argparse.Namespace) -> int:
    from .common import header, table, write_json

    sizes = sorted(int(s) for s in args.sizes.split(","))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"edgefl: error: --systems {args.systems!r}: expected some of "
                         f"{', '.join(SYSTEMS)}")  # fmt: skip
    if args.no_loop and "loop" in systems:
        systems.remove("loop")
    if "pfl" in systems:
        check_pfl(args.pfl_python)
    cfg0 = bench_config(args, sizes[0])
    conf = {**cfg0, "fleet": {**cfg0["fleet"], "devices": sizes}}
    header(NAME, ["edgefl", "bench", NAME, *sys.argv[3:]], conf, args.seed)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="edgefl-scale-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            cfg = bench_config(args, n)
            runs: dict[str, list[dict]] = {s: [] for s in systems}
            for rep in range(max(args.repeats, 1)):  # (alternating: the box's load hits all)
                for system in systems:
                    if system == "loop":
                        runs[system].append(loop_run(cfg, Path(tmp)))
                    elif system == "pfl":
                        runs[system].append(pfl_run(cfg, Path(tmp), args.pfl_python))
                    else:
                        runs[system].append(edgefl_run(cfg, root, rep, backend=system))
            if args.repeats > 1:
                for system, got in runs.items():
                    rates = [round(x["rounds_per_s"], 4) for x in got]
                    print(f"# {n} devices, {SYSTEMS[system]} rounds/s per repeat: {rates}",
                          flush=True)  # fmt: skip
            loop = _median(runs["loop"]) if "loop" in runs else None
            here = []
            if loop is not None:
                here.append({"system": SYSTEMS["loop"], "devices": n, **loop})
            for system in (s for s in systems if s != "loop"):
                ours = _median(runs[system])
                if loop is not None:
                    ours["ratio_vs_loop"] = ours["rounds_per_s"] / loop["rounds_per_s"]
                    if ours["cpu_bound_s"] > 0:  # (what an idle box would give: CPU seconds)
                        ours["cpu_ratio"] = loop["cpu_s_per_round"] / ours["cpu_bound_s"]
                here.append({"system": SYSTEMS[system], "devices": n, **ours})
            _same_model(here)
            rows += here
            print(table(here, COLS), flush=True)
    print()
    print(table(rows, COLS))
    _targets(rows, args.job)
    _per_device(rows, sizes, cfg0, args.extrapolate)
    write_json(args.json, rows)
    return 0


def _same_model(rows: list[dict]) -> None:
    """One line per kind of run: whether both backends trained the same final model (they
    must: one-by-one and stacked each); and the stacked runs' accuracy against the
    one-by-one runs' (equal within 0.5 points)."""
    for vec in (False, True):
        hashes = {r["system"]: r["model_sha256"] for r in rows
                  if "model_sha256" in r and r["system"].endswith("-vec") == vec}  # fmt: skip
        if len(hashes) > 1:
            same = len(set(hashes.values())) == 1
            print(f"# {rows[0]['devices']} devices: final model of "
                  f"{' and '.join(hashes)} {'identical' if same else 'DIFFERS'} "
                  f"(model_sha256 {', '.join(h[:12] for h in hashes.values())})",
                  flush=True)  # fmt: skip
    acc = {r["system"]: r.get("final_accuracy") for r in rows if "model_sha256" in r}
    for name, a in acc.items():
        ref = acc.get(name.removesuffix("-vec"))
        if name.endswith("-vec") and a is not None and ref is not None:
            ok = "within" if abs(a - ref) <= 0.005 else "NOT within"
            base = name.removesuffix("-vec")
            print(f"# {rows[0]['devices']} devices: {name} accuracy {a:.4f} vs {base} "
                  f"{ref:.4f} ({ok} 0.5 points)", flush=True)  # fmt: skip


def _median(runs: list[dict]) -> dict:
    """The run with the median rounds/s (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r["rounds_per_s"])[len(runs) // 2]


COLS = [
    "system", "devices", "rounds_per_s", "ratio_vs_loop", "s_per_round", "cpu_s_per_round",
    "cpu_ratio", "cmd_wall_s", "peak_rss_mb", "ckpt_mb", "events_mb", "summary_kb",
    "stacked_tasks", "final_accuracy",
]  # fmt: skip


def _targets(rows: list[dict], job: str = "logreg") -> None:
    for r in rows:
        if r["system"] == SYSTEMS["inline"] and "ratio_vs_loop" in r:
            ok = "met" if r["ratio_vs_loop"] >= INLINE_TARGET else "NOT met"
            print(f"# {r['devices']} devices: edgefl-inline / loop rounds/s "
                  f"{r['ratio_vs_loop']:.2f} (target >= {INLINE_TARGET}: {ok})")  # fmt: skip
        want = JOB_TARGETS.get(job) if r["devices"] >= 1000 else None
        if job == "logreg" and r["devices"] >= 10_000:
            want = VEC_TARGET
        if r["system"] == SYSTEMS["mpi-vec"] and "ratio_vs_loop" in r and want:
            ok = "met" if r["ratio_vs_loop"] >= want else "NOT met"
            print(f"# {r['devices']} devices, job {job}: edgefl-vec / loop rounds/s "
                  f"{r['ratio_vs_loop']:.2f} (target >= {want}: {ok})")  # fmt: skip
        vec = (SYSTEMS["mpi-vec"], SYSTEMS["inline-vec"])
        if job == "logreg" and r["system"] in vec and r["devices"] >= BIG_FLEET:
            ok = "met" if r["peak_rss_mb"] <= BIG_RSS_TARGET_MB else "NOT met"
            print(f"# {r['devices']} devices, {r['system']}: peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"(target <= {BIG_RSS_TARGET_MB:.0f}: {ok})")  # fmt: skip
        if r["system"] != "edgefl":
            continue
        rss = r["peak_rss_mb"]
        ok_rss = "met" if rss <= RSS_TARGET_MB else "NOT met"
        line = (
            f"# {r['devices']} devices: peak RSS {rss:.0f} MB "
            f"(target <= {RSS_TARGET_MB:.0f}: {ok_rss})"
        )
        if "ratio_vs_loop" in r:
            ok = "met" if r["ratio_vs_loop"] >= RATIO_TARGET else "NOT met"
            line += (
                f"; edgefl / loop rounds/s {r['ratio_vs_loop']:.2f} "
                f"(target >= {RATIO_TARGET}: {ok})"
            )
        print(line)


def _per_device(rows: list[dict], sizes: list[int], cfg: dict, target: int) -> None:
    if len(sizes) < 2:
        print("# per-device memory: needs two sizes")
        return
    data_b = data_bytes_per_device(cfg)
    for system in SYSTEMS.values():
        got = [r for r in rows if r["system"] == system]
        if len(got) < 2:
            continue
        ns = [r["devices"] for r in got]
        m0, mslope = _fit(ns, [r["peak_rss_mb"] * 1e6 for r in got])
        t0, tslope = _fit(ns, [r["s_per_round"] for r in got])
        beyond = mslope - data_b
        print(
            f"# {system} memory per device: {mslope / 1e3:.1f} KB (peak RSS slope "
            f"{ns[0]}..{ns[-1]}), of which its data {data_b / 1e3:.1f} KB, beyond its data "
            f"{beyond / 1e3:.1f} KB"
        )
        print(
            f"# {system} time per device and round: {tslope * 1e3:.3f} ms (slope), fixed "
            f"{t0:.3f} s per round"
        )
        print(
            f"# {system} extrapolated to {target} devices (from {', '.join(map(str, ns))}): "
            f"peak RSS {(m0 + mslope * target) / 1e9:.2f} GB ({mslope / 1e3:.1f} KB per "
            f"device), {t0 + tslope * target:.1f} s per round"
        )


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it as: edgefl bench scale")
