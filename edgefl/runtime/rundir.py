"""The run directory: where a job's config, metrics, checkpoints and final model go.

A run directory has an identity and one owner at a time:

- ``run_id`` (a file): a random id (uuid4, 32 hex digits) made when the directory is first
  prepared, written into every checkpoint (top-level ``run_id``) and into summary.json.
  A resume into a directory holding another run (its metrics.jsonl, and an id that is not
  the checkpoint's) is refused (:func:`check_run_identity`), so a checkpoint copied from
  elsewhere never rewrites this run's metrics and config. A checkpoint without an id (an
  older edgefl's) is not checked. Continuing a checkpoint with ``--out NEWDIR`` makes a
  new run directory, with an id of its own.
- ``.edgefl-lock`` (a file): held with ``flock`` by the process that owns the job for as
  long as the job runs (``edgefl simulate``, the Python API's ``simulate``, or rank 0 of a
  hand-started ``mpirun ... edgefl run``; the ranks of a job ``edgefl simulate`` launched
  see that their launcher holds it). A second job on the directory is refused in one
  line, touching nothing. The lock is the kernel's: it ends with the process holding it,
  also when that process is SIGKILLed, so no stale lock outlives a job (the file stays,
  holding the pid of its last owner).
"""

from __future__ import annotations

import fcntl
import os
import re
import time
import uuid
from pathlib import Path

from ..config import dump_config
from ..errors import EdgeflError
from ..shipped import config_note

RUN_ID_FILE = "run_id"
LOCK_FILE = ".edgefl-lock"
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_LAUNCHER_ENV = "EDGEFL_LAUNCHER"  # (edgefl.launcher.LAUNCHER_ENV: "<pid>:<launch id>")
_held: dict[str, int] = {}  # resolved run directory -> file descriptor of its held lock


def resolve_run_dir(cfg: dict, out: str | None, resume: str | None, stem: str) -> Path:
    """Pick the run directory: ``--out``, else ``run.out``, else the resumed checkpoint's run
    directory, else ``runs/<YYYYmmdd-HHMMSS>-<stem>``."""
    if out:
        return Path(out)
    if cfg["run"]["out"]:
        return Path(cfg["run"]["out"])
    if resume:
        p = Path(resume).resolve()
        if p.parent.name == "checkpoints":
            return p.parent.parent
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"


