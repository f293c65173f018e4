"""Device profiles of simulated edge fleets: compute cost, memory cap, links, availability,
failures and jitter (pure Python/numpy, no MPI).

A :class:`Profile` says how long a device takes, in *virtual* seconds, to train on a number
of samples and to move bytes over its links. :func:`load_fleet` turns the config value
``sim.profiles`` (a built-in set name, or a ``.toml`` / ``.csv`` file) into one profile per
device id. Everything random (on/off periods, failure times, jitter) is a pure function of
``(run seed, device id)`` (plus the task number for jitter), so every rank computes the same
values in any order. Units: seconds, bytes, bytes per second, samples.

The built-in sets, their numbers and where they come from are in ``docs/device-profiles.md``.
"""

from __future__ import annotations

import bisect
import csv
import difflib
import functools
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..seeding import derive_seed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KEY = "sim.profiles"
"""The config key whose value :func:`load_fleet` parses (named in every error message)."""

# stream purposes (last part of derive_seed's key); distinct from edgefl.seeding's 1, 2
STREAM_AVAILABILITY = 0x5101
STREAM_FAILURE = 0x5102
STREAM_JITTER = 0x5103
STREAM_ASSIGN = 0x5104

INF = math.inf
_CHUNK = 32  # on/off periods drawn per extension of a random availability timeline


def _bad(where: str, msg: str) -> ConfigError:
    return ConfigError(
        f"config key '{KEY}': {where}: {msg}" if where else f"config key '{KEY}': {msg}"
    )


# -- availability -------------------------------------------------------------------------
class _Timeline:
    """Online intervals [starts[i], ends[i]) of one (seed, device), generated lazily.

    Alternating exponential on/off periods (means ``mean_on``, ``mean_off``). The first state
    is drawn from the stationary distribution (online with probability
    mean_on / (mean_on + mean_off)); by memorylessness the first period is again exponential.
    Draws happen in a fixed order (one uniform, one first-offline length, then chunks of
    ``_CHUNK`` on-lengths and ``_CHUNK`` off-lengths), so the intervals do not depend on
    which queries came first.
    """

    __slots__ = ("rng", "mean_on", "mean_off", "starts", "ends", "cursor")

    def __init__(self, seed: int, mean_on: float, mean_off: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.mean_on = mean_on
        self.mean_off = mean_off
        self.starts: list[float] = []
        self.ends: list[float] = []
        online_first = self.rng.random() < mean_on / (mean_on + mean_off)
        first_off = float(self.rng.exponential(mean_off))
        self.cursor = 0.0 if online_first else first_off

    def _extend(self) -> None:
        on = self.rng.exponential(self.mean_on, _CHUNK).tolist()
        off = self.rng.exponential(self.mean_off, _CHUNK).tolist()
        t = self.cursor
        for a, b in zip(on, off):
            if a > 0.0:
                if self.ends and self.ends[-1] == t:  # a zero-length off period: merge
                    self.ends[-1] = t + a
                else:
                    self.starts.append(t)
                    self.ends.append(t + a)
                t = t + a
            t = t + b
        self.cursor = t

    def cover(self, t: float) -> None:
        """Generate until an interval starts after ``t`` (so the one holding t is final)."""
        while not self.starts or self.starts[-1] <= t:
            self._extend()


@dataclass(frozen=True)
class Availability:
    """When a device is online, in virtual seconds since the start of the run.

    Args:
        mode: ``"always"`` (default), ``"trace"`` (the online intervals below) or
            ``"random"`` (alternating exponential on/off periods).
        intervals: ``"trace"`` only: sorted, non-overlapping online intervals
            ``((start, end), ...)`` in seconds, ``0 <= start < end``; intervals that touch are
            merged. Default ``()``.
        period_s: ``"trace"`` only: if > 0 the trace repeats every ``period_s`` seconds (all
            intervals must end by then); 0 (default) = after the last interval the device is
            offline forever.
        mean_on_s: ``"random"`` only: mean online period in seconds (> 0). Default 0.
        mean_off_s: ``"random"`` only: mean offline period in seconds (> 0). Default 0.

    Queries take the run seed and the device id; in ``"random"`` mode they are pure
    functions of ``(seed, device)``: the intervals are generated once per pair, lazily, and
    cached on this object (O(log n) per query after that).
    """

    mode: str = "always"
    intervals: tuple[tuple[float, float], ...] = ()
    period_s: float = 0.0
    mean_on_s: float = 0.0
    mean_off_s: float = 0.0
    _cache: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_availability(self, f"availability mode {self.mode!r}")
        merged: list[tuple[float, float]] = []
        for s, e in self.intervals:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], float(e))
            else:
                merged.append((float(s), float(e)))
        object.__setattr__(self, "intervals", tuple(merged))
        object.__setattr__(self, "period_s", float(self.period_s))
        object.__setattr__(self, "mean_on_s", float(self.mean_on_s))
        object.__setattr__(self, "mean_off_s", float(self.mean_off_s))

    # trace helpers -----------------------------------------------------------------------
    def _trace_lists(self) -> tuple[list[float], list[float]]:
        got = self._cache.get("trace")
        if got is None:
            got = ([s for s, _ in self.intervals], [e for _, e in self.intervals])
            self._cache["trace"] = got
        return got

    def _split(self, t: float) -> tuple[float, float]:
        """(period offset, time within the period) for a trace."""
        if self.period_s > 0:
            k = math.floor(t / self.period_s)
            return k * self.period_s, t - k * self.period_s
        return 0.0, t

    def _timeline(self, seed: int, device: int) -> _Timeline:
        key = (int(seed), int(device))
        tl = self._cache.get(key)
        if tl is None:
            s = derive_seed(seed, device, STREAM_AVAILABILITY)
            tl = _Timeline(s, self.mean_on_s, self.mean_off_s)
            self._cache[key] = tl
        return tl

    def _lists(self, t: float, seed: int, device: int) -> tuple[float, float, list, list]:
        """(offset, local time, starts, ends) for a query at ``t``."""
        if not (t >= 0.0):
            raise ValueError(f"availability query at t = {t!r}: must be a time >= 0")
        if self.mode == "trace":
            off, local = self._split(t)
            starts, ends = self._trace_lists()
            return off, local, starts, ends
        tl = self._timeline(seed, device)
        tl.cover(t)
        return 0.0, t, tl.starts, tl.ends

    # public queries ----------------------------------------------------------------------
    def is_online(self, t: float, seed: int, device: int) -> bool:
        """Whether the device is online at virtual time ``t`` (seconds, >= 0)."""
        if self.mode == "always":
            return True
        _, local, starts, ends = self._lists(t, seed, device)
        i = bisect.bisect_right(starts, local) - 1
        return i >= 0 and local < ends[i]

    def online_until(self, t: float, seed: int, device: int) -> float:
        """End (seconds) of the online interval holding ``t``; ``inf`` if it never ends;
        ``t`` itself if the device is offline at ``t``."""
        if self.mode == "always":
            return INF
        off, local, starts, ends = self._lists(t, seed, device)
        i = bisect.bisect_right(starts, local) - 1
        if i < 0 or local >= ends[i]:
            return t
        end = off + ends[i]
        if self.mode == "trace" and self.period_s > 0 and ends[i] == self.period_s:
            if starts[0] == 0.0:  # continues into the next period
                if len(starts) == 1:
                    return INF  # online for the whole period, every period
                end = off + self.period_s + ends[0]
        return end

    def next_online(self, t: float, seed: int, device: int) -> float:
        """``t`` if online at ``t``, else the start (seconds) of the next online interval;
        ``inf`` if the device never comes back."""
        if self.mode == "always":
            return t
        off, local, starts, ends = self._lists(t, seed, device)
        j = bisect.bisect_right(starts, local)
        if j > 0 and local < ends[j - 1]:
            return t
        if j < len(starts):
            return off + starts[j]
        if self.mode == "trace" and self.period_s > 0:
            return off + self.period_s + starts[0]
        return INF  # pragma: no cover - random timelines always cover past t

    def online_fraction(self) -> float:
        """Long-run fraction of time online (1 for always; 0 after a finite trace ends)."""
        if self.mode == "always":
            return 1.0
        if self.mode == "random":
            return self.mean_on_s / (self.mean_on_s + self.mean_off_s)
        if self.period_s > 0:
            return sum(e - s for s, e in self.intervals) / self.period_s
        return 0.0


