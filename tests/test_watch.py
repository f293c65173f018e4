"""Rank 0's watch over the workers (edgefl/runtime/watch.py), over the loopback transport:
liveness beats to idle workers, one straggler warning per silence, and the farewell STOP
(and, on this host, SIGKILL) to a rank the time-out detector gives up on. The same over a
real SIGSTOP under mpiexec: tests/fault/test_rehost.py."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

from edgefl.comm.liveness import Liveness
from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import Kind, Validator
from edgefl.runtime.watch import DECLARED_DEAD, LIVENESS, RankWatch


def _core(timeout_s: float = 0.0, warn_s: float = 0.0, host: str = "elsewhere", pid: int = 0):
    fabric = Fabric(3)
    ts = [LoopbackTransport(fabric, r, Validator(r)) for r in range(3)]
    ts[0].validator.hosted = {1: frozenset({0}), 2: frozenset({1})}
    core = SimpleNamespace(
        t=ts[0], workers=[1, 2], inflight={1: (4, 0, 0.0)},
        devices={0: {"rank": 1}, 1: {"rank": 2}},
        rank_info={1: {"host": host, "pid": pid}, 2: {"host": host, "pid": pid}},
    )  # fmt: skip
    comm = {"failure_timeout_s": timeout_s, "straggler_warn_s": warn_s}
    return core, RankWatch(core, comm), ts


def test_beats_reach_every_live_worker():
    core, w, ts = _core(timeout_s=0.2)  # a beat every 0.05 s
    time.sleep(0.06)
    w.tick()
    w.tick()  # (too soon for another)
    for t in ts[1:]:
        got = t.poll()
        assert [(m.kind, m.aux[0]) for m in got] == [(Kind.HEARTBEAT, LIVENESS)]


def test_no_beats_without_time_outs():
    core, w, ts = _core(timeout_s=0.0)
    time.sleep(0.02)
    w.tick()
    assert ts[1].poll() == [] and ts[2].poll() == []


def test_one_straggler_warning_per_silence(capsys):
    core, w, _ts = _core(warn_s=0.05)
    now = time.monotonic()
    w.owes(2, now)
    w.tick()
    assert capsys.readouterr().out == ""  # not yet
    time.sleep(0.07)
    w.tick()
    w.tick()
    out = capsys.readouterr().out
    assert out.count("warning: rank 2 (devices [1]) owes an answer") == 1
    assert "set comm.failure_timeout_s" in out
    assert w.warnings[0]["rank"] == 2 and w.warnings[0]["devices"] == [1]
    w.answered(2, time.monotonic(), done=False)  # progress re-arms the warning
    time.sleep(0.07)
    w.tick()
    assert "rank 2" in capsys.readouterr().out


def test_give_up_sends_the_farewell():
    core, w, ts = _core(timeout_s=1.0)
    w.give_up(2)
    (msg,) = ts[2].poll()
    assert msg.kind == Kind.STOP and msg.aux[2] == DECLARED_DEAD


def test_give_up_kills_a_rank_on_this_host():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.send_signal(signal.SIGSTOP)  # frozen: only SIGKILL ends it
        core, w, _ts = _core(timeout_s=1.0, host=socket.gethostname(), pid=child.pid)
        w.give_up(1)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_transport_calls_on_suspect_before_declaring_failed():
    fabric = Fabric(2)
    t0 = LoopbackTransport(fabric, 0, Validator(0))
    t0.liveness = Liveness(0.05)
    suspected = []
    t0.on_suspect = lambda r: suspected.append((r, r in t0.failed))
    t0.liveness.expect(1, time.monotonic())
    deadline = time.monotonic() + 2.0
    while not t0.failed and time.monotonic() < deadline:
        t0.poll(timeout=0.01)
    assert suspected == [(1, False)] and t0.take_failures() == [1]
