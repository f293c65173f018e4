"""Reading processes from Linux ``/proc``: the one place edgefl parses ``/proc/PID/...``.

Pure standard library and light to import: :mod:`edgefl.rankwrap` (every rank, at start-up)
and :mod:`edgefl.launcher` use it, as do the benches.

Units: memory in bytes (``statm`` pages times ``os.sysconf('SC_PAGE_SIZE')``); CPU and start
times as the kernel counts them, in clock ticks (:data:`CLK_TCK` a second; start times are
ticks since the machine's boot), unless a name says seconds.

A process that is gone (or was never there, or belongs to another user where the file is
private) reads as ``None`` from the functions that return one value, and as an empty list
from :func:`children`, :func:`children_by_scan` and :func:`tree`; nothing here raises for it.
Everything here is Linux only; :func:`available` tells whether there is a ``/proc``.

The ``stat`` line is ``PID (COMM) STATE PPID ...`` where COMM (the program's name, up to 15
bytes) may hold spaces and parentheses: it is split at the *last* ``)``
(:func:`parse_stat`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

CLK_TCK: int = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""Clock ticks a second: the unit of the CPU and start times in ``/proc/PID/stat``."""
PAGE_SIZE: int = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""Bytes of a memory page: the unit of ``/proc/PID/statm``."""


def available() -> bool:
    """Whether this machine has a ``/proc`` to read (Linux)."""
    return os.path.isdir("/proc")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, never there, or another user's
        return None


# -- /proc/PID/stat -------------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """The fields of ``/proc/PID/stat`` that edgefl uses (``man 5 proc``, field numbers
    from 1).

    Attributes:
        pid: field 1.
        comm: field 2, the program's name without its parentheses.
        state: field 3, one letter: ``R`` running, ``S`` sleeping, ``Z`` zombie, ``X`` dead...
        ppid: field 4, the parent's pid.
        utime: field 14, user CPU time, in clock ticks.
        stime: field 15, system CPU time, in clock ticks.
        start: field 22, the start time, in clock ticks since the boot; with the pid it tells
            a process from a later one that got the same pid.
    """

    pid: int
    comm: str
    state: str
    ppid: int
    utime: int
    stime: int
    start: int

    @property
    def cpu_ticks(self) -> int:
        """User + system CPU time, in clock ticks."""
        return self.utime + self.stime

    @property
    def cpu_s(self) -> float:
        """User + system CPU time, in seconds."""
        return self.cpu_ticks / CLK_TCK


def parse_stat(text: bytes | str) -> Stat | None:
    """Parse the text of a ``/proc/PID/stat`` file; None if it is not one (too short, no
    ``)``). The name (comm) is what lies between the first ``(`` and the *last* ``)``: it
    may hold spaces and parentheses itself."""
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    head, sep, tail = raw.rpartition(b")")
    if not sep:
        return None
    pid, _, comm = head.partition(b"(")
    fields = tail.split()  # fields[0] is field 3 (state)
    try:
        return Stat(
            pid=int(pid),
            comm=comm.decode("utf-8", "replace"),
            state=fields[0].decode("ascii", "replace"),
            ppid=int(fields[1]),
            utime=int(fields[11]),
            stime=int(fields[12]),
            start=int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def stat(pid: int) -> Stat | None:
    """``/proc/PID/stat`` of ``pid`` parsed (:class:`Stat`), or None if it is gone."""
    raw = _read(f"/proc/{pid}/stat")
    return None if raw is None else parse_stat(raw)


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (stat field 22), in clock ticks since the boot; None if it
    is gone. Equal start times: the same process (not a later one with a reused pid)."""
    st = stat(pid)
    return None if st is None else st.start


def state(pid: int) -> str | None:
    """The state letter of ``pid`` (stat field 3: ``R``, ``S``, ``Z``...), None if gone."""
    st = stat(pid)
    return None if st is None else st.state