def prepare_run_dir(path: Path, cfg: dict, resuming: bool) -> Path:
    """Create the run directory, claim it for this job (:func:`claim_run_dir`), give it a
    run id if it has none and write the effective config (atomically).

    Refuses a directory another job holds, and one that already holds a run's metrics
    unless resuming, so a finished run is never overwritten by accident; both before
    anything is written.
    """
    if path.exists() and not path.is_dir():
        raise EdgeflError(f"run directory '{path}' exists and is not a directory")
    _refuse_if_held(path)  # (before the next check: a running job has metrics too)
    if (path / "metrics.jsonl").exists() and not resuming:
        raise EdgeflError(
            f"run directory '{path}' already holds a run (metrics.jsonl); choose another --out "
            "or continue it with --resume"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        claim_run_dir(path)
        if read_run_id(path) is None:
            _write_atomic(path / RUN_ID_FILE, new_run_id() + "\n")
        # (values naming objects passed by value get a comment saying so: edgefl.shipped)
        _write_atomic(path / "config.toml", config_note(cfg) + dump_config(cfg))
    except OSError as e:
        raise EdgeflError(f"cannot write run directory '{path}': {e.strerror}") from None
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -- identity -----------------------------------------------------------------------------
def new_run_id() -> str:
    """A fresh run id: 32 hex digits (uuid4)."""
    return uuid.uuid4().hex


def read_run_id(run_dir: Path | str | None) -> str | None:
    """The run id kept in ``run_dir`` (its ``run_id`` file), or None: no directory, no file
    (a run directory of an older edgefl) or not an id."""
    if run_dir is None:
        return None
    try:
        text = (Path(run_dir) / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _RUN_ID.fullmatch(text) else None


def run_identity(run_dir: Path | str | None) -> dict[str, str]:
    """``{"run_id": ...}`` of ``run_dir`` for a checkpoint or summary.json; empty if it has
    no id."""
    rid = read_run_id(run_dir)
    return {"run_id": rid} if rid is not None else {}


def check_run_identity(run_dir: Path, checkpoint_id: str | None, checkpoint: str) -> None:
    """Refuse (EdgeflError, one line naming both) to resume ``checkpoint`` (its run id
    ``checkpoint_id``) into ``run_dir`` when that directory holds another run: metrics
    written and an id that is not the checkpoint's (or none: an older edgefl's run, while
    the checkpoint comes from a run that had one). A checkpoint without an id, and a
    directory without metrics (new, or prepared by this job's launcher), pass."""
    if checkpoint_id is None or not (run_dir / "metrics.jsonl").exists():
        return
    here = read_run_id(run_dir)
    if here == checkpoint_id:
        return
    holds = f"run {here}" if here is not None else "a run without a run id"
    raise EdgeflError(
        f"checkpoint '{checkpoint}' belongs to run {checkpoint_id}, but run directory "
        f"'{run_dir}' holds {holds}: resuming would replace that run's metrics and config; "
        "continue the checkpoint in a new run directory with --out NEWDIR"
    )


def check_run_dir(run_dir: Path, checkpoint: str | None) -> None:
    """Before a launch (``edgefl simulate``, also ``--dry-run``), touching nothing: refuse a
    run directory another job holds, and a resume (from the checkpoint file ``checkpoint``,
    verified again, reading only its ``run_id``) into another run's directory
    (:func:`check_run_identity`). :func:`prepare_run_dir` claims the directory later."""
    if run_dir.is_dir():
        _refuse_if_held(run_dir)
    if not checkpoint:
        return
    from ..ckpt.store import read_top_entry

    rid = read_top_entry(checkpoint, "run_id")
    check_run_identity(run_dir, rid if isinstance(rid, str) else None, checkpoint)


# -- the lock -----------------------------------------------------------------------------
def _launcher_pid() -> int | None:
    """The pid of the ``edgefl simulate`` (or ``edgefl.simulate``) that launched this
    process as a rank of its job, or None."""
    pid = os.environ.get(_LAUNCHER_ENV, "").partition(":")[0]
    return int(pid) if pid.isdigit() else None


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _in_use(path: Path, pid: int | None) -> EdgeflError:
    who = f"pid {pid}" if pid is not None else "another process"
    return EdgeflError(
        f"run directory '{path}' is in use by another job ({who} holds {path / LOCK_FILE}): "
        "wait for it to end, or choose another --out"
    )


def _refuse_if_held(path: Path) -> None:
    """Refuse a directory whose lock another job holds, without creating anything."""
    if str(path.resolve()) in _held:
        return
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (yet): nobody holds it
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            if pid is None or pid != _launcher_pid():
                raise _in_use(path, pid) from None
    finally:
        os.close(fd)  # (releases the shared lock taken to test it)


def claim_run_dir(path: Path) -> bool:
    """Hold ``path``'s lock (``.edgefl-lock``, an exclusive ``flock``) for this process until
    :func:`release_run_dir` or the process ends. True if this process holds it now; False if
    the launcher of this job (``EDGEFL_LAUNCHER``) holds it for us (a rank of a job
    ``edgefl simulate`` started). EdgeflError (one line, naming the holder's pid) if another
    job holds it. Claiming a directory this process holds already is a no-op."""
    key = str(path.resolve())
    if key in _held:
        return True
    lock = path / LOCK_FILE
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _lock(fd)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            if pid is not None and pid == _launcher_pid():
                return False
            raise _in_use(path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the file locked must still be the one at the path (not replaced meanwhile)
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    _held[key] = fd
    return True


def _lock(fd: int, patience_s: float = 0.5) -> None:
    """``flock(fd, LOCK_EX)`` without waiting for a job, but for a moment: another process
    testing the lock (:func:`_refuse_if_held`) holds it shared for microseconds.
    BlockingIOError if it is still held after ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def release_run_dir(path: Path) -> None:
    """Give up this process's lock of ``path`` (if it holds it): the job is over."""
    fd = _held.pop(str(Path(path).resolve()), None)
    if fd is not None:
        os.close(fd)
