"""Stopping or killing a run from outside leaves no rank behind, and says what happened.

Two real launches (``edgefl simulate`` of a long, tiny job in a session of its own, killed
once its first metrics row is written): SIGTERM to ``edgefl simulate`` (exit status 130,
"interrupted"), SIGKILL to ``prterun``/``mpiexec`` (137, "killed by signal 9"); every rank
must be gone within 5 s. The rest runs in this process: the launcher's signal handling and
verdicts (edgefl.launcher.Supervisor) on a stand-in for mpiexec, and the rank side
(edgefl.rankwrap.RankGuard) on this process. docs/fault-tolerance.md, "Stopping a run".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgefl import launcher as L
from edgefl.rankwrap import RankGuard, process_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LIMIT_S = 5.0  # every rank gone this long after the kill
# a job that would run for minutes: 2 devices on 1 worker, 20 ms of sleep per task
JOB = ["--ranks", "2", "--devices", "2", "--rounds", "100000",
       "--set", "data.args.dim=10", "--set", "data.args.classes=4",
       "--set", "model.args.hidden=[8]", "--set", 'output.progress="quiet"',
       "--set", "debug.delay_s=0.02", "--set", "run.checkpoint_every=0"]  # fmt: skip


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ranks(out: Path) -> list[int]:
    """Live rank processes of run directory ``out`` (``python -m edgefl run <out>/...``;
    mpiexec's own command line names it too)."""
    key = f"-m edgefl run {out / 'config.toml'}"
    found = []
    for p in os.listdir("/proc"):
        cmd = _cmdline(int(p)) if p.isdigit() else ""
        if key in cmd and "prterun" not in cmd and "mpiexec" not in cmd:
            found.append(int(p))
    return found


def _children(pid: int) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = Path(f"/proc/{p}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(stat[1]) == pid:
                found.append(int(p))
    return found


def _launch(out: Path) -> tuple[subprocess.Popen, list[int], int, Path]:
    """Start the long job; wait for its first metrics row. (process, rank pids, mpiexec pid,
    stderr file)."""
    err = out.with_name(out.name + ".stderr")
    with open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgefl", "simulate", "--out", str(out), *JOB],
            stdout=subprocess.DEVNULL, stderr=e, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
        if proc.poll() is not None or time.monotonic() > deadline:
            _cleanup(proc, out)
            pytest.fail(f"the job did not start: {err.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    ranks = _ranks(out)
    mpiexec = [c for c in _children(proc.pid) if "edgefl run" in _cmdline(c)]
    if len(ranks) != 2 or len(mpiexec) != 1 or set(_children(mpiexec[0])) != set(ranks):
        _cleanup(proc, out)
        pytest.fail(f"expected mpiexec and 2 ranks: {mpiexec} {ranks}")
    return proc, ranks, mpiexec[0], err


def _cleanup(proc: subprocess.Popen, out: Path) -> None:
    for pid in [*_ranks(out), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait(timeout=30)


def _gone_within(pids: list[int], limit: float) -> float:
    """Seconds until none of ``pids`` runs (fails after ``limit``)."""
    t0 = time.monotonic()
    while any(process_alive(p) for p in pids):
        if time.monotonic() - t0 > limit:
            left = [p for p in pids if process_alive(p)]
            raise AssertionError(f"processes {left} still run {limit} s after the kill")
        time.sleep(0.02)
    return time.monotonic() - t0


def _last_line(err: Path) -> str:
    lines = [x for x in err.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else ""


@pytest.mark.mpi
@pytest.mark.parametrize("target", ["sigterm-simulate", "sigkill-mpiexec"])
def test_killing_the_launcher_stops_every_rank(tmp_path, launcher, target):
    out = tmp_path / "run"
    proc, ranks, mpiexec, err = _launch(out)
    try:
        if target == "sigterm-simulate":
            os.kill(proc.pid, signal.SIGTERM)
            want, says = 130, "interrupted by SIGTERM"
        else:
            os.kill(mpiexec, signal.SIGKILL)
            want, says = 137, "mpiexec was killed by signal 9 (SIGKILL)"
        took = _gone_within([*ranks, mpiexec], LIMIT_S)
        assert proc.wait(timeout=LIMIT_S + 5) == want
    finally:
        if proc.poll() is None or _ranks(out):
            _cleanup(proc, out)
    print(f"{target}: every rank gone {took:.2f} s after the kill")
    assert (out / "exit_status").read_text() == f"{want}\n"
    last = _last_line(err)
    assert last.startswith("edgefl simulate: ") and says in last, last
    assert f"(exit status {want})" in last
    assert not _ranks(out)


# -- in this process: the launcher's side ---------------------------------------------------
def _supervise(tmp_path: Path, code: str, signum: int = 0, at: float = 0.3):
    """Run ``python -c code`` as the stand-in for mpiexec under a Supervisor; send this
    process ``signum`` ``at`` s later. (supervisor, return code, seconds waited)."""
    env = L.child_env(False)
    sup = L.Supervisor(env, tmp_path / "exit_status")
    sup.start([sys.executable, "-c", code])
    if signum:
        threading.Timer(at, os.kill, (os.getpid(), signum)).start()
    t0 = time.monotonic()
    rc = sup.wait()
    return sup, rc, time.monotonic() - t0


def test_a_stop_signal_terminates_mpiexec_and_says_interrupted(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    sup, rc, took = _supervise(tmp_path, "import time; time.sleep(30)", signal.SIGTERM)
    assert rc == -signal.SIGTERM and took < 2.0
    assert signal.getsignal(signal.SIGTERM) is before  # handlers put back
    assert sup.conclude(rc) == (
        130,
        "interrupted by SIGTERM: the ranks were stopped (exit status 130)",
    )
    assert (tmp_path / "exit_status").read_text() == "130\n"


def test_an_mpiexec_ignoring_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "GRACE_S", 0.5)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    sup, rc, took = _supervise(tmp_path, code, signal.SIGHUP, at=0.5)
    assert rc == -signal.SIGKILL and 0.9 < took < 3.0
    assert sup.conclude(rc)[0] == 130


def test_leftover_ranks_are_found_by_their_launch_and_killed(tmp_path):
    env = L.child_env(False)
    launch = env[L.LAUNCHER_ENV]
    assert launch.startswith(f"{os.getpid()}:")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in L.launched_by(launch) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert L.launched_by(launch) == [child.pid]
        assert L.launched_by(launch + "x") == []
        assert L.end_leftovers(launch, grace_s=0.2) == [child.pid]
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()


@pytest.mark.parametrize(
    "code, verdict, want, says",
    [
        (0, "0", 0, ""),  # completed: rank 0 said it all
        (0, "3", 3, ""),  # stopped early, rank 0's verdict
        (-9, "137", 137, "mpiexec was killed by signal 9 (SIGKILL)"),  # rank 0 wrote too
        (-11, None, 139, "mpiexec was killed by signal 11 (SIGSEGV)"),
        (1, "143", 143, "the ranks were killed by signal 15 (SIGTERM)"),
        (3, None, 3, "without rank 0's verdict: mpiexec exit status 3"),  # rank 0 died
        (2, None, 2, ""),  # a user error before the run directory: the ranks printed it
    ],
)
def test_verdicts(tmp_path, code, verdict, want, says):
    path = tmp_path / "exit_status"
    if verdict is not None:
        path.write_text(verdict + "\n")
    status, line = L.Supervisor({}, path).conclude(code)
    assert status == want and path.read_text() == f"{want}\n"
    assert (says in line and line.endswith(f"(exit status {want})")) if says else line == ""


def test_status_texts_are_distinct():
    codes = [0, 2, 3, 130, 137, 143, 129]
    texts = [L.status_text(c) for c in codes]
    assert len(set(texts)) == len(codes)
    assert L.status_text(137) == "killed by signal 9 (SIGKILL)"


# -- in this process: the rank's side -------------------------------------------------------
def test_guard_sees_a_stop_signal_at_once():
    before = signal.getsignal(signal.SIGTERM)
    guard = RankGuard(1, launcher="").arm()
    try:
        assert guard.check() is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled: it only wakes the guard
        t0 = time.monotonic()
        assert guard.check(timeout=2.0) == (143, "received SIGTERM")
        assert time.monotonic() - t0 < 0.5
    finally:
        guard.disarm()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_forked_child_of_a_guarded_rank_dies_of_sigterm_alone():
    guard = RankGuard(1, launcher="").arm()
    try:
        pid = os.fork()
        if pid == 0:  # the child: SIGTERM must end it, not wake the parent's guard
            time.sleep(10)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, st = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGTERM
        assert guard.check(timeout=0.2) is None
    finally:
        guard.disarm()


def test_guard_sees_its_launcher_gone_even_as_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    guard = RankGuard(2, launcher=f"{child.pid}:test")
    assert guard.check() is None
    child.kill()
    deadline = time.monotonic() + 5
    while process_alive(child.pid) and time.monotonic() < deadline:  # a zombie: not reaped
        time.sleep(0.01)
    try:
        assert guard.check() == (137, f"edgefl simulate (pid {child.pid}) is gone")
    finally:
        child.wait()


def test_rank_0_records_its_status_unless_one_is_there(tmp_path, capsys):
    (tmp_path / "exit_status").write_text("0\n")  # an earlier run's, under plain mpiexec
    guard = RankGuard(0, launcher="")
    guard.use_status_file(tmp_path / "exit_status")
    assert guard.record(143, "received SIGTERM")
    assert guard.status_file.read_text() == "143\n"
    assert "edgefl: rank 0: received SIGTERM: stopping the job (exit status 143)" in (
        capsys.readouterr().err
    )
    guard.status_file.write_text("130\n")  # edgefl simulate's verdict came first
    assert not guard.record(137, "its parent process (pid 1, mpiexec) is gone")
    assert guard.status_file.read_text() == "130\n"
    assert not RankGuard(1, launcher="").record(143, "x")  # workers write nothing
