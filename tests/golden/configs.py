"""The golden-model job configurations and the one definition of how they are run.

Each named config is a list of ``--set KEY=VALUE`` overrides of ``edgefl simulate``. Its
final global model (``model_sha256`` of ``summary.json``) was recorded in ``models.json`` by
``tests/golden/record.py``, both over real ``mpiexec`` and in one process over the loopback
transport (the two agreed bit for bit), with portable kernels (``run.kernels``, the
default): the hashes are those of any x86-64 machine with AVX2. A change of any of these
hashes is a change of what training computes. (They were first recorded from commit
508a1ce with native kernels, on a machine whose MKL and torch kernels an Intel AVX-512
machine could not reproduce with any setting; re-recorded once, code unchanged, when
portable kernels came: docs/reproducibility.md.)

Every config is deterministic: the virtual clock (``edgefl simulate`` turns
``sim.clock = "auto"`` into ``"virtual"``), a fixed ``sim.reference_s_per_sample`` (0 would
calibrate on the machine), a fixed seed, and ``fleet.device = "cpu"`` (``auto`` would pick a
GPU where there is one, which changes the arithmetic).

``effective_config`` mirrors what ``edgefl simulate`` (``edgefl/cli.py`` ``cmd_simulate``)
does to the config before the ranks start, so the in-process run trains exactly the job the
CLI runs: clock ``auto`` -> ``virtual``, ``fleet.ranks`` capped at devices + 1 + servers,
and the ranks reading the config back from the run directory's ``config.toml``. (Not
mirrored: ``comm.failure_timeout_s`` = 120 for an MPI without ULFM, a liveness time-out
that does not change the model; relative profile paths, since the one profile file is
given by absolute path.)
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
MODELS_JSON = HERE / "models.json"
GOLDEN_DIR_TOKEN = "@GOLDEN@"  # stands for this folder in a --set value (profile files)


def job(*parts: str | list[str]) -> list[str]:
    """Overrides from lists and single overrides, in order; a later value of a key replaces
    the earlier one (which keeps its place), so every key appears once."""
    out: dict[str, str] = {}
    for part in parts:
        for s in [part] if isinstance(part, str) else part:
            out[s.split("=", 1)[0]] = s
    return list(out.values())


# every config: deterministic and portable (see the module docstring)
PINNED = [
    "fleet.device=cpu",
    "sim.reference_s_per_sample=0.0001",
    "output.progress=quiet",
]
# a tiny fleet: 4 devices on 2 worker ranks, 4 rounds
FLEET = job(PINNED, "run.checkpoint_every=0", "fleet.devices=4", "fleet.ranks=3", "run.rounds=4")
# ... training an 8-unit MLP on a 10-feature 4-class synthetic task
SMALL = job(FLEET, "data.args.dim=10", "data.args.classes=4", "model.args.hidden=[8]")
# six devices of very different speeds (asynchronous policies have something to do)
MIXED = job(SMALL, "fleet.devices=6", "sim.profiles=edge-mix")
# devices going on and off line and one that crashes (tests/golden/churn.toml)
CHURN = job(SMALL, "fleet.devices=6", f"sim.profiles={GOLDEN_DIR_TOKEN}/churn.toml")
# Hermes as edgefl bench hermes runs it (edgefl/bench/hermes.py HERMES), on hermes-12
HERMES = job(
    SMALL,
    "fleet.devices=6",
    "sim.profiles=hermes-12",
    "algorithm.consistency=asp",
    "algorithm.gate=hermes",
    "algorithm.allocation=hermes",
    "algorithm.aggregation=loss-weighted",
    "allocation.trigger=always",
    "hermes.max_local_iterations=4",
)
GDDR = ["algorithm.residual=gddr", "gddr.alpha=0.4", "gddr.tau=4"]
# the sparse L1 logistic-regression workload of docs/parameter-server.md, made small
CLICKS = job(
    FLEET,
    "data.source=clicks",
    "model.name=logreg",
    "data.args={features=300, samples_per_device=60, nnz_per_example=5, base_logit=0.0}",
    "train.lr=0.5",
)
SPARSE = job(CLICKS, "ps.sparse=true", "ps.key_cache=true")
DIGITS = ["data.source=partition", 'data.args={dataset = "digits", scheme = "iid"}']

CONFIGS: dict[str, list[str]] = {
    # -- FedAvg -----------------------------------------------------------------------
    # the built-in job (8 devices, 4 worker ranks, dim 60, 10 classes, MLP [64]) as in
    # docs/quickstart.md: edgefl simulate --rounds 5
    "default_job": job(PINNED, "run.rounds=5"),
    "fedavg_small": job(SMALL),
    # models big enough for vectorised kernels, on real images (scikit-learn's 8x8 digits):
    # the default MLP ([64]) and the CNN. Their arithmetic changes with the CPU's kernels
    # (AVX-512 vs AVX2) unless run.kernels = "portable" (the default; docs/reproducibility.md)
    "mlp_digits": job(FLEET, DIGITS, "fleet.devices=6", "run.rounds=3"),
    "cnn_digits": job(FLEET, DIGITS, "fleet.devices=6", "run.rounds=3", "model.name=cnn"),
    # the stacked path (train.vectorize): each worker trains its devices as one stack, the
    # written-out step's matrix products through numpy's OpenBLAS, which portable kernels
    # pin as well (edgefl/training/blas.py); the sequential path's hashes are those above
    "default_job_vectorized": job(PINNED, "run.rounds=5", "train.vectorize=on"),
    "mlp_digits_vectorized": job(
        FLEET, DIGITS, "fleet.devices=6", "run.rounds=3", "train.vectorize=on"
    ),
    # -- bring your own training --------------------------------------------------------
    "adam_cosine": job(
        SMALL,
        "train.optimizer=adam",
        "train.lr=0.01",
        "train.lr_schedule=cosine",
        "train.weight_decay=0.01",
    ),
    "fedprox_small": job(SMALL, "fedprox.enabled=true", "fedprox.mu=0.1"),
    "scaffold_small": job(SMALL, "scaffold.enabled=true", "train.local_steps=3"),
    "fedavg_mean_steps_momentum": job(
        SMALL,
        "seed=3",
        "algorithm.aggregation=mean",
        "train.local_steps=3",
        "train.batch_size=0",
        "train.momentum=0.9",
        "train.weight_decay=0.001",
        "server.lr=0.5",
    ),
    # -- consistency models (docs/simulation.md, edgefl/bench/consistency.py) -------------
    "bsp_participation": job(MIXED, "server.participation=0.5", "server.min_devices=2"),
    "bsp_deadline_allocation": job(MIXED, "server.deadline_s=0.3", "algorithm.allocation=hermes"),
    "ssp": job(MIXED, "run.rounds=12", "algorithm.consistency=ssp", "algorithm.staleness=2"),
    "asp": job(MIXED, "run.rounds=12", "algorithm.consistency=asp"),
    "fedbuff": job(MIXED, "run.rounds=5", "algorithm.consistency=fedbuff", "algorithm.buffer_k=3"),
    "fedasync_hinge": job(
        MIXED,
        "run.rounds=12",
        "algorithm.consistency=fedasync",
        "algorithm.fedasync_fn=hinge",
        "algorithm.fedasync_b=2",
    ),
    "churn_asp": job(CHURN, "run.rounds=12", "algorithm.consistency=asp"),
    # -- Hermes (docs/hermes.md) --------------------------------------------------------
    "hermes": job(HERMES, "run.rounds=8"),
    "hermes_softmax_broadcast_all": job(
        HERMES,
        "run.rounds=8",
        "algorithm.aggregation=loss-softmax",
        "hermes.broadcast=all",
        "hermes.softmax_buffer=2",
        "hermes.test=percentile",
        "hermes.percentile=20.0",
        "hermes.reset_alpha=true",
    ),
    # -- GDDR (docs/gddr.md, edgefl/bench/gddr.py) ----------------------------------------
    "gddr": job(SMALL, "run.rounds=6", *GDDR),
    "gddr_adaptive": job(
        SMALL,
        "run.rounds=6",
        *GDDR,
        "gddr.adaptive=true",
        "gddr.tau_min=2",
        "gddr.tau_max=6",
        "gddr.installments=2",
    ),
    "hermes_gddr": job(HERMES, "run.rounds=8", *GDDR),
    # a crashed device's withheld residual is replayed from its residual checkpoint
    "churn_gddr_replay": job(CHURN, "run.rounds=8", *GDDR, "gddr.checkpoint_every=1"),
    # -- example ordering (docs/ordering.md) ----------------------------------------------
    "cdgrab_step": job(SMALL, "algorithm.ordering=cd-grab", "ordering.ship=step"),
    "cdgrab_epoch_sketch": job(
        SMALL,
        "algorithm.ordering=cd-grab",
        "ordering.ship=epoch",
        "ordering.sketch_dim=16",
        "ordering.sketch_kind=gaussian",
    ),
    "idgrab_microbatch": job(
        SMALL,
        "algorithm.ordering=id-grab",
        "ordering.unit=microbatch",
        "ordering.microbatch=2",
    ),
    "idgrab_bal_sketch": job(SMALL, "algorithm.ordering=id-grab-bal", "ordering.sketch_dim=16"),
    "rr": job(SMALL, "algorithm.ordering=rr"),
    # -- DP and server optimizers (docs/robustness.md, docs/parameter-server.md) ----------
    "dp": job(SMALL, "dp.enabled=true", "dp.clip=0.5", "dp.noise_multiplier=0.8"),
    "server_fedavgm": job(SMALL, "server.optimizer=fedavgm", "server.beta1=0.8"),
    "server_fedadam": job(SMALL, "server.optimizer=fedadam", "server.lr=0.05"),
    "server_fedyogi": job(SMALL, "server.optimizer=fedyogi", "server.lr=0.05"),
    "server_fedadagrad": job(SMALL, "server.optimizer=fedadagrad", "server.lr=0.05"),
    "server_l1_prox": job(SMALL, "server.l1=0.002"),
    # -- robust aggregation and update filters (docs/robustness.md) -----------------------
    "median": job(MIXED, "algorithm.aggregation=median"),
    "trimmed_mean_byzantine": job(
        MIXED,
        "algorithm.aggregation=trimmed-mean",
        "robust.trim_fraction=0.2",
        "debug.byzantine=[0]",
        "debug.byzantine_mode=signflip",
    ),
    "krum_byzantine": job(
        MIXED,
        "algorithm.aggregation=krum",
        "robust.krum_f=1",
        "debug.byzantine=[1]",
        "debug.byzantine_mode=scale",
        "debug.byzantine_scale=20.0",
    ),
    "multi_krum": job(
        MIXED,
        "algorithm.aggregation=multi-krum",
        "robust.krum_f=1",
        "robust.multi_krum_m=3",
    ),
    "norm_clip": job(MIXED, "algorithm.aggregation=norm-clip"),
    "norm_bound_filters": job(
        MIXED,
        "robust.norm_bound=5.0",
        "robust.norm_bound_relative=1.5",
        "robust.norm_bound_mode=clip",
        "debug.byzantine=[2]",
        "debug.byzantine_mode=scale",
    ),
    # -- parameter server (docs/parameter-server.md) --------------------------------------
    "ps_sparse_keycache": job(SPARSE, "debug.forget_key_cache_every=2"),
    "ps_significant_float16": job(
        SPARSE,
        'ps.filters=["significant"]',
        "ps.sig_threshold=0.01",
        "ps.value_dtype=float16",
    ),
    "ps_kkt_working_set_bfloat16": job(
        SPARSE,
        "server.l1=0.01",
        'ps.filters=["kkt","significant"]',
        "ps.sig_threshold=0.01",
        "ps.kkt_carry=true",
        "ps.pull=working-set",
        "ps.value_dtype=bfloat16",
    ),
    "ps_working_set_dense_fedadagrad": job(
        CLICKS,
        "ps.pull=working-set",
        "server.optimizer=fedadagrad",
        "server.lr=0.1",
    ),
    "ps_servers_2": job(SMALL, "fleet.ranks=5", "ps.servers=2", "model.args.hidden=[32]"),
    "ps_servers_3_replicas_2": job(
        SMALL,
        "fleet.ranks=6",
        "ps.servers=3",
        "ps.replicas=2",
        "algorithm.aggregation=mean",
        "server.lr=0.8",
    ),
}

# Configs whose loopback run cannot give the MPI job's model, and why: recorded over MPI
# only ("backend": "mpi" in models.json) and checked by the MPI test only.
MPI_ONLY: dict[str, str] = {
    "churn_gddr_replay": (
        "the replay reads the dead device's residual checkpoint, which its worker writes into "
        "the run directory; conftest.run_loopback_job builds workers without one (Worker "
        "out_dir=None), so in one process the replay is skipped (replay_errors) and the "
        "model differs"
    ),
}
# configs the MPI test runs through the real CLI besides the MPI_ONLY ones (each MPI job
# takes about 12-16 s on the 2-core box): gated Hermes control traffic, and server shards
MPI_SAMPLE = ("hermes", "ps_servers_2")


def expand(sets: list[str]) -> list[str]:
    """The overrides with GOLDEN_DIR_TOKEN replaced by this folder's absolute path."""
    return [s.replace(GOLDEN_DIR_TOKEN, str(HERE)) for s in sets]