def _check_availability(a: Any, where: str, prefix: str = "") -> None:
    """Validate an Availability's fields (``a`` may be any object with its attributes);
    ``prefix`` is put before field names in messages (e.g. ``"availability."``)."""
    if a.mode not in ("always", "trace", "random"):
        raise _bad(where, f"field '{prefix}mode' = {a.mode!r}: expected always, trace or random")
    if a.mode == "trace":
        fi = f"field '{prefix}intervals'"
        if not a.intervals:
            raise _bad(where, f"{fi}: expected at least one [start, end] interval")
        prev = 0.0
        for k, iv in enumerate(a.intervals):
            if not isinstance(iv, (list, tuple)) or len(iv) != 2:
                raise _bad(where, f"{fi} item {k + 1} = {iv!r}: expected [start, end]")
            s, e = iv
            for v in (s, e):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise _bad(where, f"{fi} item {k + 1} = {list(iv)!r}: expected numbers")
            if not (0 <= s < e):
                raise _bad(where, f"{fi} item {k + 1} = {list(iv)!r}: expected 0 <= start < end")
            if s < prev:
                raise _bad(
                    where,
                    f"{fi} item {k + 1} = {list(iv)!r}: intervals must be sorted and must not "
                    "overlap",
                )
            prev = e
        p = a.period_s
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 <= p < INF):
            raise _bad(where, f"field '{prefix}period_s' = {p!r}: must be a number >= 0")
        if p > 0 and prev > p:
            raise _bad(
                where,
                f"field '{prefix}period_s' = {p!r}: the last interval ends at {prev!r}, after "
                "the period",
            )
    if a.mode == "random":
        for name in ("mean_on_s", "mean_off_s"):
            v = getattr(a, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < INF):
                raise _bad(where, f"field '{prefix}{name}' = {v!r}: must be a number > 0")


