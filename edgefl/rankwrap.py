"""What runs inside (or around) each rank so that no rank outlives its job.

:class:`RankGuard` (started by :func:`edgefl.runtime.job.run_rank` in every rank) ends the
rank promptly when it is told to stop or loses its launcher:

- SIGTERM, SIGINT or SIGHUP (Open MPI passes SIGTERM on when ``mpiexec`` is stopped): the
  rank exits with 128 + N (130 for SIGINT: interrupted);
- its parent (``mpiexec``/``prterun``, or the wrapper below) is gone, or the process named
  by ``EDGEFL_LAUNCHER`` (``edgefl simulate``) is gone: the rank exits with 137, the
  status of a SIGKILL, the one signal a launcher cannot handle.

Checks run on a thread every ``interval_s`` (0.2 s) and a signal wakes it at once (through
``signal.set_wakeup_fd``), so the rank leaves even while its main thread waits in the
transport. Once the job runs, a stop signal is first handed to the runtime
(:func:`defer_stop`): rank 0 then stops the run in order (checkpoint, summary, STOP to the
workers, which keep serving it meanwhile), and the rank leaves as below only if it is still
there ``grace_s`` later (:data:`STOP_GRACE_S`) or a second signal comes. Rank 0 writes the
status into the run directory's ``exit_status`` unless a status is already there
(``edgefl simulate`` writes 130 before stopping the ranks) and prints one line saying why;
then the rank kills itself with that signal (no ``MPI_Finalize``: the job is over; the
other ranks see a failure).

``python -m edgefl.rankwrap ARGV...``: the per-rank wrapper for MPICH / Intel MPI (Hydra)
launches (docs/architecture.md, Failures). Hydra tears every rank down when one dies of a
signal. With ``-disable-auto-cleanup`` it does not, but it still sends the survivors
SIGUSR1. ``edgefl simulate`` therefore starts each rank through this wrapper: it ignores
SIGUSR1 (inherited by the rank it starts), passes SIGTERM, SIGINT and SIGHUP on to the
rank, and turns a signal death of the rank into an ordinary exit status (128 + signal), so
the launcher sees an exit, not a crash. Failure detection itself then comes from time-outs
(``comm.failure_timeout_s``), since these MPIs have no ULFM.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import procfs
from .launcher import KILLED, LAUNCHER_ENV

STOP_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n)
)
LAUNCHER_LOST = KILLED + 9  # as if SIGKILLed
STOP_GRACE_S = 5.0  # a deferred stop signal: seconds the runtime gets to end in order


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``started`` (its /proc start time as
    text: ``str(edgefl.procfs.start_time(pid))``), is still the same process. Without
    /proc: whether a signal 0 reaches it."""
    if procfs.available():
        st = procfs.stat(pid)
        return st is not None and st.state not in ("Z", "X") and started in (None, str(st.start))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankGuard:
    """Ends this rank when it is signalled to stop or its launcher is gone (module doc).

    Args:
        rank: this rank's number (rank 0 writes ``exit_status`` and prints why).
        interval_s: seconds between checks of the parent and the launcher.
        launcher: ``EDGEFL_LAUNCHER`` (default: from the environment; "" for none).
    """

    def __init__(self, rank: int, interval_s: float = 0.2, launcher: str | None = None) -> None:
        self.rank = rank
        self.interval_s = interval_s
        self.status_file: Path | None = None  # rank 0: set once the run directory exists
        self.parent = os.getppid()
        spec = os.environ.get(LAUNCHER_ENV, "") if launcher is None else launcher
        pid = spec.split(":", 1)[0]
        self.launcher_pid = int(pid) if pid.isdigit() else 0
        st = procfs.start_time(self.launcher_pid) if self.launcher_pid else None
        self.launcher_started = str(st) if st is not None else None
        self._pipe: tuple[int, int] | None = None
        self._old: dict[int, object] = {}
        self._old_fd = -1
        self.on_stop = None  # (status, why) -> None: a stop signal, handled by the runtime
        self.grace_s = STOP_GRACE_S
        self._leave_at: float | None = None
        self._deferred: tuple[int, str] | None = None

    def arm(self) -> RankGuard:
        """Catch the stop signals (main thread only; elsewhere only the checks run)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._pipe = (r, w)
        for s in STOP_SIGNALS:
            self._old[s] = signal.signal(s, _ignore)
        global _fork_hook
        if not _fork_hook:  # a forked child (a plug-in's) must not wake this guard
            os.register_at_fork(after_in_child=_unguard_child)
            _fork_hook = True
        return self

    def disarm(self) -> None:
        """Put the previous handlers back (tests)."""
        if self._pipe is None:
            return
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        for fd in self._pipe:
            os.close(fd)
        self._pipe, self._old = None, {}

    def start(self) -> RankGuard:
        """Arm and start the checking thread (a daemon)."""
        global _active
        self.arm()
        threading.Thread(target=self._run, name="edgefl-rank-guard", daemon=True).start()
        _active = self
        return self

    def check(self, timeout: float = 0.0) -> tuple[int, str] | None:
        """Wait up to ``timeout`` seconds for a stop signal, then look at the parent and
        the launcher; (exit status, why) when the rank must stop, else None."""
        if self._pipe is None:
            time.sleep(timeout)
        elif select.select([self._pipe[0]], [], [], timeout)[0]:
            for signum in os.read(self._pipe[0], 64):
                if signum in STOP_SIGNALS:
                    return KILLED + signum, f"received {signal.Signals(signum).name}"
        if os.getppid() != self.parent:
            return LAUNCHER_LOST, f"its parent process (pid {self.parent}, mpiexec) is gone"
        if self.launcher_pid and not process_alive(self.launcher_pid, self.launcher_started):
            return LAUNCHER_LOST, f"edgefl simulate (pid {self.launcher_pid}) is gone"
        return None

    def _run(self) -> None:
        while True:
            found = self.check(self.interval_s)
            if found is not None and found[0] != LAUNCHER_LOST and self._defer(found):
                continue
            if found is not None:
                self.leave(*found)
            if self._leave_at is not None and time.monotonic() >= self._leave_at:
                status, why = self._deferred or (LAUNCHER_LOST, "?")
                self.leave(status, f"{why}, and the run did not end within {self.grace_s:g} s")

    def _defer(self, found: tuple[int, str]) -> bool:
        """A first stop signal while the runtime handles them: hand it over (True), leave
        ``grace_s`` later if still here; a second one is not deferred (False)."""
        if self.on_stop is None or self._deferred is not None:
            return False
        self._deferred = found
        self._leave_at = time.monotonic() + self.grace_s
        try:
            self.record(*found)  # (rank 0: in case the run cannot end in order)
            self.on_stop(*found)
        except BaseException:  # noqa: BLE001 - then leave as without the runtime
            return False
        return True

    def use_status_file(self, path: Path) -> None:
        """Rank 0: where to record a stop (the run directory's ``exit_status``). Without a
        launcher (plain ``mpiexec ... edgefl run``) a status left by an earlier run there
        is removed; ``edgefl simulate`` removes it itself before it starts mpiexec."""
        if not self.launcher_pid:
            path.unlink(missing_ok=True)
        self.status_file = path

    def record(self, status: int, why: str) -> bool:
        """Rank 0: write ``status`` into ``exit_status`` unless one is there, and say why on
        stderr; True if it wrote it."""
        if self.rank != 0 or self.status_file is None:
            return False
        try:
            fd = os.open(self.status_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:  # there already (edgefl simulate's own verdict), or no directory
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{status}\n")
        try:
            print(f"edgefl: rank 0: {why}: stopping the job (exit status {status})",
                  file=sys.stderr, flush=True)  # fmt: skip
        except (OSError, ValueError):
            pass  # (mpiexec may be gone with the terminal it forwarded to)
        return True

    def leave(self, status: int, why: str) -> None:
        """Record (rank 0) and end this process at once, killed by signal ``status`` - 128:
        MPI reports a rank killed by a signal to the others as a failure (with ULFM, a
        plain ``os._exit`` of rank 0 was not: the workers waited for it for ever)."""
        try:
            self.record(status, why)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except BaseException:  # noqa: BLE001 - leaving regardless
            pass
        _die_by(status - KILLED)


def _die_by(signum: int) -> None:
    """End this process with signal ``signum`` from any thread: reset its action to the
    default in C (``signal.signal`` works on the main thread only), raise it; SIGKILL if
    that did not end it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(0.5)
    except BaseException:  # noqa: BLE001 - then the hard way
        pass
    os.kill(os.getpid(), signal.SIGKILL)


_fork_hook = False
_active: RankGuard | None = None  # the guard started in this process (run_rank)


def defer_stop(on_stop, grace_s: float = STOP_GRACE_S) -> bool:
    """Let the runtime handle this rank's stop signals: ``on_stop(status, why)`` is called
    (on the guard's thread; it should only set a flag) for the first one, and the rank
    leaves ``grace_s`` later if it has not ended by then. ``on_stop=None`` undoes it.
    False when no guard runs in this process (in-process backends, tests)."""
    if _active is None:
        return False
    _active.grace_s = grace_s
    _active.on_stop = on_stop
    return True


def _unguard_child() -> None:
    """In a child forked from a guarded rank: the stop signals act as by default again."""
    try:
        signal.set_wakeup_fd(-1)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
    except ValueError:  # (forked from another thread: nothing to undo there)
        pass


def _ignore(signum: int, frame: object) -> None:
    """(The wakeup fd carries the signal to the guard's thread.)"""


def main(argv: list[str]) -> int:
    """Run ``argv`` with SIGUSR1 ignored and the stop signals passed on; its exit status,
    or 128 + signal number."""
    if not argv:
        print("usage: python -m edgefl.rankwrap COMMAND [ARG...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.Popen(argv, close_fds=False)  # Hydra hands the PMI socket down as an fd
    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: proc.send_signal(signum))
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