def effective_config(sets: list[str]) -> tuple[dict, int]:
    """(config, MPI ranks) of ``edgefl simulate --set S ...``, as its ranks see it."""
    import tomllib

    from edgefl.config import dump_config, load_config
    from edgefl.config.ranks import rank_count

    cfg = load_config(None, expand(sets))
    if cfg["sim"]["clock"] == "auto":
        cfg["sim"]["clock"] = "virtual"
    ranks = rank_count(cfg)  # ("auto": the cores of this machine; the model is the same)
    # the ranks load the run directory's config.toml (written by dump_config)
    cfg = load_config(doc=tomllib.loads(dump_config(cfg)))
    return cfg, ranks


def check_deterministic(name: str, cfg: dict) -> None:
    """Refuse a config whose result could depend on the machine or on timing."""
    bad = []
    if cfg["sim"]["clock"] != "virtual":
        bad.append(f"sim.clock = {cfg['sim']['clock']!r}")
    if cfg["sim"]["reference_s_per_sample"] <= 0:
        bad.append("sim.reference_s_per_sample = 0 (calibrates on the machine)")
    if cfg["fleet"]["device"] != "cpu" or cfg["fleet"]["device_map"]:
        bad.append("fleet.device is not cpu")
    if cfg["debug"]["delay_s"] or cfg["debug"]["kill_ranks"] or cfg["debug"]["inject"]:
        bad.append("a timing or fault test hook")
    if bad:
        raise AssertionError(f"golden config {name!r} is not deterministic: {'; '.join(bad)}")


