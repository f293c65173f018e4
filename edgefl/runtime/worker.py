"""Ranks >= 1: host one or more devices, train each one when told, push its update.

The core trains and reports; every algorithm's worker-side part is a plugin's worker half
(:mod:`edgefl.algorithms`), called at fixed points of :meth:`Worker.train`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import traceback
from collections import deque

import numpy as np
import torch

from ..algorithms import worker_plugins
from ..algorithms.base import LocalJob, TaskSpec, Upload, WorkerPlugin
from ..comm import Kind, Transport
from ..comm.taskflags import CONTINUE, FLUSH, ISOLATE, REFRESH, unpack_flags
from ..data import FederatedDataset
from ..data.holdout import holdout_split
from ..errors import ConfigError, EdgeflError
from ..kernels import fingerprint as numerics_fingerprint
from ..models import build_model
from ..models.flat import FlatParams
from ..models.train import local_train
from ..seeding import SUBSET, TRAIN, derive_seed, derive_seeds
from ..server import make_client
from ..training import FitContext, FitTask, check_result, load_client, lr_at, resolve_loss
from ..training.optim import optimizer_factory
from ..training.trainer import as_tensors, plan_steps
from . import devstate, stacking
from .blame import STARTED
from .contexts import RuntimeWorkerContext
from .debughooks import WorkerDebug
from .heap import Settled
from .placement import devices_of_rank, torch_device_for
from .state import Task
from .watch import DECLARED_DEAD, FAREWELL, FAREWELL_WAIT_S, LIVENESS, STOPPED, WANT_FAREWELL

log = logging.getLogger("edgefl.worker")

#: under the virtual clock a worker sends its (small) updates in bursts of up to this many
#: (or HOLD_BYTES, or after HOLD_S seconds, or as soon as it has no task ready): rank 0 then
#: wakes once per burst instead of once per update (each wake-up costs it a spell of
#: polling, CPU the workers need when ranks share cores). The clock orders the events, so
#: the results are the same.
HOLD_UPDATES = 64
HOLD_BYTES = 1 << 22
HOLD_S = 0.1


class Worker:
    """The loop of one worker rank.

    Devices hosted by the rank are trained one after another. The rank keeps one model
    instance per torch device it uses (not one per logical device): a device's state is its
    data, its counters, its plugins' state and the global model it is told to start from.

    Args:
        cfg: effective config.
        transport: this rank's transport.
        task: data (lazy; only this rank's devices are built) and a CPU model instance.
        local_rank: node-local rank (GPU selection).
        out_dir: the run directory (plugins may write per-device files below it, e.g.
            residual checkpoints); None: none.
    """

    local_flags = CONTINUE | FLUSH  # tasks that need no new model version

    def __init__(
        self,
        cfg: dict,
        transport: Transport,
        task: Task,
        local_rank: int = 0,
        out_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.t = transport
        self.task = task
        self.data: FederatedDataset = task.data
        self.rank = transport.rank
        self.local_rank = local_rank
        self.out_dir = out_dir
        self.client = make_client(self)  # server ranks' side (None: rank 0 serves)
        servers = self.client.servers if self.client is not None else 0
        self.devices = devices_of_rank(self.rank, cfg["fleet"]["devices"], transport.size,
                                       servers)  # fmt: skip
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        f = cfg["fleet"]
        self.torch_dev = {
            d: torch_device_for(d, f["device"], f["device_map"], local_rank, cuda)
            for d in self.devices
        }
        self.models: dict[str, tuple[torch.nn.Module, FlatParams]] = {}
        self.global_model = np.zeros(task.flat.numel, np.float32)  # shape/dtype template
        self.versions: dict[int, np.ndarray] = {}  # model version -> parameters
        self.queue: deque[tuple[int, int, int, TaskSpec]] = deque()  # (device, task, v, spec)
        self.gated = cfg["algorithm"]["gate"] != "always"  # devices push when a gate says
        self.local: dict[int, _LocalState] = {}  # gated devices between pushes
        self.peer_failures = False  # some rank died during the job (see finalize)
        self._free: list[np.ndarray] = []
        # model versions received since the last TRAIN: the TRAIN that needs one comes right
        # after it (an old version sent for a re-run), maybe in a later poll (a bundle)
        self._unclaimed: set[int] = set()
        self.debug = WorkerDebug(self)
        self.doing = "set-up"  # what the rank is busy with (named in error reports)
        tr = cfg["train"]
        self.loss = resolve_loss(tr["loss"], self.data.info.task)  # train.loss
        self.fit = load_client(tr["client"])  # the client hook (train.client)
        self.make_optimizer = optimizer_factory(tr)  # train.optimizer
        self.holdout: float | None = None  # the held-out fraction a plugin asked for
        self.splits: dict[int, tuple] = {}  # device -> (training split, held-out split)
        self.ctx = RuntimeWorkerContext(self)  # what the plugins see of this rank
        self.plugins: list[WorkerPlugin] = worker_plugins(self.ctx)
        self._handlers = {k: p.on_message for p in self.plugins for k in p.message_kinds}
        if self.client is not None:
            self._handlers.update({k: self.client.on_message for k in self.client.message_kinds})
        self._handlers[Kind.STATE] = lambda msg: devstate.answer(self, msg)
        self._handlers[Kind.HOST] = self.host
        # each device's state when its latest task started (a checkpoint taken while the
        # task is in flight holds this "before" state): device -> (task, encoded state)
        self.snapshots: dict[int, tuple[int, np.ndarray]] = {}
        base = WorkerPlugin.device_state
        self._snap = self.gated or any(type(p).device_state is not base for p in self.plugins)
        dbg = cfg["debug"]
        quiet = not (dbg["kill_ranks"] or dbg["inject"] or dbg["delay_s"])  # (fault tests)
        small = max(HOLD_BYTES // max(task.flat.nbytes, 1), 1)
        self._hold = min(HOLD_UPDATES, small) if cfg["sim"]["clock"] == "virtual" and quiet else 0
        self._hold = self._hold if self._hold > 1 else 0
        self._held: list[tuple[int, int, tuple, np.ndarray]] = []  # (device, task, aux, delta)
        self._held_since = 0.0
        self.stack = False  # train.vectorize: queued tasks trained together (stacking.py)
        self.stacked_tasks = 0
        self._sample_numel: int | None = None  # elements of one example (0: not tensors)
        self._built: set[int] = set()  # devices whose data _build_queued built
        if cfg["train"]["vectorize"] != "off":  # ("on": refused before launch if it can't)
            why = stacking.why_not(cfg, self.task.model, [type(p) for p in self.plugins])
            self.stack = why is None
            self._probed = False  # (can vmap batch the model? tried before the first stack)
            self._says = self.rank == servers + 1  # (said once: by the first worker)
            if why:
                self._trains_alone(why)

    def buffer(self) -> np.ndarray:
        """A model-sized float32 buffer (recycled)."""
        return self._free.pop() if self._free else np.empty_like(self.global_model)

    def free(self, buf: np.ndarray) -> None:
        """Give a buffer from :meth:`buffer` back (once nothing reads it any more); a view
        (a row of a stack's deltas) is not kept."""
        if buf.base is None:
            self._free.append(buf)

    def model_on(self, dev: str) -> tuple[torch.nn.Module, FlatParams]:
        """This rank's model instance on torch device ``dev`` (and its flat view)."""
        if dev not in self.models:
            if dev == "cpu":
                self.models[dev] = (self.task.model, self.task.flat)
            else:
                if dev.startswith("cuda") and not torch.cuda.is_available():
                    raise ConfigError(
                        f"torch device '{dev}' requested (fleet.device / fleet.device_map) "
                        "but CUDA is not available here"
                    )
                c = self.cfg
                m = build_model(
                    c["model"]["name"], self.data.info, dict(c["model"]["args"]), c["seed"]
                ).to(dev)
                self.models[dev] = (m, FlatParams(m, dev))
        return self.models[dev]

    def register(self) -> None:
        """Build this rank's devices' data and models, then announce them to rank 0."""
        devs = []
        for d in self.devices:
            self.model_on(self.torch_dev[d])
            devs.append({
                "id": d, "torch": self.torch_dev[d],
                "kind": "gpu" if self.torch_dev[d].startswith("cuda") else "cpu",
                "samples": int(self.data.num_samples(d)),
            })  # fmt: skip
        info = {
            "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "devices": devs, "numel": int(self.task.flat.numel), "signature": self.task.signature,
            "numerics": numerics_fingerprint(self.cfg["run"]["kernels"]),  # (rank 0 compares)
        }  # fmt: skip
        for p in self.plugins:
            p.on_register(info)
        self.warm_up()
        payload = np.frombuffer(json.dumps(info).encode("utf-8"), np.uint8)
        self.t.send(0, Kind.REGISTER, payload=payload)

    def host(self, msg) -> None:
        """HOST from rank 0: a dead rank's device is this rank's from now on (its data is
        built here on first use; its plugins' state from rank 0's latest checkpoint)."""
        d = msg.device
        try:
            body = devstate.decode(msg.payload)
        except ValueError as e:
            raise EdgeflError(f"rank {self.rank}: HOST of device {d}: {e}") from None
        self.t.release(msg)
        if d in self.devices:
            return
        self.devices.append(d)
        f = self.cfg["fleet"]
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.torch_dev[d] = torch_device_for(d, f["device"], f["device_map"], self.local_rank,
                                             cuda)  # fmt: skip
        self.model_on(self.torch_dev[d])
        halves = {p.name: p for p in self.plugins}
        for name, st in (body.get("state") or {}).items():
            if name in halves:
                halves[name].load_device_state(d, st)
        log.info("rank %d: now hosts device %d", self.rank, d)

    def warm_up(self) -> None:
        """One untimed SGD step per torch device, so torch's one-off first-step set-up
        (about a second here) is not charged to the first round's device times. The model
        is overwritten from the global model before every real round."""
        done = set()
        for d in self.devices:
            dev = self.torch_dev[d]
            if dev in done:
                continue
            done.add(dev)
            model, _ = self.model_on(dev)
            local_train(
                model, self.data.train(d), epochs=1, steps=1, batch_size=1, lr=0.0,
                momentum=0.0, weight_decay=0.0, generator=torch.Generator(),
                task=self.data.info.task, device=dev, loss=self.loss,
            )  # fmt: skip

    def run(self) -> int:
        """Serve the coordinator until STOP; returns the exit status it asks for.

        MODEL messages are kept by version (a TRAIN names the version its task starts
        from); TRAINs queue up and are trained one at a time, in the order they came.
        Plugins (and the server backend's client) handle their own kinds. The garbage
        collector leaves what lives all run alone (:mod:`.heap`): the datasets built are
        frozen once their number has doubled.
        """
        with Settled() as settled:
            return self._serve(settled)

    def _serve(self, settled: Settled) -> int:
        limit = 2 * self.cfg["comm"]["failure_timeout_s"]  # without ULFM: silence of rank 0
        heard = time.monotonic()
        while True:
            ready = self.queue and self._ready(self.queue[0])
            if self._held and (not ready or time.monotonic() - self._held_since > HOLD_S):
                self._send_held()
            wait = 0.0 if ready else (0.5 if self.queue else 5.0)
            before = time.monotonic()
            msgs = self._drain(self.t.poll(timeout=wait))
            now = time.monotonic()
            if msgs or now - before > wait + limit / 2:  # (a poll this long: this rank
                heard = now  # was stopped, SIGSTOP: rank 0 was not the silent one)
            elif limit and not self.queue and now - heard > limit:
                self.t.declare_failed(0, f"silent for {limit:.0f} s (comm.failure_timeout_s x 2)")
            farewell = [m for m in msgs if m.kind == Kind.STOP and m.aux[2] == DECLARED_DEAD]
            if farewell:
                return self._declared_dead()
            if 0 in self.t.take_failures() or 0 in self.t.failed:
                print(
                    f"edgefl: rank {self.rank}: the coordinator (rank 0) is gone; this worker "
                    "stops (resume the run from its latest checkpoint with --resume)",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                return 3
            for msg in msgs:
                if msg.kind == Kind.HEARTBEAT and msg.aux[0] == LIVENESS:
                    continue  # rank 0 is alive (it waits for a slow rank)
                if msg.kind == Kind.STOP:
                    self.peer_failures = bool(msg.aux[1]) or bool(self.t.failed)
                    # acknowledges the STOP, with how many of its tasks trained stacked
                    self.t.send(
                        0, Kind.HEARTBEAT, aux=(STOPPED, float(self.stacked_tasks), 0.0, 0.0)
                    )
                    self.t.wait_sends()
                    if msg.aux[3] == WANT_FAREWELL:
                        self._await_farewell()
                    return int(msg.aux[0])
                self._on_message(msg)
            if self.stack:
                self._build_queued()
                settled.grown(len(self._built))
            group = self._group() if self.stack else []
            if group:
                self._train_group(group)
                self._forget_versions()
            elif self.queue and self._ready(self.queue[0]):
                device, task, version, spec = self.queue.popleft()
                if spec.flags & ISOLATE and self._held:  # (rank 0 must know what runs)
                    self._send_held()
                self.train(device, task, version, spec)
                self._forget_versions()

    def _drain(self, msgs: list) -> list:
        """``msgs`` and whatever else has arrived by now. A poll returns at most one message
        per peer; taking all of them before the next task lets rank 0's sends complete (a
        large fleet's TRAINs otherwise wait at rank 0, one per task trained here, and every
        poll there tests them all) and keeps the order they came in."""
        if not msgs:
            return msgs
        for _ in range(1 << 16):
            more = self.t.poll(timeout=0.0)
            if not more:
                break
            msgs.extend(more)
            if any(m.kind == Kind.STOP for m in more):
                break
        return msgs

    def _await_farewell(self) -> None:
        """After acknowledging a STOP: wait (up to FAREWELL_WAIT_S seconds) until rank 0
        answers that it read the acknowledgement, so this rank's exit is never taken for a
        crash (a rank leaving without MPI_Finalize is reported like one)."""
        deadline = time.monotonic() + FAREWELL_WAIT_S
        while time.monotonic() < deadline and 0 not in self.t.failed:
            for m in self.t.poll(timeout=0.5):
                if m.kind == Kind.STOP and m.aux[2] == FAREWELL:
                    return
                self.t.release(m)

    def _declared_dead(self) -> int:
        """Rank 0 gave up on this rank (it was silent too long): leave quietly, status 0
        (the job goes on, or went on, without it)."""
        print(f"edgefl: rank {self.rank}: rank 0 declared this rank dead after "
              f"{self.cfg['comm']['failure_timeout_s']:g} s without an answer "
              "(comm.failure_timeout_s; frozen or overloaded?); its devices went to other "
              "ranks; this rank stops", file=sys.stderr, flush=True)  # fmt: skip
        self.peer_failures = True
        return 0

    def _on_message(self, msg) -> None:
        if msg.kind == Kind.MODEL:
            buf = self.buffer()
            np.copyto(buf, msg.payload)
            self.versions[msg.round] = buf
            self._unclaimed.add(msg.round)
            self.t.release(msg)
        elif msg.kind == Kind.TRAIN:
            version = int(msg.aux[0])
            flags, arg = unpack_flags(int(msg.aux[3]))
            cont = flags & CONTINUE and not flags & REFRESH and msg.device in self.local
            cont = cont or flags & FLUSH
            if not cont and version not in self.versions and self.client is None:
                log.warning("rank %d: TRAIN of device %d from model version %d, which never "
                            "came; ignored", self.rank, msg.device, version)  # fmt: skip
                return
            spec = TaskSpec(int(msg.aux[1]), int(msg.aux[2]), flags, arg)
            self.queue.append((msg.device, msg.round, version, spec))
            self._unclaimed.clear()
        elif msg.kind in self._handlers:
            self._handlers[msg.kind](msg)
        else:
            log.warning("rank %d: ignoring %s", self.rank, msg.kind.name)

    def _ready(self, item: tuple) -> bool:
        """Can this queued task start (pulls from server ranks: is its model version whole)?"""
        return self.client is None or self.client.ready(item[2], item[3].flags)

    def _forget_versions(self) -> None:
        """Drop model versions no queued task needs (the newest one is kept)."""
        if len(self.versions) <= 1:
            return
        keep = {q[2] for q in self.queue} | self._unclaimed
        keep.update(st.base for st in self.local.values())
        keep.add(max(self.versions))
        for v in [v for v in self.versions if v not in keep]:
            self._free.append(self.versions.pop(v))

    def hold_out(self, fraction: float) -> None:
        """Hold out ``fraction`` of every device's samples (a plugin asked, through its
        context): :meth:`split` then makes the one split. A second, different fraction is
        refused (the halves would train on different sets)."""
        if self.holdout is not None and self.holdout != fraction:
            raise ValueError(f"two hold-out fractions ({self.holdout} and {fraction})")
        self.holdout = float(fraction)

    def split(self, device: int) -> tuple | None:
        """(training split, held-out split) of ``device`` when a plugin asked for a hold-out
        (:func:`~edgefl.data.holdout.holdout_split`; a device with one sample measures on
        the sample it trains on), or None (every sample trains)."""
        if self.holdout is None:
            return None
        got = self.splits.get(device)
        if got is None:
            ds = self.data.train(device)
            if len(ds) < 2:
                got = (ds, ds)
            else:
                got = holdout_split(ds, self.holdout, self.cfg["seed"], device)
            self.splits[device] = got
        return got

    def _hook(self, name: str, *args):
        """The answer of decision ``name`` (``train``, ``gate``): its owner's (the loader
        lets at most one plugin override it), or None (the core decides)."""
        for p in self.plugins:
            got = getattr(p, name)(*args)
            if got is not None:
                return got
        return None

    def train(self, device: int, task: int, version: int, spec: TaskSpec | None = None) -> None:
        """Run one task (local iteration) of ``device`` and report it.

        Args:
            task: the device's task number (seeds its shuffles).
            version: the model version the task starts from (ignored with CONTINUE: the
                device goes on from its own local model).
            spec: samples (0 = all of its training split; a seeded random subset when
                fewer), batch (0 = ``train.batch_size``), flags, the plugin argument.

        Without a gate every task ends with an update (the delta from the starting model).
        With a gate the device evaluates its held-out loss after the iteration and either
        pushes its accumulated delta since it last got the global model or reports the
        iteration without a payload (REPORT).
        """
        spec = spec or TaskSpec()
        self.doing = f"training device {device} (task {task}, model version {version})"
        if spec.flags & FLUSH:
            self._flush(device, task)
            return
        if self._snap:
            self.snapshots[device] = (task, devstate.snapshot(self, device))
        self.debug.before_task()
        st = self._local_state(device, version, spec.flags)
        job, holdout = self._job(device, task, version, spec, st)
        job.new_model = st.fresh or not self.gated
        st.fresh = False
        if spec.flags & ISOLATE:  # a re-run after its host failed: say that it starts now
            self.t.send(0, Kind.HEARTBEAT, device=device, round=task,
                        aux=(STARTED, 0.0, 0.0, 0.0))  # fmt: skip
        t0 = time.perf_counter()
        for p in self.plugins:
            p.before_train(device, job)
        loss = self._hook("train", device, job)
        if loss is None:
            got = self.fit(job.model, job.dataset, job.fit_task, job.fit_ctx)
            res = check_result(got, self.cfg["train"]["client"], device)
            loss, job.metrics = res.loss, res.metrics
            job.ctx["client_samples"] = res.samples
        if job.torch_device.startswith("cuda"):
            torch.cuda.synchronize(job.torch_device)
        seconds = time.perf_counter() - t0
        for p in self.plugins:
            p.after_train(device, job)
        self._finish(job, st, holdout, loss, seconds)

    def _finish(self, job: LocalJob, st: _LocalState, holdout, loss: float, seconds: float,
                delta: np.ndarray | None = None) -> None:  # fmt: skip
        """A task's local training is over (``job.model`` holds the trained model,
        ``after_train`` has run; ``loss``: its training loss, ``seconds`` its time): with a
        gate, the gate decides (a REPORT when the device does not push); else, or on a
        push, its UPDATE goes out. ``delta``: the update when already computed (a row of a
        stack's deltas)."""
        device = job.device
        if self.gated:
            np.copyto(st.params, job.flat.to_host())
            st.iterations += 1
            push, loss, z = self._hook("gate", device, job, holdout, st.iterations)
            if not push:
                self.t.send(0, Kind.REPORT, device=device, round=job.task,
                            aux=(float(len(job.dataset)), float(loss), seconds, z))  # fmt: skip
                return
            del self.local[device]
        if delta is None:
            delta = self.buffer()
            trained = st.params if self.gated else job.flat.to_host()
            np.subtract(trained, self.versions[st.base], out=delta)
        self.debug.alter(device, delta)
        job.aux = (float(self.data.num_samples(device)), float(loss), seconds,
                   float(st.iterations))  # fmt: skip
        self._send_update(device, job, delta)

    def _encode(self, up: Upload, job: LocalJob | None) -> bool:
        """The worker side of the update pipeline: every plugin's ``encode`` in plugin
        order; True when one of them encoded the upload: the core sent that one message
        and gave a task's delta buffer back (once the message left, when the payload is
        a view of it)."""
        for p in self.plugins:
            p.encode(up, job)
        if not up.by:
            return False
        pooled = job is not None  # (a task's delta is a pool buffer; a flush's zeros not)
        shared = pooled and np.may_share_memory(up.payload, up.delta)
        self.t.send(0, up.kind, device=up.device, round=up.task, aux=up.aux,
                    payload=up.payload,
                    release=(lambda: self.free(up.delta)) if shared else None)  # fmt: skip
        if pooled and not shared:
            self.free(up.delta)
        return True

    def _build_queued(self) -> None:
        """Build the training data of every queued device not built yet, before any stack
        of them trains (train.vectorize). Each device's data is kept for the run; built
        between two stacks instead, it lands among the heap blocks a stack's large
        temporary tensors leave behind, and the allocator cannot give those back: 30 to
        60 MB more per worker at 5,000 devices. The same data either way (a device's data
        is a pure function of the seed and its id); only when it is built changes."""
        if self.holdout is not None:
            return  # (the splits are built on first use: Worker.split)
        built = self._built
        for d, _task, _v, _spec in self.queue:
            if d not in built:
                self.data.train(d)
                built.add(d)

    def _trains_alone(self, why: str) -> None:
        """This rank cannot stack (``why``): every task trains alone; the first worker
        says so, once."""
        self.stack = False
        if self._says:
            log.warning("train.vectorize = 'auto': every task trains alone because %s", why)

    def _group(self) -> list[tuple[int, int, int, TaskSpec]]:
        if not self._probed and self.queue:  # (the queued devices' data already built)
            self._probed = True
            why = stacking.probe_data(self.task.model, self.data.train(self.queue[0][0]),
                                      self.loss)  # fmt: skip
            if why is not None:
                self._trains_alone(why)
                return []

        def size_of(d: int) -> int | None:
            if self._sample_numel is None:  # (the first device says: tensors or not)
                ds = (self.split(d) or (self.data.train(d), None))[0]
                xy = as_tensors(ds)
                self._sample_numel = 0 if xy is None or not len(ds) else int(xy[0][0].numel())
            if not self._sample_numel:
                return None
            if self.holdout is None:  # (without building the device's dataset)
                return int(self.data.num_samples(d))
            return len(self.split(d)[0])

        def limit(n: int) -> int:
            mb = self.cfg["train"]["vectorize_mb"]
            return stacking.stack_limit(mb, self.task.flat.param_numel, n, self._sample_numel)

        from ..training.stacked import full_batch_width, masks_supported

        # (BatchNorm: padding would enter the batch statistics; devices of one size stack)
        masks = masks_supported(self.loss) and not self.task.flat.buffer_names

        def width(n: int, spec: TaskSpec) -> tuple | None:  # (a stack pads sizes: its width)
            if not masks:
                return None
            bs = spec.batch or self.cfg["train"]["batch_size"]
            return ("batch", bs) if 0 < bs < n else ("whole", full_batch_width(n))

        return stacking.take_group(self.queue, self._ready, size_of, self.torch_dev, limit,
                                   width, any_version=self.gated)  # fmt: skip

    def _train_group(self, items: list[tuple[int, int, int, TaskSpec]]) -> None:
        """Train ``items`` (:func:`.stacking.take_group`) as one stack, then each goes on as
        a task trained alone does (``after_train``, the gate, the update pipeline, its
        UPDATE or REPORT). Without a gate every device starts from the model version of
        the stack; with one, each from its own local model (``_local_state``)."""
        from ..training.stacked import fit_stacked, full_batch_width, masks_supported

        version, gated = items[0][2], self.gated
        jobs, states, holdouts = [], [], []
        flat_bufs = self.task.flat.buffer_names  # (BatchNorm's running statistics)
        rows: list[np.ndarray] = []  # each device's start: float buffers, or all (a gate)
        seeds = derive_seeds(self.cfg["seed"], [i[0] for i in items], [i[1] for i in items], TRAIN)
        for (device, task, v, spec), seed in zip(items, seeds.tolist(), strict=True):
            self.doing = f"training device {device} (task {task}, model version {v}, stacked)"
            if self._snap:
                self.snapshots[device] = (task, devstate.snapshot(self, device))
            self.debug.before_task()
            st = self._local_state(device, v, spec.flags)
            job, holdout = self._job(device, task, v, spec, st, seed)
            job.new_model = st.fresh or not gated
            st.fresh = False
            for p in self.plugins:
                p.before_train(device, job)
            if gated:  # (its own model, as before_train left it: FedBN's buffers in it)
                rows.append(job.flat.to_host().copy())
            elif flat_bufs:  # (what the device starts from: FedBN has put its own there)
                rows.append(job.flat.buffer_values())
            jobs.append(job)
            states.append(st)
            holdouts.append(holdout)
        self.doing = f"training {len(jobs)} devices stacked (model version {version})"
        dev = jobs[0].torch_device
        model, flat = self.model_on(dev)
        names = [n for n, _ in model.named_parameters()]
        bufs = None
        if gated:
            each = np.stack(rows)
            starts = each[:, : flat.param_numel]
            start = self._stacked_rows(flat, each, names, dev, 0)
            if flat_bufs:
                bufs = self._stacked_rows(flat, each, flat_bufs, dev, 0)
        else:
            flat.from_host(self.versions[version])
            starts = self.versions[version][: flat.param_numel]
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            if flat_bufs:
                bufs = self._stacked_rows(flat, np.stack(rows), flat_bufs, dev, flat.param_numel)
        data = [as_tensors(j.dataset) for j in jobs]
        if any(xy is None for xy in data):
            raise RuntimeError(
                f"rank {self.rank}: devices {[j.device for j in jobs]} were grouped to train "
                "stacked but their training data are not tensors"
            )
        ft, tr = jobs[0].fit_task, self.cfg["train"]
        counts = [len(y) for _, y in data]
        bs = ft.batch_size
        # with masks, every stack takes masked batches (mini-batches from its examples
        # packed, or full batches padded to the full-batch width of its sizes), even one of
        # equal sizes: a device's arithmetic is then its own
        ragged = masks_supported(self.loss) and (0 < bs < min(counts) or not 0 < bs < max(counts))
        ragged = ragged and not flat_bufs
        gens = [j.fit_ctx.generator for j in jobs]
        mu, corr = stacking.gradient_terms(
            jobs, starts, names, [tuple(model.get_parameter(n).shape) for n in names],
            list(flat.offsets[: len(names)]),
        )  # fmt: skip
        # mini-batches of devices of different sizes: most steps first, examples packed
        mini = ragged and 0 < bs < min(counts)
        order = None
        if mini:
            order = stacking.longest_first(counts, ft.epochs, ft.steps, bs)
            if order == sorted(order):
                order = None
        stack_counts = counts  # (in the stack's order)
        if order is not None:
            data, stack_counts, gens = ([xs[i] for i in order] for xs in (data, counts, gens))
            rows_t = torch.tensor(order)
            if gated:
                start = {n: v[rows_t.to(dev)] for n, v in start.items()}
            if corr is not None:
                corr = {n: c[rows_t] for n, c in corr.items()}
        offsets = None
        if mini:
            X, Y, offsets = stacking.packed(data, dev)
        elif ragged:
            X, Y = stacking.padded(data, dev, full_batch_width(max(counts)))
        elif len(set(counts)) > 1:
            raise RuntimeError(
                f"rank {self.rank}: devices {[j.device for j in jobs]} of different sizes "
                "were grouped to train stacked without masks"
            )
        else:
            X = torch.stack([x for x, _ in data]).to(dev)
            Y = torch.stack([y for _, y in data]).to(dev)
        t0 = time.perf_counter()
        got, losses = fit_stacked(
            model, start, X, Y, generators=gens, loss=self.loss,
            lr=ft.lr, epochs=ft.epochs, steps=ft.steps, batch_size=ft.batch_size,
            momentum=tr["momentum"], weight_decay=tr["weight_decay"], prox_mu=mu,
            corrections=None if corr is None else {n: c.to(dev) for n, c in corr.items()},
            counts=stack_counts if ragged else None, offsets=offsets, buffers=bufs,
        )  # fmt: skip
        if order is not None:  # (back in the jobs' order)
            back = torch.argsort(rows_t)
            got = {n: v[back.to(v.device)] for n, v in got.items()}
            losses = losses[back.to(losses.device)]
        gate_losses = self._held_out_losses(model, got, bufs, holdouts) if gated else None
        if bufs:
            got.update(bufs)
            names += flat_bufs
        if dev.startswith("cuda"):
            torch.cuda.synchronize(dev)
        seconds = (time.perf_counter() - t0) / len(jobs)
        steps = {n: plan_steps(ft.epochs, ft.steps, ft.batch_size, n)[1] for n in set(counts)}
        loss_of = losses.tolist()
        deltas = None
        held = dict(model.named_parameters())
        held.update((n, model.get_buffer(n)) for n in flat_bufs)
        if not gated and all(type(p).after_train is WorkerPlugin.after_train for p in self.plugins):
            # no plugin looks at a device's trained model: every delta at once, each a
            # row of one array (not a pooled buffer: see free), the model left alone
            deltas = stacking.stacked_deltas(got, names, flat, self.versions[version])
        for i, job in enumerate(jobs):
            self.doing = f"training device {job.device} (task {job.task}, stacked)"
            job.fit_ctx.steps = steps[counts[i]]
            if deltas is None:
                with torch.no_grad():
                    for n in names:  # (the trained parameters and BatchNorm buffers)
                        held[n].copy_(got[n][i])
                for p in self.plugins:
                    p.after_train(job.device, job)
            if gate_losses is not None:
                job.holdout_loss = gate_losses[i]
            self._finish(job, states[i], holdouts[i], loss_of[i], seconds,
                         None if deltas is None else deltas[i])  # fmt: skip
        self.stacked_tasks += len(jobs)
        log.debug("rank %d: trained %d tasks stacked", self.rank, len(jobs))

    def _held_out_losses(self, model, got: dict, bufs: dict | None,
                         holdouts: list) -> list[float] | None:  # fmt: skip
        """A gated stack's held-out losses, each device's trained model on its own split,
        at once (:func:`~edgefl.training.stacked.held_out_losses`); None when they are not
        tensors or the loss is not the built-in cross-entropy (the gate evaluates each)."""
        from ..training.stacked import held_out_losses, masks_supported

        data = [None if h is None else as_tensors(h) for h in holdouts]
        if not masks_supported(self.loss) or any(xy is None for xy in data):
            return None
        got = held_out_losses(model, got, data, buffers=bufs)
        return None if got is None else got.tolist()

    @staticmethod
    def _stacked_rows(flat: FlatParams, rows: np.ndarray, names: list[str], dev: str,
                      base: int) -> dict:  # fmt: skip
        """Tensors ``names`` of a stack, name -> ``(K, *shape)`` (a contiguous tensor each,
        on ``dev``), from each device's flat values ``rows`` (``(K, m)``: the flat vector's
        entries from element ``base`` on)."""
        out = {}
        for n, shape, off in zip(flat.names, flat.shapes, flat.offsets, strict=True):
            if n not in names:
                continue
            size = int(np.prod(shape))
            part = rows[:, off - base : off - base + size].reshape(len(rows), *shape)
            out[n] = torch.from_numpy(np.ascontiguousarray(part)).to(dev)
        return out

    def _flush(self, device: int, task: int) -> None:
        """End of training: a plugin encodes what the device holds back, or a zero UPDATE
        goes out."""
        aux = (float(self.data.num_samples(device)), 0.0, 0.0, 0.0)
        zeros = np.zeros(self.global_model.size, np.float32)
        if not self._encode(Upload(device, task, zeros, aux, flush=True), None):
            self.t.send(0, Kind.UPDATE, device=device, round=task, aux=aux, payload=zeros)

    def _job(self, device: int, task: int, version: int, spec: TaskSpec, st: _LocalState,
             seed: int | None = None):  # fmt: skip
        """The task's model (set to its start), its training examples (a seeded subset when
        ``spec.samples`` asks for fewer) and the held-out split (a gate's, else None).
        ``seed``: the seed of its training stream if already derived (a stack's, at once)."""
        dev = self.torch_dev[device]
        model, flat = self.model_on(dev)
        flat.from_host(st.params if self.gated else self.versions[version])
        train_ds, holdout = self.split(device) or (self.data.train(device), None)
        if 0 < spec.samples < len(train_ds):
            g = torch.Generator().manual_seed(derive_seed(self.cfg["seed"], device, task, SUBSET))
            idx = torch.randperm(len(train_ds), generator=g)[: spec.samples].sort().values
            train_ds = torch.utils.data.Subset(train_ds, idx.tolist())
        start = self.versions.get(version)
        job = LocalJob(device, task, version, spec, model, train_ds, dev, start)
        job.flat = flat
        c = self.cfg["train"]
        job.fit_task = FitTask(
            c["local_epochs"], c["local_steps"], spec.batch or c["batch_size"],
            lr_at(c, self.cfg["run"]["rounds"], version), spec.samples, None, version,
        )  # fmt: skip
        if seed is None:
            seed = derive_seed(self.cfg["seed"], device, task, TRAIN)
        gen = torch.Generator().manual_seed(seed)
        job.fit_ctx = FitContext(
            device, task, version, gen, dev, self.loss, self.make_optimizer, start
        )  # fmt: skip
        return job, holdout

    def _local_state(self, device: int, version: int, flags: int) -> _LocalState:
        """Where the task starts: a gated device's own local model (CONTINUE; after a
        broadcast, REFRESH, the new global model), else model ``version``."""
        st = self.local.get(device) if flags & CONTINUE else None
        if st is not None and flags & REFRESH:
            st.params = self.versions[version].copy()
            st.base = version
            st.fresh = True
        if st is None:
            st = _LocalState(version, self.versions[version].copy() if self.gated else None)
            if self.gated:
                self.local[device] = st
                st.fresh = True
        return st

    def local_state_dict(self, d: int) -> dict:
        """A gated device's local model between pushes (for checkpoints; {} if none)."""
        st = self.local.get(d)
        if st is None:
            return {}
        return {"base": st.base, "iterations": st.iterations, "params": st.params.copy(),
                "start": self.versions[st.base].copy()}  # fmt: skip

    def load_local_state(self, d: int, state: dict) -> None:
        """Restore :meth:`local_state_dict` (a resume)."""
        st = _LocalState(int(state["base"]), np.array(state["params"], np.float32))
        st.iterations = int(state["iterations"])
        self.local[d] = st
        if st.base not in self.versions:
            buf = self.buffer()
            np.copyto(buf, state["start"])
            self.versions[st.base] = buf

    def _send_update(self, device: int, job: LocalJob, delta: np.ndarray) -> None:
        """A plugin's encoding (it then owns nothing of ``delta``), the server ranks'
        pieces, or a dense UPDATE."""
        if self._encode(Upload(device, job.task, delta, job.aux), job):
            return
        if self.client is not None:
            self.client.push(device, job.task, job.version, delta, job.aux)
            return
        self.debug.forge(device, job.task, delta, job.aux)
        if self._hold and not job.spec.flags & ISOLATE:
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append((device, job.task, job.aux, delta))
            if len(self._held) >= self._hold:
                self._send_held()
            return
        self._send(device, job.task, job.aux, delta)

    def _send(self, device: int, task: int, aux: tuple, delta: np.ndarray) -> None:
        seq = self.t.send(0, Kind.UPDATE, device=device, round=task, aux=aux, payload=delta,
                          release=lambda: self.free(delta))  # fmt: skip
        self.debug.duplicate(device, task, delta, aux, seq)

    def _send_held(self) -> None:
        """Send the updates held back (see HOLD_UPDATES), in the order they were made."""
        held, self._held = self._held, []
        for device, task, aux, delta in held:
            self._send(device, task, aux, delta)


class _LocalState:
    """A gated device between pushes: its local model and the version it started from."""

    __slots__ = ("base", "params", "iterations", "fresh")

    def __init__(self, base: int, params: np.ndarray | None) -> None:
        self.base = base
        self.params = params
        self.iterations = 0
        self.fresh = False  # it adopted a new global model the next task has not seen


def error_text(where: str, e: Exception) -> str:
    """The ERROR text of a worker-side failure: a user error's own line, else where it
    happened and the exception (whose traceback goes to stderr)."""
    if isinstance(e, EdgeflError):
        return str(e)
    traceback.print_exc()  # not a user error: keep the details on stderr
    return f"{where}: {type(e).__name__}: {e}"


def error_payload(text: str) -> np.ndarray:
    """An ERROR message body (UTF-8 bytes as uint8)."""
    return np.frombuffer(text.encode("utf-8")[:65536], np.uint8).copy()
