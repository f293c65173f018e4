"""Per-device timelines: intervals of download, compute, upload, waiting, offline and dead.

The coordinator records each task's busy intervals as it plans or observes them; at the end
of the run :meth:`Timeline.finish` fills in the rest of every device's time: *offline* and
*dead* from its profile (virtual clock), and *waiting* (online, alive, not busy: time spent
waiting on the coordinator) for what is left. The idle fraction of a device is its waiting
time over its online, alive time.

On the virtual clock the busy intervals are the planned download, compute and upload of
each task; on the wall clock they are the measured compute seconds each update reports,
ending at its arrival (:func:`edgefl.runtime.planning.observed`). A checkpoint holds the
busy intervals (:meth:`Timeline.state_dict`), so a resumed run's timeline covers the whole
run from second 0.
"""

from __future__ import annotations

import csv
import math
from array import array
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

STATES = ("download", "compute", "upload", "waiting", "offline", "dead")


class Timeline:
    """Intervals per device, in seconds (virtual or wall) since the start of the run."""

    def __init__(self) -> None:
        self._clear()
        self.rows: list[tuple[int, str, float, float]] = []
        self.idle: dict[int, float] = {}
        self._sums: tuple[list[float], list[float]] = ([], [])  # per device: waiting, present
        self.origin = 0.0  # the first second covered (> 0 only after an old checkpoint)

    def add(self, device: int, state: str, start: float, end: float) -> None:
        """A busy interval of ``device`` (``state`` one of download, compute, upload) from
        ``start`` to ``end`` seconds; empty ones are ignored."""
        if end > start:
            self._dev.append(device)
            self._state.append(STATES.index(state))
            self._start.append(start)
            self._end.append(end)

    def _clear(self) -> None:
        # (the busy intervals as columns, in the order they were added: 25 bytes an
        # interval, where a tuple per interval in a list per device took about 120)
        self._dev, self._state = array("q"), array("b")
        self._start, self._end = array("d"), array("d")

    def _columns(self) -> tuple[np.ndarray, ...]:
        """(device, state index, start_s, end_s) of every busy interval, by device (stable:
        each device's in the order they were added)."""
        dev = np.array(self._dev, np.int64)
        order = np.argsort(dev, kind="stable")
        start, end = np.array(self._start, np.float64), np.array(self._end, np.float64)
        return dev[order], np.array(self._state, np.int8)[order], start[order], end[order]

    @property
    def busy(self) -> dict[int, list[tuple[str, float, float]]]:
        """The busy intervals so far: device -> [(state, start_s, end_s), ...] in the order
        they were added, devices in increasing order."""
        out: dict[int, list[tuple[str, float, float]]] = {}
        for d, k, a, b in zip(*(c.tolist() for c in self._columns()), strict=True):
            out.setdefault(d, []).append((STATES[k], a, b))
        return out

    def state_dict(self) -> dict:
        """The busy intervals so far (for a checkpoint): ``busy`` is an (N, 4) float64 array
        of rows (device, index in STATES, start_s, end_s), ``origin`` the first second."""
        columns = self._columns()
        busy = np.empty((len(columns[0]), 4), np.float64)  # (filled column by column:
        for j, col in enumerate(columns):  # stacking the columns made three more copies)
            busy[:, j] = col
        return {"busy": busy, "origin": float(self.origin)}

    def load_state_dict(self, state: dict | None, now: float, keep_future: bool) -> None:
        """Take back the busy intervals of a checkpoint taken at ``now`` seconds.

        ``keep_future``: keep the parts after ``now`` too (the tasks in flight go on as
        planned); False cuts them off (those tasks start again). A checkpoint without a
        timeline (an older edgefl) leaves it empty, covering the run from ``now`` on.
        """
        self._clear()
        if state is None:
            self.origin = float(now)
            return
        busy = state.get("busy")
        if not isinstance(busy, np.ndarray) or busy.ndim != 2 or busy.shape[1] != 4:
            raise CheckpointError("checkpoint entry 'timeline/busy' is not an (N, 4) array")
        self.origin = float(state.get("origin", 0.0))
        for d, k, a, b in busy.tolist():
            if not (0 <= k < len(STATES) and math.isfinite(a) and math.isfinite(b)):
                raise CheckpointError(
                    f"checkpoint entry 'timeline/busy' has a bad row {d, k, a, b}"
                )
            self.add(int(d), STATES[int(k)], a, b if keep_future else min(b, now))

    def finish(
        self,
        devices: list[int],
        end: float,
        profiles=None,
        seed: int = 0,
        csv_path: Path | None = None,
    ) -> None:
        """Complete every device's timeline from :attr:`origin` up to ``end`` seconds.

        ``profiles`` (device -> Profile, virtual clock only) give the offline and dead
        intervals; without them a device is online and alive throughout. With ``csv_path``
        the rows go straight into that file (as :meth:`write_csv` writes them) and are not
        kept: a long run of a large fleet has millions of them (10,000 devices for 60 BSP
        rounds: 3.6 million, about 400 MB as tuples). :attr:`idle` and
        :meth:`idle_fraction` are set either way.
        """
        self._sums = ([], [])
        rows = self._rows(devices, end, profiles, seed)
        if csv_path is None:
            self.rows = list(rows)
        else:
            self.rows = []
            _write_rows(csv_path, rows)

    def _rows(self, devices: list[int], end: float, profiles, seed: int):
        """:meth:`finish`'s rows, device by device (a generator that sets :attr:`idle` and
        the sums of :meth:`idle_fraction` as it goes)."""
        dev, state, starts, ends = self._columns()
        waits, presents = self._sums
        for d in devices:
            lo, hi = np.searchsorted(dev, d, "left"), np.searchsorted(dev, d, "right")
            mine = zip(state[lo:hi].tolist(), starts[lo:hi].tolist(), ends[lo:hi].tolist(),
                       strict=True)  # fmt: skip
            busy = sorted((a, min(b, end), STATES[k]) for k, a, b in mine if a < end)
            away = _away(profiles[d], seed, d, end) if profiles is not None else []
            spans = [(a, b, s) for a, b, s in busy] + [(a, b, s) for s, a, b in away]
            spans = sorted((max(a, self.origin), b, s) for a, b, s in spans if b > self.origin)
            t = self.origin
            waiting = 0.0
            present = 0.0
            for a, b, s in spans:
                if a > t:
                    yield (d, "waiting", t, a)
                    waiting += a - t
                    present += a - t
                a = max(a, t)
                if b > a:
                    yield (d, s, a, b)
                    if s not in ("offline", "dead"):
                        present += b - a
                    t = b
            if end > t:
                yield (d, "waiting", t, end)
                waiting += end - t
                present += end - t
            self.idle[d] = waiting / present if present > 0 else 0.0
            waits.append(waiting)
            presents.append(present)

    def idle_fraction(self) -> float:
        """Overall idle fraction: total waiting time over total online, alive time (of the
        last :meth:`finish`)."""
        waits, presents = self._sums
        tot = sum(presents)
        return sum(waits) / tot if tot > 0 else 0.0

    def write_csv(self, path: Path) -> None:
        """``device,state,start_s,end_s`` rows, sorted by device then start."""
        _write_rows(path, self.rows)


def _write_rows(path: Path, rows) -> None:
    """timeline.csv of ``rows`` (an iterable of (device, state, start_s, end_s)): to a
    temporary file, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["device", "state", "start_s", "end_s"])
        for d, s, a, b in rows:
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
