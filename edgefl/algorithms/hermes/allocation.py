"""Coordinator-side work allocation: how much of its own data each device uses per iteration.

An allocator turns measured iteration times into each device's work for its next iteration:
D, the number of samples it trains on per iteration, and b, its mini-batch size. In federated
terms D is how many of the device's *own* samples it uses per iteration (nothing moves between
devices): a device with 5000 samples and D = 1200 trains E local epochs over a 1200-sample
subset, and the runtime should walk through its data in consecutive D-sized chunks (wrapping
around), as the Hermes master hands out consecutive chunks of the training set.

``FixedAllocation`` never changes anything (plain FedAvg: D = the whole local dataset, capped
by memory). ``HermesAllocation`` is the dynamic allocation of Hermes (Basani et al., HiPC 2024,
arXiv:2410.20495, and the authors' public master code): pull every device's iteration time
toward the median of the first measured times, so that no device is a straggler.

Time model (seconds): T = E * D * k / b, with E local epochs, D samples per iteration, b the
batch size and k the seconds one mini-batch step takes on that device (estimated from each
measurement as k = T * b / (E * D), then smoothed). Because k is taken as independent of b,
only D / b (steps per epoch) matters to the prediction; b is therefore left alone unless D hits
a hard limit (see :class:`HermesAllocation`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefl.config import checks
from edgefl.errors import ConfigError

BATCH_LADDER = (2, 4, 8, 16, 32, 64)
TRIGGERS = ("fences", "always")
BATCH_GAIN = 0.01  # a batch-size change must bring the prediction >= 1 % of T* closer


def cv(times: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation of ``times``: population std / mean (dimensionless).

    0 means every device takes the same time. Raises ``ValueError`` for an empty input or a
    non-positive mean.
    """
    t = np.asarray(times, dtype=np.float64).ravel()
    if t.size == 0:
        raise ValueError("cv() needs at least one time")
    m = float(t.mean())
    if not m > 0:
        raise ValueError(f"cv() needs a positive mean, got {m}")
    return float(t.std() / m)


def tukey_fences(values: Sequence[float] | np.ndarray, k: float = 1.5) -> tuple[float, float]:
    """Tukey's fences [Q1 - k * IQR, Q3 + k * IQR] (numpy's linear percentiles)."""
    q1, q3 = np.percentile(np.asarray(values, dtype=np.float64), [25.0, 75.0])
    iqr = q3 - q1
    return float(q1 - k * iqr), float(q3 + k * iqr)


@dataclass(frozen=True)
class Allocation:
    """One device's work per iteration.

    Args:
        samples: D, samples of its own data it trains on per iteration (>= batch).
        batch: b, mini-batch size in samples.
    """

    samples: int
    batch: int


@dataclass
class _Device:
    dataset_size: int
    memory_cap: int | None
    samples: int
    batch: int
    ks: dict[int, float] = field(default_factory=dict)  # batch size -> smoothed k (seconds)
    first_time: float | None = None
    last_time: float | None = None
    measurements: int = 0
    changes: int = 0
    last_dir: int = 0  # sign of the latest change of the predicted time (+1 longer, -1 shorter)

    @property
    def limit(self) -> int:
        """Hard upper bound on D: its dataset size and its memory cap."""
        return min(self.dataset_size, self.memory_cap or self.dataset_size)

    def k_at(self, b: int) -> float | None:
        """Seconds per mini-batch step at batch size ``b``: the smoothed measurement at that b;
        else a line k = k0 + k1 * b (k0, k1 >= 0) fitted to the batch sizes measured; with a
        single one, that k (the paper's model: k does not depend on b)."""
        if not self.ks:
            return None
        if b in self.ks:
            return self.ks[b]
        if len(self.ks) == 1:
            return next(iter(self.ks.values()))
        bs = np.array(sorted(self.ks), dtype=np.float64)
        kv = np.array([self.ks[int(x)] for x in bs])
        slope = float(np.polyfit(bs, kv, 1)[0])
        k1 = max(slope, 0.0)
        k0 = float(kv.mean() - k1 * bs.mean())
        if k0 < 0:  # through the origin: k proportional to b
            k0, k1 = 0.0, float((kv * bs).sum() / (bs * bs).sum())
        return k0 + k1 * b


