"""Launching a job of ``edgefl simulate`` and :func:`edgefl.simulate` on this machine, on
either backend, once the config is known (:func:`edgefl.config.sources.simulation_config`)
and checked (:mod:`edgefl.preflight`).

The MPI backend: :func:`mpi_launcher` (the mpiexec and the config adjusted to it),
:func:`mpi_command`, :func:`banner`, then :func:`launch_mpi` (the check done before) or
:func:`launch_checked` (``edgefl simulate``: the check done by rank 0 while the other ranks
start), both over :class:`edgefl.launcher.Supervisor`. The in-process backend:
:func:`run_in_process` (``--backend inline``, ``backend="inline"``). Heavy modules (torch,
the runtime) are imported only when a function needs them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from .config.ranks import rank_reason
from .errors import EdgeflError
from .preflight import CHECK_CONFIG, CHECK_OPEN, CHECK_VERDICT, PreflightFailed, preflight


# -- the MPI backend ----------------------------------------------------------------------
def mpi_launcher(cfg: dict) -> tuple[Any, dict]:
    """(the mpiexec to use, the config adjusted to it): an MPI that cannot report dead
    ranks gets ``comm.failure_timeout_s`` = 120 s unless one is set."""
    from .config import with_values
    from .launcher import check_mpi4py, find_mpiexec

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
    """The line ``edgefl simulate`` prints before launching: the fleet, the MPI and why the
    job has these ranks (:func:`edgefl.config.ranks.rank_reason`)."""
    servers = cfg["ps"]["servers"]
    return (
        f"edgefl simulate: {cfg['fleet']['devices']} devices on {ranks - 1 - servers} worker "
        f"ranks + {f'{servers} server shards + ' if servers else ''}coordinator "
        f"({launcher.flavor} {launcher.version}, {rank_reason(cfg, ranks)}), "
        f"run directory {run_dir}"
    )


def launch_mpi(
    cmd: list[str], run_dir: Path, relay: bool = False, env: dict[str, str] | None = None
) -> int:
    """Run the mpiexec command and return the job's exit status, also left in
    ``run_dir/exit_status`` (rank 0's verdict, else what :class:`edgefl.launcher.Supervisor`
    found: 130 interrupted, 128 + N mpiexec killed by signal N, else mpiexec's status).
    SIGINT, SIGTERM or SIGHUP of this process stop every rank (within ``GRACE_S``); a
    SIGINT then raises KeyboardInterrupt. Prints one last line on stderr when the job did
    not end by itself. ``relay``: copy the ranks' output into this process's
    ``sys.stdout``/``sys.stderr`` (a notebook) instead of sharing its file descriptors.
    ``env``: more variables for the ranks' environment (:func:`edgefl.simulate`: where its
    objects passed by value are, :data:`edgefl.shipped.SHIPPED_ENV`)."""

    from .launcher import Supervisor, child_env
    from .runtime.rundir import release_run_dir

    status_file = run_dir / "exit_status"
    status_file.unlink(missing_ok=True)
    sup = Supervisor({**child_env(_isatty(sys.stdout)), **(env or {})}, status_file)
    if relay:
        returncode = _run_relayed(cmd, sup)
    else:
        sup.start(cmd)
        returncode = sup.wait()
    release_run_dir(run_dir)  # (the job is over: another may take the run directory)
    return _concluded(sup, returncode)


def launch_checked(
    cmd: list[str], cfg: dict, run_dir: Path, resuming: bool, banner_line: str
) -> int:
    """``edgefl simulate``'s launch: :func:`launch_mpi`, with the pre-launch check
    (:func:`preflight`) done by rank 0 while the other ranks start, instead of in this
    process before any starts.

    The ranks get a private check directory (:data:`edgefl.launcher.GATE_ENV`). After their
    imports and ``MPI_Init`` (the costly part of a rank's start, run in parallel), rank 0
    runs the check on the config pickled there and writes its verdict
    (:func:`edgefl.preflight.gate_check`); every rank then waits for the gate (a file there)
    before it reads the config or touches the run directory. On a good verdict this process
    writes the run directory, prints the banner and opens the gate; on a bad one (or a stop
    signal, or mpiexec ending first) it kills mpiexec and the ranks at once and writes
    nothing: the outcome is that of the check run first (its error line and status 2; 130
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


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def needs_relay() -> bool:
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


# -- the in-process backend ---------------------------------------------------------------
def run_in_process(
    cfg: dict,
    ranks: int,
    run_dir: Path,
    resume: str | None = None,
    state: dict | None = None,
) -> tuple[int, str]:
    """The in-process backend's launch, shared by ``edgefl simulate --backend inline`` and
    :func:`edgefl.simulate` (``backend="inline"``): the pre-launch check (:func:`preflight`,
    here), the run directory (continuing checkpoint ``resume``: ``state`` is what
    :func:`edgefl.ckpt.resume_checkpoint` read from it, read here when None), the banner
    line, then the job on ``ranks`` ranks in this process
    (:func:`edgefl.runtime.inline.run_inline`). :func:`edgefl.runtime.inline.check_inline`
    is the caller's, before anything else.

    Returns (exit status, error line or ""), as the MPI backend's: 0 completed, 2 an error
    (its line already printed), 3 stopped early. SIGINT, SIGTERM or SIGHUP (handled when
    this is the main thread) stop every rank: exit status 130 in the run directory and one
    line on stderr; after a SIGINT, KeyboardInterrupt is raised again (the CLI: status 130).
    """
    from .preflight import checked_test_set

    preflight(cfg, keep_test=True)  # (rank 0, in this process, takes the test set it built)
    try:
        return _run_checked(cfg, ranks, run_dir, resume, state)
    finally:
        checked_test_set(cfg)  # (not taken when the job failed first: not kept in the process)


def _run_checked(
    cfg: dict, ranks: int, run_dir: Path, resume: str | None, state: dict | None
) -> tuple[int, str]:
    """:func:`run_in_process` after its check: the run directory, the banner, the job."""
    from .runtime.inline import run_inline
    from .runtime.rundir import check_run_identity, prepare_run_dir

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
