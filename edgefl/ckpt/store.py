"""Checkpoint storage: atomic HDF5 writes, verified reads, discovery of the latest file.

Layout: one HDF5 file; nested dicts are groups, every leaf is a contiguous, uncompressed
dataset with attributes ``kind`` (see ``plan.KINDS``) and ``crc32`` (of the raw bytes). The
root attributes ``format_version`` and ``complete`` are written last (the commit marker).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from edgefl.ckpt.plan import Node, crc32, plan_state, rebuild_state
from edgefl.errors import CheckpointError

FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^ckpt-(\d{6,})\.h5$")
# Errors h5py/HDF5 raise on damaged files; translated into one-line CheckpointErrors.
_READ_ERRORS = (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError)
# Fault-test hook (tests/fault/test_job_failures.py, docs/fault-tolerance.md): with the
# environment variable EDGEFL_TEST_CKPT_KILL=N, the N-th save_checkpoint call of a process
# writes half of the state into its temporary file, flushes it and SIGKILLs the process
# (before the commit marker and the rename). Unset in normal use.
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

    The file is written to ``.<name>.tmp-<pid>`` in the same directory, fsynced, renamed
    onto ``path`` and the directory fsynced. On any exception (KeyboardInterrupt included)
    the temporary file is removed and an existing ``path`` is left untouched. Unsupported
    values raise TypeError naming the key path; I/O failures raise CheckpointError.
    """
    target = Path(path)
    nodes = plan_state(state)  # validate everything before touching the disk
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
                f.attrs["complete"] = True  # commit marker: the last thing written
                f.flush()
            _fsync_path(tmp)
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


def open_checkpoint(path: str | os.PathLike) -> h5py.File:
    """Open a checkpoint read-only (an open ``h5py.File``, to be closed by the caller) after
    checking it is a complete checkpoint of our format_version; CheckpointError (one line,
    naming the file) otherwise. :func:`load_checkpoint` and ``describe_checkpoint`` read
    through it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint '{p}': no such file")
    if not p.is_file():
        raise CheckpointError(f"checkpoint '{p}': not a regular file")
    try:
        is_h5 = h5py.is_hdf5(p)
    except OSError as exc:
        raise CheckpointError(f"checkpoint '{p}': cannot read ({_first_line(exc)})") from None
    if not is_h5:
        raise CheckpointError(f"checkpoint '{p}': not an HDF5 file")
    try:
        f = h5py.File(p, "r")
    except _READ_ERRORS as exc:
        raise CheckpointError(
            f"checkpoint '{p}': cannot open, file is truncated or corrupt ({_first_line(exc)})"
        ) from None
    try:
        complete = bool(f.attrs.get("complete", False))
        version = f.attrs.get("format_version")
    except _READ_ERRORS as exc:
        f.close()
        raise CheckpointError(
            f"checkpoint '{p}': corrupt root attributes ({_first_line(exc)})"
        ) from None
    if not complete:
        f.close()
        raise CheckpointError(
            f"checkpoint '{p}': incomplete (no commit marker; the write was interrupted)"
        )
    if version is None or int(version) != FORMAT_VERSION:
        f.close()
        raise CheckpointError(
            f"checkpoint '{p}': format_version {None if version is None else int(version)} "
            f"is not supported (this edgefl reads {FORMAT_VERSION})"
        )
    return f


def _read_array(ds: h5py.Dataset) -> np.ndarray:
    out = np.empty(ds.shape, dtype=ds.dtype)
    if out.size:
        ds.read_direct(out)
    return out


def read_nodes(f: h5py.File, where: str, verify: bool = True) -> list[Node]:
    """All nodes of an open checkpoint in file order (crc32 verified if ``verify``).

    ``where`` names the file in error messages.
    """
    nodes: list[Node] = []

    def walk(group: h5py.Group, names: tuple[str, ...]) -> None:
        for name in group:
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


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a checkpoint written by ``save_checkpoint``; returns the state dict.

    Raises CheckpointError (one line, naming the file) if the file is missing, not HDF5,
    truncated, lacks the commit marker, has another format_version, or fails a crc32 check.
    """
    with open_checkpoint(path) as f:
        nodes = read_nodes(f, str(path))
    try:
        return rebuild_state(nodes)
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint '{path}': malformed entry ({_first_line(exc)})"
        ) from None


def is_complete(path: str | os.PathLike) -> bool:
    """True if ``path`` opens as a checkpoint with the commit marker and our format_version."""
    try:
        with open_checkpoint(path):
            return True
    except CheckpointError:
        return False


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Newest complete ``ckpt-<round:06d>.h5`` in ``directory`` (highest round), else None.

    Incomplete, truncated or foreign files are skipped (only the commit marker is checked;
    ``load_checkpoint`` verifies the data).
    """
    d = Path(directory)
    if not d.is_dir():
        return None
    found: list[tuple[int, Path]] = []
    for entry in d.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    for _, p in sorted(found, reverse=True):
        if is_complete(p):
            return p
    return None