# -- failures -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """When a device crashes for good (virtual seconds).

    Args:
        mode: ``"none"`` (default), ``"crash"`` (at ``at_s``) or ``"mtbf"`` (an exponential
            time with mean ``mtbf_s``, drawn per (seed, device)).
        at_s: ``"crash"`` only: crash time in seconds (>= 0). Default 0.
        mtbf_s: ``"mtbf"`` only: mean time between failures in seconds (> 0). Default 0.

    A crashed device stays down; the runtime decides what happens to its work.
    """

    mode: str = "none"
    at_s: float = 0.0
    mtbf_s: float = 0.0
    _cache: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_failure(self, f"failure mode {self.mode!r}")
        object.__setattr__(self, "at_s", float(self.at_s))
        object.__setattr__(self, "mtbf_s", float(self.mtbf_s))

    def crash_time(self, seed: int, device: int) -> float:
        """Virtual time (seconds) at which the device crashes; ``inf`` if it never does."""
        if self.mode == "none":
            return INF
        if self.mode == "crash":
            return self.at_s
        key = (int(seed), int(device))
        t = self._cache.get(key)
        if t is None:
            rng = np.random.default_rng(derive_seed(seed, device, STREAM_FAILURE))
            t = float(rng.exponential(self.mtbf_s))
            self._cache[key] = t
        return t


def _check_failure(f: Any, where: str, prefix: str = "") -> None:
    """Validate a Failure's fields (``f`` may be any object with its attributes)."""
    if f.mode not in ("none", "crash", "mtbf"):
        raise _bad(where, f"field '{prefix}mode' = {f.mode!r}: expected none, crash or mtbf")
    for mode, name, excl in (("crash", "at_s", False), ("mtbf", "mtbf_s", True)):
        v = getattr(f, name)
        if f.mode == mode and (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not (v < INF and (v > 0 if excl else v >= 0))
        ):
            raise _bad(
                where, f"field '{prefix}{name}' = {v!r}: must be a number {'>' if excl else '>='} 0"
            )


# -- profiles -----------------------------------------------------------------------------
REFERENCE_BPS = 12.5e6  # 100 Mbit/s
REFERENCE_LATENCY_S = 0.01


