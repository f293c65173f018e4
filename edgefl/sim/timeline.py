"""Per-device timelines: intervals of download, compute, upload, waiting, offline and dead.

The coordinator records each task's busy intervals as it plans or observes them; at the end
of the run :meth:`Timeline.finish` fills in the rest of every device's time: *offline* and
*dead* from its profile (virtual clock), and *waiting* (online, alive, not busy: time spent
waiting on the coordinator) for what is left. The idle fraction of a device is its waiting
time over its online, alive time.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

STATES = ("download", "compute", "upload", "waiting", "offline", "dead")


class Timeline:
    """Intervals per device, in seconds (virtual or wall) since the start of the run."""

    def __init__(self) -> None:
        self.busy: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
        self.rows: list[tuple[int, str, float, float]] = []
        self.idle: dict[int, float] = {}

    def add(self, device: int, state: str, start: float, end: float) -> None:
        if end > start:
            self.busy[device].append((state, start, end))

    def finish(self, devices: list[int], end: float, profiles=None, seed: int = 0) -> None:
        """Complete every device's timeline up to ``end`` seconds.

        ``profiles`` (device -> Profile, virtual clock only) give the offline and dead
        intervals; without them a device is online and alive throughout.
        """
        rows: list[tuple[int, str, float, float]] = []
        for d in devices:
            busy = sorted((a, min(b, end), s) for s, a, b in self.busy.get(d, []) if a < end)
            away = _away(profiles[d], seed, d, end) if profiles is not None else []
            spans = [(a, b, s) for a, b, s in busy] + [(a, b, s) for s, a, b in away]
            spans.sort()
            t = 0.0
            waiting = 0.0
            present = 0.0
            for a, b, s in spans:
                if a > t:
                    rows.append((d, "waiting", t, a))
                    waiting += a - t
                    present += a - t
                a = max(a, t)
                if b > a:
                    rows.append((d, s, a, b))
                    if s not in ("offline", "dead"):
                        present += b - a
                    t = b
            if end > t:
                rows.append((d, "waiting", t, end))
                waiting += end - t
                present += end - t
            self.idle[d] = waiting / present if present > 0 else 0.0
        self.rows = rows

    def idle_fraction(self) -> float:
        """Overall idle fraction: total waiting time over total online, alive time."""
        wait = defaultdict(float)
        present = defaultdict(float)
        for d, s, a, b in self.rows:
            if s == "waiting":
                wait[d] += b - a
            if s not in ("offline", "dead"):
                present[d] += b - a
        tot = sum(present.values())
        return sum(wait.values()) / tot if tot > 0 else 0.0

    def write_csv(self, path: Path) -> None:
        """``device,state,start_s,end_s`` rows, sorted by device then start."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["device", "state", "start_s", "end_s"])
            for d, s, a, b in self.rows:
                w.writerow([d, s, repr(float(a)), repr(float(b))])
        tmp.replace(path)


def _away(profile, seed: int, device: int, end: float) -> list[tuple[str, float, float]]:
    """Offline and dead intervals of ``device`` within [0, end)."""
    out = []
    crash = profile.failure.crash_time(seed, device)
    stop = min(end, crash)
    av = profile.availability
    t = 0.0
    while t < stop:
        if av.is_online(t, seed, device):
            t = av.online_until(t, seed, device)
            if t == math.inf:
                break
        else:
            n = av.next_online(t, seed, device)
            out.append(("offline", t, min(n, stop)))
            t = n
    if crash < end:
        out.append(("dead", crash, end))
    return out


def read_csv(path: Path) -> list[tuple[int, str, float, float]]:
    """Read a ``timeline.csv`` back (for ``edgefl report``)."""
    with open(path, newline="", encoding="utf-8") as f:
        r = csv.reader(f)
        next(r, None)
        return [(int(d), s, float(a), float(b)) for d, s, a, b in r]


__all__ = ["STATES", "Timeline", "read_csv"]
