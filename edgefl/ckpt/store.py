"""Checkpoint storage: atomic, sealed HDF5 writes, verified reads, the latest good file.

Layout: one HDF5 file; nested dicts are groups, every leaf is a contiguous, uncompressed
dataset with attributes ``kind`` (see ``plan.KINDS``) and ``crc32`` (of the raw bytes). The
root attributes ``format_version`` and ``complete`` are written last in the HDF5 file; then
the file is closed and sealed with the commit trailer of ``edgefl.ckpt.seal`` (a SHA-256 of
the whole file, checked before h5py parses a byte of it). A file sealed as a run checkpoint
(its state has ``config_toml``, ``round`` and ``model``) is also checked against the resume
schema (``edgefl.ckpt.schema``) on every load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from edgefl.ckpt import seal
from edgefl.ckpt.plan import Node, crc32, plan_state, rebuild_state
from edgefl.ckpt.schema import check_run_state, is_run_state
from edgefl.errors import CheckpointError

log = logging.getLogger("edgefl.ckpt")
FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^ckpt-(\d{6,})\.h5$")
# Errors h5py/HDF5 raise on damaged files; translated into one-line CheckpointErrors.
_READ_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError,
                AttributeError, OverflowError, MemoryError)  # fmt: skip
# Fault-test hook (tests/fault/test_job_failures.py, docs/fault-tolerance.md): with the
# environment variable EDGEFL_TEST_CKPT_KILL=N, the N-th save_checkpoint call of a process
# writes half of the state into its temporary file, flushes it and SIGKILLs the process
# (before the commit marker, the trailer and the rename). Unset in normal use.
TEST_KILL_ENV = "EDGEFL_TEST_CKPT_KILL"
_saves_started = 0


def checkpoint_name(round: int) -> str:
    """File name of the checkpoint taken after round ``round``: ``ckpt-<round:06d>.h5``."""
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"checkpoint round must be a non-negative int, got {round!r}")
    return f"ckpt-{round:06d}.h5"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."


# ---------------------------------------------------------------------------------- writing


def _write_leaf(parent: h5py.Group, name: str, node: Node) -> None:
    """Create the dataset for one leaf (contiguous, uncompressed) with its attributes."""
    assert node.data is not None
    ds = parent.create_dataset(name, data=node.data)
    ds.attrs["kind"] = node.kind
    ds.attrs["crc32"] = np.uint32(crc32(node.data))


def _write_nodes(f: h5py.File, nodes: list[Node]) -> None:
    groups: dict[tuple[str, ...], h5py.Group] = {(): f}
    for node in nodes:
        parent = groups[node.names[:-1]]
        if node.kind == "group":
            groups[node.names] = parent.create_group(node.names[-1], track_order=True)
        else:
            _write_leaf(parent, node.names[-1], node)


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms/filesystems cannot open directories: best effort
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Atomically write ``state`` (nested dict, see ``edgefl.ckpt``) to ``path``.

    The HDF5 file is written to ``.<name>.tmp-<pid>`` in the same directory and closed; the
    commit trailer (``edgefl.ckpt.seal``: SHA-256 of the file) is appended and the file
    fsynced, renamed onto ``path`` and the directory fsynced. On any exception
    (KeyboardInterrupt included) the temporary file is removed and an existing ``path`` is
    left untouched. Unsupported values raise TypeError naming the key path; I/O failures
    raise CheckpointError.

    Cost of the seal: one more sequential pass over the file, 35-40 ms for 38 MiB here
    (a save of that size takes 115-122 ms without it; ``edgefl.ckpt.seal`` has the figures).
    """
    target = Path(path)
    nodes = plan_state(state)  # validate everything before touching the disk
    content = seal.RUN if is_run_state(state) else seal.STATE
    directory = target.parent
    tmp = directory / f".{target.name}.tmp-{os.getpid()}"
    global _saves_started
    _saves_started += 1
    try:
        try:
            with h5py.File(tmp, "w", track_order=True) as f:
                if os.environ.get(TEST_KILL_ENV) == str(_saves_started):  # test hook, above
                    _write_nodes(f, nodes[: len(nodes) // 2])
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                _write_nodes(f, nodes)
                f.attrs["created_unix_s"] = time.time()
                f.attrs["format_version"] = np.int64(FORMAT_VERSION)
                f.attrs["complete"] = True  # the last thing written into the HDF5 file
                f.flush()
            with open(tmp, "r+b") as fh:
                seal.seal(fh, content)  # the commit: a file without it is never read
            os.replace(tmp, target)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint '{target}': cannot write ({_first_line(exc)})"
            ) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_path(directory if str(directory) else Path("."), directory=True)


# ---------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Sealed:
    """An open, verified checkpoint (see :func:`open_checkpoint`)."""

    file: h5py.File
    content: str  # "run" (a run's checkpoint, checked against the resume schema) or "state"
    size: int  # bytes, trailer included


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike) -> Iterator[Sealed]:
    """Open a checkpoint read-only after checking, before h5py parses any of it, that its
    bytes match the commit trailer's SHA-256; then that it has the commit marker and our
    format_version. Yields a :class:`Sealed`; CheckpointError (one line, naming the file)
    otherwise. h5py reads through the same open file that was hashed."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint '{p}': no such file")
    if not p.is_file():
        raise CheckpointError(f"checkpoint '{p}': not a regular file")
    try:
        fh = open(p, "rb")  # closed below, after h5py (which reads through it)
    except OSError as exc:
        raise CheckpointError(f"checkpoint '{p}': cannot read ({_first_line(exc)})") from None
    with fh:
        try:
            content = seal.verify(fh, str(p))
            size = os.fstat(fh.fileno()).st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint '{p}': cannot read ({_first_line(exc)})") from None
        try:
            f = h5py.File(fh, "r")
        except _READ_ERRORS as exc:
            raise CheckpointError(
                f"checkpoint '{p}': cannot open, file is truncated or corrupt ({_first_line(exc)})"
            ) from None
        with f:
            _check_root(f, p)
            yield Sealed(f, seal.CONTENTS[content], size)


def _check_root(f: h5py.File, p: Path) -> None:
    try:
        complete = bool(f.attrs.get("complete", False))
        version = f.attrs.get("format_version")
        version = None if version is None else int(version)
    except _READ_ERRORS as exc:
        raise CheckpointError(
            f"checkpoint '{p}': corrupt root attributes ({_first_line(exc)})"
        ) from None
    if not complete:
        raise CheckpointError(
            f"checkpoint '{p}': incomplete (no commit marker; the write was interrupted)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{p}': format_version {version} "
            f"is not supported (this edgefl reads {FORMAT_VERSION})"
        )


def _read_array(ds: h5py.Dataset) -> np.ndarray:
    out = np.empty(ds.shape, dtype=ds.dtype)
    if out.size:
        ds.read_direct(out)
    return out


def read_nodes(
    f: h5py.File, where: str, verify: bool = True, max_bytes: int | None = None
) -> list[Node]:
    """All nodes of an open checkpoint in file order (crc32 verified if ``verify``).

    ``where`` names the file in error messages; a dataset claiming more than ``max_bytes``
    (the file's size: data are stored uncompressed) is refused before it is read.
    """
    nodes: list[Node] = []

    def walk(group: h5py.Group, names: tuple[str, ...]) -> None:
        try:
            links = list(group)
        except _READ_ERRORS as exc:
            raise CheckpointError(
                f"checkpoint '{where}': cannot list '/{'/'.join(names)}' ({_first_line(exc)})"
            ) from None
        for name in links:
            child = (*names, name)
            path = "/" + "/".join(child)
            try:
                obj = group[name]
                if isinstance(obj, h5py.Group):
                    nodes.append(Node(child, "group"))
                    walk(obj, child)
                    continue
                kind = obj.attrs["kind"]
                kind = kind.decode() if isinstance(kind, bytes) else str(kind)
                stored = int(obj.attrs["crc32"])
                claimed = int(obj.size) * obj.dtype.itemsize
                if max_bytes is not None and claimed > max_bytes:
                    raise CheckpointError(
                        f"checkpoint '{where}': dataset '{path}' claims {claimed} bytes, "
                        f"more than the file's {max_bytes}"
                    )
                data = _read_array(obj)
            except CheckpointError:
                raise
            except _READ_ERRORS as exc:
                raise CheckpointError(
                    f"checkpoint '{where}': cannot read '{path}' ({_first_line(exc)})"
                ) from None
            if verify:
                actual = crc32(data)
                if actual != stored:
                    raise CheckpointError(
                        f"checkpoint '{where}': dataset '{path}' is corrupt "
                        f"(crc32 {actual:08x}, expected {stored:08x})"
                    )
            nodes.append(Node(child, kind, data))

    walk(f, ())
    return nodes


@dataclass(frozen=True)
class Checkpoint:
    """A fully verified checkpoint (see :func:`read_checkpoint`)."""

    path: Path
    content: str  # "run" or "state" (see Sealed)
    size: int  # bytes of the file, trailer included
    created_unix_s: float | None  # when it was written (Unix time, seconds)
    nodes: list[Node]  # in file order
    state: dict[str, Any]


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Verify and read a checkpoint: trailer SHA-256, commit marker, format_version, every
    dataset's crc32 and, for a run's checkpoint, the resume schema. CheckpointError (one
    line, naming the file and, for the schema, the entry) on any failure."""
    p = Path(path)
    with open_checkpoint(p) as c:
        nodes = read_nodes(c.file, str(p), max_bytes=c.size)
        try:
            created = c.file.attrs.get("created_unix_s")
            created = None if created is None else float(created)
        except _READ_ERRORS:
            created = None
        content, size = c.content, c.size
    try:
        state = rebuild_state(nodes)
    except (ValueError, KeyError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint '{p}': malformed entry ({_first_line(exc)})") from None
    if content == "run":
        check_run_state(state, str(p))
    return Checkpoint(p, content, size, created, nodes, state)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a checkpoint written by ``save_checkpoint``; returns the state dict.

    Raises CheckpointError (one line, naming the file) if the file is missing, fails its
    commit trailer (not HDF5, truncated, torn, any byte changed, or written by an edgefl
    without the trailer), lacks the commit marker, has another format_version, fails a
    crc32 check or, for a run's checkpoint, misses an entry of the resume schema or has
    one of the wrong type (``edgefl.ckpt.schema``; the message names the entry).
    """
    return read_checkpoint(path).state


def is_complete(path: str | os.PathLike) -> bool:
    """True if ``path`` passes its commit trailer's SHA-256 and has the commit marker and
    our format_version (the datasets' crc32 and the schema are checked by loading)."""
    try:
        with open_checkpoint(path):
            return True
    except CheckpointError:
        return False


def _candidates(d: Path) -> list[Path]:
    """``ckpt-<round>.h5`` files of directory ``d``, highest round first."""
    found: list[tuple[int, Path]] = []
    for entry in d.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return [p for _, p in sorted(found, reverse=True)]


def _newest(d: Path, run_only: bool) -> tuple[Path, dict[str, Any]] | None:
    for p in _candidates(d):
        try:
            ck = read_checkpoint(p)
        except CheckpointError as exc:
            log.warning("latest checkpoint: skipping %s", exc)
            continue
        if run_only and ck.content != "run":
            log.warning("latest checkpoint: skipping checkpoint '%s': not a run's checkpoint", p)
            continue
        return p, ck.state
    return None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Newest good ``ckpt-<round:06d>.h5`` in ``directory`` (highest round), else None.

    Every candidate is loaded and verified like ``load_checkpoint`` does; a bad one (torn,
    truncated, corrupt, failing the resume schema) is skipped with a warning naming it and
    why (logger ``edgefl.ckpt``), and the next older one is tried.
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    found = _newest(d, run_only=False)
    return found[0] if found is not None else None


def resume_checkpoint(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(file, state) to resume from: ``path`` itself if it is a file, which must be a good
    run checkpoint; for a directory (a run directory or its ``checkpoints/``) its newest
    good one, skipping bad ones with a warning. CheckpointError (one line) otherwise."""
    p = Path(path)
    if p.is_dir():
        d = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        found = _newest(d, run_only=True)
        if found is None:
            raise CheckpointError(f"checkpoint directory '{d}': no good checkpoint to resume from")
        return found
    ck = read_checkpoint(p)
    if ck.content != "run":
        raise CheckpointError(
            f"checkpoint '{p}': not a run's checkpoint (no config_toml, round and model); "
            "--resume takes a run's checkpoints/ckpt-NNNNNN.h5"
        )
    return p, ck.state
