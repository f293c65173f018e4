"""The Python API: :func:`simulate` runs a job and returns its :class:`Result`.

``edgefl simulate`` (edgefl/cli.py) is built on the same functions: :func:`simulation_config`
(the effective config and the rank count), :func:`check_ranks_can_import`, :func:`preflight`
(the pre-launch check), :func:`mpi_launcher`, :func:`mpi_command` and
:func:`launch_checked` (:func:`launch_mpi` with the check done by rank 0 while the other
ranks start); with ``--backend inline``, :func:`run_in_process`, as :func:`simulate`.
Heavy modules (torch, the runtime) are imported only when a function needs them, so
``import edgefl`` stays cheap. docs/python-api.md is the walkthrough.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from .config.ranks import rank_count
from .errors import ConfigError, EdgeflError
from .hardexit import flush_and_exit

BACKENDS = ("mpi", "inline")

# how a config value names an object of the caller's __main__ ("__main__:Net"; any key)
_MAIN = "__main__:"


class RunFailed(EdgeflError):
    """A run that ended with a nonzero exit status (2: an error, see the message; 3: the
    job stopped early, e.g. the model diverged; 128 + N: killed by signal N from outside;
    docs/fault-tolerance.md section 9 lists them all).

    Attributes:
        status: the job's exit status.
        run_dir: its run directory (metrics and checkpoints written so far are there).
    """

    def __init__(self, status: int, run_dir: Path, detail: str = "") -> None:
        self.status = status
        self.run_dir = Path(run_dir)
        more = f": {detail}" if detail else ""
        super().__init__(
            f"the run failed with exit status {status} (run directory {run_dir}){more}"
        )


class Result:
    """A finished run, read from its run directory.

    ``Result(run_dir)`` also opens an earlier run (``edgefl simulate --out DIR``).

    Attributes:
        run_dir: the run directory (Path).
        metrics: one dict per model version (round), as in ``metrics.jsonl``; times in
            seconds, traffic in bytes.
        summary: ``summary.json`` as a dict.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.metrics: list[dict] = _read_jsonl(self.run_dir / "metrics.jsonl")
        self.summary: dict = _read_json(self.run_dir / "summary.json")

    @property
    def final_accuracy(self) -> float | None:
        """Test accuracy (fraction in [0, 1]) of the final model; None if never evaluated."""
        return self.summary.get("final_accuracy")

    @property
    def model_sha256(self) -> str:
        """SHA-256 (hex) of the final global model's float32 parameters."""
        return self.summary["model_sha256"]

    @property
    def config(self) -> dict:
        """The effective config the run used (its ``config.toml``)."""
        from .config import load_config

        return load_config(self.run_dir / "config.toml")

    def metrics_frame(self) -> Any:
        """:attr:`metrics` as a pandas DataFrame, one row per round (the per-device
        ``devices`` column holds dicts). Raises ImportError when pandas is missing."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Result.metrics_frame() needs pandas: pip install pandas") from None
        return pd.DataFrame(self.metrics)

    def model(self) -> Any:
        """A torch module of the configured model holding the final weights
        (``final_model.pt``), on the CPU, in eval mode."""
        import torch

        from .runtime.state import build_task

        path = self.run_dir / "final_model.pt"
        if not path.is_file():
            raise EdgeflError(f"run directory '{self.run_dir}' has no final_model.pt")
        model = build_task(self.config, "cpu").model
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()

    def __repr__(self) -> str:
        acc = self.final_accuracy
        acc_s = f"{acc:.4f}" if acc is not None else "-"
        return (
            f"Result(run_dir='{self.run_dir}', rounds={len(self.metrics)}, final_accuracy={acc_s})"
        )


def simulate(
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    out: str | Path | None = None,
    backend: str | None = None,
) -> Result:
    """Run a job on this machine and return its :class:`Result`.

    Args:
        config: default None, the built-in job. A path (str or Path) to a TOML config, or a
            dict: sections nested as in the TOML (``{"fleet": {"devices": 4}}``) or dotted
            keys (``{"fleet.devices": 4}``), checked like a config file.
        overrides: default None. Dotted keys applied after ``config`` with exactly the
            validation of ``edgefl simulate --set KEY=VALUE``; values are Python values
            (``{"run.rounds": 3, "model.args.hidden": [8]}``), not TOML text.
        out: default None: ``run.out`` if set, else ``runs/<YYYYmmdd-HHMMSS>-<name>`` below
            the current directory (``-2``, ``-3``, ... appended if taken; ``<name>``: the
            config file's stem, ``default`` or ``config`` for a dict). A given directory
            must not already hold a run.
        backend: default None: the config's ``run.backend`` (``"mpi"`` unless set).
            ``"mpi"``: launch ``mpiexec`` with ``fleet.ranks`` ranks, as ``edgefl simulate``
            does. ``"inline"``: coordinator and workers in this process (threads over the
            in-process loopback transport, no MPI), as ``edgefl simulate --backend inline``
            does; same run directory and, for the same config and seed, the same final
            model. A backend given here wins over ``run.backend``.

    A class or function given as a config value (``{"model.name": MyNet}``) stands for its
    ``'module:qualname'``. Objects of ``__main__`` (a script, a notebook) work only with
    ``backend="inline"``: the MPI ranks are new processes that cannot import them.

    Raises:
        ConfigError: a bad key or value, before anything starts (nothing is written).
        EdgeflError: another user error found before the start (missing mpiexec, data).
        RunFailed: the run ended with a nonzero exit status.
        ValueError: an unknown ``backend``.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(map(repr, BACKENDS))}")
    path, doc, stem = _config_source(config)
    cfg, ranks = simulation_config(path, override_list(overrides), doc=doc)
    backend = cfg["run"]["backend"] if backend is None else backend
    from .runtime.rundir import prepare_run_dir, resolve_run_dir

    def run_dir_of(cfg: dict) -> Path:
        found = resolve_run_dir(cfg, str(out) if out is not None else None, None, stem)
        if out is None and not cfg["run"]["out"]:
            found = _unused(found)  # runs started within the same second (a sweep)
        return found

    detail = ""
    if backend == "mpi":
        check_ranks_can_import(cfg)
        launcher, cfg = mpi_launcher(cfg)
        preflight(cfg)
        run_dir = run_dir_of(cfg)
        prepare_run_dir(run_dir, cfg, resuming=False)
        print(banner(cfg, ranks, launcher, run_dir), flush=True)
        status = launch_mpi(mpi_command(launcher, ranks, run_dir), run_dir, relay=_needs_relay())
    else:
        from .runtime.inline import check_inline

        check_inline(cfg)
        run_dir = run_dir_of(cfg)
        status, detail = run_in_process(cfg, ranks, run_dir)
    if status != 0:
        if not detail and (run_dir / "summary.json").is_file():
            detail = _read_json(run_dir / "summary.json").get("stopped") or ""
        raise RunFailed(status, run_dir, detail)
    return Result(run_dir)


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... if it exists."""
    n = 1
    found = path
    while found.exists():
        n += 1
        found = path.with_name(f"{path.name}-{n}")
    return found


# -- config -------------------------------------------------------------------------------
def _config_source(config: Any) -> tuple[str | None, dict | None, str]:
    """(path, doc, name for the default run directory) of ``simulate``'s ``config``."""
    if config is None:
        return None, None, "default"
    if isinstance(config, (str, os.PathLike)):
        return str(config), None, Path(config).stem
    if isinstance(config, Mapping):
        return None, config_doc(config), "config"
    raise TypeError(f"config: expected a path, a dict or None, not {type(config).__name__}")