def ppid(pid: int) -> int | None:
    """The parent pid of ``pid`` (stat field 4), None if it is gone."""
    st = stat(pid)
    return None if st is None else st.ppid


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of ``pid`` so far (stat fields 14 + 15), in clock ticks; None
    if it is gone."""
    st = stat(pid)
    return None if st is None else st.cpu_ticks


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` so far, in seconds; None if it is gone."""
    st = stat(pid)
    return None if st is None else st.cpu_s


def boot_time() -> float:
    """The unix time (seconds) of this machine's boot, what the start times count from:
    ``boot_time() + start / CLK_TCK`` is a process's start in unix seconds."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


# -- /proc/PID/statm, cmdline, environ, comm ------------------------------------------------
def parse_statm(text: bytes | str) -> tuple[int, int] | None:
    """(resident bytes, bytes of the resident pages that are file-backed or shared) from the
    text of a ``/proc/PID/statm`` file (its 2nd and 3rd fields, in pages); None if it is not
    one."""
    parts = text.split()
    try:
        return int(parts[1]) * PAGE_SIZE, int(parts[2]) * PAGE_SIZE
    except (IndexError, ValueError):
        return None


def statm(pid: int) -> tuple[int, int] | None:
    """(resident bytes, resident file-backed or shared bytes) of ``pid``; None if it is
    gone. The difference is what the process allocated itself (anonymous memory)."""
    raw = _read(f"/proc/{pid}/statm")
    return None if raw is None else parse_statm(raw)


def rss(pid: int) -> int | None:
    """The resident set size of ``pid``, in bytes; None if it is gone."""
    got = statm(pid)
    return None if got is None else got[0]


def parse_cmdline(raw: bytes) -> list[str]:
    """The arguments in the text of a ``/proc/PID/cmdline`` file (NUL-separated), decoded as
    UTF-8 (bad bytes replaced); empty arguments are left out (a process that rewrote its
    argv leaves NUL padding)."""
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def cmdline(pid: int) -> list[str] | None:
    """The command line of ``pid`` (:func:`parse_cmdline`): ``[]`` for a kernel thread or a
    zombie, None if it is gone or unreadable."""
    raw = _read(f"/proc/{pid}/cmdline")
    return None if raw is None else parse_cmdline(raw)


def parse_environ(raw: bytes) -> dict[str, str]:
    """Name -> value from the text of a ``/proc/PID/environ`` file (NUL-separated
    ``NAME=value`` entries), decoded as UTF-8 (bad bytes replaced), in their order; an
    entry without ``=`` is left out, and of a name given twice the first counts (as for
    ``getenv``)."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env.setdefault(name.decode("utf-8", "replace"), value.decode("utf-8", "replace"))
    return env


def environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` started with (:func:`parse_environ`); None if it is gone or
    another user's (the file is private)."""
    raw = _read(f"/proc/{pid}/environ")
    return None if raw is None else parse_environ(raw)


def comm(pid: int) -> str | None:
    """The program name of ``pid`` (``/proc/PID/comm``: up to 15 bytes, without the newline;
    ``python3.11`` for a Python), None if it is gone."""
    raw = _read(f"/proc/{pid}/comm")
    return None if raw is None else raw.decode("utf-8", "replace").removesuffix("\n")


# -- process trees --------------------------------------------------------------------------
def pids() -> list[int]:
    """The pids in ``/proc`` now (every process visible to this one); [] without /proc."""
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's ``/proc/PID/task/TID/children`` list; a scan
    of /proc, :func:`children_by_scan`, where the kernel has no such lists); [] if it is
    gone."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return children_by_scan(pid)
        except OSError:
            continue
    return found


def children_by_scan(pid: int) -> list[int]:
    """Direct children of ``pid`` from the parent pid of every process in /proc (slower
    than :func:`children`); [] if there are none."""
    out = []
    for p in pids():
        st = stat(p)
        if st is not None and st.ppid == pid:
            out.append(p)
    return out


def children_map() -> dict[int, list[int]]:
    """Parent pid -> its children, for every process in /proc (one scan)."""
    kids: dict[int, list[int]] = {}
    for p in pids():
        st = stat(p)
        if st is not None:
            kids.setdefault(st.ppid, []).append(p)
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents before their children (breadth first, by
    :func:`children`); [] if ``pid`` is gone."""
    if not os.path.isdir(f"/proc/{pid}"):
        return []
    out, i = [pid], 0
    while i < len(out):
        out += children(out[i])
        i += 1
    return out


def tree_usage(pid: int) -> dict[int, tuple[int, float]]:
    """(resident bytes, CPU seconds so far: user + system) of ``pid`` and of each of its
    descendants still there (one scan of /proc, :func:`children_map`); {} if it is gone."""
    kids = children_map()
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        mem, st = statm(p), stat(p)
        if mem is not None and st is not None:
            out[p] = (mem[0], st.cpu_s)
        todo.extend(kids.get(p, ()))
    return out


@dataclass
class Proc:
    """One process of a sampled tree (:class:`TreeSampler`). Times are unix seconds, memory
    in bytes."""

    pid: int
    ppid: int
    start: float
    argv: list[str]
    first_seen: float
    last_seen: float
    peak_rss: int = 0
    fork: bool = False  # a copy of its parent, not exec'd (yet): left out of the sums
    cpu_s: float = 0.0  # user + system CPU seconds at the last sample that saw it

    @property
    def exe(self) -> str:
        """The base name of ``argv[0]`` ("" if none)."""
        return os.path.basename(self.argv[0]) if self.argv else ""


class TreeSampler:
    """Samples the process tree below ``root`` (itself included) every ``interval`` seconds
    on a thread: the peaks of the summed resident set sizes (``peak_rss``) and of the summed
    anonymous memory (``peak_anon``), in bytes, and every process seen (``procs``: start
    time from /proc, argv, last time seen, its own peak RSS, its CPU seconds so far). A
    fork that has not exec'd (same argv as its parent) shares its parent's pages and is
    left out of the sums.

    Args:
        root: pid of the tree's root (a child of this process).
        interval: seconds between samples.
    """

    def __init__(self, root: int, interval: float = 0.02) -> None:
        self.root = root
        self.interval = interval
        self.boot = boot_time()
        self.procs: dict[int, Proc] = {}
        self.peak_rss = 0
        self.peak_anon = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgefl-tree-sampler", daemon=True)

    def start(self) -> TreeSampler:
        """Take a first sample now, then sample on the thread."""
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> TreeSampler:
        """Stop the thread (waits for it)."""
        self._stop.set()
        self._thread.join()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One look at the whole tree."""
        now = time.time()
        rss_sum = anon_sum = 0
        for pid in tree(self.root):
            mem = statm(pid)
            if mem is None:
                continue
            resident, anon = mem[0], max(mem[0] - mem[1], 0)
            p = self.procs.get(pid)
            st = stat(pid)
            if st is None:
                continue
            if p is None:
                argv = cmdline(pid) or []
                p = Proc(pid, st.ppid, self.boot + st.start / CLK_TCK, argv, now, now)
                self.procs[pid] = p
            elif not p.argv or p.fork or p.exe in ("mpiexec", "mpirun"):  # (exec'd since?)
                p.argv = cmdline(pid) or p.argv
            parent = self.procs.get(p.ppid)
            # a fork that has not exec'd yet shares its parent's pages: not counted twice
            p.fork = parent is not None and pid != self.root and p.argv == parent.argv
            p.last_seen = now
            p.cpu_s = st.cpu_s
            if p.fork:
                continue
            p.peak_rss = max(p.peak_rss, resident)
            rss_sum += resident
            anon_sum += anon
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss_sum)
        self.peak_anon = max(self.peak_anon, anon_sum)
