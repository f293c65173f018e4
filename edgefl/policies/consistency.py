"""Consistency policies: when devices start work and when their updates reach the model.

Pure coordinator-side logic (no MPI, no clock): the runtime feeds a policy the events it
processes, in time order, and carries out the :class:`Decision` the policy returns. The same
policy runs under the virtual clock (``edgefl simulate``) and the wall clock (``edgefl run``).

Terms used throughout:

- *version*: the number of times the global model changed so far.
- *task*: one dispatch of a device: it downloads the model of the current version, trains,
  and uploads its delta. Its *staleness* when applied is the version then minus the version
  it started from.
- *clock* (SSP): the number of updates a device has had applied (the parameter-server
  paper's per-worker logical clock; Li et al., OSDI 2014, section 3.4).

Policies (Li et al.'s bounded delay covers the first three):

- ``bsp``: rounds. A sample of the available devices trains; the round ends when all of
  them reported (or dropped out, or the deadline passed: stragglers are then dropped); their
  updates are aggregated together into one new version.
- ``ssp`` (staleness bound s): every device works continuously; each update is applied as
  it arrives, weighted as in FedAvg (its share of all samples); a device may start its next
  task only while its clock is at most s ahead of the slowest active device's. s = 0 is
  BSP: each device waits until every active device caught up, so each task starts from the
  model holding every update of the previous "round".
- ``asp``: SSP without a bound.
- ``fedbuff`` (Nguyen et al., AISTATS 2022): a fixed number of devices train concurrently;
  every K arrivals are averaged, each delta scaled by 1/sqrt(1 + staleness), into one new
  version.
- ``fedasync`` (Xie, Koyejo, Gupta, 2019): each arrival is mixed in at once:
  x <- (1 - a) x + a x_new with a = alpha * s(staleness), s constant, polynomial
  (1 + staleness)^-a_exp or hinge (1 if staleness <= b else 1 / (a_exp (staleness - b) + 1)).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..seeding import derive_seed

SAMPLE_STREAM = 2  # the derive_seed purpose used for participant sampling (seeding.SAMPLE)
POISSON_DRAW = 0x905  # after SAMPLE_STREAM in the key of a Poisson draw (dp.sampling)

DP_SAMPLINGS = ("fixed", "poisson")  # dp.sampling


def sample_size(devices: int, participation: float, min_devices: int = 1) -> int:
    """Devices a BSP round draws (and FedBuff / FedAsync keep busy): ``round(q N)`` with
    halves rounded up, at least ``min_devices``, at most N (``devices``)."""
    return min(devices, max(min_devices, math.floor(participation * devices + 0.5)))


@dataclass
class Arrival:
    """An update that reached the coordinator.

    Args:
        device: device id.
        task: the device's task number (0, 1, ...).
        base_version: the model version the task started from.
        samples: the device's training samples (its FedAvg weight).
        loss: mean local training loss of the task.
        delta: local model minus the model it started from (float32).
        time_s: when it arrived (virtual or wall seconds since the start).
        seconds: how long the task took (virtual or measured seconds).
        msg: the message it came in (the runtime releases its buffer after the apply).

    It is also what aggregators combine (the fields of
    :class:`~edgefl.policies.aggregation.Update`: ``device``, ``delta``, ``samples``,
    ``loss``, ``round``): the runtime hands arrivals to them as they are.
    """

    device: int
    task: int
    base_version: int
    samples: int
    loss: float
    delta: np.ndarray
    time_s: float = 0.0
    seconds: float = 0.0
    msg: Any = field(default=None, repr=False, compare=False)

    @property
    def round(self) -> int:
        """The task number (orders a device's updates, as ``Update.round`` does)."""
        return self.task


@dataclass
class Apply:
    """One change of the global model.

    ``mode`` says how: ``aggregate`` (the configured aggregator combines ``arrivals``;
    the server step is then applied), ``terms`` (global += server_lr * sum(coef_i *
    delta_i), the coefficients in ``coefs``), or ``mix`` (FedAsync: x <- (1 - a) x +
    a (x_base + delta), a = ``coefs[0]``, one arrival).
    """

    mode: str
    arrivals: list[Arrival]
    coefs: list[float] = field(default_factory=list)


@dataclass
class Decision:
    """What the runtime must do after an event.

    Args:
        apply: a model change to make first (None: none).
        dispatch: devices to start a task for, now, from the (new) current model.
        dropped: devices whose in-flight task no longer counts (their update, when it
            arrives, is discarded).
        timer: (time in seconds, token) to be called back at via :meth:`Consistency.timer`.
    """

    apply: Apply | None = None
    dispatch: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    timer: tuple[float, int] | None = None


Available = Callable[[int], bool]  # device -> may it start a task now (online, alive, idle)


class Consistency(ABC):
    """Base class. ``samples`` maps every device id to its number of training samples.

    Args:
        samples: device id -> training samples.
        seed: run seed (participant sampling derives from it).
        participation: fraction of the devices that train at once (BSP: per round; FedBuff
            / FedAsync: concurrency), in (0, 1]. Default 1.0.
        min_devices: fewest devices a BSP round starts with / concurrency floor. Default 1.
    """

    name = "abstract"

    def __init__(
        self,
        samples: dict[int, int],
        seed: int = 0,
        participation: float = 1.0,
        min_devices: int = 1,
    ) -> None:
        self.samples = dict(sorted(samples.items()))
        self.devices = list(self.samples)
        self.seed = seed
        self.participation = participation
        self.min_devices = min_devices
        self.total_samples = sum(self.samples.values())
        self.busy: set[int] = set()
        self.draws = 0

    # -- events -----------------------------------------------------------------------
    @abstractmethod
    def start(self, now: float, available: Available) -> Decision:
        """The first decision of a run (or of a resumed run)."""

    @abstractmethod
    def arrived(self, a: Arrival, version: int, now: float, available: Available) -> Decision:
        """An update arrived; ``version`` is the current model version."""

    def lost(self, device: int, now: float, available: Available) -> Decision:
        """``device``'s task will never report (it went offline or died)."""
        self.busy.discard(device)
        return self._refill(now, available)

    def online(self, device: int, now: float, available: Available) -> Decision:
        """``device`` became available again (back online or idle)."""
        return self._refill(now, available)

    def timer(self, token: int, now: float, available: Available) -> Decision:
        """A timer asked for in a Decision fired."""
        return Decision()

    # -- helpers ----------------------------------------------------------------------
    def concurrency(self) -> int:
        return sample_size(len(self.devices), self.participation, self.min_devices)

    def _pick(self, candidates: list[int], k: int) -> list[int]:
        """``k`` of ``candidates`` (sorted), deterministic in the seed and the draw count."""
        self.draws += 1
        if k >= len(candidates):
            return sorted(candidates)
        rng = np.random.default_rng(derive_seed(self.seed, -1, self.draws, SAMPLE_STREAM))
        return sorted(int(d) for d in rng.choice(sorted(candidates), size=k, replace=False))

    def _refill(self, now: float, available: Available) -> Decision:
        """Start idle available devices until ``concurrency()`` are busy."""
        want = self.concurrency() - len(self.busy)
        if want <= 0:
            return Decision()
        idle = [d for d in self.devices if d not in self.busy and available(d)]
        chosen = self._pick(idle, want) if idle else []
        self.busy.update(chosen)
        return Decision(dispatch=chosen)

    def weight(self, device: int) -> float:
        """The device's FedAvg share of all samples."""
        return self.samples[device] / max(self.total_samples, 1)

    def state_dict(self) -> dict:
        """The policy's state as plain JSON values (the runtime stores
        ``json.dumps(policy.state_dict())`` in its checkpoints); subclasses add theirs.

        Configuration (devices, samples, seed, participation, min_devices and the
        subclass's options) is not state: a restored policy is built with the same
        arguments first, then given the state with :meth:`load_state_dict`.
        """
        return {"draws": self.draws, "busy": _busy_state(self.busy)}

    def load_state_dict(self, st: dict) -> None:
        """Restore what :meth:`state_dict` returned (missing keys keep their defaults)."""
        self.draws = int(st.get("draws", 0))
        self.busy = {int(d) for d in st.get("busy", [])}

    def forget_tasks(self) -> None:
        """No task is out any more (they are restarted, e.g. after a resume from a state
        taken while tasks were in flight): the next :meth:`start` may use every device."""
        self.busy.clear()
        if hasattr(self, "pending"):
            self.pending = set()


class BSP(Consistency):
    """Bulk-synchronous rounds with participation sampling and an optional deadline.

    Args:
        deadline_s: seconds after a round's start at which it closes without the devices
            still training (0 = wait for all). Default 0.
        dp_sampling: None (default, no DP): a round draws ``concurrency()`` of the idle
            available devices. With client-level DP, the draw the accountant assumes
            (``dp.sampling``, docs/robustness.md): ``"fixed"``, ``concurrency()`` of *all*
            the devices without replacement (the same draw as without DP while every device
            is idle and available); ``"poisson"``, every device independently with
            probability ``participation``. A drawn device that is busy, offline or dead sits
            the round out. A round that ends without any update (none of the draw could
            train, or all were lost) is still applied, with no arrivals (the DP aggregator
            releases its noise alone), so that every draw is one accounted step.
        (others: see :class:`Consistency`)
    """

    name = "bsp"

    def __init__(self, samples, seed=0, participation=1.0, min_devices=1, deadline_s=0.0,
                 dp_sampling=None):  # fmt: skip
        super().__init__(samples, seed, participation, min_devices)
        if dp_sampling not in (None, *DP_SAMPLINGS):
            raise ConfigError(
                f"config key 'dp.sampling' = {dp_sampling!r}: expected one of "
                f"{', '.join(DP_SAMPLINGS)}"
            )
        self.dp_sampling = dp_sampling
        self.deadline_s = deadline_s
        self.round = 0
        self.pending: set[int] = set()
        self.buffer: list[Arrival] = []
        self.open = False

    def start(self, now: float, available: Available) -> Decision:
        return self._new_round(now, available)

    def _new_round(self, now: float, available: Available) -> Decision:
        idle = [d for d in self.devices if d not in self.busy and available(d)]
        if len(idle) < min(self.min_devices, len(self.devices)):
            self.open = False  # wait for devices to come back (online / idle events)
            return Decision()
        chosen = self._draw(idle)
        self.round += 1
        self.pending = set(chosen)
        self.buffer = []
        self.busy.update(chosen)
        self.open = True
        timer = (now + self.deadline_s, self.round) if self.deadline_s > 0 else None
        if not chosen:  # (DP draws only) nobody of the draw can train: close it at once
            timer = (now, self.round)
        return Decision(dispatch=chosen, timer=timer)

    def _draw(self, idle: list[int]) -> list[int]:
        """The devices of a new round among ``idle`` (see ``dp_sampling``)."""
        if self.dp_sampling is None:
            return self._pick(idle, self.concurrency())
        if self.dp_sampling == "fixed":
            drawn = self._pick(self.devices, self.concurrency())
        else:
            drawn = self._poisson()
        free = set(idle)
        return [d for d in drawn if d in free]

    def _poisson(self) -> list[int]:
        """Every device independently with probability ``participation`` (sorted),
        deterministic in the seed and the draw count."""
        self.draws += 1
        key = derive_seed(self.seed, -1, self.draws, SAMPLE_STREAM, POISSON_DRAW)
        keep = np.random.default_rng(key).random(len(self.devices)) < self.participation
        return [d for d, k in zip(self.devices, keep.tolist()) if k]

    def arrived(self, a: Arrival, version: int, now: float, available: Available) -> Decision:
        self.busy.discard(a.device)
        if a.device not in self.pending:  # a dropped straggler finished: it is idle now
            return self._maybe_restart(now, available)
        self.pending.discard(a.device)
        self.buffer.append(a)
        return self._maybe_close(now, available)

    def lost(self, device: int, now: float, available: Available) -> Decision:
        self.busy.discard(device)
        self.pending.discard(device)
        if not self.open:
            return self._maybe_restart(now, available)
        return self._maybe_close(now, available)

    def online(self, device: int, now: float, available: Available) -> Decision:
        return self._maybe_restart(now, available)

    def timer(self, token: int, now: float, available: Available) -> Decision:
        if token != self.round or not self.open:
            return Decision()
        if not self.pending and self.dp_sampling is None:
            return Decision()
        dropped = sorted(self.pending)
        self.pending = set()
        d = self._close(now, available)
        d.dropped = dropped
        return d

    def _maybe_restart(self, now: float, available: Available) -> Decision:
        return self._new_round(now, available) if not self.open else Decision()

    def _maybe_close(self, now: float, available: Available) -> Decision:
        if self.pending:
            return Decision()
        return self._close(now, available)

    def _close(self, now: float, available: Available) -> Decision:
        got = sorted(self.buffer, key=lambda a: a.device)
        self.buffer = []
        self.open = False
        nxt = self._new_round(now, available)
        if got or self.dp_sampling is not None:  # (with DP, every draw is a step)
            nxt.apply = Apply("aggregate", got)
        return nxt

    def state_dict(self) -> dict:
        """Also the round, its devices still out (``pending``) and whether it is open. Its
        buffer is empty whenever the runtime checkpoints (right after an apply)."""
        return {**super().state_dict(), "round": self.round, "open": self.open,
                "pending": _busy_state(self.pending)}  # fmt: skip

    def load_state_dict(self, st: dict) -> None:
        super().load_state_dict(st)
        self.round = int(st.get("round", 0))
        self.open = bool(st.get("open", False))
        self.pending = {int(d) for d in st.get("pending", [])}


class SSP(Consistency):
    """Stale-synchronous parallel with staleness bound ``staleness`` (None = ASP).

    Every device trains continuously (participation does not apply); each arrival is
    applied at once with its FedAvg share of all samples as coefficient (``mean``
    aggregation: 1/N each).

    Args:
        staleness: s >= 0, or None for no bound (ASP).
        equal_weights: weigh every device 1/N instead of by samples. Default False.
    """

    def __init__(self, samples, seed=0, participation=1.0, min_devices=1, staleness=4,
                 equal_weights=False):  # fmt: skip
        super().__init__(samples, seed, 1.0, min_devices)
        self.s = staleness
        self.name = "asp" if staleness is None else "ssp"
        self.equal = equal_weights
        self.clock = {d: 0 for d in self.devices}
        self.active: set[int] = set(self.devices)  # not known offline / dead

    def start(self, now: float, available: Available) -> Decision:
        return self._release(now, available)

    def _slowest(self) -> int:
        act = [self.clock[d] for d in self.active]
        return min(act) if act else 0

    def _may_start(self, d: int) -> bool:
        return self.s is None or self.clock[d] - self._slowest() <= self.s

    def _release(self, now: float, available: Available) -> Decision:
        go = []
        for d in self.devices:
            if d in self.busy:
                continue
            if not available(d):
                self.active.discard(d)  # offline or dead: does not hold the others back
                continue
            if d not in self.active:  # rejoining: catch up with the slowest active device
                self.clock[d] = max(self.clock[d], self._slowest())
                self.active.add(d)
            if self._may_start(d):
                go.append(d)
        self.busy.update(go)
        return Decision(dispatch=go)

    def arrived(self, a: Arrival, version: int, now: float, available: Available) -> Decision:
        self.busy.discard(a.device)
        self.clock[a.device] += 1
        coef = 1.0 / len(self.devices) if self.equal else self.weight(a.device)
        d = self._release(now, available)
        d.apply = Apply("terms", [a], [coef])
        return d

    def lost(self, device: int, now: float, available: Available) -> Decision:
        self.busy.discard(device)
        self.active.discard(device)
        return self._release(now, available)

    def online(self, device: int, now: float, available: Available) -> Decision:
        return self._release(now, available)

    def state_dict(self) -> dict:
        clock = {str(k): v for k, v in self.clock.items()}
        return {**super().state_dict(), "clock": clock, "active": _busy_state(self.active)}

    def load_state_dict(self, st: dict) -> None:
        super().load_state_dict(st)
        if "active" in st:
            self.active = {int(d) for d in st["active"]}
        for k, v in st.get("clock", {}).items():
            if int(k) in self.clock:
                self.clock[int(k)] = int(v)


def _busy_state(busy: set[int]) -> list[int]:
    return sorted(int(d) for d in busy)


class FedBuff(Consistency):
    """Buffered asynchronous aggregation: apply the mean of every K arrivals, each scaled
    by 1/sqrt(1 + staleness).

    Args:
        k: buffer size K >= 1. Default 4.
        (participation sets how many devices train at once)

    State (:meth:`state_dict`): the draw count, the busy devices and the buffered
    arrivals. K and the concurrency (from participation, min_devices and the devices) are
    configuration.
    """

    name = "fedbuff"

    def __init__(self, samples, seed=0, participation=1.0, min_devices=1, k=4):
        super().__init__(samples, seed, participation, min_devices)
        self.k = k
        self.buffer: list[tuple[Arrival, int]] = []  # (arrival, staleness when it arrived)

    def start(self, now: float, available: Available) -> Decision:
        """The first decision of a run or of a resumed run: no task is in flight then, so
        the busy set (restored by :meth:`load_state_dict`) is cleared first."""
        self.busy.clear()
        return self._refill(now, available)

    def state_dict(self) -> dict:
        """Plain JSON values: ``draws``, ``busy`` (sorted device ids) and ``buffer``.

        ``buffer`` lists the buffered arrivals in arrival order, each by its identifying
        fields only: ``{"device", "task", "base_version", "samples", "loss", "time_s",
        "staleness"}`` (``staleness``: the version at arrival minus ``base_version``, the
        one value that cannot be recomputed later). The deltas are not part of the state:
        the caller keeps them (keyed by ``(device, task)``, see :meth:`buffered_tasks`) and
        hands them back to :meth:`load_state_dict`.
        """
        return {
            **super().state_dict(),
            "buffer": [
                {
                    "device": int(a.device),
                    "task": int(a.task),
                    "base_version": int(a.base_version),
                    "samples": int(a.samples),
                    "loss": float(a.loss),
                    "time_s": float(a.time_s),
                    "staleness": int(s),
                }
                for a, s in self.buffer
            ],
        }

    @staticmethod
    def buffered_tasks(st: dict) -> list[tuple[int, int]]:
        """``(device, task)`` of every buffered arrival in a :meth:`state_dict`, in buffer
        order: the deltas :meth:`load_state_dict` needs to restore the buffer."""
        return [(int(e["device"]), int(e["task"])) for e in st.get("buffer", [])]

    def load_state_dict(
        self, st: dict, deltas: Mapping[tuple[int, int], np.ndarray] | None = None
    ) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            st: the state (older states without ``busy`` / ``buffer`` load as empty ones).
            deltas: ``(device, task)`` -> the delta of that buffered arrival (used as
                given, not copied), for every entry of :meth:`buffered_tasks`; KeyError
                naming the arrival when one is missing. None (a resume from a checkpoint,
                which holds no deltas): the buffered arrivals are dropped, as if they had
                been lost; their devices are idle, not busy, and get new tasks.
        """
        super().load_state_dict(st)
        self.buffer = []
        if deltas is None:
            return
        for e in st.get("buffer", []):
            key = (int(e["device"]), int(e["task"]))
            if key not in deltas:
                raise KeyError(f"FedBuff state: no delta for the buffered arrival {key}")
            a = Arrival(
                key[0],
                key[1],
                int(e["base_version"]),
                int(e["samples"]),
                float(e["loss"]),
                deltas[key],
                float(e["time_s"]),
            )
            self.buffer.append((a, int(e["staleness"])))

    def arrived(self, a: Arrival, version: int, now: float, available: Available) -> Decision:
        self.busy.discard(a.device)
        self.buffer.append((a, version - a.base_version))
        d = self._refill(now, available)
        if len(self.buffer) >= self.k:
            arr = [x for x, _ in self.buffer]
            coefs = [1.0 / (len(arr) * math.sqrt(1.0 + s)) for _, s in self.buffer]
            self.buffer = []
            d.apply = Apply("terms", arr, coefs)
        return d


class FedAsync(Consistency):
    """Asynchronous mixing x <- (1 - a) x + a x_new, a = alpha * s(staleness).

    Args:
        alpha: base mixing weight in (0, 1]. Default 0.6.
        fn: staleness function: constant, polynomial or hinge. Default polynomial.
        a_exp: the exponent / slope ``a`` of polynomial and hinge. Default 0.5.
        b: the hinge's free staleness ``b``. Default 4.

    State (:meth:`state_dict`): the draw count and the busy devices; every arrival is
    applied at once, so nothing else is held between events. The mixing options and the
    concurrency are configuration.
    """

    name = "fedasync"

    def __init__(self, samples, seed=0, participation=1.0, min_devices=1, alpha=0.6,
                 fn="polynomial", a_exp=0.5, b=4):  # fmt: skip
        super().__init__(samples, seed, participation, min_devices)
        self.alpha, self.fn, self.a_exp, self.b = alpha, fn, a_exp, b

    def mixing(self, staleness: int) -> float:
        """alpha * s(staleness)."""
        if self.fn == "constant":
            s = 1.0
        elif self.fn == "polynomial":
            s = (1.0 + staleness) ** (-self.a_exp)
        else:
            s = 1.0 if staleness <= self.b else 1.0 / (self.a_exp * (staleness - self.b) + 1.0)
        return self.alpha * s

    def start(self, now: float, available: Available) -> Decision:
        """The first decision of a run or of a resumed run: no task is in flight then, so
        the busy set (restored by :meth:`load_state_dict`) is cleared first."""
        self.busy.clear()
        return self._refill(now, available)

    def arrived(self, a: Arrival, version: int, now: float, available: Available) -> Decision:
        self.busy.discard(a.device)
        d = self._refill(now, available)
        d.apply = Apply("mix", [a], [self.mixing(version - a.base_version)])
        return d


POLICIES = ("bsp", "ssp", "asp", "fedbuff", "fedasync")


def make_consistency(cfg: dict, samples: dict[int, int]) -> Consistency:
    """Build the policy named by ``algorithm.consistency`` from the effective config."""
    alg, srv = cfg["algorithm"], cfg["server"]
    name = alg["consistency"]
    dp = cfg.get("dp", {})
    sampling = dp.get("sampling", "fixed")
    if sampling not in DP_SAMPLINGS:
        raise ConfigError(
            f"config key 'dp.sampling' = {sampling!r}: expected one of {', '.join(DP_SAMPLINGS)}"
        )
    if sampling == "poisson" and not dp.get("enabled", False):
        raise ConfigError(
            "config key 'dp.sampling' = 'poisson': Poisson participation is the sampling of "
            "client-level DP; it needs dp.enabled = true"
        )
    common = dict(
        samples=samples,
        seed=cfg["seed"],
        participation=srv["participation"],
        min_devices=min(srv["min_devices"], len(samples)),
    )
    equal = alg["aggregation"] == "mean"
    if name == "bsp":
        dp_sampling = sampling if dp.get("enabled", False) else None
        return BSP(**common, deadline_s=srv["deadline_s"], dp_sampling=dp_sampling)
    if name == "ssp":
        return SSP(**common, staleness=alg["staleness"], equal_weights=equal)
    if name == "asp":
        return SSP(**common, staleness=None, equal_weights=equal)
    if name == "fedbuff":
        return FedBuff(**common, k=alg["buffer_k"])
    if name == "fedasync":
        return FedAsync(
            **common,
            alpha=alg["fedasync_alpha"],
            fn=alg["fedasync_fn"],
            a_exp=alg["fedasync_a"],
            b=alg["fedasync_b"],
        )
    raise ConfigError(
        f"config key 'algorithm.consistency' = {name!r}: choose one of {', '.join(POLICIES)}"
    )


__all__ = [
    "Apply",
    "Arrival",
    "BSP",
    "Consistency",
    "Decision",
    "FedAsync",
    "FedBuff",
    "POLICIES",
    "SSP",
    "make_consistency",
    "sample_size",
]