def config_doc(config: Mapping[str, Any]) -> dict:
    """A config dict with dotted keys expanded into sections (``{"a.b": 1}`` ->
    ``{"a": {"b": 1}}``) and classes/functions replaced by their ``'module:qualname'``.
    A key given twice (dotted and nested) is a ConfigError."""
    doc: dict = {}

    def put(node: dict, parts: list[str], value: Any, where: str) -> None:
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"config key '{where}': '{part}' is a value, not a table")
            node = nxt
        last = parts[-1]
        if isinstance(value, Mapping):
            sub = node.setdefault(last, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"config key '{where}' is given twice")
            for k, v in value.items():
                _check_key(k, f"{where}.")
                put(sub, str(k).split("."), v, f"{where}.{k}")
        else:
            if last in node:
                raise ConfigError(f"config key '{where}' is given twice")
            node[last] = python_value(value, where)

    for key, value in config.items():
        _check_key(key, "")
        put(doc, key.split("."), value, key)
    return doc


def _check_key(key: Any, prefix: str) -> None:
    if not isinstance(key, str) or not key or "" in key.split("."):
        raise ConfigError(f"config key {prefix}{key!r}: expected a dotted name like 'run.rounds'")


def python_value(value: Any, key: str) -> Any:
    """``value`` with every class or function (also inside lists and dicts) replaced by
    its ``'module:qualname'`` spec; ConfigError naming ``key`` for one that cannot be
    imported by name (defined inside a function)."""
    if isinstance(value, type) or inspect.isfunction(value):
        qual = value.__qualname__
        if "<" in qual:  # <locals>, <lambda>
            raise ConfigError(
                f"config key '{key}': {qual} cannot be imported by name (defined inside a "
                "function or a lambda); define it at the top level of a module or notebook"
            )
        return f"{value.__module__}:{qual}"
    if isinstance(value, (list, tuple)):
        return [python_value(v, key) for v in value]
    if isinstance(value, Mapping):
        return {k: python_value(v, f"{key}.{k}") for k, v in value.items()}
    return value


