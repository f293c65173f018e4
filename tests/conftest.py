"""Shared fixtures: locating mpiexec and launching real multi-rank jobs; the Hypothesis
profile of the property tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from edgefl import kernels

# The tests compute as every edgefl run does by default (run.kernels = "portable"), pinned
# before anything loads torch: the golden models are the same on any x86-64 CPU with AVX2.
# (Subprocesses inherit it; tests of native kernels set their own environment. A process
# that pinned a mode before importing this module keeps it: tests/golden/in_env.py.)
kernels.pin(os.environ.get(kernels.KERNELS_ENV, "portable"))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Property tests draw the same examples on every run (a CI result does not depend on luck);
# HYPOTHESIS_PROFILE=explore searches with fresh random examples each time instead.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


# A model class as a notebook or a script's __main__ defines it (source for the scripts of
# tests/test_api.py and tests/test_shipped.py; it needs torch imported as torch)
NOTEBOOK_NET = """
class Net(torch.nn.Module):
    def __init__(self, info, width=8):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(info.input_shape[0], width), torch.nn.ReLU(),
            torch.nn.Linear(width, info.num_classes))

    def forward(self, x):
        return self.body(x)
"""


def load_docs_regen():
    """docs/regen.py as a module (it is a script, not part of the package), loaded once."""
    import importlib.util

    if "docs_regen" in sys.modules:
        return sys.modules["docs_regen"]
    spec = importlib.util.spec_from_file_location("docs_regen", ROOT / "docs" / "regen.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _launcher():
    from edgefl.errors import EdgeflError
    from edgefl.launcher import find_mpiexec

    try:
        import mpi4py  # noqa: F401

        return find_mpiexec()
    except (ImportError, EdgeflError):
        return None


@pytest.fixture(scope="session")
def launcher():
    """The MPI launcher; MPI tests fail (not skip) when it is missing, since MPI is required."""
    found = _launcher()
    if found is None:
        pytest.fail("no mpiexec/mpi4py: install with pip install -e '.[mpi,test]'")
    return found


# Open MPI's launcher fails to start at all ("The PMIx server's listener thread failed to
# start", status 213) when a killed prterun of the same pid left its session directory in
# $TMPDIR (docs/fault-tolerance.md, section 9). edgefl simulate gives each launch a base of
# its own (tests/fault/test_session_dirs.py); a plain mpiexec run by a test can still meet
# one. Nothing of edgefl ran then and the run directory holds no run: the launch is repeated.
_LAUNCH_FLAKES = ("The PMIx server's listener thread failed to start",)


def launch_flaked(output: str) -> bool:
    """Whether a launch's output says Open MPI itself failed to start it (see above)."""
    return any(f in output for f in _LAUNCH_FLAKES)


def start_launch(cmd: list[str], ready: Path, timeout: float = 240.0, **kw) -> subprocess.Popen:
    """``subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, **kw)`` for a command
    that starts MPI ranks, returned once the file ``ready`` exists (the run's ranks.json:
    its ranks started) or ``timeout`` seconds passed. A launch that Open MPI itself failed
    to start (see _LAUNCH_FLAKES) is repeated, at most twice; one that ended otherwise
    before ``ready`` is an AssertionError with its output."""
    for attempt in range(3):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        deadline = time.monotonic() + timeout
        while p.poll() is None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        if p.poll() is None or ready.exists():
            return p
        out, err = p.communicate()
        if launch_flaked(out + err) and attempt < 2:
            print(f"Open MPI failed to launch, retrying: {' '.join(cmd)}", file=sys.stderr)
            continue
        raise AssertionError(
            f"the launch ended before its ranks started (status {p.returncode}):\n"
            f"{(out + err)[-3000:]}"
        )
    raise AssertionError("unreachable")


def run_rows(out: Path) -> int:
    """Metrics rows the run in ``out`` has written so far (0 before its metrics.jsonl)."""
    try:
        return sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line)
    except OSError:
        return 0


def when_rows(p: subprocess.Popen, out: Path, n: int, timeout: float = 240.0) -> dict[int, int]:
    """Wait until the run ``p`` (started with :func:`start_launch`) has written ``n``
    metrics rows into ``out``; its ranks' pids (rank -> pid, from ranks.json). A run that
    ended first is an AssertionError with its output."""
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "ranks.json").exists() and run_rows(out) >= n:
            ranks = json.loads((out / "ranks.json").read_text())
            return {int(r): v["pid"] for r, v in ranks.items()}
        if p.poll() is not None:
            o, e = p.communicate()
            raise AssertionError(
                f"the run ended before round {n} (status {p.returncode}):\n{(o + e)[-3000:]}"
            )
        time.sleep(0.002)
    raise AssertionError(f"the run never reached round {n}")


