"""A sharded server group (``ps.servers = S > 0``): rank 0's side and the workers' side.

Ranks 1..S own even key ranges of the model (:class:`~edgefl.server.shard.Shard`); workers
pull each range from its owner and push each range of their updates to it, and send rank 0
a REPORT with the update's header values. Rank 0 keeps control: it runs the consistency
policy, tells the shards which updates make a version (SHARD_APPLY), assembles the new
version for evaluation and checkpoints, and fails ranges over to replicas when a shard dies
(``ps.replicas = k > 1``; docs/parameter-server.md).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..comm import Kind, Message
from ..comm.wire import HEADER_BYTES
from ..errors import ConfigError, EdgeflError
from ..policies.consistency import Apply, Arrival, Decision, make_consistency
from ..policies.keyrange import even_ranges
from ..runtime.policies import SHARD_NEEDS
from .kinds import (
    SHARD_APPLY,
    SHARD_MODEL,
    SHARD_OWNERS,
    SHARD_PULL,
    SHARD_PUSH,
    SHARD_STATS,
)
from .local import LocalServer
from .shard import fail_over, opt_slots

if TYPE_CHECKING:  # (annotations only)
    from ..runtime.coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


class ShardedServer(LocalServer):
    """Rank 0's side of a sharded server group (see the module docstring)."""

    remote_updates = True  # rank 0 gets REPORTs; the values go to the shards
    # what the group needs of the rest of the config (declared as data, checked before any
    # rank starts; edgefl/runtime/policies.py, docs/composition.md)
    requires = SHARD_NEEDS

    def __init__(self, core: Coordinator) -> None:
        super().__init__(core)
        cfg = core.cfg
        self.servers = cfg["ps"]["servers"]
        self.first_worker = self.servers + 1
        self.shards = list(range(1, self.servers + 1))
        numel = core.global_model.size
        if self.servers > numel:
            raise ConfigError(
                f"config key 'ps.servers' = {self.servers}: more shards than model keys ({numel})"
            )
        self.ranges = even_ranges(numel, self.servers)
        self.stats: dict[int, dict] = {}
        # ps.replicas = k > 1: every range is also held by the next k - 1 shards; a dead
        # shard's ranges move to a live holder (owner map, epoch) and the round re-runs
        self.replicas = int(cfg["ps"].get("replicas", 1))
        self.owners = list(self.shards)  # owner rank of every range
        self.owner_epoch = 0
        self.failovers: list[dict] = []
        self.broken = False  # a failover happened during the current round
        self._rerun_dec: Decision | None = None
        self.wait_s = 0.0  # rank 0 waiting for the shards' new ranges, seconds
        self.snap: dict | None = None  # the state of the last complete version
        # per-key state of a stateful server optimizer: the shards send each range's with
        # every new range, and it lands in core.server_opt (checkpoints, resume, failover)
        self.slots = opt_slots(cfg)

    # -- the backend hooks ------------------------------------------------------------------
    def register(self, rank: int, info: dict) -> bool:
        """A server shard's REGISTER: it must own the expected key range of the same model."""
        if rank not in self.shards:
            return False
        r = self.ranges[rank - 1]
        got = (info.get("shard"), info.get("start"), info.get("stop"))
        if got != (rank - 1, r.start, r.stop):
            raise EdgeflError(
                f"shard rank {rank} registered as (shard, start, stop) = {got}, expected "
                f"{(rank - 1, r.start, r.stop)}"
            )
        self.core.check_signature(rank, info)
        self.core.t.validator.hosted[rank] = frozenset({-1})  # its messages name no device
        return True

    def start(self) -> None:
        """Every shard gets its range of the current global model (start or resume)."""
        core = self.core
        g = core.global_model
        for s, r in zip(self.shards, self.ranges):
            core.t.send(
                s, SHARD_MODEL, round=core.version,
                aux=(float(r.start), float(r.stop), 0.0, 0.0), payload=g[r.start : r.stop],
            )  # fmt: skip
        self._send_opt_state()  # (a resume: the checkpoint's optimizer state)
        if self.replicas > 1:  # a re-run of the first round starts here
            self._take_snap(time.monotonic() - core._t0, core.ev.now)

    def send_model(self, rank: int) -> bool:
        """The shards send their ranges of this version (SHARD_MODEL) to ``rank``."""
        core = self.core
        for s in sorted(set(self.owners)):
            core.t.send(s, SHARD_PULL, round=core.version,
                        aux=(float(rank), float(core.version)))  # fmt: skip
        return True

    def down_bytes(self, d: int) -> int:
        """One SHARD_MODEL per shard + TRAIN, and the values."""
        return (self.servers + 1) * HEADER_BYTES + self.core.global_model.nbytes

    def upload_header_bytes(self) -> int:
        return (self.servers + 1) * HEADER_BYTES  # S SHARD_PUSH pieces + the REPORT

    def update_bytes(self, msg: Any) -> int:
        return (self.servers + 1) * HEADER_BYTES + self.core.global_model.nbytes

    def apply(self, ap: Apply, now: float) -> bool:
        if ap.mode != "aggregate":
            raise EdgeflError(f"ps.servers: a '{ap.mode}' apply is not supported")
        if self.broken or not self._shard_apply(ap.arrivals):
            if self.broken and not self.core.stopped:
                self._rerun_round(ap.arrivals, now)
            return False  # else a shard failed for good: the run stops at this version
        return True

    def rerun(self, dec: Decision) -> Decision:
        if self._rerun_dec is not None:
            dec, self._rerun_dec = self._rerun_dec, None
        return dec

    def after_row(self, wall: float, now: float) -> None:
        self._take_snap(wall, now)  # what a checkpoint of this version holds

    def rank_failed(self, rank: int, now: float) -> Decision | None:
        core = self.core
        if rank not in self.shards:
            return None
        if self.replicas > 1:
            if rank in core.failed_ranks:
                return Decision()  # (reported twice)
            core.failed_ranks[rank] = now
            if self._fail_over(rank, now):
                return Decision()
        # no live copy of some range: stop at the last complete version (rank 0 holds it
        # and checkpoints it)
        core.failed_ranks[rank] = now
        core.stopped = (
            f"server shard rank {rank} failed; the sharded server group (ps.servers) has no "
            "live copy of its range (ps.replicas): resume from the latest checkpoint"
        )
        print(f"edgefl: {core.stopped}", flush=True)
        core.exit_status = 3
        snap = self.snap
        if core.out_dir is not None and snap is not None:
            # the state as it was when this version was made (before the next round's tasks
            # were dispatched), so a resume continues exactly as an uninterrupted run would
            core.policy.load_state_dict(json.loads(snap["policy"]))
            core.tasks, core.staleness = snap["tasks"], snap["staleness"]
            core.devices = snap["devices"]
            core.checkpoint(core.version, core.metrics.rows, snap["wall"], snap["now"])
        return Decision()

    def finish(self) -> None:
        """Every live shard's wire counters (asked by a HEARTBEAT)."""
        core = self.core
        if core.stopped and core.failed_ranks.keys() & set(self.shards):
            return
        core.t.wait_sends()
        for s in self.shards:
            if s not in core.failed_ranks:
                core.t.send(s, Kind.HEARTBEAT)
        got = self._from_shards(SHARD_STATS, None)
        names = ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv", "replica_bytes")
        for s, msgs in sorted((got or {}).items()):
            for msg in msgs:
                v = [int(x) for x in msg.payload[:5]]
                self.stats[s] = dict(zip(names, v, strict=False))
                core.t.release(msg)

    def summary(self) -> dict:
        st = self.core.t.stats
        return {"ps": {
            "servers": self.servers,
            "ranges": [[r.start, r.stop] for r in self.ranges],
            "rank0": {"bytes_sent": sum(st.bytes_sent.values()),
                      "bytes_recv": sum(st.bytes_recv.values())},
            "shards": {str(k): v for k, v in sorted(self.stats.items())},
            "shard_wait_s": self.wait_s,
            "replicas": self.replicas,
            "replica_bytes": sum(v.get("replica_bytes", 0) for v in self.stats.values()),
            "owners": list(self.owners),
            "failovers": self.failovers,
        }}  # fmt: skip

    # -- the group --------------------------------------------------------------------------
    def _shard_apply(self, arr: list[Arrival]) -> bool:
        """Have the shards aggregate ``arr`` into the next version (each its ranges, with the
        aggregator and server step rank 0 would use, elementwise: bit-identical) and
        assemble it here (evaluation, metrics, checkpoints). False if a shard failed."""
        core = self.core
        rows = [(a.device, a.task, a.samples, a.loss) for a in arr]
        payload = np.array(rows, np.float64).reshape(-1)
        owners = sorted(set(self.owners))
        for s in owners:
            core.t.send(s, SHARD_APPLY, round=core.version + 1, payload=payload)
        t0 = time.perf_counter()
        # one SHARD_MODEL per owned range, and one per optimizer state slot of each
        counts = {s: self.owners.count(s) * (1 + len(self.slots)) for s in owners}
        got = self._from_shards(SHARD_MODEL, core.version + 1, counts)
        self.wait_s += time.perf_counter() - t0
        if got is None:
            return False
        core.t.wait_sends()  # (the apply lists)
        for s, msgs in sorted(got.items()):
            for msg in msgs:
                self._install(s, msg)
        core.server_opt.t += 1  # (the shards stepped; the step count stays in the checkpoint)
        return True

    def _install(self, s: int, msg: Message) -> None:
        bounds = (int(msg.aux[0]), int(msg.aux[1]))
        i = next((i for i, r in enumerate(self.ranges) if (r.start, r.stop) == bounds), -1)
        if i < 0 or self.owners[i] != s or msg.payload.size != self.ranges[i].size:
            raise EdgeflError(
                f"shard rank {s} sent {msg.payload.size} values for keys [{bounds[0]}, "
                f"{bounds[1]}); it owns ranges {[i for i, o in enumerate(self.owners) if o == s]}"
            )
        r = self.ranges[i]
        slot = int(msg.aux[3])  # 0: the model's values; j > 0: optimizer state slot j
        if slot == 0:
            self.core.global_model[r.start : r.stop] = msg.payload
        else:
            opt, attr = self.core.server_opt, self.slots[slot - 1][1]
            if getattr(opt, attr) is None:  # (every range of it comes in the same apply)
                setattr(opt, attr, np.zeros(self.core.global_model.size, np.float32))
            getattr(opt, attr)[r.start : r.stop] = msg.payload
        self.core.t.release(msg)

    def _send_opt_state(self) -> None:
        """Send every range's owner the range's server optimizer state held here (that of
        the last complete version: at a resume, the checkpoint's; after a failover, the
        state the re-run round starts from). Nothing before the first step: the shards'
        optimizers then start afresh, as rank 0's would."""
        opt = self.core.server_opt
        bufs = [getattr(opt, attr) for _name, attr in self.slots]
        if not bufs or any(b is None for b in bufs):
            return
        aux2 = float(self.owner_epoch)
        for s, r in zip(self.owners, self.ranges):
            for j, b in enumerate(bufs):
                self.core.t.send(
                    s, SHARD_MODEL, round=self.core.version,
                    aux=(float(r.start), float(r.stop), aux2, float(j + 1)),
                    payload=b[r.start : r.stop],
                )  # fmt: skip

    def _from_shards(
        self, kind: Kind, round_: int | None, counts: dict[int, int] | None = None
    ) -> dict[int, list[Message]] | None:
        """Wait for ``counts[s]`` ``kind`` messages (of ``round_``; None = any) from every
        shard ``s`` (default: one from every live shard; SHARD_MODEL and SHARD_OWNERS of
        the current owner-map epoch only); what else comes in meanwhile is kept for the event
        loop. None if a shard fails first (:meth:`rank_failed`: a failover, or the stop)."""
        core = self.core
        if counts is None:
            counts = {s: 1 for s in self.shards if s not in core.failed_ranks}
        got: dict[int, list[Message]] = {s: [] for s in counts}
        limit = core.cfg["comm"]["failure_timeout_s"]
        start = time.monotonic()
        while any(len(got[s]) < n for s, n in counts.items()):
            msgs = core.t.poll(timeout=0.5)
            dead = core.t.take_failures()
            if limit and time.monotonic() - start > limit:
                for s in counts:
                    if len(got[s]) < counts[s] and core.t.declare_failed(
                        s, f"silent for {limit:.0f} s"
                    ):
                        dead.append(s)
            for msg in msgs:
                if msg.src in counts and self._wanted(msg, kind, round_):
                    got[msg.src].append(msg)
                else:
                    core.ev.keep(msg)
            for r in sorted(set(dead)):
                if r in self.shards:
                    for ms in got.values():
                        for m in ms:
                            core.t.release(m)
                    core._rank_failed(r, core.ev.now)
                    return None
                core.ev.failures.append(r)  # a worker: the event loop handles it
        return got

    def _wanted(self, msg: Message, kind: Kind, round_: int | None) -> bool:
        if msg.kind != kind or round_ not in (None, msg.round):
            return False
        if kind == SHARD_MODEL:
            return int(msg.aux[2]) == self.owner_epoch
        if kind == SHARD_OWNERS:
            return int(msg.aux[0]) == self.owner_epoch
        return True

    def _fail_over(self, rank: int, now: float) -> bool:
        """Shard ``rank`` died (ps.replicas > 1): give each range it owned to its first live
        holder in ring order, tell the shards and workers (SHARD_OWNERS: the new owner map,
        version = the last complete one) and mark the round broken (it re-runs from that
        version, :meth:`_rerun_round`). False if a range has no live copy (the run stops)."""
        core = self.core
        dead = {s for s in self.shards if s in core.failed_ranks}
        owners = fail_over(self.owners, dead, self.servers, self.replicas)
        if owners is None:
            return False
        moved = [i for i, (a, b) in enumerate(zip(self.owners, owners)) if a != b]
        self.owners = owners
        self.owner_epoch += 1
        payload = np.array(owners, np.float64)
        aux = (float(self.owner_epoch), 0.0, 0.0, 0.0)
        live = [s for s in self.shards if s not in dead]
        for r in live + [w for w in core.workers if w not in core.failed_ranks]:
            core.t.send(r, SHARD_OWNERS, round=core.version, aux=aux, payload=payload)
        got = self._from_shards(SHARD_OWNERS, core.version)
        if got is None:  # another shard died meanwhile: handled by the nested call
            return self.broken or bool(core.stopped)
        missing = sorted(s for s, ms in got.items() if any(m.payload[0] != 1.0 for m in ms))
        for ms in got.values():
            for m in ms:
                core.t.release(m)
        if missing:
            log.error("shards %s lack version %d of a range they now own", missing,
                      core.version)  # fmt: skip
            return False
        self._send_opt_state()  # (the shards dropped theirs: the re-run starts from v's)
        self.broken = True
        core.t_failure = time.monotonic()
        self.failovers.append(
            {"rank": rank, "version": core.version, "ranges": moved,
             "owners": list(owners), "time_s": now}
        )  # fmt: skip
        text = (
            f"server shard rank {rank} failed; its ranges {moved} fail over to ranks "
            f"{[owners[i] for i in moved]} (ps.replicas = {self.replicas}); round "
            f"{core.version + 1} re-runs from version {core.version}"
        )
        print(f"edgefl: {text}", flush=True)
        log.warning(text)
        return True

    def _rerun_round(self, arr: list[Arrival], now: float) -> None:
        """After a failover the round's pieces that went to the dead shard are lost: drop
        the round's updates and start it again from the last complete version, with the
        same tasks (task numbers seed the training, so the re-run is deterministic)."""
        core = self.core
        for a in arr:
            core.t.release(a.msg)
        snap = self.snap
        # a fresh policy with the snapshot's state, as a resume from a checkpoint has
        samples = {d: v["samples"] for d, v in sorted(snap["devices"].items())}
        core.policy = make_consistency(core.cfg, samples)
        core.policy.load_state_dict(json.loads(snap["policy"]))
        core.policy.forget_tasks()  # the round's tasks are dropped: it starts again
        core.tasks, core.staleness = dict(snap["tasks"]), dict(snap["staleness"])
        core.devices = copy.deepcopy(snap["devices"])
        core.rank_version.clear()  # every worker rank pulls the version again
        self.broken = False
        self._rerun_dec = core.policy.start(now, core.available)

    def _take_snap(self, wall: float, now: float) -> None:
        """What a checkpoint (or a re-run after a failover) of this version starts from."""
        core = self.core
        self.snap = {
            "policy": json.dumps(core.policy.state_dict()),
            "tasks": dict(core.tasks),
            "staleness": dict(core.staleness),
            "devices": copy.deepcopy(core.devices),
            "wall": wall,
            "now": now,
        }


