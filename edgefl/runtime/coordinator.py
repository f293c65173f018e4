"""Rank 0: registers the workers, runs the rounds, aggregates, evaluates, checkpoints."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..ckpt import checkpoint_name, save_checkpoint
from ..comm import Kind, Message, Transport
from ..comm.wire import HEADER_BYTES
from ..config import config_from_toml
from ..errors import CheckpointError, EdgeflError
from ..models.train import evaluate
from ..policies.aggregation import Update
from ..policies.allocation import make_allocator
from ..policies.consistency import Apply, Arrival, Decision, make_consistency
from ..policies.hermes_metrics import HermesMetrics
from ..sim.clock import plan_task
from ..sim.timeline import Timeline
from .events import (
    ARRIVE,
    FAILED,
    LOST,
    ONLINE,
    PUSH,
    TIMER,
    Event,
    VirtualEvents,
    WallEvents,
    WorkerFailed,
    error_text,
)
from .output import MetricsLog, Progress, summary_table
from .placement import devices_of_rank
from .policies import (
    make_cfg_orderer,
    make_update_aggregator,
    make_update_filter,
    working_set_pulls,
)
from .state import RESUME_MUST_MATCH, Task, checkpoint_state
from .worker import CONTINUE, REFRESH

log = logging.getLogger("edgefl.coordinator")


class Coordinator:
    """The rank-0 loop of a BSP FedAvg job.

    Args:
        cfg: the effective config.
        transport: rank 0's transport.
        task: data (test set used) and the global model (its flat buffer *is* the global
            model that is sent, zero-copy).
        out_dir: run directory (None: write nothing, used by tests).
        resume: a loaded checkpoint dict to continue from.
    """

    def __init__(
        self,
        cfg: dict,
        transport: Transport,
        task: Task,
        out_dir: Path | None,
        resume: dict | None = None,
    ) -> None:
        self.cfg = cfg
        self.t = transport
        self.task = task
        self.out_dir = out_dir
        self.resume = resume
        self.num_devices = cfg["fleet"]["devices"]
        # sharded server group (ps.servers = S > 0): ranks 1..S own key ranges of the model
        self.servers = cfg["ps"]["servers"]
        self.shards = list(range(1, self.servers + 1))
        self.workers = list(range(self.servers + 1, transport.size))
        self.shard_ranges = []
        if self.servers:
            from ..errors import ConfigError
            from ..policies.keyrange import even_ranges

            if self.servers > task.flat.numel:
                raise ConfigError(
                    f"config key 'ps.servers' = {self.servers}: more shards than model keys "
                    f"({task.flat.numel})"
                )
            self.shard_ranges = even_ranges(task.flat.numel, self.servers)
        self.shard_stats: dict[int, dict] = {}
        # ps.replicas = k > 1: every range is also held by the next k - 1 shards; a dead
        # shard's ranges move to a live holder (owner map, epoch) and the round re-runs
        self.replicas = int(cfg["ps"].get("replicas", 1))
        self.shard_owners = list(self.shards)  # owner rank of every range
        self.owner_epoch = 0
        self.failovers: list[dict] = []
        self._shard_broken = False  # a failover happened during the current round
        self._rerun_dec: Decision | None = None
        self.shard_wait_s = 0.0  # rank 0 waiting for the shards' new ranges, seconds
        self.aggregator = make_update_aggregator(cfg, self.num_devices)
        self.update_filter = make_update_filter(cfg, task.flat.numel)
        from ..policies.server_opt import make_server_optimizer

        self.server_opt = make_server_optimizer(cfg["server"])
        self.global_model = task.flat.to_host()  # the live global model (float32, zero-copy)
        self.agg_buf = np.empty_like(self.global_model)
        self.devices: dict[int, dict] = {}
        self.start_round = 0
        self.wall_offset = 0.0
        self.start_time = 0.0  # clock seconds at the start (non-zero when resuming)
        self.history: list[dict] = []
        self.stopped = ""
        # parameter-server working-set pulls (ps.pull = "working-set")
        self.ws_dev: dict[int, np.ndarray] = {}  # device -> its accepted working set
        self.ws_rank: dict[int, tuple[np.ndarray, int]] = {}  # rank -> (union keys, digest)
        self.ws_rejected: list[int] = []  # devices whose WORKSET was rejected
        self.ws_up: dict[int, int] = {}  # device -> WORKSET bytes received (header included)
        # sparse pushes: device -> [checksum of all it produced (its flush says), checksum
        # of all decoded here, sum of |decoded values|] (filters.mass_checksum)
        self.ps_mass: dict[int, list[float]] = {}
        self.ps_kkt = [0, 0]  # KKT entries skipped, seen (all devices)
        self.ps_flushed_abs = 0.0  # sum of |values| of the final filter flushes

    # -- set-up -----------------------------------------------------------------------------
    def register(self) -> None:
        """Wait for every worker's REGISTER and check it hosts the expected devices."""
        timeout = self.cfg["comm"]["register_timeout_s"]
        deadline = time.monotonic() + timeout
        waiting = set(self.workers) | set(self.shards)
        size = self.t.size
        while waiting:
            if time.monotonic() > deadline:
                raise EdgeflError(
                    f"ranks {sorted(waiting)} did not register within {timeout} s "
                    "(comm.register_timeout_s)"
                )
            for msg in self.t.poll(timeout=0.5):
                if msg.kind == Kind.ERROR:
                    raise WorkerFailed(error_text(msg))
                if msg.kind != Kind.REGISTER:
                    log.warning(
                        "ignoring %s from rank %d during registration", msg.kind.name, msg.src
                    )
                    continue
                info = json.loads(bytes(msg.payload).decode("utf-8"))
                if msg.src in self.shards:
                    self._register_shard(msg.src, info)
                    waiting.discard(msg.src)
                    continue
                expect = devices_of_rank(msg.src, self.num_devices, size, self.servers)
                got = [d["id"] for d in info["devices"]]
                if got != expect:
                    raise EdgeflError(f"rank {msg.src} registered devices {got}, expected {expect}")
                if info["signature"] != self.task.signature:
                    raise EdgeflError(
                        f"rank {msg.src} built a different model ({info['signature']} vs "
                        f"{self.task.signature}); are all ranks using the same config?"
                    )
                for d in info["devices"]:
                    self.devices[d["id"]] = {
                        "rank": msg.src,
                        "torch": d["torch"],
                        "samples": int(d["samples"]),
                        "rounds": 0,
                        "bytes_up": 0,
                        "bytes_down": 0,
                        "msgs_up": 0,
                        "msgs_down": 0,
                        "time_s": 0.0,
                    }
                self.t.validator.hosted[msg.src] = frozenset(got)
                waiting.discard(msg.src)
        if working_set_pulls(self.cfg):
            self._collect_working_sets(time.monotonic() + timeout)

    def _register_shard(self, rank: int, info: dict) -> None:
        """A server shard's REGISTER: it must own the expected key range of the same model."""
        r = self.shard_ranges[rank - 1]
        got = (info.get("shard"), info.get("start"), info.get("stop"))
        if got != (rank - 1, r.start, r.stop):
            raise EdgeflError(
                f"shard rank {rank} registered as (shard, start, stop) = {got}, expected "
                f"{(rank - 1, r.start, r.stop)}"
            )
        if info["signature"] != self.task.signature:
            raise EdgeflError(
                f"shard rank {rank} built a different model ({info['signature']} vs "
                f"{self.task.signature}); are all ranks using the same config?"
            )
        self.t.validator.hosted[rank] = frozenset({-1})  # its messages name no device

    def _collect_working_sets(self, deadline: float) -> None:
        """ps.pull = "working-set": ask every worker for its devices' working sets (a
        HEARTBEAT: all ranks are registered, so their WORKSETs pass the wire checks now);
        each sends one WORKSET per device, then a HEARTBEAT. A malformed one (not sorted,
        not unique, outside the model) is rejected and logged; that rank then gets full
        models. A resumed run asks again (nothing of this is checkpointed)."""
        from ..policies.keyrange import check_keys, key_digest

        numel = self.global_model.size
        for w in self.workers:
            self.t.send(w, Kind.HEARTBEAT)
        waiting = set(self.workers)
        while waiting:
            waiting -= self.t.failed
            if not waiting:
                break
            if time.monotonic() > deadline:
                log.warning(
                    "ranks %s sent no working sets within comm.register_timeout_s; they get "
                    "full models", sorted(waiting)
                )  # fmt: skip
                break
            for msg in self.t.poll(timeout=0.5):
                if msg.kind == Kind.ERROR:
                    raise WorkerFailed(error_text(msg))
                if msg.kind == Kind.HEARTBEAT:
                    waiting.discard(msg.src)
                elif msg.kind == Kind.WORKSET:
                    d = msg.device
                    try:
                        keys = check_keys(msg.payload, numel, "keys")
                    except ValueError as e:
                        self.t.reject(msg.src, f"WORKSET of rank {msg.src}, device {d}: {e}")
                        self.ws_rejected.append(d)
                    else:
                        self.ws_dev[d] = keys.copy()
                        self.ws_up[d] = self.ws_up.get(d, 0) + HEADER_BYTES + msg.nbytes
                else:
                    log.warning("ignoring %s from rank %d (expected WORKSET)", msg.kind.name,
                                msg.src)  # fmt: skip
                self.t.release(msg)
        for w in self.workers:
            devs = [d for d, v in sorted(self.devices.items()) if v["rank"] == w]
            if not devs or any(d not in self.ws_dev for d in devs):
                continue
            keys = np.unique(np.concatenate([self.ws_dev[d] for d in devs]))
            if keys.size < numel:
                self.ws_rank[w] = (keys, key_digest(keys))
        full = sorted(set(self.workers) - set(self.ws_rank))
        log.info("working-set pulls to ranks %s; full models to ranks %s", sorted(self.ws_rank),
                 full)  # fmt: skip

    def _send_model(self, rank: int) -> None:
        """The current global model to ``rank``: whole (MODEL), or only the values at its
        devices' working sets (MODEL_KEYS; aux = (number of keys, their key_digest))."""
        if self.servers:  # the shards send their ranges of this version (SHARD_MODEL)
            for s in sorted(set(self.shard_owners)):
                self.t.send(s, Kind.SHARD_PULL, round=self.version,
                            aux=(float(rank), float(self.version)))  # fmt: skip
            return
        ws = self.ws_rank.get(rank)
        if ws is None:
            self.t.send(rank, Kind.MODEL, round=self.version, payload=self.global_model)
            return
        keys, digest = ws
        self.t.send(
            rank, Kind.MODEL_KEYS, round=self.version, aux=(float(keys.size), float(digest)),
            payload=self.global_model[keys],
        )  # fmt: skip

    def _down_bytes(self, d: int) -> int:
        """Bytes a model download of device ``d`` moves (MODEL or MODEL_KEYS + TRAIN headers,
        the values), counted as for one device per node: its own working set's values."""
        rank = self.devices[d]["rank"]
        if self.servers:  # one SHARD_MODEL per shard + TRAIN
            return (self.servers + 1) * HEADER_BYTES + self.global_model.nbytes
        n = self.ws_dev[d].size if rank in self.ws_rank else self.global_model.size
        return 2 * HEADER_BYTES + 4 * n

    def restore(self) -> None:
        """Continue from the checkpoint given to the constructor."""
        st = self.resume
        assert st is not None
        old = config_from_toml(st["config_toml"], "checkpoint config")
        for key in RESUME_MUST_MATCH:
            a, b = old, self.cfg
            for part in key.split("."):
                a, b = a[part], b[part]
            if a != b:
                raise CheckpointError(
                    f"checkpoint config differs from this run's at '{key}': {a!r} vs {b!r}"
                )
        if st["model"]["signature"] != self.task.signature:
            raise CheckpointError("checkpoint holds a model of a different layout")
        self.global_model[:] = st["model"]["flat"]
        self.start_round = int(st["round"])
        self.wall_offset = float(st["wall_time_s"])
        self.start_time = float(st.get("clock", {}).get("time_s", 0.0))
        self.history = [json.loads(x) for x in st["metrics_jsonl"]]
        for d, v in st["devices"].items():
            if int(d) in self.devices:
                for k in ("rounds", "bytes_up", "bytes_down", "msgs_up", "msgs_down", "time_s"):
                    self.devices[int(d)][k] = v.get(k, 0)

    # -- the event loop ----------------------------------------------------------------
    def _setup_run(self) -> None:
        cfg = self.cfg
        self.virtual = cfg["sim"]["clock"] == "virtual"
        samples = {d: v["samples"] for d, v in sorted(self.devices.items())}
        self.policy = make_consistency(cfg, samples)
        self.profiles = None
        if self.virtual:
            from ..sim.profiles import load_fleet

            self.profiles = load_fleet(cfg["sim"]["profiles"], self.num_devices, cfg["seed"])
        self.ref_s = cfg["sim"]["reference_s_per_sample"]
        if self.virtual and self.ref_s == 0:
            self.ref_s = self._calibrate()
        self.timeline = Timeline()
        self.inflight: dict[int, tuple[int, int, float]] = {}  # device -> (task, version, t0)
        self.tasks = {d: 0 for d in self.devices}
        self.rank_version: dict[int, int] = {}
        self.online_pending: set[int] = set()
        self.bases: dict[int, np.ndarray] = {}  # version -> model (FedAsync only)
        self.base_refs: dict[int, int] = {}
        self.staleness: dict[int, int] = {}
        self.version = 0
        self.lost_tasks = 0
        self.events_log = None
        self.failed: dict[int, float] = {}
        self.failed_ranks: dict[int, float] = {}
        self._t_failure: float | None = None
        self.ordering_s = 0.0  # all balancing (stream adds + finish), seconds
        self.ordering_wait_s = 0.0  # the part the round waited for (last add + finish), seconds
        self._rejected_streak = 0
        self.recovery_s: list[float] = []  # detection -> next model change (seconds)
        self.progress_after_failure_unix: list[float] = []
        self.exit_status = 0
        alg = cfg["algorithm"]
        self.gated = alg["gate"] != "always"
        self.pushes: dict[tuple[int, int], Message] = {}  # gated pushes being uploaded
        self.refresh: dict[int, bool] = {}  # gated devices to get the new model (broadcast)
        self.control_msgs = 0
        self._iter_time: dict[int, float] = {}
        self.hermes = HermesMetrics()
        hold = cfg["hermes"]["holdout_fraction"]
        self.n_train = {}
        for d, v in self.devices.items():
            n = v["samples"]
            h = min(n - 1, max(1, int(round(hold * n)))) if self.gated and n >= 2 else 0
            self.n_train[d] = n - h
            v.setdefault("requests", 0)
            v.setdefault("iterations", 0)
            self.hermes.add_device(d)
        self.allocating = alg["allocation"] != "fixed"
        self.allocator = make_allocator(
            alg["allocation"], cfg["allocation"], epochs=cfg["train"]["local_epochs"]
        )
        for d in sorted(self.devices):
            cap = self.profiles[d].mem_cap if self.profiles is not None else 0
            first = None
            if self.allocating:
                first = max(1, int(cfg["allocation"]["initial_fraction"] * self.n_train[d]))
            self.allocator.add_device(
                d,
                self.n_train[d],
                memory_cap=cap or None,
                samples=first,
                batch=cfg["train"]["batch_size"] or 32,
            )
        self.loss_agg = alg["aggregation"] in ("loss-weighted", "loss-softmax")
        self.orderer = make_cfg_orderer(cfg)
        self.sparse_dec: dict = {}
        self.sparse_resends = 0
        self.gddr = alg["residual"] == "gddr"
        if self.gddr:
            from ..policies.replay import ResidualReplay
            from ..policies.tau import make_tau_controller

            g = cfg["gddr"]
            self.decoders: dict = {}
            self.tauc = make_tau_controller(g["adaptive"], g["tau"], g["tau_min"], g["tau_max"])
            self.replay = ResidualReplay(decay=g["replay_decay"], steps=g["replay_steps"])
            self._norms: list[float] = []
            self.gddr_stats = {"messages": 0, "values": 0, "replays": [], "replay_errors": []}
        self._global_loss: tuple[int, float] | None = None
        self._shard_snap: dict | None = None  # ps.servers: the state of the last version

    def _calibrate(self) -> float:
        """Measure this machine's seconds per training sample once (sim.reference_s_per_sample
        = 0); the figure goes into the checkpoints' config and summary.json."""
        import copy

        from ..sim.profiles import calibrate_reference

        c = self.cfg["train"]
        ref = calibrate_reference(
            copy.deepcopy(self.task.model),
            self.task.data.train(0),
            batch_size=c["batch_size"] or 32,
            steps=50,
            task=self.task.data.info.task,
            lr=c["lr"],
        )
        self.cfg["sim"]["reference_s_per_sample"] = ref
        log.warning("sim.reference_s_per_sample calibrated on this machine: %.3g s", ref)
        return ref

    def _work(self, d: int) -> int:
        """Training samples one iteration of device ``d`` processes."""
        c = self.cfg["train"]
        n = self.n_train[d]
        batch = c["batch_size"]
        if self.allocating:
            a = self.allocator.allocation(d)
            n, batch = min(n, a.samples or n), a.batch or batch
        if c["local_steps"]:
            return c["local_steps"] * (batch or n)
        return c["local_epochs"] * n

    def _available(self, d: int) -> bool:
        if d in self.inflight or d in self.failed:
            return False
        if not self.virtual:
            return True
        now = self.ev.now
        prof = self.profiles[d]
        crash = prof.failure.crash_time(self.cfg["seed"], d)
        if crash <= now:
            if d not in self.failed:
                self.failed[d] = crash
            return False
        if prof.availability.is_online(now, self.cfg["seed"], d):
            return True
        if d not in self.online_pending:
            back = prof.availability.next_online(now, self.cfg["seed"], d)
            if back < crash and back < float("inf"):
                self.online_pending.add(d)
                self.ev.schedule(back, ONLINE, d)
        return False

    def _rank_failed(self, rank: int, now: float) -> Decision:
        """A worker rank died (ULFM or time-out): its devices are dead from ``now``; their
        tasks are lost; GDDR replays their residuals. Returns the policy's decision."""
        if rank in self.shards and self.replicas > 1:
            if rank in self.failed_ranks:
                return Decision()  # (reported twice)
            self.failed_ranks[rank] = now
            if self._fail_over(rank, now):
                return Decision()
        if rank in self.shards:
            # no live copy of some range (ps.servers, ps.replicas): stop at the last complete
            # version (rank 0 holds it and checkpoints it)
            self.failed_ranks[rank] = now
            self.stopped = (
                f"server shard rank {rank} failed; the sharded server group (ps.servers) has "
                "no live copy of its range (ps.replicas): resume from the latest checkpoint"
            )
            print(f"edgefl: {self.stopped}", flush=True)
            self.exit_status = 3
            snap = self._shard_snap
            if self.out_dir is not None and snap is not None:
                # the state as it was when this version was made (before the next round's
                # tasks were dispatched), so a resume continues exactly as an uninterrupted
                # run would (task numbers seed the training)
                self.policy.load_state_dict(json.loads(snap["policy"]))
                self.tasks, self.staleness = snap["tasks"], snap["staleness"]
                self.devices = snap["devices"]
                self.checkpoint(self.version, self.metrics.rows, snap["wall"], snap["now"])
            return Decision()
        if rank == 0 or rank not in self.workers:
            return Decision()
        self.failed_ranks[rank] = now
        self._t_failure = time.monotonic()
        devs = [d for d, v in sorted(self.devices.items()) if v["rank"] == rank]
        log.warning("rank %d failed at %.3f s: its devices %s are dead", rank, now, devs)
        print(f"edgefl: rank {rank} failed; devices {devs} are dead; going on", flush=True)
        self._log("failed", now, -1, -1, rank=rank)
        dec = Decision()
        for d in devs:
            if d in self.failed:
                continue
            self.failed[d] = now
            if d in self.inflight:
                task = self.inflight[d][0]
                self.ev.cancel(d, task)
                self.pushes.pop((d, task), None)
                self._task_done(d)
                self.lost_tasks += 1
                nxt = self.policy.lost(d, now, self._available)
                dec.apply = dec.apply or nxt.apply
                dec.dispatch += nxt.dispatch
                dec.dropped += nxt.dropped
                dec.timer = dec.timer or nxt.timer
            if self.gddr:
                self._start_replay(d, now)
        if self.cfg["fleet"]["on_failure"] == "stop":
            self.stopped = f"rank {rank} failed (fleet.on_failure = stop)"
            self.exit_status = 3
            self.checkpoint(self.version, self.metrics.rows, time.monotonic() - self._t0, now)
            return Decision()  # stop where the checkpoint stands: nothing more is applied
        return dec

    def _dead(self, d: int, now: float) -> bool:
        """Has device ``d`` died (crashed) by ``now``? (virtual clock: from its profile)"""
        if d in self.failed:
            return True
        if self.virtual:
            crash = self.profiles[d].failure.crash_time(self.cfg["seed"], d)
            if crash <= now:
                self.failed[d] = crash
                return True
        return False

    def _dispatch(self, d: int, now: float) -> None:
        """Start a new task of ``d`` from the current model (model download + TRAIN)."""
        task = self._next_task(d)
        self._book_download(d)
        self.inflight[d] = (task, self.version, now)
        if self.policy.name == "fedasync":
            self.bases.setdefault(self.version, self.global_model.copy())
            self.base_refs[self.version] = self.base_refs.get(self.version, 0) + 1
        self._log("dispatch", now, d, task)
        if not self._plan(d, task, now, download=True):
            return
        self._model_to_rank(self.devices[d]["rank"])
        self._send_train(d, task, now, flags=0)

    def _continue(self, d: int, now: float) -> None:
        """A gated device goes on with its next local iteration (no download; with Hermes
        ``broadcast = "all"``, after a push by another device, it first downloads and adopts
        the new global model)."""
        task = self._next_task(d)
        first, base, t0 = self.inflight[d]
        refresh = self.refresh.pop(d, False)
        if refresh:
            base = self.version
            self._book_download(d)
        self.inflight[d] = (task, base, t0)
        if not self._plan(d, task, now, download=refresh):
            return
        if refresh:
            self._model_to_rank(self.devices[d]["rank"], wait=True)
            self._send_train(d, task, now, flags=CONTINUE | REFRESH)
        else:
            self._send_train(d, task, now, flags=CONTINUE)
            self.control_msgs += 1

    def _book_download(self, d: int) -> None:
        """Device ``d`` downloads the current model: count its bytes and 2 messages."""
        down = self._down_bytes(d)
        dev = self.devices[d]
        dev["bytes_down"] += down
        dev["msgs_down"] += 2
        dev["requests"] += 1
        self._period["bytes_down"] += down
        self._period["msgs_down"] += 2

    def _model_to_rank(self, rank: int, wait: bool = False) -> None:
        """Send ``rank`` the current model unless it already has this version (``wait``:
        first let pending sends finish, as the model buffer may be in flight)."""
        if self.rank_version.get(rank) != self.version:
            if wait:
                self.t.wait_sends()
            self._send_model(rank)
            self.rank_version[rank] = self.version

    def _next_task(self, d: int) -> int:
        task = self.tasks[d]
        self.tasks[d] += 1
        return task

    def _send_train(self, d: int, task: int, now: float, flags: int) -> None:
        a = self.allocator.allocation(d) if self.allocating else None
        samples, batch = (a.samples, a.batch) if a is not None else (0, 0)
        if self.gddr:
            flags |= self.tauc.tau << 8
        aux = (float(self.version), float(samples), float(batch), float(flags))
        rank = self.devices[d]["rank"]
        self.t.send(rank, Kind.TRAIN, device=d, round=task, vtime=now, aux=aux)
        if self.t.liveness is not None:  # it owes an answer (time-out detection, no ULFM)
            self.owed[rank] = self.owed.get(rank, 0) + 1
            self.t.liveness.expect(rank, time.monotonic() + self.cfg["comm"]["failure_timeout_s"])

    def _received(self, msg: Message) -> None:
        """An answer to a TRAIN came in (time-out detection: the rank owes one less)."""
        if self.t.liveness is None:
            return
        left = self.owed.get(msg.src, 0) - 1
        self.owed[msg.src] = max(left, 0)
        if left <= 0:
            self.t.liveness.satisfied(msg.src)

    def _plan(self, d: int, task: int, now: float, download: bool) -> bool:
        """Plan an iteration on the virtual clock (no-op on the wall clock); False if it
        is lost (the device goes offline or dies first: nothing is sent)."""
        if not self.virtual:
            self.ev.schedule(0.0, ARRIVE, d, task)
            return True
        model_bytes = self.global_model.nbytes
        up = (self.servers + 1) * HEADER_BYTES if self.servers else HEADER_BYTES
        plan = plan_task(
            self.profiles[d], self.cfg["seed"], d, task, now, self._down_bytes(d),
            up + model_bytes, self._work(d), self.ref_s, download=download,
            upload=not self.gated,
        )  # fmt: skip
        for state, a, b in plan.intervals():
            self.timeline.add(d, state, a, b)
        self._iter_time[d] = plan.compute_end - plan.model_at
        if plan.lost:
            self.ev.schedule(plan.lost_at, LOST, d, task)
            return False
        self.ev.schedule(plan.arrive, ARRIVE, d, task)
        return True

    def _plan_push(self, d: int, task: int, now: float, msg: Message) -> None:
        """A gated device pushes at ``now``: its update arrives after the upload."""
        prof = self.profiles[d]
        arrive = now + prof.up_s(HEADER_BYTES + msg.nbytes)
        seed = self.cfg["seed"]
        cut = min(prof.failure.crash_time(seed, d), prof.availability.online_until(now, seed, d))
        self.timeline.add(d, "upload", now, min(arrive, cut))
        if cut < arrive:
            self.t.release(msg)
            self.ev.schedule(cut, LOST, d, task)
            return
        self.pushes[(d, task)] = msg
        self.ev.schedule(arrive, PUSH, d, task)

    def _task_done(self, d: int) -> tuple[int, int, float]:
        task, base, t0 = self.inflight.pop(d)

        if base in self.base_refs:
            self.base_refs[base] -= 1
        return task, base, t0

    def _execute(self, dec: Decision, now: float) -> None:
        if dec.apply is not None:
            self._apply(dec.apply, now)
            if self._rerun_dec is not None:  # a shard failed over: the round starts again
                dec, self._rerun_dec = self._rerun_dec, None
        if dec.timer is not None:
            self.ev.schedule(dec.timer[0], TIMER, token=dec.timer[1])
        for d in dec.dropped:
            self._log("dropped", now, d, self.inflight.get(d, (-1,))[0])
        if self.version >= self.cfg["run"]["rounds"] or self.stopped:
            return  # the run is over: start nothing new
        if dec.dispatch:
            self.t.wait_sends()  # the global buffer may have changed since the last sends
        for d in dec.dispatch:
            self._dispatch(d, now)

    def _apply(self, ap: Apply, now: float) -> None:
        self.t.wait_sends()  # sends of the global buffer must finish before it changes
        lr = np.float32(self.cfg["server"]["lr"])
        arr = ap.arrivals
        if self.update_filter is not None and ap.mode != "mix":
            arr, ap = self._filter(ap)
            if not arr:
                return
        if self.loss_agg and ap.mode != "mix":
            # Hermes: fold each update into the loss-weighted running average, then apply it
            gl = self._global_test_loss()
            for a in sorted(arr, key=lambda x: x.device) if ap.mode == "aggregate" else arr:
                cand = self._candidate_loss(a.delta)
                if self.aggregator.name == "loss-weighted":
                    step = self.aggregator.push(a.delta, cand, gl)
                else:
                    step = self.aggregator.push(a.device, a.delta, cand)
            self.server_opt.step(self.global_model, step)
        elif self.servers:
            if ap.mode != "aggregate":
                raise EdgeflError(f"ps.servers: a '{ap.mode}' apply is not supported")
            if self._shard_broken or not self._shard_apply(arr):
                if self._shard_broken and not self.stopped:
                    self._rerun_round(arr, now)
                return  # else a shard failed for good: the run stops at the current version
        elif ap.mode == "aggregate":
            ups = [Update(a.device, a.delta, a.samples, a.loss, self.version) for a in arr]
            agg = self.aggregator.aggregate(ups, out=self.agg_buf)
            self.server_opt.step(self.global_model, agg)
        elif ap.mode == "terms":
            acc = np.zeros(self.global_model.size, np.float64)
            for a, c in zip(arr, ap.coefs):
                acc += c * a.delta
            self.server_opt.step(self.global_model, acc.astype(np.float32))
        else:  # mix
            a, alpha = arr[0], np.float32(ap.coefs[0])
            base = self.bases[a.base_version]
            self.global_model *= np.float32(1.0) - alpha
            self.global_model += alpha * (base + a.delta)
        if self.gddr:
            for amt in self.replay.next_amounts():
                w = self.policy.weight(amt.device)
                self.global_model[amt.indices] += (lr * w * amt.values).astype(np.float32)
            if self._norms:
                self.tauc.update(self._norms)
                self._norms = []
        self.version += 1
        self._rejected_streak = 0
        if not np.isfinite(self.global_model).all():
            # diverged (e.g. poisoned updates averaged in by plain mean): every later update
            # would be rejected, so stop here rather than loop
            self.stopped = f"the global model became non-finite at version {self.version}"
            self.exit_status = 3
        every = self.cfg["debug"]["forget_key_cache_every"]
        if every and self.version % every == 0:
            for dec in self.sparse_dec.values():
                dec.reset_cache()
        for a in arr:
            st = self.version - 1 - a.base_version
            self.staleness[st] = self.staleness.get(st, 0) + 1
        self._gc_bases()
        for a in arr:
            self.t.release(a.msg)  # type: ignore[attr-defined]
        if self._t_failure is not None:
            self.recovery_s.append(time.monotonic() - self._t_failure)
            self.progress_after_failure_unix.append(time.time())
            self._t_failure = None
        if self.gated and self.cfg["hermes"]["broadcast"] == "all":
            pushers = {a.device for a in arr}
            for d in self.inflight:
                if d not in pushers:
                    self.refresh[d] = True
        if self.orderer is not None and ap.mode == "aggregate":
            self._next_orders(arr, now)
        self._log("apply", now, -1, -1, updates=len(arr))
        self._row(arr, now)

    # -- sharded server group (ps.servers > 0; docs/parameter-server.md) ------------------
    def _send_shard_ranges(self) -> None:
        """Start/resume: every shard gets its range of the current global model."""
        for s, r in zip(self.shards, self.shard_ranges):
            self.t.send(
                s, Kind.SHARD_MODEL, round=self.version,
                aux=(float(r.start), float(r.stop), 0.0, 0.0),
                payload=self.global_model[r.start : r.stop],
            )  # fmt: skip

    def _shard_apply(self, arr: list[Arrival]) -> bool:
        """Have the shards aggregate ``arr`` into the next version (each its ranges, with the
        aggregator and server step rank 0 would use, elementwise: bit-identical) and
        assemble it here (evaluation, metrics, checkpoints). False if a shard failed."""
        rows = [(a.device, a.task, a.samples, a.loss) for a in arr]
        payload = np.array(rows, np.float64).reshape(-1)
        new = self.version + 1
        owners = sorted(set(self.shard_owners))
        for s in owners:
            self.t.send(s, Kind.SHARD_APPLY, round=new, payload=payload)
        t0 = time.perf_counter()
        counts = {s: self.shard_owners.count(s) for s in owners}
        got = self._from_shards(Kind.SHARD_MODEL, new, counts)
        self.shard_wait_s += time.perf_counter() - t0
        if got is None:
            return False
        self.t.wait_sends()  # (the apply lists)
        for s, msgs in sorted(got.items()):
            for msg in msgs:
                bounds = (int(msg.aux[0]), int(msg.aux[1]))
                i = next((i for i, r in enumerate(self.shard_ranges)
                          if (r.start, r.stop) == bounds), -1)  # fmt: skip
                if (
                    i < 0
                    or self.shard_owners[i] != s
                    or msg.payload.size != (self.shard_ranges[i].size)
                ):
                    raise EdgeflError(
                        f"shard rank {s} sent {msg.payload.size} values for keys "
                        f"[{bounds[0]}, {bounds[1]}); it owns ranges "
                        f"{[i for i, o in enumerate(self.shard_owners) if o == s]}"
                    )
                r = self.shard_ranges[i]
                self.global_model[r.start : r.stop] = msg.payload
                self.t.release(msg)
        self.server_opt.t += 1  # (the shards stepped; the step count stays in the checkpoint)
        return True

    def _from_shards(
        self, kind: Kind, round_: int | None, counts: dict[int, int] | None = None
    ) -> dict[int, list[Message]] | None:
        """Wait for ``counts[s]`` ``kind`` messages (of ``round_``; None = any) from every
        shard ``s`` (default: one from every live shard; SHARD_MODEL and SHARD_OWNERS of
        the current owner-map epoch only); what else comes in meanwhile is kept for the event
        loop as it would have kept it. None if a shard fails first (see :meth:`_rank_failed`:
        a failover, or the run stops)."""
        if counts is None:
            counts = {s: 1 for s in self.shards if s not in self.failed_ranks}
        got: dict[int, list[Message]] = {s: [] for s in counts}
        epoch_kinds = (Kind.SHARD_MODEL, Kind.SHARD_OWNERS)
        limit = self.cfg["comm"]["failure_timeout_s"]
        start = time.monotonic()
        while any(len(got[s]) < n for s, n in counts.items()):
            msgs = self.t.poll(timeout=0.5)
            dead = self.t.take_failures()
            if limit and time.monotonic() - start > limit:
                for s in counts:
                    if len(got[s]) < counts[s] and self.t.declare_failed(
                        s, f"silent for {limit:.0f} s"
                    ):
                        dead.append(s)
            for msg in msgs:
                if (
                    msg.src in counts
                    and msg.kind == kind
                    and round_ in (None, msg.round)
                    and (kind not in epoch_kinds or int(msg.aux[0 if kind == Kind.SHARD_OWNERS
                                                                  else 2]) == self.owner_epoch)
                ):  # fmt: skip
                    got[msg.src].append(msg)
                elif msg.kind == Kind.ERROR:
                    raise WorkerFailed(error_text(msg))
                elif msg.kind in (Kind.UPDATE, Kind.REPORT, Kind.RESIDUAL, Kind.SPARSE):
                    if self.ev.received_hook is not None:
                        self.ev.received_hook(msg)
                    old = self.ev.stash.get((msg.device, msg.round))
                    if old is not None:
                        self.t.release(old)
                    self.ev.stash[(msg.device, msg.round)] = msg
                else:
                    log.warning("ignoring %s from rank %d", msg.kind.name, msg.src)
                    self.t.release(msg)
            for r in sorted(set(dead)):
                if r in self.shards:
                    for ms in got.values():
                        for m in ms:
                            self.t.release(m)
                    self._rank_failed(r, self.ev.now)
                    return None
                self.ev.failures.append(r)  # a worker: the event loop handles it
        return got

    def _fail_over(self, rank: int, now: float) -> bool:
        """Shard ``rank`` died (ps.replicas > 1): give each range it owned to its first live
        holder in ring order, tell the shards and workers (SHARD_OWNERS: the new owner map,
        version = the last complete one) and mark the round broken (it re-runs from that
        version, :meth:`_rerun_round`). False if a range has no live copy (the run stops)."""
        from .shard import fail_over

        dead = {s for s in self.shards if s in self.failed_ranks}
        owners = fail_over(self.shard_owners, dead, self.servers, self.replicas)
        if owners is None:
            return False
        moved = [i for i, (a, b) in enumerate(zip(self.shard_owners, owners)) if a != b]
        self.shard_owners = owners
        self.owner_epoch += 1
        payload = np.array(owners, np.float64)
        aux = (float(self.owner_epoch), 0.0, 0.0, 0.0)
        live = [s for s in self.shards if s not in dead]
        for r in live + [w for w in self.workers if w not in self.failed_ranks]:
            self.t.send(r, Kind.SHARD_OWNERS, round=self.version, aux=aux, payload=payload)
        got = self._from_shards(Kind.SHARD_OWNERS, self.version)
        if got is None:  # another shard died meanwhile: handled by the nested call
            return self._shard_broken or bool(self.stopped)
        missing = sorted(s for s, ms in got.items() if any(m.payload[0] != 1.0 for m in ms))
        for ms in got.values():
            for m in ms:
                self.t.release(m)
        if missing:
            log.error("shards %s lack version %d of a range they now own", missing,
                      self.version)  # fmt: skip
            return False
        self._shard_broken = True
        self._t_failure = time.monotonic()
        self.failovers.append(
            {"rank": rank, "version": self.version, "ranges": moved,
             "owners": list(owners), "time_s": now}
        )  # fmt: skip
        text = (
            f"server shard rank {rank} failed; its ranges {moved} fail over to ranks "
            f"{[owners[i] for i in moved]} (ps.replicas = {self.replicas}); round "
            f"{self.version + 1} re-runs from version {self.version}"
        )
        print(f"edgefl: {text}", flush=True)
        log.warning(text)
        return True

    def _rerun_round(self, arr: list[Arrival], now: float) -> None:
        """After a failover the round's pieces that went to the dead shard are lost: drop
        the round's updates and start it again from the last complete version, with the
        same tasks (task numbers seed the training, so the re-run is deterministic)."""
        for a in arr:
            self.t.release(a.msg)  # type: ignore[attr-defined]
        snap = self._shard_snap
        # a fresh policy with the snapshot's state, as a resume from a checkpoint has
        samples = {d: v["samples"] for d, v in sorted(snap["devices"].items())}
        self.policy = make_consistency(self.cfg, samples)
        self.policy.load_state_dict(json.loads(snap["policy"]))
        self.tasks, self.staleness = dict(snap["tasks"]), dict(snap["staleness"])
        self.devices = copy.deepcopy(snap["devices"])
        self.rank_version.clear()  # every worker rank pulls the version again
        self._shard_broken = False
        self._rerun_dec = self.policy.start(now, self._available)

    def _take_shard_snap(self, wall: float, now: float) -> None:
        """What a checkpoint (or a re-run after a failover) of this version starts from."""
        self._shard_snap = {
            "policy": json.dumps(self.policy.state_dict()),
            "tasks": dict(self.tasks),
            "staleness": dict(self.staleness),
            "devices": copy.deepcopy(self.devices),
            "wall": wall,
            "now": now,
        }

    def _collect_shard_stats(self) -> None:
        """End of the run: every live shard's wire counters (asked by a HEARTBEAT)."""
        if self.stopped and self.failed_ranks.keys() & set(self.shards):
            return
        self.t.wait_sends()
        live = [s for s in self.shards if s not in self.failed_ranks]
        for s in live:
            self.t.send(s, Kind.HEARTBEAT)
        got = self._from_shards(Kind.SHARD_STATS, None)
        for s, msgs in sorted((got or {}).items()):
            for msg in msgs:
                v = [int(x) for x in msg.payload[:5]]
                names = ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv", "replica_bytes")
                self.shard_stats[s] = dict(zip(names, v, strict=False))
                self.t.release(msg)

    def _filter(self, ap: Apply) -> tuple[list[Arrival], Apply]:
        """Norm bound (robust.norm_bound*): drop or clip outlying updates before use."""
        ups = [Update(a.device, a.delta, a.samples, a.loss, self.version) for a in ap.arrivals]
        res = self.update_filter(ups)
        for d, reason in res.rejected:
            self.t.reject(self.devices[d]["rank"], f"update of device {d}: {reason}")
        keep = {u.device: u for u in res.accepted}
        arr, coefs = [], []
        for i, a in enumerate(ap.arrivals):
            if a.device in keep:
                a.delta = keep[a.device].delta
                arr.append(a)
                if ap.coefs:
                    coefs.append(ap.coefs[i])
            else:
                self.t.release(a.msg)  # type: ignore[attr-defined]
        return arr, Apply(ap.mode, arr, coefs)

    def _gc_bases(self) -> None:
        for v in [v for v, n in self.base_refs.items() if n <= 0 and v != self.version]:
            self.bases.pop(v, None)
            del self.base_refs[v]

    def _log(self, event: str, now: float, device: int, task: int, **extra) -> None:
        if self.events_log is not None:
            rec = {"t": now, "event": event, "device": device, "task": task, "v": self.version}
            rec.update(extra)
            self.events_log.write(json.dumps(rec) + "\n")

    def _row(self, arr: list[Arrival], now: float) -> None:
        cfg = self.cfg
        r = self.version
        row: dict = {"round": r, "time_s": now, "participants": len(arr), "updates": len(arr)}
        n = sum(a.samples for a in arr)
        row["train_loss"] = float(sum(a.loss * a.samples for a in arr) / max(n, 1))
        row["staleness"] = float(np.mean([r - 1 - a.base_version for a in arr]))
        every_s = cfg["run"]["eval_every_s"]
        bucket = int(now // every_s) if every_s > 0 else 0
        if (
            r % cfg["run"]["eval_every"] == 0
            or r >= cfg["run"]["rounds"]
            or (every_s > 0 and bucket > self._eval_bucket)
        ):
            self._eval_bucket = bucket
            with torch.no_grad():
                loss, acc = evaluate(self.task.model, self._test, self.task.data.info.task)
            row["test_loss"], row["test_accuracy"] = loss, acc
        per_dev = {}
        for a in arr:
            up = HEADER_BYTES + a.msg.nbytes  # type: ignore[attr-defined]  # as sent
            per_dev[str(a.device)] = {"bytes_up": up, "msgs_up": 1, "time_s": a.seconds}
        row.update(self._period)
        if self.gated:  # the pushes (major updates) this version applied
            row["major_updates"] = sorted(a.device for a in arr)
        self._period = _new_period()
        row["wall_time_s"] = time.monotonic() - self._t0
        row["devices"] = per_dev
        self.metrics.append(row)
        self.progress.update(row)
        target = cfg["run"]["target_accuracy"]
        stop_at = cfg["debug"]["stop_after_round"]
        if target > 0 and row.get("test_accuracy", 0.0) >= target:
            self.stopped = f"target accuracy {target} reached at round {r}"
        elif stop_at and r == stop_at and r < cfg["run"]["rounds"]:
            self.stopped = f"debug.stop_after_round = {stop_at}"
        if self.servers:  # what a checkpoint of this version holds, should a shard die
            self._take_shard_snap(row["wall_time_s"], now)
        every = cfg["run"]["checkpoint_every"]
        final = r >= cfg["run"]["rounds"] or bool(self.stopped)
        if self.out_dir is not None and ((every and r % every == 0) or final):
            self.checkpoint(r, self.metrics.rows, row["wall_time_s"], now)

    def _iteration(self, ev: Event, pushed: bool) -> None:
        """Book one finished local iteration of ``ev.device`` (Hermes metrics, allocation)."""
        d = ev.device
        msg = ev.msg
        seconds = self._iter_time.get(d, 0.0) if self.virtual else float(msg.aux[2])
        if not math.isfinite(seconds) or seconds < 0:
            seconds = 0.0
        self.devices[d]["iterations"] += 1
        self._period["iterations"] += 1
        self.hermes.record_iteration(d, seconds)
        if self.allocating and seconds > 0:
            self.allocator.update({d: seconds})

    def _decode_sparse(self, d: int, task: int, msg: Message):
        """A parameter-server push: decode it; if it names a key list this coordinator does
        not hold (key cache miss), ask the device to resend it with the full index list."""
        from ..policies.compress import Decoder, KeyCacheMiss, MessageError, key_hash

        dec = self.sparse_dec.get(d)
        if dec is None:
            dec = self.sparse_dec[d] = Decoder(
                self.global_model.size, self.cfg["ps"]["cache_entries"]
            )
            if self.cfg["ps"]["key_cache"] and d in self.ws_dev:
                # the device's accepted working set is its first cached key list: its
                # pushes can name subsets of it as bitmaps from the start
                ws = self.ws_dev[d]
                dec.cache.put(key_hash(ws, self.global_model.size), ws)
        for _attempt in range(2):
            try:
                got = dec.decode(msg.payload)
                out = got.to_dense().astype(np.float32)
                keys = np.flatnonzero(out) if got.keys is None else got.keys
                self._book_mass(d, keys, out[keys])
                return out, "", msg
            except KeyCacheMiss:
                self.sparse_resends += 1
                self._book_up(d, HEADER_BYTES + msg.nbytes)  # the message that missed
                self.t.release(msg)
                self.t.send(self.devices[d]["rank"], Kind.RESEND, device=d, round=task)
                msg = self._wait_for((d, task))
            except MessageError as e:
                return None, f"sparse update of device {d}: {e}", msg
        return None, f"sparse update of device {d}: key list still unknown after a resend", msg

    def _decode_residual(self, d: int, msg: Message) -> tuple[np.ndarray | None, str]:
        """GDDR: the dense update of a RESIDUAL message (released values + norm)."""
        from ..policies.residual import ReleaseDecoder

        dec = self.decoders.get(d)
        if dec is None:
            g = self.cfg["gddr"]
            dec = self.decoders[d] = ReleaseDecoder(
                self.global_model.size, d, self.cfg["seed"], alpha=g["alpha"]
            )
        values, norm = msg.payload[:-1], float(msg.payload[-1])
        try:
            dense = dec.decode(dec.last_step + 1, int(msg.aux[3]), values)
        except ValueError as e:
            return None, f"GDDR message of device {d}: {e}"
        self.gddr_stats["messages"] += 1
        self.gddr_stats["values"] += int(values.size)
        self._norms.append(norm)
        return dense, ""

    def _start_replay(self, d: int, now: float) -> None:
        """GDDR: device ``d`` died; fold its last residual checkpoint back in over the next
        steps. A missing or corrupt checkpoint is logged and the run goes on without it."""
        from ..ckpt.residual import load_residual, residual_checkpoint_name
        from ..errors import CheckpointError

        if self.out_dir is None or d not in self.decoders:
            return
        path = self.out_dir / "checkpoints" / "gddr" / residual_checkpoint_name(d)
        try:
            state = load_residual(path)
            start = self.replay.start(state, self.decoders[d].steps_after(state["last_step"]))
        except (CheckpointError, ValueError) as e:
            log.error("GDDR replay of dead device %d skipped: %s", d, e)
            self.gddr_stats["replay_errors"].append({"device": d, "time_s": now, "error": str(e)})
            return
        if start is not None:
            self.gddr_stats["replays"].append(
                {"device": d, "time_s": now, "checkpoint_step": start.checkpoint_step,
                 "coordinates": start.coordinates, "total": start.total}
            )  # fmt: skip
            self._log("replay", now, d, -1)

    def _global_test_loss(self) -> float:
        """Test loss of the current global model (cached per version)."""
        if self._global_loss is None or self._global_loss[0] != self.version:
            with torch.no_grad():
                loss = evaluate(self.task.model, self._test, self.task.data.info.task)[0]
            self._global_loss = (self.version, loss)
        return self._global_loss[1]

    def _candidate_loss(self, delta: np.ndarray) -> float:
        """Test loss of the global model with ``delta`` applied (the model is restored)."""
        keep = self.global_model.copy()
        self.global_model += delta
        try:
            with torch.no_grad():
                return evaluate(self.task.model, self._test, self.task.data.info.task)[0]
        finally:
            self.global_model[:] = keep

    def _arrival(self, ev: Event) -> Arrival | None:
        """Check an arrived update; None (and counted as lost) if it must be rejected."""
        msg = ev.msg
        task, base, _t0 = self._task_done(ev.device)
        bad = ""
        if not all(math.isfinite(x) for x in msg.aux) or msg.aux[0] < 0 or msg.aux[2] < 0:
            bad = f"update from device {msg.device} with bad header values {msg.aux}"
        elif self.servers:
            pass  # the update went to the shards (the model's finiteness is checked)
        elif not np.isfinite(msg.payload).all():
            bad = f"non-finite update from device {msg.device}"
        delta = msg.payload
        if not bad and msg.kind == Kind.RESIDUAL:
            delta, bad = self._decode_residual(ev.device, msg)
        elif not bad and msg.kind == Kind.SPARSE:
            delta, bad, msg = self._decode_sparse(ev.device, task, msg)
            ev.msg = msg
        if bad:
            self.t.reject(msg.src, bad)
            self.t.release(msg)
            return None
        dev = self.devices[ev.device]
        up = HEADER_BYTES + msg.nbytes
        if self.servers:  # S SHARD_PUSH pieces + this REPORT
            up = (self.servers + 1) * HEADER_BYTES + self.global_model.nbytes
        dev["bytes_up"] += up
        dev["msgs_up"] += 1
        dev["rounds"] += 1
        seconds = float(msg.aux[2])
        if self.virtual:
            plan_s = ev.time - _t0
            seconds = plan_s
        dev["time_s"] += seconds
        self._period["bytes_up"] += up
        self._period["msgs_up"] += 1
        a = Arrival(ev.device, task, base, int(msg.aux[0]), float(msg.aux[1]), delta, ev.time)
        a.seconds = seconds  # type: ignore[attr-defined]
        a.msg = msg  # type: ignore[attr-defined]
        return a

    def run(self) -> int:
        """The event loop; returns the exit status (0 = completed)."""
        cfg = self.cfg
        self._setup_run()
        out = self.out_dir
        rounds = cfg["run"]["rounds"]
        self.metrics = MetricsLog(out / "metrics.jsonl" if out else None, self.history)
        self.progress = Progress(cfg["output"]["progress"], rounds)
        self._test = self.task.data.test()
        self._t0 = time.monotonic() - self.wall_offset
        self._period = _new_period()
        self._eval_bucket = 0
        self.version = self.start_round
        if self.resume is not None:
            self._restore_clock(self.resume)
        for d, up in sorted(self.ws_up.items()):  # WORKSET uploads (after restore's totals)
            self._book_up(d, up)
        start = self.start_time
        self.ev = VirtualEvents(self.t, start) if self.virtual else WallEvents(self.t, start)
        self.owed: dict[int, int] = {}
        self.ev.received_hook = self._received
        self._stream = None  # the open epoch of example ordering (EpochStream)
        self._last_add_s = 0.0  # seconds of the newest EpochStream.add
        if self.orderer is not None:
            self.ev.grads_hook = self._on_grads
        if self.servers:
            self._send_shard_ranges()
        if out is not None and cfg["sim"]["event_log"]:
            mode = "a" if self.resume is not None else "w"
            self.events_log = open(out / "events.jsonl", mode, encoding="utf-8")  # noqa: SIM115
        try:
            self._loop(rounds)
            if self.gddr or self.cfg["ps"]["sparse"]:
                self._flush_residuals()
            if self.servers:
                self._collect_shard_stats()
        finally:
            if self.events_log is not None:
                self.events_log.close()
            self.ev.release_all()
        if self.progress.mode == "bar" and self.stopped:
            self.progress.close()
        end = self.ev.now
        self.timeline.finish(sorted(self.devices), end, self.profiles, cfg["seed"])
        if out is not None:
            self.timeline.write_csv(out / "timeline.csv")
        self.finish(self.metrics.rows, self.version, time.monotonic() - self._t0, end)
        return self.exit_status

    def _send_orders(self, orders: list[np.ndarray]) -> None:
        """Send every device its order for the orderer's current epoch and open the epoch's
        stream: the devices' GRADS are balanced as they arrive (docs/ordering.md)."""
        for d, o in zip(sorted(self.devices), orders):
            self.t.send(
                self.devices[d]["rank"], Kind.ORDER, device=d, round=self.orderer.epoch,
                payload=np.ascontiguousarray(o, np.int32),
            )  # fmt: skip
        sketched = self.cfg["ordering"]["sketch_dim"] > 0
        self._stream = self.orderer.begin_epoch(sketched=sketched)
        self._stream_before = (
            self.orderer.state_dict() if self.cfg["ordering"]["save_debug"] else None
        )

    def _on_grads(self, msg: Message) -> None:
        """Feed one GRADS message (rows ``first .. first + n - 1`` of a device's epoch;
        aux = (n, width, first, 0)) to the open stream. A message that does not fit (not the
        device's task in flight, rows out of sequence, bad shape or values) is rejected and
        the device gets a D-RR order next epoch (its rows of this epoch are incomplete)."""
        d, st = msg.device, self._stream
        devs = sorted(self.devices)
        if st is None or d not in self.devices:
            self.t.reject(msg.src, f"GRADS of device {d}: no ordering epoch open")
            return
        w = devs.index(d)
        task = self.inflight.get(d, (None,))[0]
        n, width, first = int(msg.aux[0]), int(msg.aux[1]), int(msg.aux[2])
        if msg.round != task:
            why = f"for task {msg.round}, device {d} is running task {task}"
        elif n * width != msg.payload.size or n < 1:
            why = f"{msg.payload.size} values are not {n} rows of {width}"
        elif first != st.count[w]:
            why = f"rows from {first}, expected from {st.count[w]}"
        else:
            why = None
            t0 = time.perf_counter()
            try:
                st.add(w, msg.payload.reshape(n, width))
            except ValueError as e:
                why = str(e)
            # the newest add: if it carried the round's last rows, the epoch waited for it
            self._last_add_s = time.perf_counter() - t0
        if why is not None:
            self.t.reject(msg.src, f"GRADS of device {d}: {why}")
            if w not in st.missing:
                st.drop(w)

    def _next_orders(self, arr: list[Arrival], now: float) -> None:
        """CD-GraB & co.: close the epoch's stream (devices without an update this round, or
        with rows missing, get a D-RR order) and send every device its next order."""
        st = self._stream
        got = {a.device for a in arr}
        for w, d in enumerate(sorted(self.devices)):
            if d not in got and w not in st.missing:
                st.drop(w)
        used = [u.copy() for u in st.used]
        t0 = time.perf_counter()
        orders = st.finish()
        # what the epoch waited for: the decisions the last rows to arrive made possible (all
        # of an epoch's with ordering.ship = epoch, one step's when streamed) and finish()
        self.ordering_wait_s += self._last_add_s + time.perf_counter() - t0
        self._last_add_s = 0.0
        self.ordering_s += st.seconds
        if self._stream_before is not None and self.out_dir is not None:
            from ..policies.ordering import save_epoch_debug

            grads = [
                None if w in st.missing or not self.orderer.needs_grads else st.buf[w]
                for w in range(len(st.sizes))
            ]
            folder = self.out_dir / "ordering"
            folder.mkdir(exist_ok=True)
            path = folder / f"epoch-{self.orderer.epoch - 1:05d}.npz"
            sketched = self.cfg["ordering"]["sketch_dim"] > 0
            save_epoch_debug(path, self._stream_before, grads, used, orders, sketched=sketched)
        self._send_orders(orders)

    def _loop(self, rounds: int) -> None:
        max_t = self.cfg["run"]["max_virtual_s"]
        if self.orderer is not None:
            if self.orderer.orders:  # resumed: the checkpoint's current orders
                self._send_orders(self.orderer.orders)
            else:
                sizes = [self.orderer.num_units(self.n_train[d]) for d in sorted(self.devices)]
                self._send_orders(self.orderer.initial_orders(sizes))
        if self.servers and self.replicas > 1:  # a re-run of the first round starts here
            self._take_shard_snap(time.monotonic() - self._t0, self.ev.now)
        self._execute(self.policy.start(self.ev.now, self._available), self.ev.now)
        while self.version < rounds and not self.stopped:
            ev = self.ev.next()
            if ev is None:
                self.stopped = "no device can make progress (all offline, dead or idle)"
                self.exit_status = 3
                break
            now = ev.time
            if max_t and now > max_t:
                self.stopped = f"run.max_virtual_s = {max_t} reached"
                break
            if ev.kind == FAILED:
                dec = self._rank_failed(ev.token, now)
                self._execute(dec, now)
                continue
            if ev.kind == ARRIVE and ev.msg.kind == Kind.REPORT and not self.servers:
                self._iteration(ev, pushed=False)
                self._log("iteration", now, ev.device, ev.task)
                self._continue(ev.device, now)
                continue
            if ev.kind == ARRIVE and self.gated and self.virtual:
                self._iteration(ev, pushed=True)
                self._log("push", now, ev.device, ev.task)
                self._plan_push(ev.device, ev.task, now, ev.msg)
                continue
            if ev.kind == PUSH:
                ev.msg = self.pushes.pop((ev.device, ev.task))
                ev.kind = ARRIVE
            elif ev.kind == ARRIVE and self.gated:
                self._iteration(ev, pushed=True)
            if ev.kind == ARRIVE:
                if not self.gated:
                    self._iteration(ev, pushed=True)
                a = self._arrival(ev)
                self._log("arrive", now, ev.device, ev.task)
                if a is None:
                    self.lost_tasks += 1
                    self._rejected_streak += 1
                    if self._rejected_streak > 3 * self.num_devices:
                        self.stopped = (
                            f"the last {self._rejected_streak} updates were all rejected "
                            "(see the log); nothing can change the model"
                        )
                        self.exit_status = 3
                        break
                    dec = self.policy.lost(ev.device, now, self._available)
                else:
                    dec = self.policy.arrived(a, self.version, now, self._available)
                    used = dec.apply is not None and any(x is a for x in dec.apply.arrivals)
                    if not used and not self._buffered(a):
                        self.t.release(a.msg)  # type: ignore[attr-defined]
            elif ev.kind == LOST:
                self._task_done(ev.device)
                if self.gddr and self._dead(ev.device, now):
                    self._start_replay(ev.device, now)
                self.lost_tasks += 1
                self._log("lost", now, ev.device, ev.task)
                dec = self.policy.lost(ev.device, now, self._available)
            elif ev.kind == TIMER:
                self._log("timer", now, -1, -1, token=ev.token)
                dec = self.policy.timer(ev.token, now, self._available)
            else:
                self.online_pending.discard(ev.device)
                self._log("online", now, ev.device, -1)
                dec = self.policy.online(ev.device, now, self._available)
            self._execute(dec, now)

    def _flush_residuals(self) -> None:
        """End of training (GDDR): every live device sends what its residual still holds;
        it is applied with the devices' FedAvg weights, so nothing produced is lost."""
        from .worker import FLUSH

        now = self.ev.now
        got: list[Arrival] = []
        # updates already sent for tasks still out: their released values count too
        if self.virtual:
            out = [(e[2], e[3]) for e in self.ev.heap if e[1] == ARRIVE]
        else:
            out = sorted(self.ev.expected)
        for key, msg in sorted(self.pushes.items()):
            got += self._final_arrival(key, msg, now)
        self.pushes.clear()
        for key in sorted(out):
            got += self._final_arrival(key, self._wait_for(key), now)
        for d in list(self.inflight):
            self._task_done(d)
        senders = self.decoders if self.gddr else self.sparse_dec
        for d in sorted(senders):
            if d in self.failed:
                continue
            task = self._next_task(d)
            self.t.send(self.devices[d]["rank"], Kind.TRAIN, device=d, round=task,
                        aux=(float(self.version), 0.0, 0.0, float(FLUSH)))  # fmt: skip
            arr = self._final_arrival((d, task), self._wait_for((d, task)), now)
            if arr and not self.gddr:
                self._book_flush(d, arr[0])
            got += arr
        if got and not self.gddr and not any(a.delta.any() for a in got):
            # sparse pushes with nothing held back: no extra model version (so a lossless
            # sparse run ends with the model a dense run ends with, server prox included)
            for a in got:
                self.t.release(a.msg)  # type: ignore[attr-defined]
            got = []
        if got:
            self._log("flush", now, -1, -1, devices=len(got))
            self._apply(Apply("terms", got, [self.policy.weight(a.device) for a in got]), now)

    def _book_flush(self, d: int, a: Arrival) -> None:
        """Sparse pushes: a device's final flush (SPARSE; UPDATE from a device that never
        pushed); its aux says (samples, mass_checksum of all it produced, KKT entries skipped,
        KKT entries seen). Its bytes count as the device's upload."""
        msg = a.msg  # type: ignore[attr-defined]
        self.ps_mass.setdefault(d, [0.0, 0.0, 0.0])[0] = float(msg.aux[1])
        if msg.kind == Kind.UPDATE:  # (SPARSE ones were booked when decoded)
            keys = np.flatnonzero(a.delta)
            self._book_mass(d, keys, a.delta[keys])
        self.ps_flushed_abs += float(np.abs(a.delta).sum(dtype=np.float64))
        self.ps_kkt[0] += int(msg.aux[2])
        self.ps_kkt[1] += int(msg.aux[3])
        self._book_up(d, HEADER_BYTES + msg.nbytes)

    def _book_up(self, d: int, nbytes: int) -> None:
        """A message of ``nbytes`` (header included) came up from device ``d``."""
        dev = self.devices[d]
        dev["bytes_up"] += nbytes
        dev["msgs_up"] += 1
        self._period["bytes_up"] += nbytes
        self._period["msgs_up"] += 1

    def _book_mass(self, d: int, keys: np.ndarray, values: np.ndarray) -> None:
        from ..policies.filters import mass_checksum

        m = self.ps_mass.setdefault(d, [0.0, 0.0, 0.0])
        m[1] += mass_checksum(keys, values)
        m[2] += float(np.abs(values).sum(dtype=np.float64))

    def _ps_summary(self) -> dict | None:
        """summary.json "ps": working-set pulls and sparse pushes (None when neither)."""
        ps = self.cfg["ps"]
        if self.servers:
            st = self.t.stats
            return {
                "servers": self.servers,
                "ranges": [[r.start, r.stop] for r in self.shard_ranges],
                "rank0": {
                    "bytes_sent": sum(st.bytes_sent.values()),
                    "bytes_recv": sum(st.bytes_recv.values()),
                },
                "shards": {str(k): v for k, v in sorted(self.shard_stats.items())},
                "shard_wait_s": self.shard_wait_s,
                "replicas": self.replicas,
                "replica_bytes": sum(v.get("replica_bytes", 0) for v in self.shard_stats.values()),
                "owners": list(self.shard_owners),
                "failovers": self.failovers,
            }
        if not ps["sparse"] and ps["pull"] == "full":
            return None
        numel = self.global_model.size
        out: dict = {"pull": ps["pull"], "filters": list(ps["filters"])}
        if self.ws_dev or self.ws_rejected:
            fr = [k.size / numel for k in self.ws_dev.values()]
            out["working_set"] = {
                "fraction": {str(d): k.size / numel for d, k in sorted(self.ws_dev.items())},
                "fraction_mean": float(np.mean(fr)) if fr else None,
                "rank_keys": {str(r): int(v[0].size) for r, v in sorted(self.ws_rank.items())},
                "rejected_devices": sorted(self.ws_rejected),
            }
        if ps["sparse"]:
            out["mass"] = {
                str(d): {"produced": m[0], "received": m[1], "received_abs": m[2]}
                for d, m in sorted(self.ps_mass.items())
            }
            out["flushed_abs"] = self.ps_flushed_abs
            out["kkt_skipped"], out["kkt_seen"] = self.ps_kkt
        return out

    def _wait_for(self, key: tuple[int, int]) -> Message:
        while key not in self.ev.stash:
            self.ev._take(timeout=1.0)
        return self.ev.stash.pop(key)

    def _final_arrival(self, key: tuple[int, int], msg: Message, now: float) -> list[Arrival]:
        """A message collected at the end (GDDR flush): as an Arrival, or none."""
        d = key[0]
        delta = msg.payload
        if msg.kind == Kind.REPORT:
            return []
        if msg.kind in (Kind.RESIDUAL, Kind.SPARSE):
            if msg.kind == Kind.RESIDUAL:
                delta, bad = self._decode_residual(d, msg)
            else:
                delta, bad, msg = self._decode_sparse(d, key[1], msg)
            if bad:
                self.t.reject(msg.src, bad)
                self.t.release(msg)
                return []
        a = Arrival(d, key[1], self.version, self.devices[d]["samples"], 0.0, delta, now)
        a.msg = msg  # type: ignore[attr-defined]
        a.seconds = 0.0  # type: ignore[attr-defined]
        return [a]

    def _buffered(self, a: Arrival) -> bool:
        """Does the policy still hold ``a`` (BSP round or FedBuff buffer)?"""
        buf = getattr(self.policy, "buffer", [])
        return any((x[0] if isinstance(x, tuple) else x) is a for x in buf)

    def checkpoint(self, round_: int, rows: list[dict], wall: float, now: float) -> Path:
        path = self.out_dir / "checkpoints" / checkpoint_name(round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = checkpoint_state(
            self.cfg, round_, self.task.flat, self.global_model, self.devices, rows, wall
        )
        state["clock"] = {
            "mode": "virtual" if self.virtual else "wall",
            "time_s": float(now),
            "policy": json.dumps(self.policy.state_dict()),
            "tasks": json.dumps({str(d): n for d, n in self.tasks.items()}),
            "staleness": json.dumps({str(k): v for k, v in self.staleness.items()}),
        }
        if self.orderer is not None:
            state["ordering"] = self.orderer.state_dict()
        state["server_optimizer"] = self.server_opt.state_dict()
        save_checkpoint(path, state)
        return path

    def _ordering_summary(self) -> dict | None:
        if self.orderer is None:
            return None
        o = self.orderer
        return {
            "name": o.name,
            "epochs": o.epoch,
            "seconds": self.ordering_s,
            "wait_seconds": self.ordering_wait_s,
        }

    def _gddr_summary(self) -> dict | None:
        if not self.gddr:
            return None
        st = self.gddr_stats
        size = self.global_model.size
        return {
            "messages": st["messages"],
            "payload_density": st["values"] / (st["messages"] * size) if st["messages"] else None,
            "tau": self.tauc.tau,
            "replays": st["replays"],
            "replay_errors": st["replay_errors"],
        }

    def _hermes_summary(self) -> dict:
        """WI, API calls, iterations, iteration-time CV (Hermes metrics; any gate)."""
        wi = {}
        for d, v in sorted(self.devices.items()):
            wi[str(d)] = v["iterations"] / v["requests"] if v.get("requests") else 0.0
        pulls = sum(v.get("requests", 0) for v in self.devices.values())
        pushes = sum(v["msgs_up"] for v in self.devices.values())
        cvs = self.hermes.cv_by_iteration()
        return {
            "wi": wi,
            "wi_mean": float(np.mean(list(wi.values()))) if wi else 0.0,
            "iterations": sum(v["iterations"] for v in self.devices.values()),
            "pulls": pulls,
            "pushes": pushes,
            "api_calls": pulls + pushes,
            "control_messages": self.control_msgs,
            "bytes": sum(v["bytes_up"] + v["bytes_down"] for v in self.devices.values()),
            "iteration_time_cv_first": cvs[0] if cvs else None,
            "iteration_time_cv_last": cvs[-1] if cvs else None,
            # CV across devices of each device's mean over its last 5 iterations (the
            # per-task jitter of the profiles averages out; what allocation can control)
            "iteration_time_cv_settled": _settled_cv(self.hermes.times),
            "iteration_time_cv": cvs,
            "allocations": {
                str(d): [a.samples, a.batch] for d, a in self.allocator.allocations().items()
            },
        }

    def _restore_clock(self, st: dict) -> None:
        """Policy state and task counters of a resumed run (in-flight tasks restart)."""
        c = st.get("clock")
        if not c:
            return
        self.policy.load_state_dict(json.loads(c["policy"]))
        for d, n in json.loads(c["tasks"]).items():
            if int(d) in self.tasks:
                self.tasks[int(d)] = int(n)
        self.staleness = {int(k): int(v) for k, v in json.loads(c["staleness"]).items()}
        if "server_optimizer" in st:
            self.server_opt.load_state_dict(st["server_optimizer"])
        if self.orderer is not None and "ordering" in st:
            self.orderer.load_state_dict(st["ordering"])

    def finish(self, rows: list[dict], rounds_done: int, wall: float, end: float = 0.0) -> None:
        stats = self.t.stats
        for d, frac in self.timeline.idle.items():
            self.devices[d]["idle_fraction"] = frac
        info = {
            "rounds_done": rounds_done,
            "workers": len(self.workers),
            "clock": "virtual" if self.virtual else "wall",
            "time_s": end,
            "idle_fraction": self.timeline.idle_fraction(),
            "consistency": self.policy.name,
            "gate": self.cfg["algorithm"]["gate"],
            "allocation": self.cfg["algorithm"]["allocation"],
            "hermes": self._hermes_summary(),
            "dp_epsilon": self.aggregator.epsilon() if self.cfg["dp"]["enabled"] else None,
            "gddr": self._gddr_summary(),
            "sparse_resends": self.sparse_resends,
            "ps": self._ps_summary(),
            "ordering": self._ordering_summary(),
            "reference_s_per_sample": self.ref_s,
            "lost_tasks": self.lost_tasks,
            "failed_devices": {str(d): t for d, t in sorted(self.failed.items())},
            "failed_ranks": {str(r): t for r, t in sorted(self.failed_ranks.items())},
            "recovery_s": self.recovery_s,
            "progress_after_failure_unix": self.progress_after_failure_unix,
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "wall_time_s": wall,
            "stopped": self.stopped,
            "rejected": sum(stats.rejected.values()),
            "duplicates": sum(stats.duplicates.values()),
        }
        print(summary_table(rows, self.devices, info), flush=True)
        evals = [r for r in rows if r.get("test_accuracy") is not None]
        final_acc = evals[-1]["test_accuracy"] if evals else None
        print(
            f"final accuracy: {final_acc:.4f}" if final_acc is not None else "final accuracy: -",
            flush=True,
        )
        if self.out_dir is None:
            return
        summary = {
            **info,
            "final_accuracy": final_acc,
            "final_test_loss": evals[-1]["test_loss"] if evals else None,
            "model_sha256": _sha256(self.global_model),
            "devices": {str(d): v for d, v in sorted(self.devices.items())},
            "wire": {
                "bytes_sent": sum(stats.bytes_sent.values()),
                "bytes_recv": sum(stats.bytes_recv.values()),
                "msgs_sent": sum(stats.msgs_sent.values()),
                "msgs_recv": sum(stats.msgs_recv.values()),
            },
        }
        _write_json(self.out_dir / "summary.json", summary)
        torch.save(self.task.model.state_dict(), self.out_dir / "final_model.pt")

    def stop_workers(self, status: int) -> None:
        """Tell every worker to finish with ``status`` and wait until the messages left."""
        for w in self.shards + self.workers:
            self.t.send(w, Kind.STOP, aux=(float(status),))
        self.t.wait_sends()


def _settled_cv(times: dict[int, list[float]], last: int = 5) -> float | None:
    means = [float(np.mean(t[-last:])) for t in times.values() if t]
    if len(means) < 2 or np.mean(means) <= 0:
        return None
    return float(np.std(means) / np.mean(means))


def _new_period() -> dict:
    return {"bytes_up": 0, "bytes_down": 0, "msgs_up": 0, "msgs_down": 0, "iterations": 0}


def _sha256(arr: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    import os

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = ["Coordinator", "WorkerFailed"]