def run_launch(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kw)`` for a command that starts
    MPI ranks. A launch that Open MPI itself failed to start (see _LAUNCH_FLAKES) is
    repeated, at most twice."""
    for attempt in range(3):
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        flaky = proc.returncode != 0 and launch_flaked(proc.stderr + proc.stdout)
        if not flaky or attempt == 2:
            break
        print(f"Open MPI failed to launch, retrying: {' '.join(cmd)}", file=sys.stderr)
    return proc


def run_edgefl(*args: str, cwd: Path | None = None, timeout: float = 300, env=None):
    """Run ``python -m edgefl ARGS`` and return the CompletedProcess (text), repeating a
    launch Open MPI itself failed to start (:func:`run_launch`)."""
    e = dict(os.environ)
    e.update(env or {})
    return run_launch([sys.executable, "-m", "edgefl", *args], timeout=timeout, cwd=cwd, env=e)


def set_args(*sets: str) -> list[str]:
    """``--set S`` for each override ``S`` (arguments of ``python -m edgefl simulate``)."""
    return [a for s in sets for a in ("--set", s)]


def assert_one_line_error(proc, *needles: str) -> str:
    """A command refused as a user error: status 2, no traceback, exactly one stderr line
    ``edgefl: error: ...`` holding every needle. Returns the line."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 2, out
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgefl: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def edgefl_cli():
    return run_edgefl


# a tiny job (5 devices, 3 rounds, a small MLP) for whole-job tests in one process
SMALL_JOB = [
    "fleet.devices=5",
    "run.rounds=3",
    "data.args.dim=10",
    "data.args.classes=4",
    "model.args.hidden=[8]",
    'output.progress="quiet"',
]


def run_loopback_job(cfg: dict, ranks: int, *, shard_cls=None, coordinator_cls=None, fabric=None):
    """A whole job in threads over the in-process loopback transport: rank 0 a coordinator
    (``coordinator_cls``, default Coordinator), ranks >= 1 workers or, with ``ps.servers``,
    server shards (``shard_cls``, default Shard). A rank whose ``run`` raises is recorded as
    the exception's class name and dies on the fabric (the other ranks see it fail, as they
    would see its process end over MPI: a test fails instead of rank 0 waiting for it
    forever). Returns (coordinator, statuses by rank)."""
    import threading

    import torch

    from edgefl.comm.loopback import Fabric, LoopbackTransport
    from edgefl.comm.wire import Validator
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.placement import is_shard
    from edgefl.runtime.state import build_task
    from edgefl.runtime.worker import Worker
    from edgefl.server.shard import Shard

    fabric = fabric if fabric is not None else Fabric(ranks)
    statuses: list = [None] * ranks
    servers = cfg["ps"]["servers"]

    # every rank's task is built before any thread starts: a worker's warm-up step draws
    # from torch's global RNG when the data has no tensor fast path (a DataLoader draws a
    # base seed), and a draw landing inside another rank's seeded model initialisation
    # would change that model (edgefl/runtime/inline.py does the same)
    tasks = [build_task(cfg) for _ in range(ranks)]

    def side(r: int) -> None:
        task = tasks[r]
        t = LoopbackTransport(fabric, r, Validator(r, model_numel=task.flat.numel))
        if is_shard(r, servers):
            w = (shard_cls or Shard)(cfg, t, task.flat.numel, task.signature)
        else:
            w = Worker(cfg, t, task)
        w.register()
        try:
            statuses[r] = w.run()
        except Exception as e:  # noqa: BLE001 - e.g. a test's simulated death
            statuses[r] = type(e).__name__
            fabric.kill(r)  # (as a rank's process ends over MPI: the others see it gone)

    torch.set_num_threads(1)
    threads = [threading.Thread(target=side, args=(r,)) for r in range(1, ranks)]
    for th in threads:
        th.start()
    task = tasks[0]
    t0 = LoopbackTransport(fabric, 0, Validator(0, model_numel=task.flat.numel))
    coord = (coordinator_cls or Coordinator)(cfg, t0, task, out_dir=None)
    coord.register()
    if coord.resume is not None:  # (a coordinator_cls given a checkpoint to continue from)
        coord.restore()
    statuses[0] = coord.run()
    coord.stop_workers(0)
    for th in threads:
        th.join(timeout=60)
    return coord, statuses


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one test process per core, at most 4 (each test may start MPI ranks)."""
    return max(1, min(4, os.cpu_count() or 1))


# The test files that take longest (end-to-end MPI runs), longest first. With one test
# process per core and a file per process (pytest-xdist --dist loadfile, pyproject.toml),
# they are handed out first, so the short files fill in at the end instead of one long
# file running alone while the other processes are done. Order inside a file is kept.
LONGEST_FIRST = (
    "test_docs_blocks.py",
    "fault/test_stops.py",
    "fault/test_job_failures.py",
    "test_ps_shards.py",
    "test_resume_mpi.py",
    "test_ps_pull.py",
    "fault/test_blame.py",
    "test_recipes.py",
    "test_job.py",
    "test_rundir.py",
    "fault/test_rehost.py",
    "test_portable_kernels.py",
    "test_ps_replication.py",
    "test_kkt_runtime.py",
    "test_client_hook.py",
    "test_ps_runtime.py",
    "test_sim_determinism.py",
    "test_example_plugin.py",
    "fault/test_gddr_failure.py",
    "test_vectorize.py",
    "test_hermes_runtime.py",
)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    rank = {str(here / name): i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # (stable)