@dataclass(frozen=True)
class Profile:
    """What one simulated device can do.

    Args:
        name: type name (e.g. ``"phone"``); several devices may share a profile.
        kind: ``"cpu"`` (default) or ``"gpu"`` (informational; the simulated cost is set by
            the numbers below).
        speed: compute speed relative to the reference device (> 0; 1.0 = reference,
            default). The device needs ``reference_s_per_sample / speed`` seconds per sample.
        s_per_sample: absolute compute cost, seconds per training sample (forward + backward
            + update); > 0 overrides ``speed``; 0 (default) = derive from ``speed``.
        mem_cap: most samples the device can process in one iteration (0 = unlimited,
            default).
        up_bps: uplink bandwidth, bytes/s (> 0; default 12.5e6 = 100 Mbit/s).
        down_bps: downlink bandwidth, bytes/s (> 0; default 12.5e6).
        latency_s: one-way message latency, seconds (>= 0; default 0.01).
        availability: when the device is online (default always).
        failure: when it crashes (default never).
        jitter: sigma of the lognormal multiplicative jitter on compute time (>= 0; 0 =
            none, default). See :func:`jitter_factor`.
    """

    name: str
    kind: str = "cpu"
    speed: float = 1.0
    s_per_sample: float = 0.0
    mem_cap: int = 0
    up_bps: float = REFERENCE_BPS
    down_bps: float = REFERENCE_BPS
    latency_s: float = REFERENCE_LATENCY_S
    availability: Availability = field(default_factory=Availability)
    failure: Failure = field(default_factory=Failure)
    jitter: float = 0.0

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise _bad("profile", f"field 'name' = {self.name!r}: expected a non-empty string")
        values = {f: getattr(self, f) for f in _NUMERIC}
        values["kind"] = self.kind
        _check_fields(values, where, lambda f, v: f"field '{f}' = {v!r}")
        for f in _NUMERIC:
            conv = int if f == "mem_cap" else float
            object.__setattr__(self, f, conv(getattr(self, f)))
        if not isinstance(self.availability, Availability):
            raise _bad(where, "field 'availability': expected an Availability")
        if not isinstance(self.failure, Failure):
            raise _bad(where, "field 'failure': expected a Failure")

    def cost_s_per_sample(self, reference_s_per_sample: float) -> float:
        """Seconds per training sample on this device (``s_per_sample`` if set, else
        ``reference_s_per_sample / speed``)."""
        if self.s_per_sample > 0:
            return self.s_per_sample
        if not (reference_s_per_sample > 0):
            raise ValueError(
                f"profile {self.name!r} derives its cost from speed: reference_s_per_sample "
                f"must be > 0, got {reference_s_per_sample!r} (calibrate it first)"
            )
        return reference_s_per_sample / self.speed

    def compute_s(self, samples: int, reference_s_per_sample: float, factor: float = 1.0) -> float:
        """Virtual seconds to train on ``samples`` samples, times the jitter ``factor``
        (from :func:`jitter_factor`; 1.0 = no jitter)."""
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        return samples * self.cost_s_per_sample(reference_s_per_sample) * factor

    def down_s(self, nbytes: int) -> float:
        """Virtual seconds to receive ``nbytes`` bytes: latency + bytes / downlink."""
        return self.latency_s + nbytes / self.down_bps

    def up_s(self, nbytes: int) -> float:
        """Virtual seconds to send ``nbytes`` bytes: latency + bytes / uplink."""
        return self.latency_s + nbytes / self.up_bps

    def batch_cap(self, batch: int) -> int:
        """``batch`` limited by the memory cap (samples per iteration)."""
        return batch if self.mem_cap == 0 else min(batch, self.mem_cap)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (for run directories and reports)."""
        a, f = self.availability, self.failure
        av: dict[str, Any] = {"mode": a.mode}
        if a.mode == "trace":
            av["intervals"] = [list(iv) for iv in a.intervals]
            av["period_s"] = a.period_s
        elif a.mode == "random":
            av.update(mean_on_s=a.mean_on_s, mean_off_s=a.mean_off_s)
        fa: dict[str, Any] = {"mode": f.mode}
        if f.mode == "crash":
            fa["at_s"] = f.at_s
        elif f.mode == "mtbf":
            fa["mtbf_s"] = f.mtbf_s
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        out.update({k: getattr(self, k) for k in _NUMERIC})
        out.update(availability=av, failure=fa)
        return out


# numeric fields of a Profile and their rules: (type, minimum, minimum exclusive)
_NUMERIC: dict[str, tuple[str, float, bool]] = {
    "speed": ("float", 0.0, True),
    "s_per_sample": ("float", 0.0, False),
    "mem_cap": ("int", 0, False),
    "up_bps": ("float", 0.0, True),
    "down_bps": ("float", 0.0, True),
    "latency_s": ("float", 0.0, False),
    "jitter": ("float", 0.0, False),
}


def _check_fields(values: Mapping[str, Any], where: str, label) -> None:
    """Check typed values of profile fields; ``label(field, value)`` names one in errors."""
    for f, v in values.items():
        if f == "kind":
            if v not in ("cpu", "gpu"):
                raise _bad(where, f"{label(f, v)}: expected cpu or gpu")
            continue
        typ, lo, excl = _NUMERIC[f]
        if typ == "int":
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise _bad(where, f"{label(f, v)}: expected an integer")
        elif isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
            raise _bad(where, f"{label(f, v)}: expected a number")
        elif not math.isfinite(v):
            raise _bad(where, f"{label(f, v)}: expected a finite number")
        if v < lo or (excl and v == lo):
            raise _bad(where, f"{label(f, v)}: must be {'>' if excl else '>='} {lo:g}")


# -- jitter -------------------------------------------------------------------------------
_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64 finaliser (Steele, Lea & Flood, OOPSLA 2014): a 64-bit bijective hash."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=1 << 16)
def _stream_key(seed: int, device: int, stream: int) -> int:
    return derive_seed(seed, device, stream)


def jitter_factor(profile: Profile, seed: int, device: int, task: int) -> float:
    """Multiplicative jitter on the compute time of task number ``task`` of ``device``.

    ``exp(sigma * z - sigma**2 / 2)`` with ``z`` standard normal and ``sigma =
    profile.jitter``: lognormal with mean 1 (so the mean speed stays the profile's). ``z`` is
    a pure function of (seed, device, task), computed by hashing (SplitMix64 + Box-Muller),
    so any query order gives the same value and each call costs about a microsecond.
    Returns exactly 1.0 when ``profile.jitter`` is 0.
    """
    sigma = profile.jitter
    if sigma == 0:
        return 1.0
    h1 = _mix64(_stream_key(int(seed), int(device), STREAM_JITTER) ^ _mix64(int(task) & _M64))
    h2 = _mix64(h1)
    u1 = ((h1 >> 11) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    u2 = (h2 >> 11) * (1.0 / (1 << 53))  # in [0, 1)
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return math.exp(sigma * z - 0.5 * sigma * sigma)


# -- built-in sets ------------------------------------------------------------------------
REFERENCE = Profile("reference")
"""The reference device: speed 1.0, no memory cap, 100 Mbit/s both ways, 10 ms latency."""

_MBIT = 1e6 / 8  # bytes/s per Mbit/s

# (profile, weight). Numbers and sources: docs/device-profiles.md (several are estimates).
_EDGE_MIX: tuple[tuple[Profile, int], ...] = (
    (
        Profile(
            "microcontroller",
            "cpu",
            speed=0.02,
            mem_cap=16,
            up_bps=0.3 * _MBIT,
            down_bps=0.4 * _MBIT,
            latency_s=0.1,
            jitter=0.05,
        ),
        3,
    ),
    (
        Profile(
            "phone",
            "cpu",
            speed=0.3,
            mem_cap=256,
            up_bps=10 * _MBIT,
            down_bps=50 * _MBIT,
            latency_s=0.04,
            jitter=0.3,
        ),
        5,
    ),
    (
        Profile(
            "sbc",
            "cpu",
            speed=0.1,
            mem_cap=128,
            up_bps=20 * _MBIT,
            down_bps=80 * _MBIT,
            latency_s=0.02,
            jitter=0.1,
        ),
        3,
    ),
    (
        Profile(
            "embedded-gpu",
            "gpu",
            speed=2.0,
            mem_cap=512,
            up_bps=100 * _MBIT,
            down_bps=100 * _MBIT,
            latency_s=0.01,
            jitter=0.1,
        ),
        2,
    ),
    (
        Profile(
            "laptop",
            "cpu",
            speed=1.0,
            mem_cap=2048,
            up_bps=40 * _MBIT,
            down_bps=100 * _MBIT,
            latency_s=0.015,
            jitter=0.2,
        ),
        2,
    ),
    (
        Profile(
            "edge-server",
            "gpu",
            speed=10.0,
            mem_cap=0,
            up_bps=940 * _MBIT,
            down_bps=940 * _MBIT,
            latency_s=0.002,
            jitter=0.05,
        ),
        1,
    ),
)

# ASSUMED mix (the VM types of Basani et al., HiPC 2024 could not be verified): four cloud VM
# shapes, three nodes each; speed ~ vCPUs, memory cap ~ RAM. See docs/device-profiles.md.
_HERMES_12: tuple[tuple[Profile, int], ...] = tuple(
    (
        Profile(
            f"vm-{cpus}c{gib}g",
            "cpu",
            speed=cpus / 4,
            mem_cap=256 * gib,
            up_bps=100 * _MBIT,
            down_bps=100 * _MBIT,
            latency_s=0.02,
            jitter=0.1,
        ),
        3,
    )
    for cpus, gib in ((1, 1), (2, 4), (4, 8), (8, 16))
)

BUILTIN_SETS: dict[str, tuple[tuple[Profile, int], ...]] = {
    "uniform": ((REFERENCE, 1),),
    "edge-mix": _EDGE_MIX,
    "hermes-12": _HERMES_12,
}
"""Built-in device sets: name -> ((profile, weight), ...); weights are proportions."""


def apportion(weights: Sequence[int], n: int) -> list[int]:
    """Split ``n`` devices over types in proportion to integer ``weights`` (largest
    remainder / Hamilton method; ties go to the earlier type). Counts sum to ``n`` and each
    is within 1 of its exact quota ``n * w / sum(w)``."""
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    counts = [w * n // total for w in weights]
    rem = [w * n % total for w in weights]
    order = sorted(range(len(weights)), key=lambda i: (-rem[i], i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _assign(
    types: Sequence[Profile], counts: Sequence[int], seed: int, shuffle: bool
) -> list[Profile]:
    out = [p for p, c in zip(types, counts) for _ in range(c)]
    if shuffle and len(out) > 1:
        rng = np.random.default_rng(derive_seed(seed, len(out), STREAM_ASSIGN))
        out = [out[i] for i in rng.permutation(len(out))]
    return out


# -- loading ------------------------------------------------------------------------------
def load_fleet(
    spec: str, num_devices: int, seed: int, base_dir: Path | str | None = None
) -> list[Profile]:
    """One :class:`Profile` per device id ``0 .. num_devices - 1``.

    Args:
        spec: the value of ``sim.profiles``: ``uniform``, ``edge-mix``, ``hermes-12``, or a
            path to a ``.toml`` or ``.csv`` file (formats in docs/device-profiles.md).
        num_devices: fleet size N (>= 1).
        seed: run seed; built-in sets shuffle which device gets which type with it (the
            number of each type depends only on N).
        base_dir: directory that relative paths are resolved against (e.g. the config
            file's folder); default None = the current directory.

    Raises ConfigError (one line, naming the file, row and field) for bad input.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"config key '{KEY}' = {spec!r}: expected a set name ({', '.join(BUILTIN_SETS)}) "
            "or a path to a .toml or .csv file"
        )
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(f"config key 'fleet.devices' = {num_devices!r}: expected >= 1")
    spec = spec.strip()
    if spec in BUILTIN_SETS:
        entries = BUILTIN_SETS[spec]
        counts = apportion([w for _, w in entries], num_devices)
        return _assign([p for p, _ in entries], counts, seed, shuffle=True)
    suffix = Path(spec).suffix.lower()
    if suffix not in (".toml", ".csv"):
        close = difflib.get_close_matches(spec, list(BUILTIN_SETS), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config key '{KEY}' = {spec!r}: unknown device set{hint} (built-in: "
            f"{', '.join(BUILTIN_SETS)}; or a path to a .toml or .csv file)"
        )
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise ConfigError(f"config key '{KEY}' = {spec!r}: file '{path}' not found")
    if suffix == ".toml":
        return _load_toml(path, num_devices, seed)
    return _load_csv(path, num_devices)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise _bad(str(path), "not UTF-8 text") from None
    except OSError as e:
        raise _bad(str(path), f"cannot read: {e.strerror or e}") from None


# field name -> how a raw value becomes Profile fields. Shared by TOML keys and CSV columns.
_COMPUTE_KEYS = ("speed", "s_per_sample", "compute_ms_per_sample", "computation")
_UP_KEYS = ("up_bps", "up_kbps", "communication")
_DOWN_KEYS = ("down_bps", "down_kbps", "communication")
_FLOAT_KEYS = {
    "speed",
    "s_per_sample",
    "compute_ms_per_sample",
    "computation",
    "up_bps",
    "up_kbps",
    "down_bps",
    "down_kbps",
    "communication",
    "latency_s",
    "jitter",
    "mean_on_s",
    "mean_off_s",
    "mtbf_s",
    "crash_at_s",
}
_INT_KEYS = {"mem_cap", "count"}
_STR_KEYS = {"name", "kind"}


def _normalise(raw: dict[str, Any], where: str, label) -> dict[str, Any]:
    """Turn typed raw fields (TOML keys or CSV columns, already numbers) into Profile kwargs.

    Unit conversions: ``compute_ms_per_sample`` ms -> s; FedScale ``computation`` (inference
    ms per sample) x 3 for training (FedScale's augmentation factor) -> s; ``*_kbps``
    (1000 bit/s) x 125 -> bytes/s; FedScale ``communication`` (kbit/s with 1 kbit = 1024
    bits, used for both links) x 128 -> bytes/s.
    """
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _FLOAT_KEYS:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _bad(where, f"{label(k, v)}: expected a number")
            if not math.isfinite(v):
                raise _bad(where, f"{label(k, v)}: expected a finite number")
        elif k in _INT_KEYS:
            if isinstance(v, bool) or not isinstance(v, int):
                raise _bad(where, f"{label(k, v)}: expected an integer")
        elif k in _STR_KEYS and not isinstance(v, str):
            raise _bad(where, f"{label(k, v)}: expected a string")
    compute = [k for k in _COMPUTE_KEYS if k in raw]
    if len(compute) > 1:
        raise _bad(where, f"give one of {', '.join(compute)}, not several")
    for group in (("up_bps", "up_kbps", "communication"), ("down_bps", "down_kbps")):
        given = [k for k in group if k in raw]
        if len(given) > 1:
            raise _bad(where, f"give one of {', '.join(given)}, not several")
    if "communication" in raw and any(k in raw for k in ("down_bps", "down_kbps")):
        raise _bad(where, "give one of communication, down_bps/down_kbps, not several")
    positive = {"computation", "compute_ms_per_sample", "s_per_sample", "speed"}
    positive |= {"up_bps", "up_kbps", "down_bps", "down_kbps", "communication"}
    positive |= {"mean_on_s", "mean_off_s", "mtbf_s"}
    for k, v in raw.items():
        if k in positive and v <= 0:
            raise _bad(where, f"{label(k, v)}: must be > 0")
        if k in ("latency_s", "jitter", "mem_cap", "crash_at_s") and v < 0:
            raise _bad(where, f"{label(k, v)}: must be >= 0")
        if k == "count" and v < 1:
            raise _bad(where, f"{label(k, v)}: must be >= 1")
        if k == "kind" and v not in ("cpu", "gpu"):
            raise _bad(where, f"{label(k, v)}: expected cpu or gpu")
        if k == "name" and not v:
            raise _bad(where, f"{label(k, v)}: expected a non-empty string")
    if "speed" in raw:
        out["speed"] = float(raw["speed"])
    if "s_per_sample" in raw:
        out["s_per_sample"] = float(raw["s_per_sample"])
    if "compute_ms_per_sample" in raw:
        out["s_per_sample"] = raw["compute_ms_per_sample"] / 1000.0
    if "computation" in raw:
        out["s_per_sample"] = 3.0 * raw["computation"] / 1000.0
    if "up_bps" in raw:
        out["up_bps"] = float(raw["up_bps"])
    if "up_kbps" in raw:
        out["up_bps"] = raw["up_kbps"] * 125.0
    if "down_bps" in raw:
        out["down_bps"] = float(raw["down_bps"])
    if "down_kbps" in raw:
        out["down_bps"] = raw["down_kbps"] * 125.0
    if "communication" in raw:
        out["up_bps"] = out["down_bps"] = raw["communication"] * 128.0
    for k in ("name", "kind", "mem_cap", "latency_s", "jitter"):
        if k in raw:
            out[k] = raw[k]
    return out


# -- TOML ---------------------------------------------------------------------------------
_TOML_TOP = ("device", "shuffle", "description")
_TOML_DEVICE = (
    "name",
    "kind",
    "count",
    "speed",
    "s_per_sample",
    "compute_ms_per_sample",
    "mem_cap",
    "up_bps",
    "up_kbps",
    "down_bps",
    "down_kbps",
    "latency_s",
    "jitter",
    "availability",
    "failure",
)
_AVAIL_KEYS = {
    "always": ("mode",),
    "trace": ("mode", "intervals", "period_s"),
    "random": ("mode", "mean_on_s", "mean_off_s"),
}
_FAIL_KEYS = {"none": ("mode",), "crash": ("mode", "at_s"), "mtbf": ("mode", "mtbf_s")}


def _unknown(key: str, allowed: Sequence[str], what: str) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f" (allowed: {', '.join(allowed)})"
    return f"unknown {what} '{key}'{hint}"


def _toml_label(prefix: str = ""):
    return lambda k, v: f"field '{prefix}{k}' = {v!r}"


def _load_toml(path: Path, n: int, seed: int) -> list[Profile]:
    text = _read_text(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _bad(str(path), f"invalid TOML: {e}") from None
    for k in doc:
        if k not in _TOML_TOP:
            raise _bad(str(path), _unknown(k, _TOML_TOP, "top-level key"))
    shuffle = doc.get("shuffle", False)
    if not isinstance(shuffle, bool):
        raise _bad(str(path), f"field 'shuffle' = {shuffle!r}: expected true or false")
    entries = doc.get("device")
    if not isinstance(entries, list) or not entries:
        raise _bad(str(path), "expected at least one [[device]] table")
    types: list[Profile] = []
    weights: list[int] = []
    for i, entry in enumerate(entries):
        where = f"{path}, [[device]] entry {i + 1}"
        if not isinstance(entry, dict):
            raise _bad(where, "expected a table")
        if isinstance(entry.get("name"), str) and entry["name"]:
            where += f" ({entry['name']!r})"
        for k in entry:
            if k not in _TOML_DEVICE:
                raise _bad(where, _unknown(k, _TOML_DEVICE, "key"))
        flat = {k: v for k, v in entry.items() if k not in ("availability", "failure")}
        kw = _normalise(flat, where, _toml_label())
        kw.setdefault("name", f"device-{i + 1}")
        kw["availability"] = _toml_availability(entry.get("availability"), where)
        kw["failure"] = _toml_failure(entry.get("failure"), where)
        types.append(Profile(**kw))
        weights.append(flat.get("count", 1))
    if sum(weights) == n:
        counts = weights
    else:
        counts = apportion(weights, n)
    return _assign(types, counts, seed, shuffle=shuffle)


def _sub_table(raw: Any, where: str, name: str, modes: dict[str, tuple[str, ...]], default: str):
    if raw is None:
        return default, {}
    if not isinstance(raw, dict):
        raise _bad(where, f"field '{name}' = {raw!r}: expected a table [device.{name}]")
    mode = raw.get("mode", default)
    if mode not in modes:
        raise _bad(where, f"field '{name}.mode' = {mode!r}: expected {', '.join(modes)}")
    for k in raw:
        if k not in modes[mode]:
            if any(k in keys for keys in modes.values()):
                raise _bad(where, f"field '{name}.{k}' is not used by mode '{mode}'")
            raise _bad(where, _unknown(f"{name}.{k}", [f"{name}.{x}" for x in modes[mode]], "key"))
    return mode, raw


def _toml_availability(raw: Any, where: str) -> Availability:
    mode, t = _sub_table(raw, where, "availability", _AVAIL_KEYS, "always")
    if mode == "always":
        return Availability()
    for k in _AVAIL_KEYS[mode][1:]:
        if k not in t and k != "period_s":
            raise _bad(where, f"field 'availability.{k}' is missing (needed by mode {mode})")
    ivs = t.get("intervals", ())
    if mode == "trace" and not isinstance(ivs, list):
        raise _bad(where, f"field 'availability.intervals' = {ivs!r}: expected [[start, end], ...]")
    fields = SimpleNamespace(
        mode=mode,
        intervals=ivs,
        period_s=t.get("period_s", 0.0),
        mean_on_s=t.get("mean_on_s", 0.0),
        mean_off_s=t.get("mean_off_s", 0.0),
    )
    _check_availability(fields, where, "availability.")
    return Availability(
        mode,
        tuple((iv[0], iv[1]) for iv in ivs),
        fields.period_s,
        fields.mean_on_s,
        fields.mean_off_s,
    )


def _toml_failure(raw: Any, where: str) -> Failure:
    mode, t = _sub_table(raw, where, "failure", _FAIL_KEYS, "none")
    if mode == "none":
        return Failure()
    name = _FAIL_KEYS[mode][1]
    if name not in t:
        raise _bad(where, f"field 'failure.{name}' is missing (needed by mode {mode})")
    fields = SimpleNamespace(mode=mode, at_s=t.get("at_s", 0.0), mtbf_s=t.get("mtbf_s", 0.0))
    _check_failure(fields, where, "failure.")
    return Failure(mode, fields.at_s, fields.mtbf_s)


# -- CSV ----------------------------------------------------------------------------------
CSV_COLUMNS: tuple[str, ...] = (
    "name",
    "kind",
    "speed",
    "s_per_sample",
    "compute_ms_per_sample",
    "computation",
    "up_bps",
    "up_kbps",
    "down_bps",
    "down_kbps",
    "communication",
    "latency_s",
    "mem_cap",
    "jitter",
    "mean_on_s",
    "mean_off_s",
    "mtbf_s",
    "crash_at_s",
    "client_id",
)
"""Columns a CSV trace may have (``client_id`` is read and ignored)."""


def _load_csv(path: Path, n: int) -> list[Profile]:
    text = _read_text(path)
    header: list[str] | None = None
    header_line = 0
    rows: list[tuple[int, list[str]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            cells = next(csv.reader([line], strict=True))
        except csv.Error as e:
            raise _bad(f"{path}, line {lineno}", f"does not parse as CSV: {e}") from None
        cells = [c.strip() for c in cells]
        if header is None:
            header, header_line = cells, lineno
        else:
            rows.append((lineno, cells))
    if header is None:
        raise _bad(str(path), "empty file: expected a header line and device rows")
    where_h = f"{path}, header (line {header_line})"
    seen: set[str] = set()
    for c in header:
        if c not in CSV_COLUMNS:
            raise _bad(where_h, _unknown(c, CSV_COLUMNS, "column"))
        if c in seen:
            raise _bad(where_h, f"column '{c}' appears twice")
        seen.add(c)
    cols = set(header)
    missing = []
    if not cols & set(_COMPUTE_KEYS):
        missing.append(" or ".join(f"'{k}'" for k in _COMPUTE_KEYS))
    if not cols & set(_UP_KEYS):
        missing.append(" or ".join(f"'{k}'" for k in _UP_KEYS))
    if not cols & set(_DOWN_KEYS):
        missing.append(" or ".join(f"'{k}'" for k in _DOWN_KEYS))
    if missing:
        raise _bad(where_h, "missing column " + "; missing column ".join(missing))
    if ("mean_on_s" in cols) != ("mean_off_s" in cols):
        raise _bad(where_h, "columns 'mean_on_s' and 'mean_off_s' go together")
    if not rows:
        raise _bad(str(path), "no device rows after the header")
    profiles: list[Profile] = []
    for r, (lineno, cells) in enumerate(rows, start=1):
        where = f"{path}, row {r} (line {lineno})"
        if len(cells) != len(header):
            raise _bad(where, f"{len(cells)} values, but the header has {len(header)} columns")
        raw: dict[str, Any] = {}
        for c, s in zip(header, cells):
            if c != "client_id" and s != "":  # an empty cell = the column's default
                raw[c] = _csv_value(c, s, where)
        for group in (_COMPUTE_KEYS, _UP_KEYS, _DOWN_KEYS):
            if not any(k in raw for k in group):
                have = [f"'{k}'" for k in group if k in cols]
                raise _bad(where, f"field {' / '.join(have)} is empty")
        avail = Availability()
        if "mean_on_s" in raw or "mean_off_s" in raw:
            if not ("mean_on_s" in raw and "mean_off_s" in raw):
                raise _bad(where, "fields 'mean_on_s' and 'mean_off_s' go together")
            on, off = raw.pop("mean_on_s"), raw.pop("mean_off_s")
            for k, v in (("mean_on_s", on), ("mean_off_s", off)):
                if v <= 0:
                    raise _bad(where, f"field '{k}' = {_csv_repr(k, v)}: must be > 0")
            avail = Availability("random", mean_on_s=on, mean_off_s=off)
        fail = Failure()
        if "mtbf_s" in raw and "crash_at_s" in raw:
            raise _bad(where, "give one of mtbf_s, crash_at_s, not both")
        if "mtbf_s" in raw:
            v = raw.pop("mtbf_s")
            if v <= 0:
                raise _bad(where, f"field 'mtbf_s' = {_csv_repr('mtbf_s', v)}: must be > 0")
            fail = Failure("mtbf", mtbf_s=v)
        if "crash_at_s" in raw:
            v = raw.pop("crash_at_s")
            if v < 0:
                raise _bad(
                    where, f"field 'crash_at_s' = {_csv_repr('crash_at_s', v)}: must be >= 0"
                )
            fail = Failure("crash", at_s=v)
        kw = _normalise(raw, where, lambda k, v: f"field '{k}' = {_csv_repr(k, v)}")
        kw.setdefault("name", f"trace-{r}")
        kw.setdefault("latency_s", 0.0)
        profiles.append(Profile(**kw, availability=avail, failure=fail))
    return [profiles[d % len(profiles)] for d in range(n)]


def _csv_repr(k: str, v: Any) -> str:
    return repr(v) if k in _STR_KEYS else f"{v:g}" if isinstance(v, float) else str(v)


def _csv_value(c: str, s: str, where: str) -> Any:
    if c in _STR_KEYS:
        return s
    if c in _INT_KEYS:
        try:
            return int(s)
        except ValueError:
            raise _bad(where, f"field '{c}' = {s!r}: expected an integer") from None
    try:
        v = float(s)
    except ValueError:
        raise _bad(where, f"field '{c}' = {s!r}: expected a number") from None
    if not math.isfinite(v):
        raise _bad(where, f"field '{c}' = {s!r}: expected a finite number")
    return v


# -- calibration --------------------------------------------------------------------------
def calibrate_reference(
    model: Any,
    data_sample: Any,
    batch_size: int,
    steps: int,
    task: str = "classification",
    lr: float = 0.01,
    repeats: int = 3,
) -> float:
    """Measure this machine's seconds per training sample for ``model`` (torch, CPU).

    Args:
        model: a torch ``nn.Module``; a deep copy is trained, the original is untouched.
        data_sample: ``(X, Y)`` tensors (or a ``TensorDataset`` of two) to draw batches from;
            batches cycle through it in order.
        batch_size: samples per step (>= 1; capped at the sample size).
        steps: timed SGD steps per repeat (>= 1); ``max(1, steps // 10)`` untimed warm-up
            steps run first.
        task: ``"classification"`` (default) or ``"lm"``, as in edgefl.models.train.
        lr: SGD step size of the throwaway copy (default 0.01).
        repeats: timed blocks of ``steps`` steps (default 3); the fastest block counts, as
            other load on the machine only ever slows a block down.

    Returns wall-clock seconds per sample (forward + backward + update) with the current
    torch thread setting. Used once, to turn profile speeds into virtual seconds when
    ``sim.reference_s_per_sample`` is 0; the result depends on this machine, so record it in
    the run directory.
    """
    import copy

    import torch
    from torch.utils.data import TensorDataset

    from ..models.train import loss_fn
    from ..training.eager import optimizer_step, zero_grad

    if isinstance(data_sample, TensorDataset):
        X, Y = data_sample.tensors[0], data_sample.tensors[1]
    else:
        X, Y = data_sample
    n = int(X.shape[0])
    if n < 1 or batch_size < 1 or steps < 1 or repeats < 1:
        raise ValueError(
            "calibrate_reference needs samples, batch_size, steps and repeats >= 1, got "
            f"{n}, {batch_size}, {steps}, {repeats}"
        )
    bs = min(batch_size, n)
    net = copy.deepcopy(model).cpu().train()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
    X, Y = X.cpu(), Y.cpu()
    k = 0

    def step() -> None:
        nonlocal k
        start = (k * bs) % n
        k += 1
        idx = torch.arange(start, start + bs) % n
        zero_grad(opt)
        loss_fn(net(X[idx]), Y[idx], task).backward()
        optimizer_step(opt)

    for _ in range(max(1, steps // 10)):  # warm-up: allocations, lazy initialisation
        step()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, time.perf_counter() - t0)
    return best / (steps * bs)


__all__ = [
    "BUILTIN_SETS",
    "CSV_COLUMNS",
    "KEY",
    "REFERENCE",
    "Availability",
    "Failure",
    "Profile",
    "apportion",
    "calibrate_reference",
    "jitter_factor",
    "load_fleet",
]
