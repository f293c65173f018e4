"""edgefl.procfs: the /proc readers, on fake file texts and on real processes (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefl import procfs

linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")

# a stat line whose name (comm) holds spaces and parentheses, ") " included
FAKE_STAT = (
    "4242 (my (weird) ) name) S 17 4242 4242 0 -1 4194304 100 0 0 0 "
    "250 75 0 0 20 0 3 0 987654 123456789 2048 18446744073709551615 1 1 0 0 0 0 0 "
    "4096 0 0 0 0 17 3 0 0 0 0 0\n"
)


def test_parse_stat_splits_at_the_last_parenthesis():
    for text in (FAKE_STAT, FAKE_STAT.encode()):
        st = procfs.parse_stat(text)
        assert st is not None
        assert (st.pid, st.comm, st.state, st.ppid) == (4242, "my (weird) ) name", "S", 17)
        assert (st.utime, st.stime, st.start) == (250, 75, 987654)  # clock ticks
        assert st.cpu_ticks == 325
        assert st.cpu_s == pytest.approx(325 / procfs.CLK_TCK)


def test_parse_rejects_what_is_not_a_stat_line():
    assert procfs.parse_stat("") is None
    assert procfs.parse_stat("12 no parenthesis S 1 2 3") is None
    assert procfs.parse_stat("12 (short) S 1 2") is None  # too few fields
    assert procfs.parse_statm("") is None


def test_parse_statm_cmdline_environ():
    page = procfs.PAGE_SIZE
    assert procfs.parse_statm(b"1000 300 100 1 0 200 0\n") == (300 * page, 100 * page)
    assert procfs.parse_cmdline(b"python\0-m\0edgefl\0\0\0") == ["python", "-m", "edgefl"]
    assert procfs.parse_cmdline(b"") == []
    env = procfs.parse_environ(b"A=1\0B=x=y\0NOEQ\0A=2\0\xff=\xfe\0")
    assert env == {"A": "1", "B": "x=y", "\ufffd": "\ufffd"}  # the first A counts


@linux
def test_this_process():
    pid = os.getpid()
    assert procfs.available()
    st = procfs.stat(pid)
    assert st is not None and st.pid == pid and st.ppid == os.getppid()
    assert st.state in ("R", "S")
    first = procfs.start_time(pid)
    assert first is not None and first > 0
    sum(range(10**5))  # (some CPU time in between)
    assert procfs.start_time(pid) == first  # stable: the same process
    assert procfs.ppid(pid) == os.getppid()
    assert procfs.state(pid) in ("R", "S")
    assert procfs.cpu_ticks(pid) is not None and procfs.cpu_seconds(pid) is not None
    rss = procfs.rss(pid)
    assert rss is not None and rss > 0 and rss % procfs.PAGE_SIZE == 0
    resident, shared = procfs.statm(pid)
    assert 0 <= shared <= resident == rss
    argv = procfs.cmdline(pid)
    assert argv and any("python" in a or "pytest" in a for a in argv)
    env = procfs.environ(pid)
    assert env is not None and env.get("PATH") == os.environ.get("PATH")  # (at start)
    name = procfs.comm(pid)
    assert name and not name.endswith("\n")
    assert pid in procfs.pids()
    started = procfs.boot_time() + first / procfs.CLK_TCK  # unix seconds
    assert started <= time.time() + 1


@linux
def test_children_and_tree_of_a_subprocess():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        me = os.getpid()
        assert proc.pid in procfs.children(me)
        assert proc.pid in procfs.children_by_scan(me)
        assert proc.pid in procfs.children_map()[me]
        assert procfs.ppid(proc.pid) == me
        assert procfs.children(proc.pid) == []
        tree = procfs.tree(me)
        assert tree[0] == me and proc.pid in tree
        usage = procfs.tree_usage(me)
        assert me in usage and proc.pid in usage
        rss, cpu = usage[proc.pid]
        assert rss > 0 and cpu >= 0.0
    finally:
        proc.kill()
        proc.wait()


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: gone (a reuse of the pid this soon is unlikely)
    return proc.pid


@linux
def test_a_gone_pid_reads_as_none_or_empty():
    pid = _gone_pid()
    for read in (
        procfs.stat, procfs.start_time, procfs.state, procfs.ppid, procfs.cpu_ticks,
        procfs.cpu_seconds, procfs.statm, procfs.rss, procfs.cmdline, procfs.environ,
        procfs.comm,
    ):  # fmt: skip
        assert read(pid) is None, read.__name__
    assert procfs.children(pid) == []
    assert procfs.children_by_scan(pid) == []
    assert procfs.tree(pid) == []
    assert procfs.tree_usage(pid) == {}


@linux
def test_a_zombie_is_there_with_state_z():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while procfs.state(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # (exited, not reaped yet)
    try:
        assert procfs.state(proc.pid) == "Z"
        assert procfs.cmdline(proc.pid) == []
    finally:
        proc.wait()


def test_procfs_imports_only_the_standard_library():
    code = (
        "import sys, edgefl.procfs\n"
        "bad = [m for m in ('torch', 'numpy', 'mpi4py') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