class ShardClient:
    """A worker rank's side of a sharded server group: versions assembled from the shards'
    SHARD_MODEL ranges, updates pushed as SHARD_PUSH pieces (+ a REPORT to rank 0)."""

    message_kinds = (SHARD_MODEL, SHARD_OWNERS)

    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.servers = worker.cfg["ps"]["servers"]
        self.ranges = even_ranges(worker.task.flat.numel, self.servers)
        self.partial: dict[int, tuple[np.ndarray, set[int]]] = {}  # version -> (buf, ranges)
        # owner rank of every range (ps.replicas > 1: rank 0 moves a dead shard's ranges to
        # a replica holder, SHARD_OWNERS), and that map's epoch
        self.owners = list(range(1, self.servers + 1))
        self.owner_epoch = 0
        self.range_of = {(r.start, r.stop): i for i, r in enumerate(self.ranges)}

    def on_message(self, msg: Message) -> None:
        w = self.w
        if msg.kind == SHARD_OWNERS:
            self.owners = [int(x) for x in msg.payload]
            self.owner_epoch = int(msg.aux[0])
            log.warning("rank %d: shard owners now %s", w.rank, self.owners)
            w.t.release(msg)
            return
        self._install_range(msg)

    def ready(self, version: int, flags: int) -> bool:
        """Can a queued task start (has its model version fully arrived)?"""
        return bool(flags & self.w.local_flags) or version in self.w.versions

    def _install_range(self, msg: Message) -> None:
        """SHARD_MODEL from shard rank s: keys [aux0, aux1) of model version ``msg.round``
        (one range the shard owns; aux2 = the owner map's epoch); the version is usable once
        every range arrived. A range from an older owner map is ignored (its owner died)."""
        w = self.w
        s = msg.src
        i = self.range_of.get((int(msg.aux[0]), int(msg.aux[1])), -1)
        if int(msg.aux[2]) < self.owner_epoch and 0 <= i:
            w.t.release(msg)
            return
        if not (0 <= i and self.owners[i] == s and msg.payload.size == self.ranges[i].size):
            w.t.release(msg)
            raise EdgeflError(
                f"rank {w.rank}: SHARD_MODEL from rank {s} with {msg.payload.size} values "
                f"for keys [{int(msg.aux[0])}, {int(msg.aux[1])}) does not match the shard's "
                "key range (ps.servers)"
            )
        r = self.ranges[i]
        v = int(msg.round)
        if v not in self.partial:
            self.partial[v] = (w.buffer(), set())
        buf, got = self.partial[v]
        buf[r.start : r.stop] = msg.payload
        got.add(i)
        w.t.release(msg)
        if len(got) == self.servers:
            del self.partial[v]
            w.versions[v] = buf  # (a re-sent version after a failover: the same values)

    def push(self, device: int, task: int, version: int, delta, aux: tuple) -> None:
        """Each shard gets the update's values of its key range (SHARD_PUSH, aux = (start,
        stop, version the task started from)); rank 0 gets a REPORT carrying the update's
        header values (samples, loss, seconds, iterations)."""
        w = self.w
        left = [len(self.ranges)]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                w.free(delta)

        for s, r in zip(self.owners, self.ranges):
            w.t.send(
                s, SHARD_PUSH, device=device, round=task,
                aux=(float(r.start), float(r.stop), float(version), 0.0),
                payload=delta[r.start : r.stop], release=release,
            )  # fmt: skip
        w.t.send(0, Kind.REPORT, device=device, round=task, aux=aux)
