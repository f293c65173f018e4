"""Ranks 1..S with ``ps.servers = S > 0``: one server shard of a sharded server group.

The parameter server of Li et al. (OSDI 2014) partitions the model's keys over a group of
server nodes; workers push and pull each key range at the node that owns it, and a server
manager keeps control. Here rank 0 is the manager (it runs the consistency policy, decides
which updates make a round, evaluates and checkpoints) and shard ``i`` (rank ``i + 1``) owns
keys ``even_ranges(numel, S)[i]`` of the flat model (:func:`edgefl.policies.keyrange.
even_ranges`). The messages (docs/parameter-server.md, "Sharded server group"):

- rank 0 -> shard ``SHARD_MODEL`` (round = version): the shard's range at the start or on
  resume;
- rank 0 -> shard ``SHARD_PULL`` (aux = (rank, version)): send your range of that version to
  that worker rank (``SHARD_MODEL``, aux = (start, stop, 0, 0));
- worker -> shard ``SHARD_PUSH`` (device, round = task, aux = (start, stop, base version)):
  the device's update restricted to the range; its length must be the range's size;
- rank 0 -> shard ``SHARD_APPLY`` (round = the new version; float64 rows (device, task,
  samples, loss)): aggregate those pieces (they may still be on their way) with the same
  aggregator and server step rank 0 would use, elementwise over the range, so the model is
  bit-identical to an unsharded run; the new range goes back to rank 0 (``SHARD_MODEL``);
- rank 0 -> shard ``HEARTBEAT``: reply ``SHARD_STATS`` (the shard's wire counters);
- ``STOP``: acknowledged with a ``HEARTBEAT`` like a worker.

No replication: a shard that dies ends the job (rank 0 stops with exit status 3 and a
checkpoint of the last complete version).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

import numpy as np

from ..comm import Kind, Message, Transport
from ..errors import EdgeflError
from ..policies.aggregation import Update
from ..policies.keyrange import even_ranges
from .policies import make_update_aggregator

log = logging.getLogger("edgefl.shard")


class Shard:
    """The loop of one server shard.

    Args:
        cfg: the effective config (``ps.servers`` > 0; checked by
            :func:`edgefl.runtime.policies.check_shards`).
        transport: this rank's transport (rank 1..S).
        numel: model size (float32 elements).
        signature: the model layout's signature (checked by rank 0 at registration).
    """

    def __init__(self, cfg: dict, transport: Transport, numel: int, signature: str) -> None:
        from ..policies.server_opt import make_server_optimizer

        self.cfg = cfg
        self.t = transport
        self.servers = cfg["ps"]["servers"]
        self.index = transport.rank - 1
        if not 0 <= self.index < self.servers:
            raise EdgeflError(f"rank {transport.rank} is not a server shard (ps.servers)")
        self.range = even_ranges(numel, self.servers)[self.index]
        self.signature = signature
        self.aggregator = make_update_aggregator(cfg, cfg["fleet"]["devices"])
        self.server_opt = make_server_optimizer(cfg["server"])
        self.model: np.ndarray | None = None  # the range's values of version self.version
        self.agg_buf = np.empty(self.range.size, np.float32)
        self.version = -1
        self.pieces: dict[tuple[int, int], np.ndarray] = {}  # (device, task) -> piece
        self.applies: list[tuple[int, np.ndarray]] = []  # (new version, rows) not done yet
        self.pulls: list[tuple[int, int]] = []  # (rank, version) not served yet
        self.applied = 0  # applies started (debug.kill_ranks counts them)
        self.doing = "set-up"

    def register(self) -> None:
        """Announce this shard (its index and key range) to rank 0."""
        info = {
            "rank": self.t.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "shard": self.index,
            "start": self.range.start,
            "stop": self.range.stop,
            "signature": self.signature,
        }
        payload = np.frombuffer(json.dumps(info).encode("utf-8"), np.uint8)
        self.t.send(0, Kind.REGISTER, payload=payload)

    def run(self) -> int:
        """Serve until STOP; returns the exit status rank 0 asks for (3 if it is gone)."""
        limit = 2 * self.cfg["comm"]["failure_timeout_s"]
        heard = time.monotonic()
        while True:
            msgs = self.t.poll(timeout=1.0)
            now = time.monotonic()
            if any(m.src == 0 for m in msgs):
                heard = now
            elif limit and now - heard > limit and not self.applies:
                self.t.declare_failed(0, f"silent for {limit:.0f} s (comm.failure_timeout_s x 2)")
            if 0 in self.t.take_failures() or 0 in self.t.failed:
                print(
                    f"edgefl: shard rank {self.t.rank}: the coordinator (rank 0) is gone; "
                    "this shard stops",
                    file=sys.stderr,
                    flush=True,
                )
                return 3
            for msg in msgs:
                if msg.kind == Kind.STOP:
                    self.t.send(0, Kind.HEARTBEAT)
                    self.t.wait_sends()
                    return int(msg.aux[0])
                self._handle(msg)
            self._progress()

    def _handle(self, msg: Message) -> None:
        k = msg.kind
        if k == Kind.SHARD_PUSH:
            self.doing = f"receiving device {msg.device}'s update of task {msg.round}"
            self._check_range(msg, "SHARD_PUSH")
            self.pieces[(msg.device, msg.round)] = np.array(msg.payload, np.float32)
        elif k == Kind.SHARD_MODEL and msg.src == 0:
            self._check_range(msg, "SHARD_MODEL")
            self.t.wait_sends()  # pulls of the old values must be out first
            self.model = np.array(msg.payload, np.float32)
            self.version = int(msg.round)
        elif k == Kind.SHARD_PULL:
            self.pulls.append((int(msg.aux[0]), int(msg.aux[1])))
        elif k == Kind.SHARD_APPLY:
            rows = np.array(msg.payload, np.float64).reshape(-1, 4)
            self.applies.append((int(msg.round), rows))
        elif k == Kind.HEARTBEAT and msg.src == 0:
            s = self.t.stats
            vals = (s.bytes_sent, s.bytes_recv, s.msgs_sent, s.msgs_recv)
            stats = np.array([float(sum(c.values())) for c in vals], np.float64)
            self.t.send(0, Kind.SHARD_STATS, payload=stats)
        else:
            log.warning("shard rank %d: ignoring %s from rank %d", self.t.rank, k.name, msg.src)
        self.t.release(msg)

    def _check_range(self, msg: Message, what: str) -> None:
        """A piece must be exactly this shard's range (else the job ends: values must never
        land on the wrong keys)."""
        r = self.range
        start, stop = int(msg.aux[0]), int(msg.aux[1])
        n = 0 if msg.payload is None else msg.payload.size
        if (start, stop) != (r.start, r.stop) or n != r.size:
            text = (
                f"shard rank {self.t.rank}: {what} from rank {msg.src} (device {msg.device}, "
                f"round {msg.round}) carries {n} values for keys [{start}, {stop}); this "
                f"shard owns [{r.start}, {r.stop}) ({r.size} keys)"
            )
            self.t.reject(msg.src, text)
            raise EdgeflError(text)

    def _progress(self) -> None:
        """Apply what can be applied (in order), then serve the pulls of held versions."""
        while self.applies:
            version, rows = self.applies[0]
            keys = [(int(r[0]), int(r[1])) for r in rows]
            if any(k not in self.pieces for k in keys):
                break  # pieces still on their way
            self.applies.pop(0)
            self._apply(version, rows, keys)
        left = []
        for rank, version in self.pulls:
            if version == self.version and self.model is not None:
                self.t.send(
                    rank, Kind.SHARD_MODEL, round=version,
                    aux=(float(self.range.start), float(self.range.stop), 0.0, 0.0),
                    payload=self.model,
                )  # fmt: skip
            elif version > self.version:
                left.append((rank, version))
            else:
                raise EdgeflError(
                    f"shard rank {self.t.rank}: rank {rank} pulls model version {version}; "
                    f"this shard holds version {self.version} only"
                )
        self.pulls = left

    def _apply(self, version: int, rows: np.ndarray, keys: list[tuple[int, int]]) -> None:
        """Aggregate the pieces named by ``rows`` into the range (as rank 0's ``_apply``
        does for the whole model: the same aggregator and server step, elementwise) and send
        the new values to rank 0 as ``version``."""
        if self.model is None:
            raise EdgeflError(f"shard rank {self.t.rank}: an apply before any model arrived")
        self.doing = f"applying model version {version}"
        self.applied += 1
        dbg = self.cfg["debug"]
        if self.t.rank in dbg["kill_ranks"] and self.applied >= dbg["kill_after_tasks"]:
            # fault-test hook: a shard dies at its kill_after_tasks-th apply (no replication)
            print(f"edgefl: debug.kill_ranks: shard rank {self.t.rank} kills itself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ups = [
            Update(k[0], self.pieces.pop(k), int(r[2]), float(r[3]), self.version)
            for k, r in zip(keys, rows)
        ]
        agg = self.aggregator.aggregate(ups, out=self.agg_buf)
        self.t.wait_sends()  # the current values may still be on their way to workers
        self.server_opt.step(self.model, agg)
        self.version = version
        # pieces of tasks older than the applied ones are of dropped tasks: forget them
        done = {d: t for d, t in keys}
        for k in [k for k in self.pieces if k[0] in done and k[1] <= done[k[0]]]:
            del self.pieces[k]
        self.t.send(
            0, Kind.SHARD_MODEL, round=version,
            aux=(float(self.range.start), float(self.range.stop), 0.0, 0.0), payload=self.model,
        )  # fmt: skip


__all__ = ["Shard"]