def override_list(overrides: Mapping[str, Any] | None) -> list[str]:
    """``{"run.rounds": 3}`` as ``--set`` texts (``["run.rounds=3"]``), so they go through
    exactly the CLI's validation. A value TOML cannot hold (None, an object) is a
    ConfigError naming the key."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides: expected a dict of dotted keys, not {type(overrides).__name__}"
        )
    from .config import dump_config

    out = []
    for key, value in overrides.items():
        _check_key(key, "")
        value = python_value(value, key)
        try:  # (dump_config writes a key outside the schema as one TOML line)
            text = dump_config({"v": value}).split("=", 1)[1].strip()
        except TypeError:
            raise ConfigError(
                f"config key '{key}' = {value!r}: expected a string, number, boolean, list or dict"
            ) from None
        out.append(f"{key}={text}")
    return out


def simulation_config(
    path: str | None, overrides: list[str], doc: dict | None = None
) -> tuple[dict, int]:
    """The effective config ``edgefl simulate`` runs (``sim.clock`` auto -> virtual,
    relative profile files made absolute) and its MPI rank count (``fleet.ranks``, capped so
    that no worker rank is idle). Raises ConfigError for a bad config.

    Also pins ``run.kernels`` in this process's environment (:func:`edgefl.kernels.pin`),
    before anything here loads torch: the pre-launch check, the in-process backend and
    every rank launched from here (they inherit the environment) compute alike."""
    from . import kernels
    from .config import load_config, with_values

    cfg = load_config(path, overrides, doc=doc)
    kernels.pin(cfg["run"]["kernels"])  # (a line if torch already ran: run_inline says it)
    effective: dict = {}
    if cfg["sim"]["clock"] == "auto":
        effective["sim.clock"] = "virtual"
    prof = cfg["sim"]["profiles"]
    if prof.endswith((".toml", ".csv")) and not Path(prof).is_absolute():
        effective["sim.profiles"] = str(Path(prof).resolve())  # the ranks read the run's copy
    cfg = with_values(cfg, effective)
    ranks = rank_count(cfg)  # (server shard ranks 1..servers: docs/parameter-server.md)
    if cfg["ps"]["servers"]:
        from .runtime.policies import check_shards

        check_shards(cfg, ranks)
    return cfg, ranks


def main_specs(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(config key, value) of every string in ``cfg`` naming an object of ``__main__``."""
    found: list[tuple[str, str]] = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            found += main_specs(v, f"{prefix}{k}.")
    elif isinstance(cfg, list):
        for v in cfg:
            found += main_specs(v, prefix)
    elif isinstance(cfg, str) and cfg.startswith(_MAIN):
        found.append((prefix.rstrip("."), cfg))
    return found


