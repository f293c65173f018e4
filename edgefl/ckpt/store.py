"""Checkpoint storage: atomic, sealed HDF5 writes, verified reads, the latest good file.

Layout: one HDF5 file; nested dicts are groups, every leaf is a contiguous, uncompressed
dataset with attributes ``kind`` (see ``plan.KINDS``) and ``crc32`` (of the raw bytes). The
root attributes ``format_version`` and ``complete`` are written last in the HDF5 file; then
the file is closed and sealed with the commit trailer of ``edgefl.ckpt.seal`` (a SHA-256 of
the whole file, checked before h5py parses a byte of it). A file sealed as a run checkpoint
(its state has ``config_toml``, ``round`` and ``model``) is also checked against the resume
schema (``edgefl.ckpt.schema``) on every load.

Tables (format_version 2): a group of at least :data:`TABLE_MIN_ROWS` sub-groups that all
hold the same entries (names, kinds, and dtype and shape of fixed-size values), such as
``devices/<id>`` of a large fleet, is stored as a handful of column datasets instead of one
dataset per entry (an HDF5 object per entry costs about a millisecond to write and more to
read: a 10,000-device checkpoint took minutes). The group has the attribute ``table_rows``;
``%rows`` holds the rows' link names and ``%columns`` every column's relative names, kind
and layout (JSON); ``%c<j>`` column j's values (fixed-size leaves stacked, one row per
row; variable-size ones concatenated, with row offsets in ``%o<j>``); each has a crc32.
The planner (``plan.plan_tables``) finds the tables and keeps no node of their rows: they
are encoded again and written :data:`TABLE_CHUNK_ROWS` at a time into datasets made at
their full size, so writing a large fleet needs memory for one chunk of its devices.
Reading expands a table back into the very nodes, in the same order, that a group per row
gives, so the loaded state (and ``edgefl inspect``) cannot tell the two layouts apart. A
file without a table is written as format_version 1, readable by an edgefl before tables.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from edgefl.ckpt import seal
from edgefl.ckpt.plan import Node, Table, crc32, decode_leaf, plan_tables, rebuild_state
from edgefl.ckpt.schema import check_run_state, is_run_state
from edgefl.errors import CheckpointError

log = logging.getLogger("edgefl.ckpt")
FORMAT_VERSION = 1  # a file without tables
TABLE_FORMAT_VERSION = 2  # a file holding a table (below)
READ_VERSIONS = (FORMAT_VERSION, TABLE_FORMAT_VERSION)
#: fewest rows a group needs to be stored as a table
TABLE_MIN_ROWS = 64
#: rows of a table encoded and written at a time (what writing one needs memory for)
TABLE_CHUNK_ROWS = 2048
_TABLE_ATTR = "table_rows"
_FIXED = {"int": "<i8", "float": "<f8", "bool": "|b1"}  # scalar kinds: one value per row
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


def _write_nodes(f: h5py.File, plan: list[Node | Table]) -> bool:
    """Write ``plan`` (``plan.plan_tables``: depth-first, parents first) below ``f``; True
    if it holds a table. Only the groups on the path to the current node stay open."""
    open_groups: list[tuple[tuple[str, ...], h5py.Group]] = [((), f)]
    tables = False
    for item in plan:
        if isinstance(item, Table):
            while open_groups[-1][0] != item.names:
                open_groups.pop()
            _write_table(open_groups[-1][1], item)
            tables = True
            continue
        while open_groups[-1][0] != item.names[:-1]:
            open_groups.pop()
        parent = open_groups[-1][1]
        if item.kind == "group":
            open_groups.append((item.names, parent.create_group(item.names[-1], track_order=True)))
        else:
            _write_leaf(parent, item.names[-1], item)
    return tables


def _write_blob(group: h5py.Group, name: str, data: np.ndarray) -> None:
    ds = group.create_dataset(name, data=data)
    ds.attrs["crc32"] = np.uint32(crc32(data))


def _crc_more(crc: int, arr: np.ndarray) -> int:
    """``crc`` continued over the raw bytes of ``arr`` (the crc32 of a whole column is that
    of its chunks in turn)."""
    return zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8), crc)


def _write_table(group: h5py.Group, table: Table) -> None:
    """Write a table (see the module docstring), :data:`TABLE_CHUNK_ROWS` rows at a time:
    every column's dataset is made at its full size first, then filled chunk by chunk,
    its crc32 carried from chunk to chunk."""
    n = table.n
    _write_blob(group, "%rows", _json_bytes(table.row_names()))
    _write_blob(group, "%columns", _json_bytes(table.column_specs()))
    sets: list[tuple[h5py.Dataset, h5py.Dataset | None] | None] = []
    for j, (_rel, _kind, how, dtype, shape) in enumerate(table.columns):
        if how == "fixed":
            assert dtype is not None and shape is not None
            sets.append((group.create_dataset(f"%c{j}", shape=(n, *shape), dtype=dtype), None))
        elif how == "var":
            data = group.create_dataset(f"%c{j}", shape=(table.var_bytes[j],), dtype=np.uint8)
            offsets = group.create_dataset(f"%o{j}", shape=(n + 1,), dtype=np.int64)
            offsets[0] = 0
            sets.append((data, offsets))
        else:
            sets.append(None)
    zero = np.zeros(1, np.int64)
    crcs = [[0, _crc_more(0, zero)] for _ in sets]  # (data, offsets: starting at 0)
    pos = [0] * len(sets)  # bytes of each var column written so far
    for start, cols in table.chunks(TABLE_CHUNK_ROWS):
        for j, col in enumerate(cols):
            ds = sets[j]
            if ds is None:
                continue
            if ds[1] is None:  # fixed
                if col.size:
                    ds[0][start : start + len(col)] = col
                crcs[j][0] = _crc_more(crcs[j][0], col)
                continue
            data, sizes = col
            if data.size:
                ds[0][pos[j] : pos[j] + data.size] = data
            ends = pos[j] + np.cumsum(sizes, dtype=np.int64)
            if ends.size:
                ds[1][start + 1 : start + 1 + ends.size] = ends
            crcs[j] = [_crc_more(crcs[j][0], data), _crc_more(crcs[j][1], ends)]
            pos[j] += int(data.size)
    for j, ds in enumerate(sets):
        if ds is not None:
            ds[0].attrs["crc32"] = np.uint32(crcs[j][0] & 0xFFFFFFFF)
            if ds[1] is not None:
                ds[1].attrs["crc32"] = np.uint32(crcs[j][1] & 0xFFFFFFFF)
    group.attrs[_TABLE_ATTR] = np.int64(n)


def _json_bytes(value) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8).copy()


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
    nodes = plan_tables(state, TABLE_MIN_ROWS)  # validate everything before touching the disk
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
                tables = _write_nodes(f, nodes)
                f.attrs["created_unix_s"] = time.time()
                f.attrs["format_version"] = np.int64(
                    TABLE_FORMAT_VERSION if tables else FORMAT_VERSION
                )
                f.attrs["complete"] = True  # the last thing written into the HDF5 file
                f.flush()
            with open(tmp, "r+b") as fh:
                seal.seal(fh, content)  # the commit: a file without it is never read
            os.replace(tmp, target)
        except (OSError, RuntimeError) as exc:  # (HDF5 reports some I/O failures so)
            raise CheckpointError(_write_failure(target, nodes, exc, tmp)) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_path(directory if str(directory) else Path("."), directory=True)


def _write_failure(target: Path, nodes: list[Node | Table], exc: BaseException, tmp: Path) -> str:
    """The one line of a checkpoint write that failed (a full disk, say): the file, why
    (the operating system's reason, found under HDF5's wrapping), about how many bytes it
    needs (the state's leaves, or the newest older checkpoint's size if larger: HDF5 adds
    its overhead) and how many are free there, and what is kept. The temporary file is
    removed first, so the free space is what a retry would have."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    directory = target.parent if str(target.parent) else Path(".")
    need = sum(
        n.nbytes if isinstance(n, Table) else int(n.data.nbytes)
        for n in nodes
        if isinstance(n, Table) or n.data is not None
    )
    older = [p for p in _candidates_quiet(directory) if p.name != target.name]
    with contextlib.suppress(OSError):  # (the last one's size counts HDF5's overhead too)
        need = max(need, older[0].stat().st_size) if older else need
    try:
        free = _bytes(shutil.disk_usage(directory).free)
    except OSError:
        free = "unknown"
    kept = (
        f"the older checkpoints are kept ({len(older)}, newest {older[0].name})"
        if older
        else "no older checkpoint was there to keep"
    )
    if target.exists():
        kept = f"'{target.name}' is kept as it was; {kept}"
    return (
        f"checkpoint '{target}': cannot write ({_os_reason(exc)}): it needs about "
        f"{_bytes(need)}, {free} free in '{directory}'; {kept}"
    )