def sha256_of(arr) -> str:
    """What edgefl/runtime/coordinator.py ``_sha256`` writes as ``model_sha256``."""
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def run_loopback(sets: list[str], timeout: float = 300.0) -> tuple[dict, int]:
    """Run the config in this process (conftest.run_loopback_job: coordinator and workers in
    threads over the loopback transport, the coordinator writing a temporary run directory
    as under MPI, its task built before the threads start). Returns (its summary.json,
    ranks). Raises AssertionError when the job fails, hangs or its summary disagrees with
    the coordinator's model."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from conftest import run_loopback_job

    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    cfg, ranks = effective_config(sets)
    # Rank 0's task (its initial model is the job's) is built here, before the worker
    # threads exist: run_loopback_job builds it while the workers already run
    # Worker.register, whose warm-up step draws from torch's global RNG when the data has
    # no tensor fast path (a DataLoader draws a base seed per iterator; e.g. clicks). A draw
    # landing inside build_model's seeded init (fork_rng + manual_seed; its lock serialises
    # builds only) changes the initial model: seen as 2-3 different final models in 12
    # loopback runs of the clicks configs, never under MPI (one process per rank).
    task0 = build_task(cfg)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="edgefl-golden-") as tmp:
        run_dir = Path(tmp)

        def coordinator(cfg_, t, task, out_dir=None):
            return Coordinator(cfg_, t, task0, out_dir=run_dir)

        def job() -> None:
            try:
                result["out"] = run_loopback_job(cfg, ranks, coordinator_cls=coordinator)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                result["error"] = e

        th = threading.Thread(target=job, daemon=True)
        th.start()
        th.join(timeout)
        if th.is_alive():
            raise AssertionError(f"loopback job did not finish within {timeout:.0f} s")
        if "error" in result:
            raise result["error"]
        coord, statuses = result["out"]
        if statuses != [0] * ranks:
            raise AssertionError(f"loopback job exit statuses by rank: {statuses}")
        summary = json.loads((run_dir / "summary.json").read_text())
    if summary["model_sha256"] != sha256_of(coord.global_model):
        raise AssertionError("summary.json model_sha256 is not the coordinator's global model")
    SUMMARIES[tuple(sets)] = summary
    return summary, ranks


def run_loopback_dir(sets: list[str], run_dir: Path, resume: Path | None = None) -> dict:
    """Like :func:`run_loopback`, but writing ``run_dir`` (kept), optionally resuming from
    checkpoint ``resume``; returns its summary.json (tests of resumes: the checkpoints of
    the first part stay in ``run_dir``)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from conftest import run_loopback_job

    from edgefl.ckpt import load_checkpoint
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg, ranks = effective_config(sets)
    task0 = build_task(cfg)  # before the worker threads (see run_loopback)
    state = load_checkpoint(resume) if resume is not None else None

    def coordinator(cfg_, t, task, out_dir=None):
        return Coordinator(cfg_, t, task0, out_dir=run_dir, resume=state)

    out: dict = {}

    def go() -> None:
        try:
            out["r"] = run_loopback_job(cfg, ranks, coordinator_cls=coordinator)
        except BaseException as e:  # noqa: BLE001 - raised below
            out["e"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(240)
    assert not th.is_alive(), "loopback job hung"
    if "e" in out:
        raise out["e"]
    coord, statuses = out["r"]
    assert statuses == [0] * ranks, statuses
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_sha256"] == sha256_of(coord.global_model)
    return summary


# summary.json of every config run in this process (tests/test_resume_exact.py compares a
# resumed run's statistics with the uninterrupted run's without running it again)
SUMMARIES: dict[tuple[str, ...], dict] = {}


def simulate_argv(sets: list[str], out: Path) -> list[str]:
    """Arguments of ``python -m edgefl`` for the config."""
    argv = ["simulate", "--out", str(out)]
    for s in expand(sets):
        argv += ["--set", s]
    return argv


def load_models() -> dict:
    """models.json: {name: {"set": [...], "ranks": R, "model_sha256": "...", ...}}."""
    return json.loads(MODELS_JSON.read_text(encoding="utf-8"))


def mismatch_message(name: str, entry: dict, got: str, how: str) -> str:
    return (
        f"golden config {name!r} ({how}): final model sha256 {got} != recorded "
        f"{entry['model_sha256']} (tests/golden/models.json). The job now trains a different "
        "model. Fix the regression; re-record (python tests/golden/record.py --only "
        f"{name}) ONLY if the change is an intentional behaviour change. Overrides: "
        + " ".join(entry["set"])
    )
