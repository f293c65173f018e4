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
- with a stateful server optimizer (fedavgm, fedadam, fedyogi, fedadagrad) every range's
  optimizer state goes with it, one ``SHARD_MODEL`` per slot (aux3 = 1, 2, ...;
  :data:`OPT_SLOTS`), and rank 0 sends it back the same way at a resume and after a failover;
- rank 0 -> shard ``HEARTBEAT``: reply ``SHARD_STATS`` (the shard's wire counters);
- ``STOP``: acknowledged with a ``HEARTBEAT`` like a worker.

- shard -> shard ``SHARD_REPLICA`` (``ps.replicas = k > 1``; round = version, aux = (start,
  stop)): aggregate-then-replicate (Li et al., OSDI 2014, section 4.3): once an owner holds a
  version of a range (from rank 0, or after an apply) it sends the range to the range's next
  k - 1 live holders in ring order, which keep its two latest versions;
- rank 0 -> shard ``SHARD_OWNERS`` (round = version v, aux0 = epoch; float64 owner rank of
  every range): a shard died; from now on the listed owners serve the ranges. Every shard
  drops its pending applies, pulls and pieces, sets each range it owns to version v (its own
  values, or its replica) and answers ``SHARD_OWNERS`` (float64 [1] if it held version v of
  all of them, [0] if not).

With k = 1 a shard that dies ends the job (rank 0 stops with exit status 3 and a checkpoint
of the last complete version); with k > 1 rank 0 fails the range over to a live holder and
re-runs the round (docs/parameter-server.md, "Replication and failover").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from ..comm import Kind, Message, Transport
from ..comm.wire import HEADER_BYTES
from ..errors import EdgeflError
from ..policies.aggregation import Update
from ..policies.keyrange import even_ranges
from ..runtime.policies import make_update_aggregator
from .kinds import (
    SHARD_APPLY,
    SHARD_MODEL,
    SHARD_OWNERS,
    SHARD_PULL,
    SHARD_PUSH,
    SHARD_REPLICA,
    SHARD_STATS,
)

log = logging.getLogger("edgefl.shard")

# Per-key state of the built-in server optimizers, slot by slot: (its name in the
# optimizer's state_dict, the attribute holding it). A shard keeps one optimizer per range
# it owns and sends the range's state to rank 0 with every new range (SHARD_MODEL, aux3 =
# the slot's number, 1, 2, ...), so rank 0's optimizer always holds the whole state of the
# last complete version: checkpoints hold it, and a resume or a failover sends it back to
# the ranges' owners (rank 0 -> shard SHARD_MODEL with aux3 = the slot's number).
OPT_SLOTS: dict[str, tuple[tuple[str, str], ...]] = {
    "sgd": (),
    "fedavgm": (("momentum", "b"),),
    "fedadam": (("m", "m"), ("v", "v")),
    "fedyogi": (("m", "m"), ("v", "v")),
    "fedadagrad": (("m", "m"), ("v", "v")),
}


def opt_slots(cfg: dict) -> tuple[tuple[str, str], ...]:
    """The per-key state slots of the configured server optimizer (none for sgd)."""
    return OPT_SLOTS.get(cfg["server"]["optimizer"], ())


def range_holders(index: int, servers: int, replicas: int) -> list[int]:
    """Shard ranks that hold range ``index`` (0-based): its owner ``index + 1``, then the
    next ``replicas - 1`` shards in ring order (rank ``(index + j) % servers + 1``)."""
    return [(index + j) % servers + 1 for j in range(replicas)]


def fail_over(owners: list[int], dead: set[int], servers: int, replicas: int) -> list[int] | None:
    """The owner map after the shard ranks in ``dead`` failed: each range whose owner is dead
    goes to its first live holder in ring order (:func:`range_holders`); None if some range
    has no live holder left (k = 1, or all k holders dead)."""
    new = []
    for i, o in enumerate(owners):
        if o not in dead:
            new.append(o)
            continue
        live = [h for h in range_holders(i, servers, replicas) if h not in dead]
        if not live:
            return None
        new.append(live[0])
    return new


class Shard:
    """The loop of one server shard.

    Args:
        cfg: the effective config (``ps.servers`` > 0; checked by
            :func:`edgefl.runtime.policies.check_shards`); ``ps.replicas`` (default 1) copies
            of every range are kept.
        transport: this rank's transport (rank 1..S).
        numel: model size (float32 elements).
        signature: the model layout's signature (checked by rank 0 at registration).
    """

    def __init__(self, cfg: dict, transport: Transport, numel: int, signature: str) -> None:
        self.cfg = cfg
        self.t = transport
        self.servers = cfg["ps"]["servers"]
        self.replicas = int(cfg["ps"].get("replicas", 1))
        self.index = transport.rank - 1
        if not 0 <= self.index < self.servers:
            raise EdgeflError(f"rank {transport.rank} is not a server shard (ps.servers)")
        self.ranges = even_ranges(numel, self.servers)
        self.range = self.ranges[self.index]
        self.by_bounds = {(r.start, r.stop): i for i, r in enumerate(self.ranges)}
        self.owners = list(range(1, self.servers + 1))  # owner rank of every range
        self.epoch = 0  # owner-map epoch (SHARD_OWNERS)
        self.dead: set[int] = set()
        self.signature = signature
        self.aggregator = make_update_aggregator(cfg, cfg["fleet"]["devices"])
        # one server optimizer per owned range (its per-key state is the range's only)
        self.opts: dict[int, Any] = {}
        self.slots = opt_slots(cfg)
        # ranges this shard owns: index -> values of version self.version
        self.own: dict[int, np.ndarray] = {}
        self.prev: dict[int, tuple[int, np.ndarray]] = {}  # index -> (older version, values)
        # ranges this shard replicates: index -> {version: values} (the two latest)
        self.replica: dict[int, dict[int, np.ndarray]] = {}
        self.agg_bufs: dict[int, np.ndarray] = {}
        self.version = -1
        self.pieces: dict[tuple[int, int, int], np.ndarray] = {}  # (range, device, task)
        # rank 0's requests not done yet, in the order it sent them: ("apply", new version,
        # rows) and ("pull", rank, version)
        self.todo: deque[tuple[str, int, Any]] = deque()
        self.applied = 0  # applies started (debug.kill_ranks counts them)
        self.replica_bytes = 0  # SHARD_REPLICA bytes sent (header included)
        self.doing = "set-up"

    @property
    def model(self) -> np.ndarray | None:
        """The values of this shard's own range (None before the first SHARD_MODEL)."""
        return self.own.get(self.index)

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
            elif limit and now - heard > limit and not self.todo:
                self.t.declare_failed(0, f"silent for {limit:.0f} s (comm.failure_timeout_s x 2)")
            failures = self.t.take_failures()
            if 0 in failures or 0 in self.t.failed:
                print(
                    f"edgefl: shard rank {self.t.rank}: the coordinator (rank 0) is gone; "
                    "this shard stops",
                    file=sys.stderr,
                    flush=True,
                )
                return 3
            self.dead.update(r for r in failures if 1 <= r <= self.servers)
            for msg in msgs:
                if msg.kind == Kind.STOP:
                    self.t.send(0, Kind.HEARTBEAT)
                    self.t.wait_sends()
                    return int(msg.aux[0])
                self._handle(msg)
            self._progress()

    def _handle(self, msg: Message) -> None:
        k = msg.kind
        if k == SHARD_PUSH:
            self.doing = f"receiving device {msg.device}'s update of task {msg.round}"
            i = self._check_range(msg, "SHARD_PUSH", owned=True)
            self.pieces[(i, msg.device, msg.round)] = np.array(msg.payload, np.float32)
        elif k == SHARD_MODEL and msg.src == 0 and int(msg.aux[3]) > 0:
            # the optimizer state of a range this shard owns (start, resume, failover)
            i = self._check_range(msg, "SHARD_MODEL", owned=True)
            slot = int(msg.aux[3]) - 1
            if slot >= len(self.slots):
                opt = self.cfg["server"]["optimizer"]
                raise EdgeflError(
                    f"shard rank {self.t.rank}: optimizer state slot {slot + 1} from rank 0; "
                    f"{opt} has {len(self.slots)}"
                )
            setattr(self._opt(i), self.slots[slot][1], np.array(msg.payload, np.float32))
        elif k == SHARD_MODEL and msg.src == 0:
            self._check_range(msg, "SHARD_MODEL", owned=True)
            self.t.wait_sends()  # pulls of the old values must be out first
            self._set_version(int(msg.round), {self.index: np.array(msg.payload, np.float32)})
        elif k == SHARD_REPLICA:
            i = self._check_range(msg, "SHARD_REPLICA", owned=False)
            held = self.replica.setdefault(i, {})
            held[int(msg.round)] = np.array(msg.payload, np.float32)
            for v in sorted(held)[:-2]:
                del held[v]
        elif k == SHARD_OWNERS and msg.src == 0:
            self._take_owners(msg)
        elif k == SHARD_PULL:
            self.todo.append(("pull", int(msg.aux[0]), int(msg.aux[1])))
        elif k == SHARD_APPLY:
            rows = np.array(msg.payload, np.float64).reshape(-1, 4)
            self.todo.append(("apply", int(msg.round), rows))
        elif k == Kind.HEARTBEAT and msg.src == 0:
            s = self.t.stats
            vals = (s.bytes_sent, s.bytes_recv, s.msgs_sent, s.msgs_recv)
            stats = [float(sum(c.values())) for c in vals] + [float(self.replica_bytes)]
            self.t.send(0, SHARD_STATS, payload=np.array(stats, np.float64))
        else:
            log.warning("shard rank %d: ignoring %s from rank %d", self.t.rank, k.name, msg.src)
        self.t.release(msg)

    def _check_range(self, msg: Message, what: str, owned: bool) -> int:
        """A piece must be exactly one range this shard owns (``owned``) or replicates (else
        the job ends: values must never land on the wrong keys); returns its index."""
        start, stop = int(msg.aux[0]), int(msg.aux[1])
        n = 0 if msg.payload is None else msg.payload.size
        i = self.by_bounds.get((start, stop), -1)
        if owned:
            mine = self.index if what == "SHARD_MODEL" else -1
            ok = i == mine or (i >= 0 and self.owners[i] == self.t.rank)
        else:
            ok = i >= 0 and self.t.rank in range_holders(i, self.servers, self.replicas)[1:]
        if not ok or n != self.ranges[i].size:
            r = self.range
            text = (
                f"shard rank {self.t.rank}: {what} from rank {msg.src} (device {msg.device}, "
                f"round {msg.round}) carries {n} values for keys [{start}, {stop}); this "
                f"shard owns [{r.start}, {r.stop}) ({r.size} keys)"
            )
            self.t.reject(msg.src, text)
            raise EdgeflError(text)
        return i

    def _set_version(self, version: int, values: dict[int, np.ndarray]) -> None:
        """The owned ranges now hold ``version`` (``values``: index -> range); the older
        values are kept for a rollback and the new ones replicated (ps.replicas > 1)."""
        if self.replicas > 1:
            for i, a in self.own.items():
                self.prev[i] = (self.version, a)
        self.own = values
        self.version = version
        for i, a in sorted(values.items()):
            r = self.ranges[i]
            for h in range_holders(i, self.servers, self.replicas)[1:]:
                if h == self.t.rank or h in self.dead:
                    continue
                self.t.send(
                    h, SHARD_REPLICA, round=version,
                    aux=(float(r.start), float(r.stop), 0.0, 0.0), payload=a,
                )  # fmt: skip
                self.replica_bytes += HEADER_BYTES + a.nbytes

    def _take_owners(self, msg: Message) -> None:
        """SHARD_OWNERS: a shard died. Forget the in-flight round, own the listed ranges at
        version ``msg.round`` and answer whether this shard held that version of each."""
        version = int(msg.round)
        self.owners = [int(x) for x in msg.payload]
        self.epoch = int(msg.aux[0])
        self.dead.update(r for r in range(1, self.servers + 1) if r not in self.owners)
        self.todo.clear()
        self.pieces.clear()
        self.t.wait_sends()
        # rank 0 sends the optimizer state of version v for every range after the answers
        # (none before its first complete apply: the optimizers start afresh, as at v)
        self.opts.clear()
        values: dict[int, np.ndarray] = {}
        ok = True
        for i, o in enumerate(self.owners):
            if o != self.t.rank:
                continue
            if i in self.own and self.version == version:
                values[i] = self.own[i]
            elif i in self.prev and self.prev[i][0] == version:
                values[i] = self.prev[i][1]
            elif version in self.replica.get(i, {}):
                values[i] = self.replica[i][version].copy()
            else:
                ok = False
        if ok:
            self.prev.clear()
            self.own, self.version = values, version
            log.warning("shard rank %d: now owns ranges %s at version %d", self.t.rank,
                        sorted(values), version)  # fmt: skip
        self.t.send(0, SHARD_OWNERS, round=version, aux=(float(self.epoch), 0.0, 0.0, 0.0),
                    payload=np.array([1.0 if ok else 0.0], np.float64))  # fmt: skip

    def _progress(self) -> None:
        """Do rank 0's requests in the order it sent them: an apply once its pieces are in, a
        pull with the version current when it was asked. (Pulls once went after every apply
        that could be done: after a failover the workers already hold the version the round
        re-runs from and report at once, so a pull of it and the next apply came in one poll,
        the apply went first, and the pull named a version this shard no longer held.)"""
        while self.todo:
            what, a, b = self.todo[0]
            if what == "apply":
                keys = [(i, int(r[0]), int(r[1])) for i in self.own for r in b]
                if any(k not in self.pieces for k in keys):
                    return  # pieces still on their way
                self.todo.popleft()
                self._apply(a, b)
                continue
            rank, version = a, b
            if version > self.version or not self.own:
                return  # (that version is still to come)
            if version < self.version:
                raise EdgeflError(
                    f"shard rank {self.t.rank}: rank {rank} pulls model version {version}; "
                    f"this shard holds version {self.version} only"
                )
            self.todo.popleft()
            for i, v in sorted(self.own.items()):
                r = self.ranges[i]
                self.t.send(
                    rank, SHARD_MODEL, round=version,
                    aux=(float(r.start), float(r.stop), float(self.epoch), 0.0), payload=v,
                )  # fmt: skip

    def _apply(self, version: int, rows: np.ndarray) -> None:
        """Aggregate the pieces named by ``rows`` into every owned range (as rank 0's
        ``apply`` does for the whole model: the same aggregator and server step,
        elementwise), replicate the new ranges and send them to rank 0 as ``version``."""
        if not self.own:
            raise EdgeflError(f"shard rank {self.t.rank}: an apply before any model arrived")
        self.doing = f"applying model version {version}"
        self.applied += 1
        dbg = self.cfg["debug"]
        if self.t.rank in dbg["kill_ranks"] and self.applied >= dbg["kill_after_tasks"]:
            # fault-test hook: a shard dies at its kill_after_tasks-th apply
            print(f"edgefl: debug.kill_ranks: shard rank {self.t.rank} kills itself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        keys = [(int(r[0]), int(r[1])) for r in rows]
        self.t.wait_sends()  # the current values may still be on their way to workers
        new: dict[int, np.ndarray] = {}
        for i, cur in sorted(self.own.items()):
            ups = [
                Update(d, self.pieces.pop((i, d, t)), int(r[2]), float(r[3]), self.version)
                for (d, t), r in zip(keys, rows)
            ]
            buf = self.agg_bufs.get(i)
            if buf is None:
                buf = self.agg_bufs[i] = np.empty(cur.size, np.float32)
            agg = self.aggregator.aggregate(ups, out=buf)
            # a new array when the old values are kept for a rollback (ps.replicas > 1)
            val = cur.copy() if self.replicas > 1 else cur
            self._opt(i).step(val, agg)
            new[i] = val
        # pieces of tasks older than the applied ones are of dropped tasks: forget them
        done = dict(keys)
        for k in [k for k in self.pieces if k[1] in done and k[2] <= done[k[1]]]:
            del self.pieces[k]
        self._set_version(version, new)
        for i, a in sorted(new.items()):
            r = self.ranges[i]
            self.t.send(
                0, SHARD_MODEL, round=version,
                aux=(float(r.start), float(r.stop), float(self.epoch), 0.0), payload=a,
            )  # fmt: skip
            for j, (_name, attr) in enumerate(self.slots):  # the range's optimizer state
                self.t.send(
                    0, SHARD_MODEL, round=version,
                    aux=(float(r.start), float(r.stop), float(self.epoch), float(j + 1)),
                    payload=getattr(self.opts[i], attr).copy(),
                )  # fmt: skip

    def _opt(self, i: int) -> Any:
        """The server optimizer of range ``i`` (made on first use: fresh state)."""
        if i not in self.opts:
            from edgefl.algorithms.server_opt.optimizers import make_server_optimizer

            self.opts[i] = make_server_optimizer(self.cfg["server"])
        return self.opts[i]


__all__ = ["Shard", "fail_over", "range_holders"]
