"""Consistency policies (BSP, SSP, ASP, FedBuff, FedAsync) driven by a small pure
discrete-event simulator.

The driver below mirrors what ``edgefl.runtime.coordinator`` does with a policy (``_loop``,
``_execute``, ``apply``, ``_available``) on the virtual clock, without MPI or torch: every
device needs a fixed number of seconds per task, may go offline during given windows or
crash at a given time; a task that crosses an offline moment or a crash is lost at that
moment; events are processed in time order (ties: arrive, lost, timer, online, then by
device, as in ``edgefl.runtime.events``). The "model" is a float64 numpy vector.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from edgefl.algorithms.aggregators import make_aggregator
from edgefl.config.schema import defaults
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Update, ordered_updates
from edgefl.policies.consistency import (
    BSP,
    POLICIES,
    SSP,
    Apply,
    Arrival,
    Consistency,
    Decision,
    FedAsync,
    FedBuff,
    make_consistency,
)

INF = math.inf
ARRIVE, LOST, TIMER, ONLINE = 0, 1, 2, 3  # tie order of edgefl.runtime.events
DIM = 4


# -- the driver ---------------------------------------------------------------------------
@dataclass
class Dev:
    """A simulated device: ``dur`` seconds from dispatch to arrival; offline during the
    ``[start, end)`` windows of ``offline`` (sorted, not touching); crashes at ``crash``."""

    dur: float
    samples: int = 10
    offline: tuple[tuple[float, float], ...] = ()
    crash: float = INF

    def online(self, t: float) -> bool:
        return not any(a <= t < b for a, b in self.offline)

    def online_until(self, t: float) -> float:
        return min((a for a, _ in self.offline if a > t), default=INF)

    def next_online(self, t: float) -> float:
        for a, b in self.offline:
            if a <= t < b:
                return b
        return t


def fixed_delta(d: int, task: int, base: np.ndarray) -> np.ndarray:
    """A delta that depends only on (device, task)."""
    return np.random.default_rng([d, task, 77]).standard_normal(DIM)


def pulling_delta(d: int, task: int, base: np.ndarray) -> np.ndarray:
    """A delta that depends on the model the task started from (a step towards a
    device-specific target)."""
    target = np.random.default_rng([d, 5]).standard_normal(DIM)
    return 0.5 * (target - base) + 0.1 * fixed_delta(d, task, base)


@dataclass
class Applied:
    time: float
    mode: str
    items: list[tuple[int, int, int]]  # (device, task, staleness at apply)
    coefs: list[float]


class Sim:
    """Drives ``policy`` over ``devs`` until ``max_versions`` model versions (or no event
    is left, or ``max_events`` events were processed)."""

    def __init__(
        self,
        policy: Consistency,
        devs: list[Dev],
        max_versions: int,
        delta_fn: Callable[[int, int, np.ndarray], np.ndarray] = fixed_delta,
        on_dispatch: Callable[[Sim, int], None] | None = None,
        on_event: Callable[[Sim, tuple], None] | None = None,
        max_events: int = 20_000,
    ) -> None:
        self.policy = policy
        self.devs = devs
        self.max_versions = max_versions
        self.delta_fn = delta_fn
        self.on_dispatch = on_dispatch
        self.on_event = on_event
        self.max_events = max_events
        self.agg = make_aggregator("sample-weighted")
        self.model = np.zeros(DIM)
        self.models = [self.model.copy()]  # by version
        self.version = 0
        self.now = 0.0
        self.heap: list[tuple] = []
        self.n = 0
        self.inflight: dict[int, tuple[int, int, float]] = {}  # d -> (task, base, t0)
        self.tasks = {d: 0 for d in range(len(devs))}
        self.applied = {d: 0 for d in range(len(devs))}  # updates applied per device
        self.dead: set[int] = set()
        self.online_pending: set[int] = set()
        self.dispatches: list[tuple[float, int, int, int]] = []  # (time, d, task, version)
        self.applies: list[Applied] = []
        self.dropped: list[tuple[float, int]] = []
        self.arrivals: list[tuple[float, int, int]] = []  # (time, d, task)
        self.max_busy = 0
        self.stuck = False

    # the runtime's _available
    def available(self, d: int) -> bool:
        if d in self.inflight or d in self.dead:
            return False
        dev = self.devs[d]
        if dev.crash <= self.now:
            self.dead.add(d)
            return False
        if dev.online(self.now):
            return True
        if d not in self.online_pending:
            back = dev.next_online(self.now)
            if back < dev.crash and back < INF:
                self.online_pending.add(d)
                self.schedule(back, ONLINE, d)
        return False

    def schedule(self, t: float, kind: int, device: int = -1, task: int = -1, token: int = 0):
        self.n += 1
        heapq.heappush(self.heap, (t, kind, device, task, token, self.n))

    def dispatch(self, d: int) -> None:
        assert d not in self.inflight, f"device {d} dispatched while busy at t={self.now}"
        assert self.available(d), f"device {d} dispatched while unavailable at t={self.now}"
        if self.on_dispatch is not None:
            self.on_dispatch(self, d)
        task = self.tasks[d]
        self.tasks[d] += 1
        self.inflight[d] = (task, self.version, self.now)
        self.dispatches.append((self.now, d, task, self.version))
        dev = self.devs[d]
        arrive = self.now + dev.dur
        lost_at = min(dev.crash, dev.online_until(self.now))
        if lost_at < arrive:
            self.schedule(lost_at, LOST, d, task)
        else:
            self.schedule(arrive, ARRIVE, d, task)

    def apply(self, ap: Apply) -> None:
        assert ap.arrivals, "an Apply without arrivals"
        if ap.mode == "aggregate":
            ups = [Update(a.device, a.delta, a.samples, a.loss, self.version) for a in ap.arrivals]
            self.model = self.model + self.agg.combine(ordered_updates(ups))
        elif ap.mode == "terms":
            assert len(ap.coefs) == len(ap.arrivals)
            self.model = self.model + sum(c * a.delta for a, c in zip(ap.arrivals, ap.coefs))
        else:
            assert ap.mode == "mix" and len(ap.arrivals) == 1 and len(ap.coefs) == 1
            a, alpha = ap.arrivals[0], ap.coefs[0]
            self.model = (1 - alpha) * self.model + alpha * (self.models[a.base_version] + a.delta)
        items = [(a.device, a.task, self.version - a.base_version) for a in ap.arrivals]
        self.applies.append(Applied(self.now, ap.mode, items, list(ap.coefs)))
        self.version += 1
        self.models.append(self.model.copy())
        for a in ap.arrivals:
            self.applied[a.device] += 1

    def execute(self, dec: Decision) -> None:
        if dec.apply is not None:
            self.apply(dec.apply)
        if dec.timer is not None:
            self.schedule(dec.timer[0], TIMER, token=dec.timer[1])
        for d in dec.dropped:
            assert d in self.inflight, f"dropped device {d} is not training"
            self.dropped.append((self.now, d))
        if self.version >= self.max_versions:
            return
        assert dec.dispatch == sorted(set(dec.dispatch))
        for d in dec.dispatch:
            self.dispatch(d)
        self.max_busy = max(self.max_busy, len(self.inflight))

    def run(self) -> Sim:
        self.execute(self.policy.start(self.now, self.available))
        events = 0
        while self.version < self.max_versions and events < self.max_events:
            if not self.heap:
                self.stuck = True
                break
            t, kind, d, task, token, _ = heapq.heappop(self.heap)
            assert t >= self.now
            self.now = t
            events += 1
            if kind == ARRIVE:
                got, base, _t0 = self.inflight.pop(d)
                assert got == task
                self.arrivals.append((t, d, task))
                delta = self.delta_fn(d, task, self.models[base])
                a = Arrival(d, task, base, self.devs[d].samples, 0.0, delta, t)
                dec = self.policy.arrived(a, self.version, t, self.available)
            elif kind == LOST:
                self.inflight.pop(d)
                dec = self.policy.lost(d, t, self.available)
            elif kind == TIMER:
                dec = self.policy.timer(token, t, self.available)
            else:
                self.online_pending.discard(d)
                dec = self.policy.online(d, t, self.available)
            self.execute(dec)
            if self.on_event is not None:
                self.on_event(self, (t, kind, d, task))
        return self

    def dispatched(self, d: int) -> list[float]:
        return [t for t, dd, _, _ in self.dispatches if dd == d]

    def rounds(self) -> list[tuple[float, list[int]]]:
        """Dispatches grouped by time: (time, devices)."""
        out: dict[float, list[int]] = {}
        for t, d, _, _ in self.dispatches:
            out.setdefault(t, []).append(d)
        return sorted(out.items())


def samples_of(devs: list[Dev]) -> dict[int, int]:
    return {d: dev.samples for d, dev in enumerate(devs)}


def weights_of(devs: list[Dev]) -> np.ndarray:
    n = np.array([dev.samples for dev in devs], float)
    return n / n.sum()


SPREAD = [1.0, 1.7, 3.1, 5.3, 10.0]  # a 10x speed spread


# -- BSP ----------------------------------------------------------------------------------
def test_bsp_rounds_hand_checked():
    # arrivals come in reverse device order (2 at 1 s, 1 at 2 s, 0 at 4 s)
    devs = [Dev(4.0, 1), Dev(2.0, 2), Dev(1.0, 3)]
    sim = Sim(BSP(samples_of(devs)), devs, max_versions=3).run()
    assert sim.dispatches == [(t, d, r, r) for r, t in enumerate([0.0, 4.0, 8.0]) for d in range(3)]
    assert [a.time for a in sim.applies] == [4.0, 8.0, 12.0]
    for r, ap in enumerate(sim.applies):
        assert ap.mode == "aggregate"
        assert ap.items == [(0, r, 0), (1, r, 0), (2, r, 0)]  # sorted by device, fresh
    w = np.array([1, 2, 3]) / 6
    expect = sum(w[d] * fixed_delta(d, r, None) for r in range(3) for d in range(3))
    np.testing.assert_allclose(sim.model, expect, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    "n, participation, min_devices, k",
    [(10, 0.3, 1, 3), (10, 0.3, 5, 5), (10, 1.0, 1, 10), (4, 0.1, 1, 1), (20, 0.25, 1, 5)],
)
def test_bsp_participation_and_min_devices(n, participation, min_devices, k):
    devs = [Dev(1.0 + 0.1 * d) for d in range(n)]
    pol = BSP(samples_of(devs), seed=5, participation=participation, min_devices=min_devices)
    assert pol.concurrency() == k
    sim = Sim(pol, devs, max_versions=6).run()
    rounds = sim.rounds()
    assert len(rounds) == 6
    for (_, ds), ap in zip(rounds, sim.applies):
        assert len(ds) == k and len(set(ds)) == k
        assert [d for d, _, _ in ap.items] == sorted(ds)  # everyone sampled is aggregated
    if k < n:  # the sample changes from round to round
        assert len({tuple(ds) for _, ds in rounds}) > 1


def test_bsp_sampling_deterministic_in_seed():
    def chosen(seed: int, durs: list[float]) -> list[list[int]]:
        devs = [Dev(x) for x in durs]
        sim = Sim(BSP(samples_of(devs), seed=seed, participation=0.3), devs, 8).run()
        return [ds for _, ds in sim.rounds()]

    durs = [1.0 + 0.37 * d for d in range(10)]
    a = chosen(11, durs)
    assert a == chosen(11, durs)
    assert a != chosen(12, durs)
    # with every device idle at each round start, speeds do not change the draws
    assert a == chosen(11, list(reversed(durs)))


def test_bsp_deadline_drops_straggler_and_ignores_its_late_update():
    # device 2 needs 10 s, the deadline is 3 s after each round's start
    devs = [Dev(1.0), Dev(2.0), Dev(10.0)]
    sim = Sim(BSP(samples_of(devs), deadline_s=3.0), devs, max_versions=6).run()
    # round 1 closes at the deadline (3); rounds 2-5 have only devices 0, 1 (2 is still
    # busy) and close when both arrived (5, 7, 9, 11); device 2's stale update arrives at
    # 10 and is ignored; round 6 takes it again and drops it at its deadline (14)
    assert [a.time for a in sim.applies] == [3.0, 5.0, 7.0, 9.0, 11.0, 14.0]
    for ap in sim.applies:
        assert ap.mode == "aggregate" and [d for d, _, _ in ap.items] == [0, 1]
    assert sim.dropped == [(3.0, 2), (14.0, 2)]
    assert (10.0, 2, 0) in sim.arrivals
    assert sim.dispatched(2) == [0.0, 11.0]  # never while its first task was running
    assert sim.rounds()[1:3] == [(3.0, [0, 1]), (5.0, [0, 1])]


def test_bsp_arrival_on_the_deadline_counts():
    devs = [Dev(1.0), Dev(3.0)]
    sim = Sim(BSP(samples_of(devs), deadline_s=3.0), devs, max_versions=2).run()
    assert sim.dropped == []
    assert [(a.time, [d for d, _, _ in a.items]) for a in sim.applies] == [
        (3.0, [0, 1]),
        (6.0, [0, 1]),
    ]


def test_bsp_lost_device_does_not_hang_the_round():
    # device 2 goes offline at 1.5 s, in the middle of its first task
    devs = [Dev(1.0), Dev(2.0), Dev(3.0, offline=((1.5, 100.0),))]
    sim = Sim(BSP(samples_of(devs)), devs, max_versions=3).run()
    assert [a.time for a in sim.applies] == [2.0, 4.0, 6.0]
    assert all([d for d, _, _ in a.items] == [0, 1] for a in sim.applies)
    assert sim.dispatched(2) == [0.0]


def test_bsp_round_whose_devices_are_all_lost_restarts_when_they_return():
    devs = [Dev(5.0, offline=((1.0, 2.0),)), Dev(5.0, offline=((1.0, 2.5),))]
    sim = Sim(BSP(samples_of(devs), min_devices=2), devs, max_versions=1).run()
    # both lost at 1 s: the round closes with nothing to apply; with min_devices = 2 the next
    # starts when device 1 is back too, at 2.5 s
    assert sim.rounds() == [(0.0, [0, 1]), (2.5, [0, 1])]
    assert [(a.time, a.items) for a in sim.applies] == [(7.5, [(0, 1, 0), (1, 1, 0)])]


def test_bsp_waits_for_min_devices_then_starts_on_online():
    devs = [Dev(1.0), Dev(1.0), Dev(1.0, offline=((0.0, 5.0),)), Dev(1.0, offline=((0.0, 7.0),))]
    sim = Sim(BSP(samples_of(devs), min_devices=3), devs, max_versions=3).run()
    assert sim.rounds() == [(5.0, [0, 1, 2]), (6.0, [0, 1, 2]), (7.0, [0, 1, 2, 3])]
    assert [a.time for a in sim.applies] == [6.0, 7.0, 8.0]


# -- SSP / ASP ----------------------------------------------------------------------------
@pytest.mark.parametrize("s", [0, 1, 2, 4])
def test_ssp_staleness_bound_holds_after_every_event(s):
    devs = [Dev(x, samples=10 + d) for d, x in enumerate(SPREAD)]
    leads: list[int] = []

    def on_dispatch(sim: Sim, d: int) -> None:
        lead = sim.applied[d] - min(sim.applied.values())
        assert lead <= s, f"device {d} starts {lead} updates ahead at t={sim.now}"
        leads.append(lead)

    def on_event(sim: Sim, ev: tuple) -> None:
        slow = min(sim.applied.values())
        assert max(sim.applied.values()) - slow <= s + 1
        # no needless blocking: an idle device is one that may not start
        for d in range(len(devs)):
            if d not in sim.inflight and sim.version < sim.max_versions:
                assert sim.applied[d] - slow > s, f"device {d} idle at t={sim.now}"

    sim = Sim(
        SSP(samples_of(devs), staleness=s), devs, 150, on_dispatch=on_dispatch, on_event=on_event
    ).run()
    assert sim.version == 150 and not sim.stuck
    assert max(leads) == s  # the bound is used, not just respected
    assert sim.applied == sim.policy.clock
    assert all(a.mode == "terms" and len(a.items) == 1 for a in sim.applies)


@pytest.mark.parametrize("delta_fn", [fixed_delta, pulling_delta])
def test_ssp_zero_equals_bsp(delta_fn):
    devs = [Dev(x, samples=n) for x, n in zip([1.0, 2.5, 4.0, 10.0], [5, 10, 20, 40])]
    rounds = 5
    bsp = Sim(BSP(samples_of(devs)), devs, rounds, delta_fn=delta_fn).run()
    ssp = Sim(SSP(samples_of(devs), staleness=0), devs, rounds * 4, delta_fn=delta_fn).run()
    np.testing.assert_allclose(ssp.model, bsp.model, rtol=1e-12, atol=1e-14)
    # every device's task r starts from the model holding all updates of "round" r - 1
    assert sorted((d, task, v) for _, d, task, v in ssp.dispatches) == [
        (d, r, 4 * r) for d in range(4) for r in range(rounds)
    ]
    w = weights_of(devs)
    for ap in ssp.applies:
        assert ap.coefs == pytest.approx([w[ap.items[0][0]]], rel=1e-15)


def test_ssp_weights_equal_or_by_samples():
    devs = [Dev(1.0, 1), Dev(2.0, 3)]
    by_samples = Sim(SSP(samples_of(devs), staleness=2), devs, 3).run()
    assert [(a.items[0][0], a.coefs) for a in by_samples.applies] == [
        (0, [0.25]),
        (0, [0.25]),
        (1, [0.75]),
    ]
    equal = Sim(SSP(samples_of(devs), staleness=2, equal_weights=True), devs, 3).run()
    assert [a.coefs for a in equal.applies] == [[0.5], [0.5], [0.5]]


def test_asp_never_blocks():
    devs = [Dev(x) for x in SPREAD]

    def on_event(sim: Sim, ev: tuple) -> None:
        if sim.version < sim.max_versions:
            assert len(sim.inflight) == len(devs)  # every device is always training

    pol = SSP(samples_of(devs), staleness=None)
    assert pol.name == "asp"
    sim = Sim(pol, devs, 200, on_event=on_event).run()
    # each device's dispatches follow each other back to back
    for d, x in enumerate(SPREAD):
        ts = sim.dispatched(d)
        np.testing.assert_allclose(np.diff(ts), x)
    assert max(sim.applied.values()) - min(sim.applied.values()) > 50


def test_ssp_lost_device_rejoins_at_the_slowest_active_clock():
    # device 2 loses its first task at 0.5 s (offline until 10.5 s); 0 and 1 go on alone
    devs = [Dev(1.0), Dev(1.0), Dev(1.0, offline=((0.5, 10.5),))]
    seen = {}

    def on_event(sim: Sim, ev: tuple) -> None:
        if ev[1] == ONLINE:
            seen["clock"] = dict(sim.policy.clock)

    sim = Sim(SSP(samples_of(devs), staleness=2), devs, 40, on_event=on_event).run()
    # at 10.5 s devices 0 and 1 have 10 updates each: device 2 rejoins with clock 10
    assert seen["clock"] == {0: 10, 1: 10, 2: 10}
    assert 11.0 in sim.dispatched(0) and 11.0 in sim.dispatched(1)  # not held back


def test_ssp_device_offline_from_the_start_does_not_hold_others_back():
    devs = [Dev(1.0), Dev(1.0), Dev(1.0, offline=((0.0, 10.5),))]
    sim = Sim(SSP(samples_of(devs), staleness=1), devs, 30).run()
    assert sim.dispatched(0)[:11] == [float(t) for t in range(11)]
    assert sim.dispatched(2)[0] == 10.5


def test_ssp_device_crashing_while_idle_does_not_deadlock():
    # s = 1: device 0 is blocked (clock 2, slowest 0) when it crashes at 3 s
    devs = [Dev(1.0, crash=3.0), Dev(1.0), Dev(5.0)]
    sim = Sim(SSP(samples_of(devs), staleness=1), devs, 30).run()
    assert sim.dispatched(0) == [0.0, 1.0]
    assert not sim.stuck and sim.version == 30


def test_ssp_state_dict_round_trip():
    devs = [Dev(x) for x in SPREAD]
    sim = Sim(SSP(samples_of(devs), staleness=2), devs, 17).run()
    fresh = SSP(samples_of(devs), staleness=2)
    fresh.load_state_dict(sim.policy.state_dict())
    assert fresh.clock == sim.policy.clock and fresh.draws == sim.policy.draws


# -- FedBuff ------------------------------------------------------------------------------
def test_fedbuff_hand_checked():
    devs = [Dev(1.0), Dev(3.0)]
    sim = Sim(FedBuff(samples_of(devs), k=2), devs, 4).run()
    h = 0.5 / math.sqrt(2.0)
    assert [(a.time, a.mode, a.items) for a in sim.applies] == [
        (2.0, "terms", [(0, 0, 0), (0, 1, 0)]),
        (3.0, "terms", [(0, 2, 0), (1, 0, 1)]),
        # device 0's task 3 left at 3 s before device 1's arrival completed version 2
        (5.0, "terms", [(0, 3, 1), (0, 4, 0)]),
        (6.0, "terms", [(0, 5, 0), (1, 1, 1)]),
    ]
    assert [a.coefs for a in sim.applies] == [[0.5, 0.5], [0.5, h], [h, 0.5], [0.5, h]]
    fd = fixed_delta
    expect = 0.5 * (fd(0, 0, None) + fd(0, 1, None) + fd(0, 2, None)) + h * fd(1, 0, None)
    np.testing.assert_allclose(sim.models[2], expect, rtol=1e-13)


@pytest.mark.parametrize(
    "n, participation, min_devices, conc",
    [(8, 0.5, 1, 4), (10, 0.3, 1, 3), (8, 0.1, 3, 3), (5, 1.0, 1, 5), (4, 0.1, 1, 1)],
)
@pytest.mark.parametrize("k", [1, 3])
def test_fedbuff_every_k_arrivals_and_concurrency(n, participation, min_devices, conc, k):
    rng = np.random.default_rng(n + k)
    devs = [Dev(float(x)) for x in rng.uniform(1.0, 10.0, n)]
    pol = FedBuff(
        samples_of(devs), seed=3, participation=participation, min_devices=min_devices, k=k
    )
    assert pol.concurrency() == conc

    def on_event(sim: Sim, ev: tuple) -> None:
        if sim.version < sim.max_versions:
            assert len(sim.inflight) == conc
        # an apply happens exactly when the arrival count reaches a multiple of K
        assert len(sim.applies) == len(sim.arrivals) // k

    sim = Sim(pol, devs, 25, on_event=on_event).run()
    assert sim.version == 25 and sim.max_busy == conc
    for ap in sim.applies:
        assert len(ap.items) == k
        want = [1.0 / (k * math.sqrt(1.0 + st)) for _, _, st in ap.items]
        assert ap.coefs == pytest.approx(want, rel=1e-15)
    if conc > 1:  # with one device at a time every update is fresh
        assert any(st > 0 for ap in sim.applies for _, _, st in ap.items)


# -- FedAsync -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn, alpha, a_exp, b, staleness, expected",
    [
        ("constant", 0.6, 0.5, 4, 0, 0.6),
        ("constant", 0.6, 0.5, 4, 7, 0.6),
        ("polynomial", 0.6, 0.5, 4, 0, 0.6),
        ("polynomial", 0.6, 0.5, 4, 3, 0.3),  # 0.6 / sqrt(4)
        ("polynomial", 0.6, 0.5, 4, 8, 0.2),  # 0.6 / sqrt(9)
        ("polynomial", 0.5, 1.0, 4, 4, 0.1),  # 0.5 / 5
        ("hinge", 0.6, 0.5, 4, 0, 0.6),
        ("hinge", 0.6, 0.5, 4, 4, 0.6),  # up to b: full weight
        ("hinge", 0.6, 0.5, 4, 5, 0.4),  # 0.6 / (0.5 * 1 + 1)
        ("hinge", 0.6, 0.5, 4, 6, 0.3),  # 0.6 / (0.5 * 2 + 1)
        ("hinge", 0.6, 0.5, 4, 10, 0.15),  # 0.6 / (0.5 * 6 + 1)
        ("hinge", 0.9, 10.0, 2, 3, 0.9 / 11),
    ],
)
def test_fedasync_mixing_hand_computed(fn, alpha, a_exp, b, staleness, expected):
    pol = FedAsync({0: 1}, alpha=alpha, fn=fn, a_exp=a_exp, b=b)
    assert pol.mixing(staleness) == pytest.approx(expected, rel=1e-14)


def test_fedasync_in_the_driver():
    devs = [Dev(1.0), Dev(3.0)]
    sim = Sim(FedAsync(samples_of(devs), alpha=0.5, fn="polynomial", a_exp=0.5), devs, 4).run()
    # device 1's first update (from version 0) arrives at 3 s after 3 versions: 0.5 / 2
    assert [(a.time, a.mode, a.items, a.coefs) for a in sim.applies] == [
        (1.0, "mix", [(0, 0, 0)], [0.5]),
        (2.0, "mix", [(0, 1, 0)], [0.5]),
        (3.0, "mix", [(0, 2, 0)], [0.5]),
        (3.0, "mix", [(1, 0, 3)], [0.25]),
    ]
    fd = fixed_delta
    x1 = 0.5 * fd(0, 0, None)
    x2 = 0.5 * x1 + 0.5 * (x1 + fd(0, 1, None))
    np.testing.assert_allclose(sim.models[2], x2, rtol=1e-14)
    x3 = 0.5 * x2 + 0.5 * (x2 + fd(0, 2, None))
    np.testing.assert_allclose(sim.models[4], 0.75 * x3 + 0.25 * fd(1, 0, None), rtol=1e-13)


def test_fedasync_concurrency():
    devs = [Dev(1.0 + d) for d in range(8)]
    pol = FedAsync(samples_of(devs), participation=0.25, alpha=0.5)

    def on_event(sim: Sim, ev: tuple) -> None:
        if sim.version < sim.max_versions:
            assert len(sim.inflight) == 2

    sim = Sim(pol, devs, 20, on_event=on_event).run()
    assert sim.version == 20 and len(sim.arrivals) == 20


# -- make_consistency ---------------------------------------------------------------------
def _cfg(**alg) -> dict:
    cfg = defaults()
    cfg["algorithm"].update(alg)
    return cfg


SAMPLES = {0: 10, 1: 20, 2: 30}


def test_make_consistency_bsp():
    cfg = _cfg(consistency="bsp")
    cfg["seed"] = 42
    cfg["server"].update(participation=0.5, min_devices=2, deadline_s=7.5)
    pol = make_consistency(cfg, SAMPLES)
    assert type(pol) is BSP and pol.name == "bsp"
    assert (pol.seed, pol.participation, pol.min_devices, pol.deadline_s) == (42, 0.5, 2, 7.5)
    assert pol.samples == SAMPLES


@pytest.mark.parametrize("agg, equal", [("sample-weighted", False), ("mean", True)])
def test_make_consistency_ssp_and_asp(agg, equal):
    pol = make_consistency(_cfg(consistency="ssp", staleness=3, aggregation=agg), SAMPLES)
    assert type(pol) is SSP and pol.name == "ssp" and pol.s == 3 and pol.equal is equal
    pol = make_consistency(_cfg(consistency="asp", aggregation=agg), SAMPLES)
    assert type(pol) is SSP and pol.name == "asp" and pol.s is None and pol.equal is equal


def test_make_consistency_fedbuff_and_fedasync():
    cfg = _cfg(consistency="fedbuff", buffer_k=6)
    cfg["server"]["participation"] = 0.4
    pol = make_consistency(cfg, SAMPLES)
    assert type(pol) is FedBuff and pol.k == 6 and pol.participation == 0.4
    cfg = _cfg(
        consistency="fedasync",
        fedasync_alpha=0.3,
        fedasync_fn="hinge",
        fedasync_a=2.0,
        fedasync_b=1,
    )
    pol = make_consistency(cfg, SAMPLES)
    assert type(pol) is FedAsync
    assert (pol.alpha, pol.fn, pol.a_exp, pol.b) == (0.3, "hinge", 2.0, 1)
    assert pol.mixing(3) == pytest.approx(0.3 / (2.0 * 2 + 1))


def test_make_consistency_defaults_and_clamp():
    cfg = defaults()
    cfg["server"]["min_devices"] = 10
    pol = make_consistency(cfg, SAMPLES)
    assert pol.name == cfg["algorithm"]["consistency"] == "bsp"
    assert pol.min_devices == 3  # clamped to the fleet size
    for name in POLICIES:
        assert make_consistency(_cfg(consistency=name), SAMPLES).name == name


def test_make_consistency_unknown_name():
    with pytest.raises(ConfigError, match=r"'algorithm\.consistency' = 'bulk'.*bsp"):
        make_consistency(_cfg(consistency="bulk"), SAMPLES)
