"""Test hooks of a worker rank (config ``[debug]``): faults a test injects on purpose.

``debug.kill_ranks`` / ``kill_after_tasks`` (the rank SIGKILLs itself; in-process, its
thread dies and the loopback fabric reports it dead), ``debug.delay_s``
(random sleeps), ``debug.byzantine`` (scaled or sign-flipped updates), ``debug.inject``
(malformed messages sent once, on rank 1; again every ``inject_every`` tasks) and its
``duplicate`` (a re-delivered sequence number with garbage). Off by default.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..comm import Kind


class RankKilled(BaseException):
    """``debug.kill_ranks`` under the in-process backend: the rank's thread ends here (a
    BaseException, so no ``except Exception`` on the way reports it as an error)."""


class WorkerDebug:
    """The ``[debug]`` hooks of worker rank ``worker``."""

    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.cfg = worker.cfg["debug"]
        self.tasks_started = 0
        self._rng = random.SystemRandom()  # deliberately unseeded (a test hook)
        self.inject = list(self.cfg["inject"]) if worker.rank == 1 else []
        self.done: set[str] = set()

    def before_task(self) -> None:
        """A task starts: maybe die, re-arm the injections, or sleep."""
        dbg, rank = self.cfg, self.w.rank
        self.tasks_started += 1
        if rank in dbg["kill_ranks"] and self.tasks_started >= dbg["kill_after_tasks"]:
            print(f"edgefl: debug.kill_ranks: rank {rank} kills itself", flush=True)
            if self.w.out_dir:
                stamp = Path(self.w.out_dir) / f"kill-rank{rank}.time"
                stamp.write_text(repr(time.time()))
            fabric = getattr(self.w.t, "fabric", None)
            if fabric is not None:  # the in-process backend: this rank's thread dies
                fabric.kill(rank)
                raise RankKilled(rank)
            os.kill(os.getpid(), signal.SIGKILL)
        every = dbg["inject_every"]
        if every and rank == 1 and self.tasks_started % every == 0:
            self.inject = list(dbg["inject"])
        if dbg["delay_s"]:
            time.sleep(self._rng.random() * dbg["delay_s"])

    def alter(self, device: int, delta: np.ndarray) -> None:
        """A Byzantine device's update, scaled or sign-flipped in place."""
        if device in self.cfg["byzantine"]:
            k = self.cfg["byzantine_scale"]
            delta *= np.float32(-k if self.cfg["byzantine_mode"] == "signflip" else k)

    def forge(self, device: int, round_: int, delta: np.ndarray, aux: tuple) -> None:
        """Send the malformed messages of ``debug.inject`` once."""
        if not self.inject:
            return
        t, n = self.w.t, delta.size
        bad = {
            "bad-length": (device, np.zeros(n + 3, np.float32)),
            "bad-dtype": (device, np.zeros(n, np.float64)),
            "foreign-device": (self.w.cfg["fleet"]["devices"] + 7, np.zeros(n, np.float32)),
        }
        for what in self.inject:
            if what == "bad-kind":
                t.send(0, 99, device=device, round=round_)  # type: ignore[arg-type]
            elif what in bad:
                dev, payload = bad[what]
                t.send(0, Kind.UPDATE, device=dev, round=round_, aux=aux, payload=payload)
        self.done = set(self.inject)
        self.inject = []
        t.wait_sends()

    def duplicate(self, device: int, round_: int, delta: np.ndarray, aux: tuple, seq) -> None:
        """Re-deliver sequence number ``seq`` with garbage: the receiver must ignore it."""
        if "duplicate" in self.done:
            junk = np.full_like(delta, 1e6)
            self.w.t.send(0, Kind.UPDATE, device=device, round=round_, aux=aux, payload=junk,
                          seq=seq)  # fmt: skip
            self.done.discard("duplicate")