def check_ranks_can_import(cfg: dict) -> None:
    """Refuse, before any launch, a config naming objects of ``__main__`` (``"__main__:Net"``):
    MPI ranks are new processes that import ``python -m edgefl``, not the caller's script."""
    for key, spec in main_specs(cfg)[:1]:
        raise ConfigError(
            f"config key '{key}' = {spec!r}: the MPI ranks are new processes that cannot "
            "import your script's __main__; move it into a module file (e.g. mymodels.py, "
            "then 'mymodels:Name') or run in this process with "
            'edgefl.simulate(..., backend="inline")'
        )


def check_cuda(cfg: dict) -> None:
    """``edgefl simulate`` runs its ranks on this machine: a CUDA torch device asked for in
    ``fleet.device`` or ``fleet.device_map`` where torch sees no GPU is one line now, not a
    worker's error after MPI started (``edgefl run`` on a cluster checks on each rank)."""
    import torch

    if torch.cuda.is_available():
        return
    f = cfg["fleet"]
    asked = [("fleet.device", f["device"])]
    asked += [(f"fleet.device_map.{d}", v) for d, v in sorted(f["device_map"].items())]
    for key, value in asked:
        if str(value).startswith("cuda"):
            raise ConfigError(
                f"config key '{key}' = {value!r}: torch device requested but CUDA is not "
                "available here (torch.cuda.is_available() is False); use cpu or auto"
            )


def preflight(cfg: dict, show: Any = None) -> str:
    """Check in this process, before the job starts (``edgefl simulate``: rank 0 while the
    other ranks wait, :func:`launch_checked`; ``--dry-run`` and :func:`simulate`: before
    any rank starts), what would otherwise fail only once the job runs, each as a one-line
    error: the trackers; the data source and the model (built once); the job's memory,
    estimated from four devices before anything of the fleet's size is built
    (:mod:`edgefl.data.checks`; over what this machine has available: a ConfigError naming
    ``fleet.devices``); the policies; the devices' training data and the test set (labels,
    shapes, dtypes, NaN/inf, empty devices; ``run.preflight`` chooses all devices, a
    sample or none); the training hooks; the device profiles.

    Returns one line: what was checked and the memory estimate (empty with
    ``run.preflight = "off"``). It is printed on stderr when worth reading (the estimate
    is over half the available memory, or not every device was checked), else logged at
    INFO (``EDGEFL_LOG=info``); ``show``: what prints it instead (called with the line).
    """
    import logging
    import time

    from .data.checks import (
        available_memory,
        check_memory,
        check_test,
        estimate_memory,
        fmt_bytes,
        scan_devices,
    )
    from .runtime.policies import check_policies
    from .runtime.state import build_task
    from .runtime.trackers import check_trackers
    from .training import check_training

    check_trackers(cfg)  # optional packages of output.trackers (tensorboard, mlflow)
    check_cuda(cfg)
    task = build_task(cfg, "cpu")
    mode = cfg["run"].get("preflight", "auto")
    source = cfg["data"]["source"]
    line = ""
    if mode == "off":
        check_policies(cfg)
        task.data.test()
    else:
        # the estimate comes before anything of the fleet's size (policies, test set)
        ranks = rank_count(cfg)
        est = estimate_memory(task.data, ranks + 1, 4 * int(task.flat.numel))
        room = available_memory()
        check_memory(est, room)
        check_policies(cfg)
        t0 = time.perf_counter()
        scan = scan_devices(task.data, mode, source)
        est.test_bytes = check_test(task.data, source)
        seconds = time.perf_counter() - t0
        check_memory(est, room)
        checked = (
            f"all {scan.devices} devices"
            if scan.checked == scan.devices
            else f'{scan.checked} of {scan.devices} devices (run.preflight = "full": all, '
            f"about {scan.projected_s:.0f} s)"
        )
        of = f" of {fmt_bytes(room[0])} available" if room else ""
        line = (
            f"edgefl simulate: checked the data of {checked} and the test set in "
            f"{seconds:.2f} s; memory estimate {fmt_bytes(est.total)}{of}"
        )
        if scan.checked < scan.devices or (room and est.total > room[0] / 2):
            if show is not None:
                show(line)
            else:
                print(line, file=sys.stderr, flush=True)
        else:
            logging.getLogger(__name__).info(line)
    check_training(cfg, task)  # train.loss, train.optimizer, train.client
    if cfg["sim"]["clock"] == "virtual":
        from .sim.profiles import load_fleet

        load_fleet(cfg["sim"]["profiles"], cfg["fleet"]["devices"], cfg["seed"])
    return line


