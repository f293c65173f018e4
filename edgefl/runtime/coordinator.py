"""Rank 0: registers the workers, runs the event loop, applies model changes, checkpoints.

The core knows events, not algorithms: every algorithm is a plugin
(:mod:`edgefl.algorithms`) whose coordinator half is called at fixed points of this loop,
and where the model lives (here, or spread over server ranks) is a server backend
(:mod:`edgefl.server`). docs/architecture.md walks through the loop.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from ..algorithms import coordinator_plugins, worker_keeps_state
from ..algorithms.base import CoordinatorPlugin, Download, TaskSpec
from ..comm import Kind, Message, Transport
from ..comm.taskflags import CONTINUE, REFRESH, pack_flags
from ..comm.wire import HEADER_BYTES
from ..data.spill import load_test, spill_budget
from ..errors import EdgeflError
from ..kernels import fingerprint
from ..launcher import INTERRUPTED
from ..policies.consistency import Apply, Arrival, Decision, make_consistency
from ..rankwrap import defer_stop
from ..server import make_server
from ..server.local import LocalServer
from ..sim.timeline import Timeline
from . import (
    blame,
    checkpointing,
    divergence,
    failures,
    flush,
    heap,
    planning,
    registration,
    rehost,
    summary,
)
from .contexts import RuntimeCoordinatorContext
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
)
from .output import MetricsLog, Progress
from .policies import make_update_aggregator
from .state import Task
from .trackers import make_trackers
from .watch import FAREWELL, STOPPED, WANT_FAREWELL, RankWatch
from .worker import HOLD_UPDATES

log = logging.getLogger("edgefl.coordinator")

STOP_AT_VERSION_S = 1.0  # a stop signal: how long the run waits for the next model version


class Coordinator:
    """The rank-0 loop.

    Args:
        cfg: the effective config (read only).
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
        from edgefl.algorithms.server_opt.optimizers import make_server_optimizer
        from edgefl.training import resolve_loss

        self.cfg = cfg
        self.t = transport
        self.task = task
        self.loss = resolve_loss(cfg["train"]["loss"], task.data.info.task)  # train.loss
        self.out_dir = out_dir
        self.resume = resume
        self.num_devices = cfg["fleet"]["devices"]
        self.global_model = task.flat.to_host()  # the live global model (float32, zero-copy)
        self.server = make_server(self)  # where updates are aggregated (rank 0 or server ranks)
        self.workers = list(range(self.server.first_worker, transport.size))
        self.aggregator = make_update_aggregator(cfg, self.num_devices)
        self.server_opt = make_server_optimizer(cfg["server"])
        self.devices: dict[int, dict] = {}
        self.rank_info: dict[int, dict] = {}  # rank -> its REGISTER (JSON)
        # where this process's numbers come from (edgefl/kernels.py); ranks that differ
        self.numerics = fingerprint(cfg["run"]["kernels"])
        self.numerics_differ: dict[str, list[str]] = {}
        self.start_round = 0
        self.wall_offset = 0.0
        self.start_time = 0.0  # clock seconds at the start (non-zero when resuming)
        self.history: list[dict] = []
        self.stopped = ""
        self.interrupted = False  # stopped to be resumed (not the end of training)
        self.exit_status = 0
        self.diverged: dict | None = None  # the first sign of divergence (divergence.py)
        self.version = 0
        self.plugins: list[CoordinatorPlugin] = []

    # -- set-up -----------------------------------------------------------------------------
    def register(self) -> None:
        """Wait for every rank's REGISTER, then set up the run (see
        :func:`.registration.register`)."""
        registration.register(self)

    def check_signature(self, rank: int, info: dict) -> None:
        """A registering rank must have built the same model layout as rank 0."""
        if info["signature"] != self.task.signature:
            raise EdgeflError(
                f"rank {rank} built a different model ({info['signature']} vs "
                f"{self.task.signature}); are all ranks using the same config?"
            )

    def setup(self) -> None:
        """Build the run's state once every rank registered: the consistency policy, the
        fleet's profiles, the bookkeeping, the plugins (each handed :attr:`ctx`)."""
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
        self.bases: dict[int, np.ndarray] = {}  # version -> model of tasks still out
        self.keep_bases = self.policy.name == "fedasync" or self.out_dir is not None
        self.base_refs: dict[int, int] = {}
        self.staleness: dict[int, int] = {}
        self.lost_tasks = 0
        self.events_log = None
        self._log_later: list | None = None  # (events.jsonl lines held back: log_event)
        self.failed: dict[int, float] = {}
        self.failed_ranks: dict[int, float] = {}
        self.t_failure: float | None = None
        self._rejected_streak = 0
        self.recovery_s: list[float] = []  # detection -> next model change (seconds)
        self.progress_after_failure_unix: list[float] = []
        self.gated = cfg["algorithm"]["gate"] != "always"  # devices push when their gate says
        self.pushes: dict[tuple[int, int], Message] = {}  # gated pushes being uploaded
        self.refresh: dict[int, bool] = {}  # gated devices to get the new model first
        self.control_msgs = 0
        self.iter_time: dict[int, float] = {}
        self.planned_arrival = 0.0  # (virtual s: the arrival of the task planned last)
        self.n_train = {d: v["samples"] for d, v in self.devices.items()}  # plugins may cut
        self.ctx = RuntimeCoordinatorContext(self)  # what the plugins see of the run
        self.plugins = coordinator_plugins(self.ctx)
        self.worker_state = worker_keeps_state(cfg) or self.gated  # (gated: local models)
        self.sent: dict[int, tuple[int, tuple]] = {}  # device -> (its latest task, TRAIN aux)
        self.pending: Decision | None = None  # what the run does after the apply under way
        base = CoordinatorPlugin.on_device_dead
        self.dead_hooks = [p for p in self.plugins if type(p).on_device_dead is not base]
        self._owners = {k: p for p in self.plugins for k in (*p.update_kinds, *p.message_kinds)}
        self.rehost = rehost.enabled(cfg) and rehost.supported(self)  # fleet.rehost
        self.quarantine: dict[int, dict] = {}  # devices with non-finite updates
        self.rehosted: list[dict] = []  # devices moved off dead ranks (summary.json)
        self.stacked_tasks = 0  # tasks the workers trained stacked (train.vectorize; at STOP)
        self.reruns = 0  # tasks in flight re-sent to a device's new rank
        self.device_states: dict = {}  # latest checkpoint's per-device plugin state
        self.stop_checkpointed = False  # a checkpoint was written after the run stopped
        self.stop_request: tuple[float, int, str] | None = None  # a stop signal: (when,
        # exit status, why)
        # a version's metrics row may be finished after its tasks are dispatched (_row):
        # only without plugins that read rows or flush at the end, and with a server that
        # keeps nothing at a row
        self.row_waits = (
            all(type(p).on_row is CoordinatorPlugin.on_row for p in self.plugins)
            and all(type(p).flush_devices is CoordinatorPlugin.flush_devices for p in self.plugins)
            and type(self.server).after_row is LocalServer.after_row
        )
        self.may_defer_row = False
        self.deferred_row: tuple[dict, float] | None = None

    def _calibrate(self) -> float:
        return planning.calibrate(self)

    def restore(self) -> None:
        """Continue from the checkpoint given to the constructor (after :meth:`register`)."""
        checkpointing.restore(self, self.resume)

    # -- tasks ------------------------------------------------------------------------------
    def available(self, d: int) -> bool:
        """May device ``d`` start a task now (alive, idle, online)?"""
        if d in self.inflight or d in self.failed:
            return False
        if self.quarantine and self.quarantine.get(d, {}).get("excluded_at") is not None:
            return False
        if not self.virtual:
            return True
        now, seed = self.ev.now, self.cfg["seed"]
        prof = self.profiles[d]
        crash = prof.failure.crash_time(seed, d)
        if crash <= now:
            self.failed.setdefault(d, crash)
            return False
        if prof.availability.is_online(now, seed, d):
            return True
        if d not in self.online_pending:
            back = prof.availability.next_online(now, seed, d)
            if back < crash and back < float("inf"):
                self.online_pending.add(d)
                self.ev.schedule(back, ONLINE, d)
        return False

    def _spec(self, d: int, flags: int) -> TaskSpec:
        spec = TaskSpec(flags=flags)
        for p in self.plugins:
            p.shape_task(d, spec)
        return spec

    def _dispatch(self, d: int, now: float, later: list | None = None) -> None:
        """Start a new task of ``d`` from the current model (model download + TRAIN).
        ``later``: the TRAIN is not sent yet; (planned arrival, d, task, spec) goes there
        for :meth:`_send_in_arrival_order`."""
        task = self.next_task(d)
        self._book_download(d)
        self.inflight[d] = (task, self.version, now)
        self.hold_base()
        self.log_event("dispatch", now, d, task)
        spec = self._spec(d, 0)
        if not self._plan(d, task, now, spec, download=True):
            return
        if later is not None:
            later.append((self.planned_arrival, len(later), d, task, spec))
            return
        self.model_to_rank(self.devices[d]["rank"])
        self._send_train(d, task, now, spec)

    def _send_in_arrival_order(self, later: list, now: float) -> None:
        """Send the TRAINs of tasks planned together (a round's, a wave's), those planned
        to arrive first on the virtual clock first. Rank 0 takes updates in virtual-time
        order, waiting for the next one; a worker trains its tasks in the order their
        TRAINs came. Sent in the devices' order, a round's updates came in in an order
        unrelated to the one rank 0 takes them in: most waited until the workers were done
        (at 10,000 devices, the last third of a round). What the run computes does not
        change: every task is planned, booked and logged as before, in the same order, and
        rank 0 takes the updates in the same order (docs/architecture.md, the
        coordinator's event loop)."""
        later.sort(key=lambda x: (x[0], x[1]))
        for _, _, d, task, spec in later:
            self.model_to_rank(self.devices[d]["rank"])
            self._send_train(d, task, now, spec)

    def _continue(self, d: int, now: float) -> None:
        """A gated device goes on with its next local iteration (no download; after a
        broadcast it first downloads and adopts the new global model)."""
        task = self.next_task(d)
        _first, base, t0 = self.inflight[d]
        refresh = self.refresh.pop(d, False)
        if refresh:
            if base in self.base_refs:
                self.base_refs[base] -= 1
            base = self.version
            self.hold_base()
            self._book_download(d)
        self.inflight[d] = (task, base, t0)
        spec = self._spec(d, CONTINUE | REFRESH if refresh else CONTINUE)
        if not self._plan(d, task, now, spec, download=refresh):
            return
        if refresh:
            self.model_to_rank(self.devices[d]["rank"], wait=True)
        else:
            self.control_msgs += 1
        self._send_train(d, task, now, spec)

    def hold_base(self) -> None:
        """A task starts from the current version: keep a copy while it is out (FedAsync
        mixes with it; a checkpoint sends it again to the task's rank on resume)."""
        if self.keep_bases:
            v = self.version
            if v not in self.bases:  # (one copy per version, not one per task)
                self.bases[v] = self.global_model.copy()
            self.base_refs[v] = self.base_refs.get(v, 0) + 1

    def _book_download(self, d: int) -> None:
        """Device ``d`` downloads the current model: count its bytes and 2 messages."""
        down = self.down_bytes(d)
        dev = self.devices[d]
        dev["bytes_down"] += down
        dev["msgs_down"] += 2
        dev["requests"] += 1
        self.period["bytes_down"] += down
        self.period["msgs_down"] += 2

    def down_bytes(self, d: int) -> int:
        """Bytes a model download of device ``d`` moves (model messages + TRAIN header)."""
        for src in (self.server, *self.plugins):
            n = src.down_bytes(d)
            if n is not None:
                return n
        return 2 * HEADER_BYTES + self.global_model.nbytes

    def model_to_rank(self, rank: int, wait: bool = False) -> None:
        """Send ``rank`` the current model unless it already has this version (``wait``:
        first let pending sends finish, as the model buffer may be in flight)."""
        if self.rank_version.get(rank) == self.version:
            return
        if wait:
            self.t.wait_sends()
        down = Download(rank, self.version)
        for p in self.plugins:
            p.send_model(down)
        if self.server.send_model(rank):
            pass  # the server ranks send it (SHARD_MODEL pieces)
        elif down.by:
            self.t.send(rank, down.kind, round=self.version, aux=down.aux, payload=down.payload)
        else:
            self.t.send(rank, Kind.MODEL, round=self.version, payload=self.global_model)
        self.rank_version[rank] = self.version

    def next_task(self, d: int) -> int:
        task = self.tasks[d]
        self.tasks[d] += 1
        return task

    def _send_train(self, d: int, task: int, now: float, spec: TaskSpec) -> None:
        flags = pack_flags(spec.flags, spec.arg)
        aux = (float(self.version), float(spec.samples), float(spec.batch), float(flags))
        self.send_task(d, task, aux, now)

    def send_task(self, d: int, task: int, aux: tuple, now: float = 0.0) -> None:
        """A TRAIN to ``d``'s rank; with time-out detection its rank now owes an answer."""
        rank = self.devices[d]["rank"]
        self.t.send(rank, Kind.TRAIN, device=d, round=task, vtime=now, aux=aux)
        self.sent[d] = (task, aux)
        self.owed[rank] = self.owed.get(rank, 0) + 1
        mono = time.monotonic()
        self.watch.owes(rank, mono)
        self.tasks_owed.sent(rank, d, task, aux, mono)
        if self.t.liveness is not None:  # (silent for failure_timeout_s from now: dead)
            self.t.liveness.expect(rank, time.monotonic())

    def _received(self, msg: Message) -> None:
        """An answer to a TRAIN came in: the rank owes one less (time-out detection,
        straggler warnings)."""
        left = self.owed.get(msg.src, 0) - 1
        self.owed[msg.src] = max(left, 0)
        mono = time.monotonic()
        self.watch.answered(msg.src, mono, done=left <= 0)
        self.tasks_owed.answered(msg, mono)
        if left <= 0 and self.t.liveness is not None:
            self.t.liveness.satisfied(msg.src)

    def _stop_signal(self, status: int, why: str) -> None:
        """(The rank guard's thread.) A stop signal: the run stops at the next model version
        (its checkpoint resumes exactly), or after STOP_AT_VERSION_S without one (the
        newest checkpoint, written at a version, is the resume point)."""
        if self.stop_request is None:
            self.stop_request = (time.monotonic(), status, why)

    def _tick(self) -> None:
        """After every poll of the event loop: the watch's duties; a stop signal's stop."""
        self.watch.tick()
        req = self.stop_request
        if req is None or self.stopped:
            return
        if time.monotonic() - req[0] < STOP_AT_VERSION_S:
            return  # (summary.record_row stops at the next model version)
        # between two model versions the state is not one a resume continues exactly from,
        # and its checkpoint would replace the exact one of this version: keep the newest
        # checkpoint written at a version instead (a resume continues from there)
        self.stop_checkpointed = True
        self.interrupt(
            f"no model version within {STOP_AT_VERSION_S:g} s; the newest checkpoint stays "
            "the resume point"
        )
        self.ev.halt = True

    def interrupt(self, where: str) -> None:
        """Stop the run for the stop signal received (exit status 128 + N, resumable)."""
        _, status, why = self.stop_request or (0.0, INTERRUPTED, "interrupted")
        self.stopped = f"interrupted ({why}) at model version {self.version}; {where}"
        self.interrupted = True
        self.exit_status = status
        kept = "" if self.stop_checkpointed else "; its checkpoint is written for --resume"
        print(f"edgefl: rank 0: {why}: the run stops at model version {self.version} "
              f"({where}){kept}", flush=True)  # fmt: skip

    def _heartbeat(self, msg: Message) -> None:
        """A worker's HEARTBEAT in the event loop: an isolated task starts (blame.py)."""
        if msg.aux and msg.aux[0] == blame.STARTED:
            self.tasks_owed.on_started(msg, time.monotonic())

    def _plan(self, d: int, task: int, now: float, spec: TaskSpec, download: bool) -> bool:
        return planning.plan(self, d, task, now, spec, download)

    def _plan_push(self, d: int, task: int, now: float, msg: Message) -> None:
        return planning.plan_push(self, d, task, now, msg)

    def task_done(self, d: int) -> tuple[int, int, float]:
        task, base, t0 = self.inflight.pop(d)
        if base in self.base_refs:
            self.base_refs[base] -= 1
        return task, base, t0

    # -- model changes ----------------------------------------------------------------------
    def _execute(self, dec: Decision, now: float) -> None:
        if dec.apply is not None:
            self.pending = dec  # (a checkpoint of the new version records what follows)
            self.may_defer_row = bool(dec.dispatch)  # (the row may wait for the dispatch)
            try:
                self.apply(dec.apply, now)
            finally:
                self.may_defer_row = False
            self.pending = None
            dec = self.server.rerun(dec)  # a failed-over round starts again
        try:
            self._carry_out(dec, now)
        finally:
            self._finish_row()

    def _carry_out(self, dec: Decision, now: float) -> None:
        if dec.timer is not None:
            self.ev.schedule(dec.timer[0], TIMER, token=dec.timer[1])
        for d in dec.dropped:
            self.log_event("dropped", now, d, self.inflight.get(d, (-1,))[0])
        if self.version >= self.cfg["run"]["rounds"] or self.stopped:
            return  # the run is over: start nothing new
        if dec.dispatch:
            self.t.wait_sends()  # the global buffer may have changed since the last sends
        if len(dec.dispatch) > 1 and self.virtual:
            later: list = []
            self._log_later = []  # (its events.jsonl lines: written after the TRAINs)
            try:
                for d in dec.dispatch:
                    self._dispatch(d, now, later)
                self._send_in_arrival_order(later, now)
            finally:
                self._write_later()
            return
        for d in dec.dispatch:
            self._dispatch(d, now)

    def apply(self, ap: Apply, now: float) -> None:
        """Make one model change of ``ap`` at clock ``now`` (seconds): the plugins'
        transforms, the aggregation step, the version count, the metrics row."""
        self.t.wait_sends()  # sends of the global buffer must finish before it changes
        if ap.mode != "mix":
            for p in self.plugins:
                new = p.transform(ap)
                if new is not ap and not new.arrivals:
                    return
                ap = new
        step = None
        if ap.mode != "mix":
            step = next((s for p in self.plugins if (s := p.aggregate(ap)) is not None), None)
        if step is not None:
            self.server_opt.step(self.global_model, step)
        elif not self.server.apply(ap, now):
            return
        self.version += 1
        self._rejected_streak = 0
        arr = ap.arrivals
        for a in arr:
            st = self.version - 1 - a.base_version
            self.staleness[st] = self.staleness.get(st, 0) + 1
        for v in [v for v, n in self.base_refs.items() if n <= 0 and v != self.version]:
            self.bases.pop(v, None)
            del self.base_refs[v]
        for a in arr:
            if getattr(a, "msg", None) is not None:
                self.t.release(a.msg)
        if self.t_failure is not None:
            self.recovery_s.append(time.monotonic() - self.t_failure)
            self.progress_after_failure_unix.append(time.time())
            self.t_failure = None
        for p in self.plugins:
            p.after_apply(ap, now)
        if not np.isfinite(self.global_model).all():
            # diverged (e.g. poisoned updates averaged in by plain mean): every later update
            # would be rejected, so stop here rather than loop
            divergence.model_nonfinite(self)
        self.log_event("apply", now, -1, -1, updates=len(arr))
        self._row(arr, now)

    def log_event(self, event: str, now: float, device: int, task: int, **extra) -> None:
        """One line of events.jsonl (``sim.event_log``). While a dispatch wave is planned
        (:meth:`_carry_out`) the lines wait, in order, until its TRAINs are out."""
        if self.events_log is not None:
            if self._log_later is not None:
                self._log_later.append((now, event, device, task, self.version, extra))
                return
            self.events_log.write(event_line(now, event, device, task, self.version, extra))

    def _write_later(self) -> None:
        """Write the lines a dispatch wave's planning logged (see :meth:`log_event`)."""
        lines, self._log_later = self._log_later, None
        if lines and self.events_log is not None:
            self.events_log.write("".join(event_line(*x) for x in lines))

    def _row(self, arr: list[Arrival], now: float) -> None:
        if not self._row_can_wait():
            return summary.record_row(self, arr, now)
        self.deferred_row = (summary.begin_row(self, arr, now, evaluate_now=False), now)

    def _row_can_wait(self) -> bool:
        """May the new version's row (its test-set evaluation above all) wait until the
        tasks that start from it are out, so that the workers train while rank 0
        evaluates? Only when the row cannot change what happens next: no checkpoint at
        this version, no target accuracy or debug stop to reach, not the last version,
        no stop signal, no plugin that reads the row or flushes held-back updates at the
        end, a server that keeps nothing at a row. (A non-finite test loss then stops the
        run with those tasks out: none of them changes the model.)"""
        cfg, r = self.cfg, self.version
        every = cfg["run"]["checkpoint_every"]
        return (
            self.may_defer_row
            and self.row_waits
            and not self.stopped
            and self.stop_request is None
            and r < cfg["run"]["rounds"]
            and cfg["run"]["target_accuracy"] <= 0
            and cfg["debug"]["stop_after_round"] != r
            and not (self.out_dir is not None and every and r % every == 0)
        )

    def _finish_row(self) -> None:
        """The row :meth:`_row` left for after the dispatch (if any): evaluated, written."""
        if self.deferred_row is not None:
            (row, now), self.deferred_row = self.deferred_row, None
            self.t.flush_bundles()  # (the tasks' TRAINs out now, not at the next poll)
            summary.finish_row(self, row, now, deferred=True)

    def checkpoint(self, round_: int, rows: list[dict], wall: float, now: float) -> Path:
        """Write checkpoint ``round_`` (core state, every plugin's state under its name)."""
        return checkpointing.save(self, round_, rows, wall, now)

    # -- failures ---------------------------------------------------------------------------
    def _rank_failed(self, rank: int, now: float) -> Decision:
        return failures.rank_failed(self, rank, now)

    def _dead(self, d: int, now: float) -> bool:
        return failures.dead(self, d, now)

    # -- arrivals ---------------------------------------------------------------------------
    def _iteration(self, ev: Event) -> None:
        """Book one finished local iteration of ``ev.device`` (plugins: metrics, allocation)."""
        d = ev.device
        seconds = self.iter_time.get(d, 0.0) if self.virtual else float(ev.msg.aux[2])
        if not math.isfinite(seconds) or seconds < 0:
            seconds = 0.0
        self.devices[d]["iterations"] += 1
        self.period["iterations"] += 1
        for p in self.plugins:
            p.on_iteration(d, seconds)

    def decode(self, d: int, task: int, msg: Message) -> tuple[np.ndarray | None, str, Message]:
        """The dense delta of an update message (a plugin's kind: its decoder)."""
        owner = self._owners.get(msg.kind)
        if owner is None:
            return msg.payload, "", msg
        return owner.decode(d, task, msg)

    def _arrival(self, ev: Event) -> Arrival | None:
        """Check an arrived update; None (and counted as lost) if it must be rejected."""
        msg = ev.msg
        task, base, t0 = self.task_done(ev.device)
        bad = ""
        if not math.isfinite(msg.aux[1]):
            return failures.quarantine(self, ev.device, task, f"loss {msg.aux[1]}", msg)
        if not all(math.isfinite(x) for x in msg.aux) or msg.aux[0] < 0 or msg.aux[2] < 0:
            bad = f"update from device {msg.device} with bad header values {msg.aux}"
        elif not self.server.remote_updates and not np.isfinite(msg.payload).all():
            return failures.quarantine(self, ev.device, task, "values in its update", msg)
        delta = msg.payload
        if not bad:
            delta, bad, msg = self.decode(ev.device, task, msg)
            ev.msg = msg
        if bad:
            self.t.reject(msg.src, bad)
            self.t.release(msg)
            return None
        q = self.quarantine.get(ev.device)
        if q is not None:
            q["streak"] = 0
        dev = self.devices[ev.device]
        self.book_up(ev.device, self.server.update_bytes(msg))
        dev["rounds"] += 1
        seconds = ev.time - t0 if self.virtual else float(msg.aux[2])
        planning.observed(self, ev.device, t0, ev.time, seconds)  # (wall clock: timeline)
        dev["time_s"] += seconds
        a = Arrival(ev.device, task, base, int(msg.aux[0]), float(msg.aux[1]), delta, ev.time)
        a.seconds = seconds
        a.msg = msg
        return a

    def book_up(self, d: int, nbytes: int) -> None:
        """A message of ``nbytes`` (header included) came up from device ``d``."""
        dev = self.devices[d]
        dev["bytes_up"] += nbytes
        dev["msgs_up"] += 1
        self.period["bytes_up"] += nbytes
        self.period["msgs_up"] += 1

    # -- the event loop ---------------------------------------------------------------------
    def run(self) -> int:
        """The event loop; returns the exit status (0 = completed)."""
        cfg, out = self.cfg, self.out_dir
        rounds = cfg["run"]["rounds"]
        self.metrics = MetricsLog(out / "metrics.jsonl" if out else None, self.history)
        self.progress = Progress(cfg["output"]["progress"], rounds, start=self.start_round)
        self.trackers = make_trackers(cfg, out, self.history)  # output.trackers (csv, ...)
        self.test_set = (
            self.task.test_set
            if self.task.test_set is not None
            else load_test(self.task.data, spill_budget(cfg))
        )
        self._t0 = time.monotonic() - self.wall_offset
        self.period = summary.new_period()
        self.eval_bucket = 0
        self.version = self.start_round
        for p in self.plugins:
            p.on_start()
        start = self.start_time
        self.ev = VirtualEvents(self.t, start) if self.virtual else WallEvents(self.t, start)
        self.owed: dict[int, int] = {}
        self.watch = RankWatch(self, cfg["comm"])
        self.tasks_owed = blame.TaskWatch(self, HOLD_UPDATES)  # watchdog, strikes (blame.py)
        self.watch.tasks = self.tasks_owed
        self.ev.received_hook = self._received
        self.ev.heard_hook = self.tasks_owed.heard_from
        self.ev.heartbeat_hook = self._heartbeat
        self.ev.tick_hook = self._tick
        defer_stop(self._stop_signal)  # (SIGINT/SIGTERM: stop in order, checkpointed)
        self.t.on_suspect = self.watch.give_up
        self.ev.handlers = {k: p.on_message for p in self.plugins for k in p.message_kinds}
        self.ev.update_kinds = {Kind.UPDATE, Kind.REPORT, *self._update_kinds()}
        self.server.start()
        self._first = checkpointing.resume_flight(self)  # (a resume: tasks in flight)
        if out is not None and cfg["sim"]["event_log"]:
            mode = "a" if self.resume is not None else "w"
            self.events_log = open(out / "events.jsonl", mode, encoding="utf-8")  # noqa: SIM115
        try:
            with heap.Settled():  # (the collector off what lives all run: heap.py)
                self._loop(rounds)
            self._flush()
            if self.exit_status == 0 and not self.interrupted:
                for p in self.plugins:
                    p.on_end()  # (e.g. federated evaluation of the final model)
            self.server.finish()
            self._end()
        finally:
            if self.events_log is not None:
                self.events_log.close()
            self.ev.release_all()
        self.progress.close()  # (a bar ends itself at the last round; idempotent)
        end = self.ev.now
        csv_path = out / "timeline.csv" if out is not None else None  # (rows streamed there)
        self.timeline.finish(sorted(self.devices), end, self.profiles, cfg["seed"], csv_path)
        self.finish(self.metrics.rows, self.version, time.monotonic() - self._t0, end)
        return self.exit_status

    def _end(self) -> None:
        """After the last round or an early stop: the checkpoint of a stop (every stop
        leaves one to resume from), then the workers are told to stop and acknowledge, so
        a rank that dies in the last moments is recorded (failed_ranks, events.jsonl)."""
        failures.late(self)
        if self.out_dir is not None and self.stopped and not self.stop_checkpointed:
            from ..ckpt import checkpoint_name

            # a periodic checkpoint of this version is kept as it is: it was taken when the
            # version was made, and resumes exactly; the stop's state may have moved on
            # (e.g. workers lost with their launcher: a resume of it trained another model)
            if not (self.out_dir / "checkpoints" / checkpoint_name(self.version)).is_file():
                wall = time.monotonic() - self._t0
                self.checkpoint(self.version, self.metrics.rows, wall, self.ev.now)
        # (a stop signal: the launcher ends the ranks a few seconds later; a stuck worker
        # must not keep rank 0 from writing its summary)
        self.stop_workers(self.exit_status, True, 2.0 if self.stop_request else 60.0)
        failures.late(self)

    def _update_kinds(self) -> set[int]:
        return {k for p in self.plugins for k in p.update_kinds}

    def _loop(self, rounds: int) -> None:
        max_t = self.cfg["run"]["max_virtual_s"]
        first = self._first or self.policy.start(self.ev.now, self.available)
        self._execute(first, self.ev.now)
        while self.version < rounds and not self.stopped:
            ev = self.ev.next()
            if ev is None:
                if self.stopped:  # (halted: a stop signal)
                    break
                self.stopped = (
                    "no device can make progress (all offline, dead, quarantined or idle)"
                )
                self.exit_status = 3
                break
            now = ev.time
            if max_t and now > max_t:
                self.stopped = f"run.max_virtual_s = {max_t} reached"
                break
            if ev.kind == FAILED:
                self._execute(self._rank_failed(ev.token, now), now)
                continue
            dec = self._event(ev, now)
            if dec is None:
                if self.stopped:
                    break
                continue
            self._execute(dec, now)

    def _event(self, ev: Event, now: float) -> Decision | None:
        """The policy's decision on one event (None: nothing to decide yet)."""
        if ev.kind == ARRIVE and ev.msg.kind == Kind.REPORT and not self.server.remote_updates:
            self._iteration(ev)
            if not self.virtual:  # (wall clock: the iteration's compute on the timeline)
                t0 = self.inflight[ev.device][2]
                planning.observed(self, ev.device, t0, ev.time, float(ev.msg.aux[2]))
            self.log_event("iteration", now, ev.device, ev.task)
            self._continue(ev.device, now)
            return None
        if ev.kind == ARRIVE and self.gated and self.virtual:
            self._iteration(ev)
            self.log_event("push", now, ev.device, ev.task)
            self._plan_push(ev.device, ev.task, now, ev.msg)
            return None
        if ev.kind == PUSH:
            ev.msg = self.pushes.pop((ev.device, ev.task))
            ev.kind = ARRIVE
        elif ev.kind == ARRIVE:
            self._iteration(ev)
        if ev.kind == ARRIVE:
            return self._on_arrival(ev, now)
        if ev.kind == LOST:
            self.task_done(ev.device)
            if self.dead_hooks and self._dead(ev.device, now):
                for p in self.dead_hooks:
                    p.on_device_dead(ev.device, now)
            self.lost_tasks += 1
            self.log_event("lost", now, ev.device, ev.task)
            return self.policy.lost(ev.device, now, self.available)
        if ev.kind == TIMER:
            self.log_event("timer", now, -1, -1, token=ev.token)
            return self.policy.timer(ev.token, now, self.available)
        self.online_pending.discard(ev.device)
        self.log_event("online", now, ev.device, -1)
        return self.policy.online(ev.device, now, self.available)

    def _on_arrival(self, ev: Event, now: float) -> Decision | None:
        a = self._arrival(ev)
        self.log_event("arrive", now, ev.device, ev.task)
        if a is not None:
            dec = self.policy.arrived(a, self.version, now, self.available)
            used = dec.apply is not None and any(x is a for x in dec.apply.arrivals)
            if not used and not self._buffered(a):
                self.t.release(a.msg)
            return dec
        self.lost_tasks += 1
        self._rejected_streak += 1
        if self._rejected_streak > 3 * self.num_devices:
            self.stopped = (
                f"the last {self._rejected_streak} updates were all rejected (see the log); "
                "nothing can change the model"
            )
            self.exit_status = 3
            return None
        return self.policy.lost(ev.device, now, self.available)

    def _buffered(self, a: Arrival) -> bool:
        """Does the policy still hold ``a`` (BSP round or FedBuff buffer)?"""
        buf = getattr(self.policy, "buffer", [])
        if buf and ((x := buf[-1]) is a or (isinstance(x, tuple) and x[0] is a)):
            return True  # (the usual case: just appended; a scan of a BSP round is O(devices))
        return any((x[0] if isinstance(x, tuple) else x) is a for x in buf)

    # -- the end ----------------------------------------------------------------------------
    def _flush(self) -> None:
        return flush.flush(self)

    def wait_for(self, key: tuple[int, int], limit_s: float | None = None) -> Message:
        return flush.wait_for(self, key, limit_s)

    def plugin(self, name: str) -> CoordinatorPlugin | None:
        """The coordinator half of plugin ``name`` (None when it is not on)."""
        return next((p for p in self.plugins if p.name == name), None)

    def finish(self, rows: list[dict], rounds_done: int, wall: float, end: float = 0.0) -> None:
        """Print the summary table and write summary.json and final_model.pt."""
        summary.finish(self, rows, rounds_done, wall, end)

    def stop_workers(self, status: int, acknowledged: bool = False, timeout: float = 60.0) -> None:
        """Tell every other rank to finish with ``status`` and wait until the messages left.

        ``acknowledged``: tell only the worker ranks, and wait (up to ``timeout`` s) until
        each one acknowledged (then it is retired: its exit is no failure) or is found dead.
        """
        t = self.t
        ranks = self.workers if acknowledged else range(1, t.size)
        failed = 1.0 if t.failed else 0.0  # (tells the workers not to wait in MPI_Finalize)
        # told before rank 0 has written the summary: the workers leave with 0, since a rank
        # exiting non-zero lets mpiexec tear the job down while rank 0 still writes (seen:
        # fleet.on_failure = stop ending with status 2 and no summary). The job's status is
        # rank 0's (its exit status and exit_status file).
        code = 0.0 if acknowledged else float(status)
        # an acknowledging worker then waits for rank 0's FAREWELL before it exits: a rank
        # that leaves without MPI_Finalize (after a failure) is reported like a crash, and
        # that report could overtake its acknowledgement (seen: a worker that acknowledged
        # in failed_ranks, 1 run in ~30 under load)
        want = WANT_FAREWELL if acknowledged else 0.0
        for w in ranks:
            t.send(w, Kind.STOP, aux=(code, failed, 0.0, want))
        t.wait_sends()
        if not acknowledged:
            return
        waiting = set(ranks) - t.failed - t.retired
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            for msg in t.poll(timeout=0.5):
                started = msg.kind == Kind.HEARTBEAT and msg.aux and msg.aux[0] == blame.STARTED
                if msg.kind in (Kind.HEARTBEAT, Kind.ERROR) and not started:
                    if msg.kind == Kind.HEARTBEAT and len(msg.aux) > 1 and msg.aux[0] == STOPPED:
                        self.stacked_tasks += int(msg.aux[1])
                    waiting.discard(msg.src)
                    t.send(msg.src, Kind.STOP, aux=(code, failed, FAREWELL, 0.0))
                    t.wait_sends()
                    t.retire(msg.src)
                t.release(msg)
            self.ev.failures += t.take_failures()
            self.watch.tick()  # (a rank stuck in a task is given up on: blame.py)
            waiting -= t.failed
        if waiting:
            log.warning("ranks %s did not acknowledge STOP within %.0f s", sorted(waiting),
                        timeout)  # fmt: skip


def event_line(now: float, event: str, device: int, task: int, version: int, extra: dict) -> str:
    """``json.dumps({"t": now, "event": event, "device": device, "task": task, "v":
    version, **extra}) + "\\n"``, the same text, formatted directly for the usual types (two
    lines per device and round: a large fleet writes many)."""
    if (type(now) is float and math.isfinite(now) and type(device) is int
            and type(task) is int and type(version) is int
            and event.isascii() and event.isidentifier()):  # fmt: skip
        head = (f'{{"t": {now!r}, "event": "{event}", "device": {device}, "task": {task}, '
                f'"v": {version}')  # fmt: skip
        if not extra:
            return head + "}\n"
        more = json.dumps(extra)
        if more.startswith('{"') and not any(k in _EVENT_KEYS for k in extra):
            return f"{head}, {more[1:]}\n"
    rec = {"t": now, "event": event, "device": device, "task": task, "v": version}
    rec.update(extra)
    return json.dumps(rec) + "\n"


_EVENT_KEYS = frozenset(("t", "event", "device", "task", "v"))

__all__ = ["Coordinator", "WorkerFailed"]
