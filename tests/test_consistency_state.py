"""FedBuff / FedAsync state: ``state_dict`` -> JSON -> fresh policy -> ``load_state_dict``
continues with exactly the decisions the original policy would have made.

The runs use the pure discrete-event driver of ``test_consistency`` (which mirrors the
coordinator); mid-run the driver's policy is swapped for a restored copy, and everything
that follows (dispatches, applies with their coefficients, the model) must be the same as
in an uninterrupted run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_consistency import SPREAD, Dev, Sim, samples_of

from edgefl.policies.consistency import Arrival, FedAsync, FedBuff

DEVS = [Dev(x) for x in SPREAD] + [Dev(2.3), Dev(4.1)]  # 7 devices, different speeds


def fedbuff() -> FedBuff:
    # 4 of 7 devices train at once (the draws matter), every 3 arrivals are applied
    return FedBuff(samples_of(DEVS), seed=11, participation=0.6, k=3)


def fedasync() -> FedAsync:
    return FedAsync(samples_of(DEVS), seed=11, participation=0.6, fn="hinge", b=1)


def restored(policy, make):
    """A fresh policy given ``policy``'s state through JSON (and the buffered deltas, which
    the caller keeps)."""
    st = json.loads(json.dumps(policy.state_dict()))
    fresh = make()
    if isinstance(policy, FedBuff):
        deltas = {(a.device, a.task): a.delta for a, _ in policy.buffer}
        assert sorted(FedBuff.buffered_tasks(st)) == sorted(deltas)
        fresh.load_state_dict(st, deltas)
    else:
        fresh.load_state_dict(st)
    return fresh


def run(make, versions: int, swap_at: int | None = None) -> tuple[Sim, dict]:
    """Run a fresh policy for ``versions`` versions; after event ``swap_at`` the driver's
    policy is replaced by a restored copy. Returns the sim and what the swapped-out policy
    held at the swap."""
    seen: dict = {}
    events = [0]

    def on_event(sim: Sim, ev: tuple) -> None:
        events[0] += 1
        if events[0] == swap_at:
            old = sim.policy
            seen["busy"] = set(old.busy)
            seen["buffer"] = len(getattr(old, "buffer", []))
            seen["draws"] = old.draws
            sim.policy = restored(old, make)
            assert sim.policy.state_dict() == old.state_dict()

    sim = Sim(make(), DEVS, versions, on_event=on_event).run()
    return sim, seen


def same_run(a: Sim, b: Sim) -> None:
    assert a.dispatches == b.dispatches
    assert [(x.time, x.mode, x.items) for x in a.applies] == [
        (x.time, x.mode, x.items) for x in b.applies
    ]
    assert [x.coefs for x in a.applies] == [x.coefs for x in b.applies]  # bit-identical
    assert np.array_equal(a.model, b.model)
    assert a.version == b.version


@pytest.mark.parametrize("swap_at", [5, 17, 40, 41, 42])
def test_fedbuff_round_trip_continues_identically(swap_at):
    ref, _ = run(fedbuff, 30)
    got, seen = run(fedbuff, 30, swap_at)
    assert seen and seen["busy"]  # the swap happened with tasks in flight
    same_run(ref, got)


def test_fedbuff_round_trip_with_a_full_buffer_state():
    # find swap points where arrivals wait in the buffer (the state the old
    # state_dict lost) and check each of them
    points = []
    for swap_at in range(1, 60):
        _, seen = run(fedbuff, 30, swap_at)
        if seen.get("buffer", 0) >= 2:
            points.append(swap_at)
    assert len(points) >= 5
    ref, _ = run(fedbuff, 30)
    for swap_at in points[:8]:
        got, seen = run(fedbuff, 30, swap_at)
        assert seen["buffer"] >= 2
        same_run(ref, got)


@pytest.mark.parametrize("swap_at", [3, 11, 25, 38])
def test_fedasync_round_trip_continues_identically(swap_at):
    ref, _ = run(fedasync, 60)
    got, seen = run(fedasync, 60, swap_at)
    assert seen and seen["busy"] and seen["draws"] > 1
    same_run(ref, got)


def test_without_the_busy_set_the_decisions_differ():
    # the control: a restored copy that forgot its busy devices (what load_state_dict did
    # before) dispatches devices that are still training
    sim = Sim(fedbuff(), DEVS, 5)
    sim.execute(sim.policy.start(0.0, sim.available))
    fresh = fedbuff()
    fresh.load_state_dict({"draws": sim.policy.draws})
    assert fresh.busy == set() and sim.policy.busy
    d = fresh.lost(next(iter(sim.policy.busy)), 0.5, lambda dev: True)
    assert set(d.dispatch) & sim.policy.busy


def test_fedbuff_state_is_json_and_names_the_buffered_arrivals():
    p = fedbuff()
    p.start(0.0, lambda d: True)
    busy = sorted(p.busy)
    a = Arrival(np.int64(busy[0]), 0, 0, np.int64(10), np.float32(0.25), np.ones(3), 1.5)
    b = Arrival(busy[1], 0, 0, 12, 0.5, np.full(3, 2.0, np.float32), 2.0)
    p.arrived(a, 0, 1.5, lambda d: False)
    p.arrived(b, 1, 2.0, lambda d: False)  # one version later: staleness 1
    st = json.loads(json.dumps(p.state_dict()))
    assert st["draws"] == p.draws
    assert st["busy"] == sorted(p.busy) and len(st["busy"]) == len(busy) - 2
    assert st["buffer"] == [
        {"device": busy[0], "task": 0, "base_version": 0, "samples": 10, "loss": 0.25,
         "time_s": 1.5, "staleness": 0},
        {"device": busy[1], "task": 0, "base_version": 0, "samples": 12, "loss": 0.5,
         "time_s": 2.0, "staleness": 1},
    ]  # fmt: skip
    assert FedBuff.buffered_tasks(st) == [(busy[0], 0), (busy[1], 0)]
    # the deltas come back from the caller, as given
    q = fedbuff()
    q.load_state_dict(st, {(busy[0], 0): a.delta, (busy[1], 0): b.delta})
    assert [(x.device, x.task, s) for x, s in q.buffer] == [(busy[0], 0, 0), (busy[1], 0, 1)]
    assert q.buffer[0][0].delta is a.delta and q.buffer[1][0].delta is b.delta
    assert q.busy == p.busy and q.draws == p.draws
    with pytest.raises(KeyError, match=rf"no delta for the buffered arrival \({busy[1]}, 0\)"):
        fedbuff().load_state_dict(st, {(busy[0], 0): a.delta})


def test_resume_without_deltas_drops_the_buffer_and_start_clears_busy():
    # a resume from a checkpoint: no deltas, nothing in flight; start() refills from scratch
    p = fedbuff()
    p.start(0.0, lambda d: True)
    d0 = sorted(p.busy)[0]
    p.arrived(Arrival(d0, 0, 0, 10, 0.1, np.ones(3), 1.0), 0, 1.0, lambda d: False)
    st = json.loads(json.dumps(p.state_dict()))
    q = fedbuff()
    q.load_state_dict(st)
    assert q.buffer == [] and q.busy == p.busy and q.draws == p.draws
    dec = q.start(5.0, lambda d: True)
    assert q.busy == set(dec.dispatch) and len(dec.dispatch) == q.concurrency()
    assert q.draws == p.draws + 1
    # same for FedAsync
    fa = fedasync()
    fa.start(0.0, lambda d: True)
    fb = fedasync()
    fb.load_state_dict(json.loads(json.dumps(fa.state_dict())))
    assert fb.busy == fa.busy and fb.draws == fa.draws
    dec = fb.start(5.0, lambda d: True)
    assert fb.busy == set(dec.dispatch) and len(dec.dispatch) == fb.concurrency()


def test_older_states_load():
    # checkpoints written before busy / buffer were part of the state
    p = fedbuff()
    p.load_state_dict({"draws": 7})
    assert (p.draws, p.busy, p.buffer) == (7, set(), [])
    q = fedasync()
    q.load_state_dict({"draws": 3})
    assert (q.draws, q.busy) == (3, set())