def preflight_apart(cfg: dict) -> None:
    """:func:`preflight` in a child process (``edgefl simulate --dry-run``; a real launch has
    rank 0 check, :func:`launch_checked`), so that this process never loads torch: about
    30 MB instead of 250 MB, and an exit that costs nothing. The child sees what a rank
    sees (started as the ranks are, the working directory last on ``sys.path``) and prints
    what :func:`preflight` prints; a user error is its one line, raised here as
    :class:`PreflightFailed` (nothing more to print). In a process that has torch already
    (a notebook, a test), the check runs right here."""
    if "torch" in sys.modules:
        preflight(cfg)
        return
    import pickle

    from .launcher import rank_python

    proc = subprocess.run(
        [*rank_python(), "-m", "edgefl.api", "--preflight"], input=pickle.dumps(cfg)
    )  # (stdout and stderr are this process's own)
    if proc.returncode == 130:
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise PreflightFailed(proc.returncode)


class PreflightFailed(EdgeflError):
    """The child of :func:`preflight_apart` failed; it said why on stderr already."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"the pre-launch check failed with exit status {status}")


def _preflight_child() -> int:
    """``python -m edgefl.api --preflight``: :func:`preflight` of the pickled config on
    stdin; 0, or 2 after printing the user error's line. Leaves at once (the process has
    nothing else to do), so its torch costs no exit time."""
    import logging
    import pickle

    if getattr(sys.flags, "safe_path", False):
        sys.path.append(os.getcwd())  # (as edgefl.cli.main does for the ranks)
    logging.basicConfig(
        level=os.environ.get("EDGEFL_LOG", "WARNING").upper(),
        format="edgefl %(levelname)s %(name)s: %(message)s",
    )
    status = 0
    try:
        preflight(pickle.load(sys.stdin.buffer))
    except EdgeflError as e:
        print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        status = 2
    except KeyboardInterrupt:
        status = 130
    logging.shutdown()
    flush_and_exit(status)


# -- the in-process backend ---------------------------------------------------------------
def run_in_process(
    cfg: dict,
    ranks: int,
    run_dir: Path,
    resume: str | None = None,
    state: dict | None = None,
) -> tuple[int, str]:
    """The in-process backend's launch, shared by ``edgefl simulate --backend inline`` and
    :func:`simulate` (``backend="inline"``): the pre-launch check (:func:`preflight`, here),
    the run directory (continuing checkpoint ``resume``: ``state`` is what
    :func:`edgefl.ckpt.resume_checkpoint` read from it, read here when None), the banner
    line, then the job on ``ranks`` ranks in this process
    (:func:`edgefl.runtime.inline.run_inline`). :func:`edgefl.runtime.inline.check_inline`
    is the caller's, before anything else.

    Returns (exit status, error line or ""), as the MPI backend's: 0 completed, 2 an error
    (its line already printed), 3 stopped early. SIGINT, SIGTERM or SIGHUP (handled when
    this is the main thread) stop every rank: exit status 130 in the run directory and one
    line on stderr; after a SIGINT, KeyboardInterrupt is raised again (the CLI: status 130).
    """
    from .runtime.inline import run_inline
    from .runtime.rundir import check_run_identity, prepare_run_dir

    preflight(cfg)
    if resume and state is None:
        from .ckpt import resume_checkpoint

        state = resume_checkpoint(resume)[1]
    if state is not None:  # not into another run's directory (as rank 0 under MPI)
        check_run_identity(run_dir, state.get("run_id"), str(resume))
    prepare_run_dir(run_dir, cfg, resuming=state is not None)
    print(inline_banner(cfg, ranks, run_dir), flush=True)
    with _StopSignals() as stop:
        try:
            return run_inline(run_dir, ranks, state)
        except KeyboardInterrupt:
            from .launcher import INTERRUPTED, signal_name

            name = signal_name(stop.signum or signal.SIGINT)
            line = f"interrupted by {name}: the job was stopped (exit status {INTERRUPTED})"
            print(f"edgefl simulate: {line}", file=sys.stderr, flush=True)
            if stop.signum in (0, signal.SIGINT):
                raise
            return INTERRUPTED, line


def inline_banner(cfg: dict, ranks: int, run_dir: Path) -> str:
    """The line the in-process backend prints before the job starts."""
    return (
        f"edgefl simulate: {_inline_fleet(cfg, ranks)} in this process (threads, no MPI), "
        f"run directory {run_dir}"
    )


def inline_plan(cfg: dict, ranks: int) -> str:
    """What ``edgefl simulate --backend inline --dry-run`` prints: what would run."""
    return f"inline: {ranks} ranks in this process (threads, no MPI): {_inline_fleet(cfg, ranks)}"


def _inline_fleet(cfg: dict, ranks: int) -> str:
    servers = cfg["ps"]["servers"]
    return (
        f"{cfg['fleet']['devices']} devices on {ranks - 1 - servers} worker "
        f"ranks + {f'{servers} server shards + ' if servers else ''}coordinator"
    )


class _StopSignals:
    """While in effect (in the main thread only): SIGINT, SIGTERM and SIGHUP raise
    KeyboardInterrupt in the main thread (the in-process job's coordinator); ``signum`` is
    the first one received (0: none)."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        raise KeyboardInterrupt

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                s = getattr(signal, name, None)
                if s is None:
                    continue
                try:
                    self._old[s] = signal.signal(s, self._on_signal)
                except (ValueError, OSError):  # not the main interpreter
                    pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


# -- the MPI backend ----------------------------------------------------------------------
def check_mpi4py() -> None:
    """EdgeflError with the install command when mpi4py is missing."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise EdgeflError(
            "mpi4py is not installed: pip install 'edgefl[mpi]' (mpi4py + Open MPI)"
        ) from None


def mpi_launcher(cfg: dict) -> tuple[Any, dict]:
    """(the mpiexec to use, the config adjusted to it): an MPI that cannot report dead
    ranks gets ``comm.failure_timeout_s`` = 120 s unless one is set."""
    from .config import with_values
    from .launcher import find_mpiexec

    check_mpi4py()
    launcher = find_mpiexec()
    if launcher.failure_detection() == "timeout" and cfg["comm"]["failure_timeout_s"] == 0:
        # this MPI cannot report dead ranks: fall back to time-outs (docs/architecture.md, Failures)
        cfg = with_values(cfg, {"comm.failure_timeout_s": 120.0})
    return launcher, cfg


def mpi_command(launcher: Any, ranks: int, run_dir: Path, resume: str | None = None) -> list[str]:
    """The mpiexec command line running ``python -m edgefl run`` on the run directory's
    config.toml."""
    from .launcher import rank_python

    argv = [*rank_python(), "-m", "edgefl", "run", str(run_dir / "config.toml"), "--out",
            str(run_dir)]  # fmt: skip
    if resume:
        argv += ["--resume", str(resume)]
    return launcher.command(ranks, argv)


def banner(cfg: dict, ranks: int, launcher: Any, run_dir: Path) -> str:
    """The line ``edgefl simulate`` prints before launching."""
    servers = cfg["ps"]["servers"]
    return (
        f"edgefl simulate: {cfg['fleet']['devices']} devices on {ranks - 1 - servers} worker "
        f"ranks + {f'{servers} server shards + ' if servers else ''}coordinator "
        f"({launcher.flavor} {launcher.version}), run directory {run_dir}"
    )


def launch_mpi(cmd: list[str], run_dir: Path, relay: bool = False) -> int:
    """Run the mpiexec command and return the job's exit status, also left in
    ``run_dir/exit_status`` (rank 0's verdict, else what :class:`edgefl.launcher.Supervisor`
    found: 130 interrupted, 128 + N mpiexec killed by signal N, else mpiexec's status).
    SIGINT, SIGTERM or SIGHUP of this process stop every rank (within ``GRACE_S``); a
    SIGINT then raises KeyboardInterrupt. Prints one last line on stderr when the job did
    not end by itself. ``relay``: copy the ranks' output into this process's
    ``sys.stdout``/``sys.stderr`` (a notebook) instead of sharing its file descriptors."""

    from .launcher import Supervisor, child_env
    from .runtime.rundir import release_run_dir

    status_file = run_dir / "exit_status"
    status_file.unlink(missing_ok=True)
    sup = Supervisor(child_env(_isatty(sys.stdout)), status_file)
    if relay:
        returncode = _run_relayed(cmd, sup)
    else:
        sup.start(cmd)
        returncode = sup.wait()
    release_run_dir(run_dir)  # (the job is over: another may take the run directory)
    return _concluded(sup, returncode)


# files of the check directory of :func:`launch_checked` (``EDGEFL_GATE``)
CHECK_CONFIG, CHECK_VERDICT, CHECK_OPEN = "config.pickle", "verdict.json", "open"


def launch_checked(
    cmd: list[str], cfg: dict, run_dir: Path, resuming: bool, banner_line: str
) -> int:
    """``edgefl simulate``'s launch: :func:`launch_mpi`, with the pre-launch check
    (:func:`preflight`) done by rank 0 while the other ranks start, instead of in this
    process before any starts.

    The ranks get a private check directory (:data:`edgefl.launcher.GATE_ENV`). After their
    imports and ``MPI_Init`` (the costly part of a rank's start, run in parallel), rank 0
    runs the check on the config pickled there and writes its verdict
    (:func:`gate_check`); every rank then waits for the gate (a file there) before it reads
    the config or touches the run directory. On a good verdict this process writes the run
    directory, prints the banner and opens the gate; on a bad one (or a stop signal, or
    mpiexec ending first) it kills mpiexec and the ranks at once and writes nothing: the
    outcome is that of the check run first (its error line and status 2; 130
    interrupted). The check so costs no process (and no torch import) of its own. Returns
    the job's exit status, as :func:`launch_mpi`.
    """
    import pickle
    import shutil
    import tempfile
    import time

    from .launcher import GATE_ENV, KILLED, Supervisor, child_env
    from .runtime.rundir import prepare_run_dir, release_run_dir

    status_file = run_dir / "exit_status"
    check = Path(tempfile.mkdtemp(prefix="edgefl-check-"))
    (check / CHECK_CONFIG).write_bytes(pickle.dumps(cfg))
    env = child_env(_isatty(sys.stdout))
    env[GATE_ENV] = str(check)
    sup = Supervisor(env, status_file, armed=False)
    try:
        try:
            proc = sup.start(cmd)
            verdict = None
            while verdict is None and proc.poll() is None:
                time.sleep(0.01)  # (a stop signal raises KeyboardInterrupt here)
                verdict = _read_verdict(check / CHECK_VERDICT)
            verdict = verdict or _read_verdict(check / CHECK_VERDICT)
            if verdict is None:  # mpiexec ended before rank 0 could check (its output says why)
                sup.abandon()
                code = proc.returncode
                status = KILLED - code if code < 0 else code or 1
                print(f"edgefl simulate: the ranks ended before the pre-launch check was done "
                      f"(mpiexec exit status {code})", file=sys.stderr, flush=True)  # fmt: skip
                return status
            for line in verdict.get("lines", []):
                print(line, file=sys.stderr, flush=True)
            if not verdict.get("ok"):
                sup.abandon()
                if "error" in verdict:
                    raise EdgeflError(verdict["error"])  # (the CLI prints it: status 2)
                sys.stderr.write(verdict.get("traceback", ""))
                raise PreflightFailed(1)
            prepare_run_dir(run_dir, cfg, resuming=resuming)
            status_file.unlink(missing_ok=True)
        except BaseException:
            sup.abandon()
            raise
        sup.armed = True
        print(banner_line, flush=True)
        (check / CHECK_OPEN).touch()
        returncode = sup.wait()
    finally:
        shutil.rmtree(check, ignore_errors=True)
        release_run_dir(run_dir)  # (held since prepare_run_dir, for the job's life)
    return _concluded(sup, returncode)


def _read_verdict(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def gate_check(check_dir: str) -> None:
    """Rank 0 of a job started by :func:`launch_checked`: :func:`preflight` of the config
    pickled in ``check_dir``; the verdict goes there as JSON (``ok``; ``error``: a user
    error's line; ``traceback``: any other failure; ``lines``: what the check prints),
    written atomically. Never raises (the launcher reports and ends the job)."""
    import json
    import pickle
    import traceback

    d = Path(check_dir)
    lines: list[str] = []
    try:
        preflight(pickle.loads((d / CHECK_CONFIG).read_bytes()), show=lines.append)
        verdict: dict = {"ok": True}
    except EdgeflError as e:
        verdict = {"ok": False, "error": str(e)}
    except Exception:  # noqa: BLE001 - reported by the launcher, as it would have crashed
        verdict = {"ok": False, "traceback": traceback.format_exc()}
    verdict["lines"] = lines
    tmp = d / f".{CHECK_VERDICT}.tmp"
    tmp.write_text(json.dumps(verdict), encoding="utf-8")
    os.replace(tmp, d / CHECK_VERDICT)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _needs_relay() -> bool:
    """True when sys.stdout/stderr are not this process's file descriptors 1/2 (Jupyter,
    captured output), so a child's output would not show where the caller looks."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            if stream.fileno() != fd:
                return True
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation included
            return True
    return False


def _run_relayed(cmd: list[str], sup: Any) -> int:
    """Run ``cmd`` under Supervisor ``sup`` with its output copied into ``sys.stdout`` /
    ``sys.stderr``; mpiexec's return code."""
    proc = sup.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def copy(src: IO[bytes], name: str) -> None:
        for chunk in iter(lambda: src.read1(65536), b""):  # type: ignore[attr-defined]
            dest = getattr(sys, name)
            dest.write(chunk.decode("utf-8", "replace"))
            dest.flush()

    threads = [
        threading.Thread(target=copy, args=(proc.stdout, "stdout"), daemon=True),
        threading.Thread(target=copy, args=(proc.stderr, "stderr"), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        return sup.wait()
    finally:
        for t in threads:
            t.join(timeout=5)


# -- reading a run directory --------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeflError(f"'{path}' not found: not a finished run directory") from None
    except (OSError, ValueError) as e:
        raise EdgeflError(f"cannot read '{path}': {e}") from None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeflError(f"'{path}' not found: not a run directory") from None
    except OSError as e:
        raise EdgeflError(f"cannot read '{path}': {e.strerror}") from None
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise EdgeflError(f"cannot read '{path}': {e}") from None


def _concluded(sup, returncode: int) -> int:
    """The job's exit status from the supervisor ``sup`` once mpiexec returned
    ``returncode``, its line (if any) printed; an interrupt by SIGINT is re-raised."""
    import signal

    status, line = sup.conclude(returncode)
    if line:
        print(f"edgefl simulate: {line}", file=sys.stderr, flush=True)
    if sup.signum == signal.SIGINT:
        raise KeyboardInterrupt  # (the CLI turns it into 130)
    return status


if __name__ == "__main__":
    if sys.argv[1:] == ["--preflight"]:
        _preflight_child()
    sys.exit("usage: python -m edgefl.api --preflight < PICKLED_CONFIG")