class Allocator(ABC):
    """Coordinator-side allocation policy over a fleet of devices.

    Register every device with :meth:`add_device`, then feed measured iteration times to
    :meth:`update`, which returns the allocation each measured device should use next.

    Args:
        epochs: local epochs E per iteration (``train.local_epochs``, default 1).
    """

    name = "abstract"

    def __init__(self, epochs: int = 1) -> None:
        epochs = checks.integer("train.local_epochs", epochs)
        if epochs < 1:
            raise ConfigError(f"config key 'train.local_epochs' = {epochs!r}: must be >= 1")
        self.epochs = epochs
        self._dev: dict[int, _Device] = {}

    # ---- fleet -------------------------------------------------------------------------------

    def add_device(
        self,
        device: int,
        dataset_size: int,
        memory_cap: int | None = None,
        samples: int | None = None,
        batch: int = 32,
    ) -> Allocation:
        """Register a device and return its initial allocation.

        Args:
            device: device id.
            dataset_size: samples the device holds (>= 1).
            memory_cap: most samples it can hold for one iteration (None = no cap).
            samples: initial D (default: its whole dataset, capped by ``memory_cap``); clamped
                into [1, min(dataset_size, memory_cap)].
            batch: initial b in samples (``train.batch_size``, default 32; 0 = full batch,
                i.e. b = D); clamped to at most D.
        """
        if device in self._dev:
            raise ValueError(f"device {device} is already registered")
        if int(dataset_size) < 1:
            raise ValueError(f"device {device}: dataset_size must be >= 1, got {dataset_size}")
        if memory_cap is not None and int(memory_cap) < 1:
            raise ValueError(f"device {device}: memory_cap must be >= 1 sample, got {memory_cap}")
        if int(batch) < 0:
            raise ValueError(f"device {device}: batch must be >= 0, got {batch}")
        d = _Device(int(dataset_size), None if memory_cap is None else int(memory_cap), 1, 1)
        s = d.limit if samples is None else min(max(int(samples), 1), d.limit)
        d.samples = s
        d.batch = s if int(batch) == 0 else min(int(batch), s)
        self._dev[int(device)] = d
        return self.allocation(device)

    @property
    def devices(self) -> list[int]:
        """Registered device ids, ascending."""
        return sorted(self._dev)

    def allocation(self, device: int) -> Allocation:
        """The device's current allocation."""
        d = self._dev[int(device)]
        return Allocation(d.samples, d.batch)

    def allocations(self) -> dict[int, Allocation]:
        """Every device's current allocation, by ascending id."""
        return {i: self.allocation(i) for i in self.devices}

    def step_time(self, device: int, batch: int | None = None) -> float | None:
        """Seconds per mini-batch step k of the device at ``batch`` (default: its current b);
        None before a measurement."""
        d = self._dev[int(device)]
        return d.k_at(d.batch if batch is None else int(batch))

    def predicted_time(
        self, device: int, samples: int | None = None, batch: int | None = None
    ) -> float | None:
        """Predicted iteration time E * D * k / b in seconds (None before a measurement)."""
        d = self._dev[int(device)]
        s = d.samples if samples is None else samples
        b = d.batch if batch is None else batch
        k = d.k_at(b)
        return None if k is None else self.epochs * s * k / b

    def last_time(self, device: int) -> float | None:
        """The device's latest measured iteration time in seconds."""
        return self._dev[int(device)].last_time

    # ---- measurements ------------------------------------------------------------------------

    def _record(self, device: int, seconds: float) -> None:
        if device not in self._dev:
            raise KeyError(f"device {device} is not registered")
        t = float(seconds)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"device {device}: iteration time must be > 0 seconds, got {seconds}")
        d = self._dev[device]
        k_new = t * d.batch / (self.epochs * d.samples)
        old = d.ks.get(d.batch)
        g = self.smoothing
        d.ks[d.batch] = k_new if old is None else (1.0 - g) * old + g * k_new
        if d.first_time is None:
            d.first_time = t
        d.last_time = t
        d.measurements += 1

    smoothing = 1.0  # EMA weight of the newest measurement (subclasses override)

    @abstractmethod
    def update(self, times: Mapping[int, float]) -> dict[int, Allocation]:
        """Record measured iteration times (seconds, each under the device's current
        allocation) and return the allocation each device in ``times`` should use next.

        ``times`` may name any subset of the fleet (one device under asynchronous training,
        all of them after a synchronous round); devices are processed in ascending id order.
        """

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (lists in ascending device order; None = not yet measured)."""
        ids = self.devices
        dv = [self._dev[i] for i in ids]
        return {
            "devices": ids,
            "dataset_size": [d.dataset_size for d in dv],
            "memory_cap": [d.memory_cap for d in dv],
            "samples": [d.samples for d in dv],
            "batch": [d.batch for d in dv],
            "k_batches": [sorted(d.ks) for d in dv],
            "k_values": [[d.ks[b] for b in sorted(d.ks)] for d in dv],
            "first_time": [d.first_time for d in dv],
            "last_time": [d.last_time for d in dv],
            "measurements": [d.measurements for d in dv],
            "changes": [d.changes for d in dv],
            "last_dir": [d.last_dir for d in dv],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (replaces the registered fleet)."""
        self._dev = {}
        for j, i in enumerate(state["devices"]):
            self._dev[int(i)] = _Device(
                dataset_size=int(state["dataset_size"][j]),
                memory_cap=_opt_int(state["memory_cap"][j]),
                samples=int(state["samples"][j]),
                batch=int(state["batch"][j]),
                ks={int(b): float(v) for b, v in zip(state["k_batches"][j], state["k_values"][j])},
                first_time=_opt_float(state["first_time"][j]),
                last_time=_opt_float(state["last_time"][j]),
                measurements=int(state["measurements"][j]),
                changes=int(state["changes"][j]),
                last_dir=int(state["last_dir"][j]),
            )


