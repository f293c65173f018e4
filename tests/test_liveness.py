"""Time-out failure detection (:class:`Liveness`) and the transport failure API over the
loopback transport: ``failed``, ``take_failures``, ``declare_failed``, ``retire``, dropped
sends to dead ranks, waiting polls that return when a rank dies."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.comm.liveness import Liveness
from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import Kind, Validator
from edgefl.errors import ConfigError

# -- Liveness ------------------------------------------------------------------------------


def test_silence_counts_from_the_later_of_deadline_and_last_message():
    lv = Liveness(2.0)
    lv.heard(1, 10.0)
    lv.expect(1, deadline=11.0)  # due at 11: silence counts from 11
    assert lv.silence(1, 12.5) == pytest.approx(1.5)
    assert lv.overdue(13.0) == []  # exactly 2 s: not yet "longer than"
    assert lv.overdue(13.01) == [1]
    lv.heard(1, 12.0)  # a sign of life after the deadline restarts the count
    assert lv.silence(1, 13.01) == pytest.approx(1.01)
    assert lv.overdue(13.01) == []
    assert lv.overdue(14.5) == [1]


def test_nothing_expected_means_never_overdue():
    lv = Liveness(0.5)
    lv.heard(2, 0.0)
    assert lv.overdue(1e9) == []
    assert lv.silence(2, 1e9) == 0.0
    lv.expect(2, 1.0)
    assert lv.overdue(1.6) == [2]
    lv.satisfied(2)
    assert lv.overdue(100.0) == [] and lv.expected() == []


def test_earliest_deadline_counts_and_forget_stops_reports():
    lv = Liveness(1.0)
    lv.expect(3, 5.0)
    lv.expect(3, 8.0)  # a later deadline does not extend the earlier one
    lv.expect(1, 7.0)
    assert lv.expected() == [1, 3]
    assert lv.overdue(6.5) == [3]
    assert lv.overdue(8.5) == [1, 3]
    lv.forget(3)
    assert lv.overdue(8.5) == [1]
    assert lv.last_heard(3) is None


def test_a_rank_never_heard_counts_from_its_deadline_and_clock_going_back_is_ignored():
    lv = Liveness(1.0)
    lv.expect(4, 0.0)
    assert lv.silence(4, 0.75) == pytest.approx(0.75)
    lv.heard(4, 5.0)
    lv.heard(4, 3.0)  # older news: ignored
    assert lv.last_heard(4) == 5.0
    assert lv.overdue(5.9) == [] and lv.overdue(6.1) == [4]


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "soon", None])
def test_bad_timeout_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"config key 'comm.failure_timeout_s' = .*> 0"):
        Liveness(bad)


@settings(max_examples=80, deadline=None)
@given(
    timeout=st.floats(0.01, 100.0),
    deadline=st.floats(0.0, 1000.0),
    beats=st.lists(st.floats(0.0, 1000.0), max_size=8),
    now=st.floats(0.0, 2000.0),
)
def test_overdue_iff_silent_longer_than_the_timeout(timeout, deadline, beats, now):
    lv = Liveness(timeout)
    for b in beats:
        lv.heard(7, b)
    lv.expect(7, deadline)
    start = max([deadline, *beats])
    assert (lv.overdue(now) == [7]) == (now - start > timeout)
    # a message at `now` always clears the suspicion
    lv.heard(7, now)
    assert lv.overdue(now) == []


# -- the transport failure API, over loopback ---------------------------------------------


def trio():
    fabric = Fabric(3)
    ts = [LoopbackTransport(fabric, r, Validator(r)) for r in range(3)]
    ts[0].validator.hosted = {1: frozenset({1}), 2: frozenset({2})}
    return fabric, ts


def test_killed_rank_is_reported_once_and_others_are_still_served():
    fabric, (t0, t1, t2) = trio()
    t1.send(0, Kind.HEARTBEAT)
    t2.send(0, Kind.HEARTBEAT)
    fabric.kill(2)  # its unreceived heartbeat is lost with it
    msgs = t0.poll()
    assert [m.src for m in msgs] == [1]
    assert t0.failed == {2}
    assert t0.take_failures() == [2]
    assert t0.take_failures() == []  # reported once
    released = []
    t0.send(2, Kind.STOP, release=lambda: released.append(True))  # dropped, released at once
    assert released == [True] and t0.stats.msgs_sent[2] == 0
    t1.send(0, Kind.HEARTBEAT)
    assert [m.src for m in t0.poll()] == [1]
    t0.wait_sends()
    t0.close()


def test_waiting_poll_returns_early_when_a_rank_dies():
    fabric, (t0, _t1, _t2) = trio()
    threading.Timer(0.05, fabric.kill, (1,)).start()
    start = time.monotonic()
    assert t0.poll(timeout=5.0) == []
    assert time.monotonic() - start < 2.0
    assert t0.take_failures() == [1]


def test_worker_sees_the_coordinator_die():
    fabric, (_t0, t1, _t2) = trio()
    fabric.kill(0)
    t1.poll()
    assert t1.take_failures() == [0]


def test_declared_and_retired_ranks():
    _fabric, (t0, t1, t2) = trio()
    assert t0.declare_failed(2, "silent") is True
    assert t0.declare_failed(2) is False  # already known
    assert t0.declare_failed(0) is False  # never itself
    t2.send(0, Kind.HEARTBEAT)  # nothing is received from a declared-dead rank
    assert t0.poll() == []
    assert t0.take_failures() == [2]
    t0.retire(1)  # finished normally: not a failure, nothing more from or to it
    t1.send(0, Kind.HEARTBEAT)
    assert t0.poll() == []
    assert t0.retired == {1} and t0.failed == {2}
    assert t0._mark_failed([1], "exited") == []  # its exit is not reported
    assert t0.take_failures() == []


def test_attached_liveness_declares_a_silent_rank_failed():
    _fabric, (t0, t1, t2) = trio()
    t0.liveness = Liveness(0.05)
    now = time.monotonic()
    t0.liveness.expect(1, now)
    t0.liveness.expect(2, now)
    stop = now + 0.5
    while time.monotonic() < stop and not t0.failed:
        t1.send(0, Kind.HEARTBEAT)  # rank 1 keeps talking, rank 2 says nothing
        t0.poll(timeout=0.01)
    assert t0.take_failures() == [2]
    assert t0.failed == {2}
    assert t0.liveness.last_heard(1) is not None
    assert t0.liveness.expected() == [1]  # the dead rank is no longer watched


def test_payload_to_dead_rank_is_not_copied_onto_the_wire():
    fabric, (t0, _t1, _t2) = trio()
    fabric.kill(1)
    t0.poll()
    big = np.zeros(1 << 10, np.float32)
    t0.send(1, Kind.MODEL, payload=big)
    assert not fabric.queues[(0, 1)]
