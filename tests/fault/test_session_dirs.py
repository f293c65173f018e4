"""Open MPI session directories left behind by killed launches do not break later ones.

A launch whose ``prterun`` is killed leaves its session directory, ``$TMPDIR/ompi.<pid>``,
with PMIx's rendezvous files in it. When a later ``prterun`` gets the same pid (pids wrap
around), Open MPI refuses to start: "The PMIx server's listener thread failed to start",
exit status 213 (PRRTE's silent error), before any rank runs. CI met it after the suite's
own kill tests. Each launch of :class:`edgefl.launcher.Supervisor` therefore gives Open MPI
a session base of its own (``PRTE_MCA_prte_tmpdir_base``), removed when the job is over.

1. From outside: stale session directories for the next pids in the run's ``TMPDIR``; a real
   ``edgefl simulate`` whose prterun got one of those pids completes, and leaves nothing.
2. The Supervisor on a stand-in for mpiexec: the base exists while it runs and is gone
   after; a base the user set is theirs; bases of launchers that died are swept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefl import launcher as L

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

AHEAD = 3000  # the next pids given a stale session directory


def _next_pids(n: int) -> list[int]:
    """The ``n`` pids the kernel hands out next (it counts up from the last one and wraps
    around to 300 at pid_max), as far as one can know without taking them."""
    last = int(subprocess.check_output(["sh", "-c", "echo $$"]))
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return [p if p < top else p - top + 300 for p in range(last + 1, last + 1 + n)]


def _stale(tmp: Path, pids: list[int]) -> None:
    """What a killed prterun leaves: ``ompi.<pid>`` with PMIx's rendezvous files."""
    for p in pids:
        d = tmp / f"ompi.{p}"
        d.mkdir()
        for name in ("pmix.vm.tool", f"pmix.vm.tool.{p}", f"pmix.vm.tool.prterun-vm-{p}@0"):
            (d / name).write_text("stale\n")


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


@pytest.mark.mpi
def test_a_stale_session_directory_of_the_same_pid_is_harmless(tmp_path, launcher):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pids = _next_pids(AHEAD)
    _stale(tmp, pids)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(out), "--ranks", "2",
           "--devices", "2", "--rounds", "30", "--set", "debug.delay_s=0.05",
           "--set", 'output.progress="quiet"', "--set", "run.checkpoint_every=0"]  # fmt: skip
    # (not conftest.start_launch: it would repeat the very failure this test is about)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp)})  # fmt: skip
    ranks = out / "ranks.json"
    deadline = time.monotonic() + 120
    while not ranks.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    prterun = None
    if ranks.exists():
        rank0 = json.loads(ranks.read_text())["0"]["pid"]
        prterun = _ppid(rank0)
    o, e = p.communicate(timeout=300)
    assert p.returncode == 0, (o + e)[-3000:]
    assert prterun in pids, f"prterun got pid {prterun}, past the stale ones"
    assert (tmp / f"ompi.{prterun}" / "pmix.vm.tool").read_text() == "stale\n"  # not its own
    assert not list(tmp.glob("edgefl-mpi-*")), "the launch's session base was left behind"


STAND_IN = "import os, sys; print(os.environ.get(sys.argv[1], ''), flush=True)"


def _supervised(env: dict, tmp: Path) -> tuple[str, L.Supervisor]:
    sup = L.Supervisor(env, tmp / "exit_status")
    proc = sup.start([sys.executable, "-c", STAND_IN, L.SESSION_BASE_ENV],
                     stdout=subprocess.PIPE, text=True)  # fmt: skip
    seen = proc.stdout.readline().strip()
    assert seen == "" or Path(seen).is_dir()  # (there while the job runs)
    proc.stdout.close()
    assert sup.wait() == 0
    return seen, sup


def test_each_launch_has_its_own_session_base(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    env = {k: v for k, v in L.child_env(False).items() if k != L.SESSION_BASE_ENV}
    first, sup = _supervised(dict(env), tmp_path)
    second, _ = _supervised(dict(env), tmp_path)
    assert first and second and first != second
    assert L.SESSION_BASE_ENV not in sup.env  # (a later start of it makes a new one)
    assert Path(first).parent == tmp_path and Path(first).name.startswith("edgefl-mpi-")
    assert not Path(first).exists() and not Path(second).exists()


def test_a_session_base_the_user_set_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    env = {**L.child_env(False), L.SESSION_BASE_ENV: str(mine)}
    seen, _ = _supervised(env, tmp_path)
    assert seen == str(mine) and mine.is_dir()


def test_the_bases_of_launchers_that_died_are_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"edgefl-mpi-{dead.pid}-abc"
    kept = tmp_path / f"edgefl-mpi-{os.getpid()}-abc"  # (this process: alive)
    other = tmp_path / "edgefl-mpi-notapid-abc"
    for d in (gone, kept, other):
        (d / "ompi.1").mkdir(parents=True)
    _supervised(dict(L.child_env(False)), tmp_path)
    assert not gone.exists() and kept.exists() and other.exists()