def _os_reason(exc: BaseException) -> str:
    """The most telling line of a write failure and the exceptions it arose from (HDF5
    raises OSError or RuntimeError with the errno inside its text, or a RuntimeError while
    closing after the real error)."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        code = getattr(e, "errno", None) if isinstance(e, OSError) else None
        m = _ERRNO_RE.search(str(e))
        if m:
            code = int(m.group(1))
        if code:
            return f"{os.strerror(code)}, errno {code}"
    return _first_line(chain[-1])


_ERRNO_RE = re.compile(r"errno = (\d+)")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _candidates_quiet(d: Path) -> list[Path]:
    try:
        return _candidates(d)
    except OSError:
        return []


def read_top_entry(path: str | os.PathLike, key: str) -> Any:
    """The value of the top-level leaf ``key`` of the checkpoint ``path`` (its SHA-256
    trailer, commit marker and that dataset's crc32 verified), or None if it has none;
    reads nothing else (e.g. a resume's ``run_id``). CheckpointError (one line) otherwise."""
    p = Path(path)
    with open_checkpoint(p) as c:
        try:
            obj = c.file.get(key)
            if not isinstance(obj, h5py.Dataset):
                return None
            kind = obj.attrs["kind"]
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            stored = int(obj.attrs["crc32"])
            if int(obj.size) * obj.dtype.itemsize > c.size:
                raise ValueError("it claims more bytes than the file has")
            data = _read_array(obj)
        except _READ_ERRORS as exc:
            raise CheckpointError(
                f"checkpoint '{p}': cannot read '/{key}' ({_first_line(exc)})"
            ) from None
    if crc32(data) != stored:
        raise CheckpointError(f"checkpoint '{p}': dataset '/{key}' is corrupt (crc32)")
    try:
        return decode_leaf(kind, data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint '{p}': malformed '/{key}' ({_first_line(exc)})"
        ) from None


# ---------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Sealed:
    """An open, verified checkpoint (see :func:`open_checkpoint`)."""

    file: h5py.File
    content: str  # "run" (a run's checkpoint, checked against the resume schema) or "state"
    size: int  # bytes, trailer included
    format_version: int = FORMAT_VERSION


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
            version = _check_root(f, p)
            yield Sealed(f, seal.CONTENTS[content], size, version)


def _check_root(f: h5py.File, p: Path) -> int:
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
    if version not in READ_VERSIONS:
        raise CheckpointError(
            f"checkpoint '{p}': format_version {version} "
            f"is not supported (this edgefl reads {' and '.join(map(str, READ_VERSIONS))})"
        )
    return version


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
                    if _TABLE_ATTR in obj.attrs:
                        nodes.extend(_read_table(obj, child, where, verify, max_bytes))
                    else:
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


def _read_blob(group: h5py.Group, name: str, where: str, verify: bool,
               max_bytes: int | None) -> np.ndarray:  # fmt: skip
    ds = group[name]
    path = f"{group.name}/{name}"
    claimed = int(ds.size) * ds.dtype.itemsize
    if max_bytes is not None and claimed > max_bytes:
        raise CheckpointError(
            f"checkpoint '{where}': dataset '{path}' claims {claimed} bytes, more than the "
            f"file's {max_bytes}"
        )
    data = _read_array(ds)
    if verify and crc32(data) != int(ds.attrs["crc32"]):
        raise CheckpointError(
            f"checkpoint '{where}': dataset '{path}' is corrupt (crc32 {crc32(data):08x}, "
            f"expected {int(ds.attrs['crc32']):08x})"
        )
    return data


def _read_table(group: h5py.Group, names: tuple[str, ...], where: str, verify: bool,
                max_bytes: int | None) -> list[Node]:  # fmt: skip
    """The nodes a table stands for (those of one group per row, in the same order)."""
    blob = lambda n: _read_blob(group, n, where, verify, max_bytes)  # noqa: E731
    try:
        rows = json.loads(blob("%rows").tobytes().decode("utf-8"))
        columns = json.loads(blob("%columns").tobytes().decode("utf-8"))
        n = int(group.attrs[_TABLE_ATTR])
        if (
            not isinstance(rows, list)
            or len(rows) != n
            or not all(isinstance(r, str) for r in rows)
        ):
            raise ValueError("its row names do not match table_rows")
        cols = []
        for j, (rel, kind, how, *fixed) in enumerate(columns):
            rel = tuple(str(x) for x in rel)
            if how == "fixed":
                data = blob(f"%c{j}")
                if data.shape != (n, *fixed[1]) or data.dtype.str != fixed[0]:
                    raise ValueError(f"column {j} has shape {data.shape}, dtype {data.dtype}")
                cols.append((rel, kind, data, None))
            elif how == "var":
                data, offsets = blob(f"%c{j}"), blob(f"%o{j}")
                if (offsets.shape != (n + 1,) or data.ndim != 1 or offsets[0] != 0
                        or offsets[-1] != data.size or (np.diff(offsets) < 0).any()):  # fmt: skip
                    raise ValueError(f"column {j} has bad row offsets")
                cols.append((rel, kind, data, offsets.tolist()))
            elif how == "none":
                cols.append((rel, kind, None, None))
            else:
                raise ValueError(f"column {j} has an unknown layout {how!r}")
    except CheckpointError:
        raise
    except (*_READ_ERRORS, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint '{where}': cannot read the table '{group.name}' ({_first_line(exc)})"
        ) from None
    empty = np.zeros(0, np.uint8)
    out = []
    for r, row in enumerate(rows):
        base = (*names, row)
        out.append(Node(base, "group"))
        for rel, kind, data, offsets in cols:
            if kind == "group":
                out.append(Node((*base, *rel), "group"))
            elif data is None:
                out.append(Node((*base, *rel), kind, empty.copy()))
            elif offsets is None:
                out.append(Node((*base, *rel), kind, data[r, ...]))
            else:
                out.append(Node((*base, *rel), kind, data[offsets[r] : offsets[r + 1]]))
    return out


@dataclass(frozen=True)
class Checkpoint:
    """A fully verified checkpoint (see :func:`read_checkpoint`)."""

    path: Path
    content: str  # "run" or "state" (see Sealed)
    size: int  # bytes of the file, trailer included
    created_unix_s: float | None  # when it was written (Unix time, seconds)
    nodes: list[Node]  # in file order
    state: dict[str, Any]
    format_version: int = FORMAT_VERSION


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
        content, size, version = c.content, c.size, c.format_version
    try:
        state = rebuild_state(nodes)
    except (ValueError, KeyError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint '{p}': malformed entry ({_first_line(exc)})") from None
    if content == "run":
        check_run_state(state, str(p))
    return Checkpoint(p, content, size, created, nodes, state, version)


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