class FixedAllocation(Allocator):
    """Every device keeps its initial allocation; measurements are only recorded.

    Args:
        epochs: local epochs E per iteration (``train.local_epochs``, default 1).
    """

    name = "fixed"

    def update(self, times: Mapping[int, float]) -> dict[int, Allocation]:
        for i in sorted(times):
            self._record(int(i), times[i])
        return {int(i): self.allocation(i) for i in sorted(times)}


class HermesAllocation(Allocator):
    """Hermes' dynamic allocation toward the median iteration time.

    Per :meth:`update`: record each measurement (k = T * b / (E * D), EMA-smoothed); once every
    registered device has reported once, fix the target T* = median of their first measured
    times (it never moves afterwards, as in the authors' code). Then each measured device that
    has reported at least ``warmup`` times and whose latest time lies strictly outside the
    Tukey fences [Q1 - fence * IQR, Q3 + fence * IQR] of the *other* devices' latest times is
    re-allocated (inside the fences it is left alone):

    1. if its predicted time at the current allocation is already within ``tolerance`` * T*
       of T*, nothing changes (the outlier was noise);
    2. a binary search over integer D in [b, min(dataset size, memory cap)] at its current b
       finds the D whose predicted time is closest to T*;
    3. only if that D sits on a hard limit (its data / memory cap, or one mini-batch) and is
       still off target, a binary search over b in {2, 4, ..., 64} (at most the limit) picks
       the batch size whose best D gets closest to T*; b moves at most one rung (x2 or /2)
       per step and only for a predicted gain of at least 1 % of T*; k is tracked per batch
       size, and once two batch sizes have been measured a line k(b) = k0 + k1 * b fitted to
       them predicts the others (so the search stops lowering b when that does not help);
    4. D moves at most ``max_change`` * D per step, never past the hard limits;
    5. a change opposite to the device's previous one needs the prediction to be off by more
       than 2 * ``tolerance`` (hysteresis: measurement noise cannot make D dither).

    Differences from the authors' master code: they search every D and keep the smallest one
    that lands within +-1 s of T* (so devices end up with very few samples and small batches),
    use inclusive fences, E = 5 and no smoothing, step bound or tolerance.

    Args:
        epochs: local epochs E (``train.local_epochs``, default 1).
        warmup: measurements a device must have reported before it can be re-allocated, >= 1
            (``allocation.warmup``, default 1).
        smoothing: EMA weight of the newest k estimate, in (0, 1] (``allocation.smoothing``,
            default 0.3; 1 = no smoothing).
        max_change: largest relative change of D per step, in (0, 1]
            (``allocation.max_change``, default 0.5).
        tolerance: relative distance to T* counted as on target, in [0, 1)
            (``allocation.tolerance``, default 0.1).
        fence: Tukey fence multiplier of the IQR, > 0 (``allocation.fence``, default 1.5).
        trigger: ``"fences"`` (default, Hermes: only devices outside the fences of the others
            are re-allocated) or ``"always"`` (every device after warm-up, whenever its
            predicted time is off T* by more than ``tolerance``) (``allocation.trigger``).
            The fences only catch *outliers*: on a fleet whose speeds spread smoothly (e.g.
            log-uniformly over 10x) at most the extreme device is outside them and the spread
            stays; on a
            fleet where most devices are alike and a few are much faster or slower, the
            outliers are pulled to T*, the IQR shrinks and the rest follow.
        batch_sizes: ladder of batch sizes the b search may choose (default 2, 4, ..., 64).
    """

    name = "hermes"

    def __init__(
        self,
        epochs: int = 1,
        warmup: int = 1,
        smoothing: float = 0.3,
        max_change: float = 0.5,
        tolerance: float = 0.1,
        fence: float = 1.5,
        trigger: str = "fences",
        batch_sizes: Sequence[int] = BATCH_LADDER,
    ) -> None:
        super().__init__(epochs)
        warmup = checks.integer("allocation.warmup", warmup)
        if warmup < 1:
            raise ConfigError(f"config key 'allocation.warmup' = {warmup!r}: must be >= 1")
        smoothing = checks.number("allocation.smoothing", smoothing)
        if not 0.0 < smoothing <= 1.0:
            raise ConfigError(
                f"config key 'allocation.smoothing' = {smoothing!r}: must be in (0, 1]"
            )
        max_change = checks.number("allocation.max_change", max_change)
        if not 0.0 < max_change <= 1.0:
            raise ConfigError(
                f"config key 'allocation.max_change' = {max_change!r}: must be in (0, 1]"
            )
        tolerance = checks.number("allocation.tolerance", tolerance)
        if not 0.0 <= tolerance < 1.0:
            raise ConfigError(
                f"config key 'allocation.tolerance' = {tolerance!r}: must be in [0, 1)"
            )
        fence = checks.number("allocation.fence", fence)
        if not fence > 0:
            raise ConfigError(f"config key 'allocation.fence' = {fence!r}: must be > 0")
        if trigger not in TRIGGERS:
            raise ConfigError(
                f"config key 'allocation.trigger' = {trigger!r}: expected one of "
                + ", ".join(TRIGGERS)
            )
        ladder = sorted({int(b) for b in batch_sizes})
        if not ladder or ladder[0] < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}")
        self.warmup = warmup
        self.smoothing = smoothing
        self.max_change = max_change
        self.tolerance = tolerance
        self.fence = fence
        self.trigger = trigger
        self.batch_sizes = tuple(ladder)
        self.target: float | None = None  # T*, seconds

    @classmethod
    def from_config(
        cls, allocation: Mapping[str, Any] | None = None, epochs: int = 1
    ) -> HermesAllocation:
        """Build from the ``[allocation]`` table (missing keys take the defaults)."""
        keys = ("warmup", "smoothing", "max_change", "tolerance", "fence", "trigger")
        return cls(epochs=epochs, **checks.pick(allocation, keys))

    # ---- the searches ------------------------------------------------------------------------

    def _best_samples(self, k: float, b: int, lo: int, hi: int) -> int:
        """Binary search over integer D in [lo, hi] for the predicted time closest to T*."""
        target = self.target
        assert target is not None
        pred = lambda s: self.epochs * s * k / b  # noqa: E731  (increasing in s)
        if pred(hi) <= target:
            return hi
        if pred(lo) >= target:
            return lo
        a, z = lo, hi  # invariant: pred(a) < target <= pred(z)
        while z - a > 1:
            mid = (a + z) // 2
            if pred(mid) < target:
                a = mid
            else:
                z = mid
        return a if target - pred(a) <= pred(z) - target else z

    def _best_batch(self, d: _Device, limit: int, current: int) -> int:
        """Binary search over the ladder for the b whose best D predicts closest to T*."""
        target = self.target
        assert target is not None
        ladder = [b for b in self.batch_sizes if b <= limit] or [min(current, limit)]

        def err(b: int) -> float:
            k = d.k_at(b)
            assert k is not None
            s = self._best_samples(k, b, b, limit)
            return self.epochs * s * k / b - target  # non-increasing in b (k/b is)

        lo, hi = 0, len(ladder) - 1
        if err(ladder[hi]) >= 0:
            return ladder[hi]
        if err(ladder[lo]) <= 0:
            return ladder[lo]
        while hi - lo > 1:  # invariant: err(ladder[lo]) > 0 > err(ladder[hi])
            mid = (lo + hi) // 2
            if err(ladder[mid]) > 0:
                lo = mid
            else:
                hi = mid
        return ladder[lo] if abs(err(ladder[lo])) <= abs(err(ladder[hi])) else ladder[hi]

    def _reallocate(self, device: int) -> None:
        d = self._dev[device]
        target = self.target
        k = d.k_at(d.batch)
        assert target is not None and k is not None
        limit = d.limit
        err = self.epochs * d.samples * k / d.batch - target
        if abs(err) <= self.tolerance * target:
            return
        direction = -1 if err > 0 else 1
        if direction == -d.last_dir and abs(err) <= 2.0 * self.tolerance * target:
            return  # reversing the previous change needs twice the evidence: no dithering
        b = min(d.batch, limit)
        s = self._best_samples(k, b, b, limit)
        off = abs(self.epochs * s * k / b - target) > self.tolerance * target
        if off and (s == limit or s == b):
            want = self._best_batch(d, limit, b)
            if want != b:  # one rung of the ladder at most
                rungs = [x for x in self.batch_sizes if x <= limit]
                want = (
                    min(x for x in rungs if x > b) if want > b else max(x for x in rungs if x < b)
                )
                k2 = d.k_at(want)
                assert k2 is not None
                s2 = self._best_samples(k2, want, want, limit)
                gain = abs(self.epochs * s * k / b - target) - abs(
                    self.epochs * s2 * k2 / want - target
                )
                if gain > BATCH_GAIN * target:  # worth a batch-size change
                    b, s, k = want, s2, k2
        lo = max(b, math.ceil(d.samples * (1.0 - self.max_change)))
        hi = min(limit, math.floor(d.samples * (1.0 + self.max_change)))
        if lo <= hi:
            s = min(max(s, lo), hi)
        else:  # the hard limits moved under the device: obey them
            s = min(max(s, b), limit)
        if (s, b) != (d.samples, d.batch):
            new = self.epochs * s * k / b - target
            if new != err:
                d.last_dir = 1 if new > err else -1
            d.samples, d.batch = s, b
            d.changes += 1

    def update(self, times: Mapping[int, float]) -> dict[int, Allocation]:
        order = sorted(int(i) for i in times)
        for i in order:
            self._record(i, times[i])
        if self.target is None and all(d.first_time is not None for d in self._dev.values()):
            self.target = float(np.median([d.first_time for d in self._dev.values()]))
        if self.target is not None and len(self._dev) >= 2:
            for i in order:
                d = self._dev[i]
                if d.measurements < self.warmup:
                    continue
                if self.trigger == "always":
                    self._reallocate(i)
                    continue
                others = [
                    o.last_time for j, o in self._dev.items() if j != i and o.last_time is not None
                ]
                if not others:
                    continue
                low, high = tukey_fences(others, self.fence)
                assert d.last_time is not None
                if d.last_time < low or d.last_time > high:
                    self._reallocate(i)
        return {i: self.allocation(i) for i in order}

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["target"] = self.target
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.target = _opt_float(state["target"])


ALLOCATORS = ("fixed", "hermes")


def make_allocator(
    name: str, allocation: Mapping[str, Any] | None = None, epochs: int = 1
) -> Allocator:
    """Allocator by config name (``algorithm.allocation``: fixed | hermes)."""
    if name == "fixed":
        return FixedAllocation(epochs)
    if name == "hermes":
        return HermesAllocation.from_config(allocation, epochs)
    raise ConfigError(
        f"config key 'algorithm.allocation' = {name!r}: expected one of " + ", ".join(ALLOCATORS)
    )


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)
