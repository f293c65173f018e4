"""Ranks >= 1: host one or more devices, train each one when told, push its delta."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ..comm import Kind, Transport
from ..data import FederatedDataset
from ..models import build_model
from ..models.flat import FlatParams
from ..models.train import evaluate, local_train
from ..seeding import TRAIN, derive_seed
from .placement import devices_of_rank, torch_device_for
from .state import Task

log = logging.getLogger("edgefl.worker")


class Worker:
    """The loop of one worker rank.

    Devices hosted by the rank are trained one after another. The rank keeps one model
    instance per torch device it uses (not one per logical device): a device's state is its
    data, its counters and the global model it is told to start from.

    Args:
        cfg: effective config.
        transport: this rank's transport.
        task: data (lazy; only this rank's devices are built) and a CPU model instance.
        local_rank: node-local rank (GPU selection).
        out_dir: the run directory (GDDR residual checkpoints go to its
            ``checkpoints/gddr/``); None: no residual checkpoints.
    """

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
        # sharded server group (ps.servers = S > 0): pull from / push to ranks 1..S
        self.servers = cfg["ps"]["servers"]
        self.devices = devices_of_rank(
            self.rank, cfg["fleet"]["devices"], transport.size, self.servers
        )
        self.shard_ranges = []
        if self.servers:
            from ..policies.keyrange import even_ranges

            self.shard_ranges = even_ranges(task.flat.numel, self.servers)
        self.partial: dict[int, tuple[np.ndarray, set[int]]] = {}  # version -> (buf, ranges)
        # owner rank of every range (ps.replicas > 1: rank 0 moves a dead shard's ranges to
        # a replica holder, SHARD_OWNERS), and that map's epoch
        self.shard_owners = list(range(1, self.servers + 1))
        self.owner_epoch = 0
        self.range_of = {(r.start, r.stop): i for i, r in enumerate(self.shard_ranges)}
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.torch_dev = {
            d: torch_device_for(
                d, cfg["fleet"]["device"], cfg["fleet"]["device_map"], local_rank, cuda
            )
            for d in self.devices
        }
        self.models: dict[str, tuple[torch.nn.Module, FlatParams]] = {}
        self.global_model = np.zeros(task.flat.numel, np.float32)  # shape/dtype template
        self.versions: dict[int, np.ndarray] = {}  # model version -> parameters
        # (device, task, version, (samples, batch, flags))
        self.queue: deque[tuple[int, int, int, tuple[int, int, int]]] = deque()
        self.gated = cfg["algorithm"]["gate"] != "always"
        self.local: dict[int, _LocalState] = {}  # gated devices between pushes
        self.gates: dict = {}
        self.splits: dict = {}
        self.residual_on = cfg["algorithm"]["residual"] == "gddr"
        self.tasks_started = 0
        from .policies import WORKING_SET_MODELS, make_cfg_orderer, working_set_pulls

        self.orderer = make_cfg_orderer(cfg)  # used for its sketch only
        self.orders: dict[int, np.ndarray] = {}
        self.peer_failures = False  # some rank died during the job (see finalize)
        self.sparse_on = cfg["ps"]["sparse"]
        self.kkt_on = self.sparse_on and "kkt" in cfg["ps"]["filters"]
        self.ws_pull = working_set_pulls(cfg)  # rank 0 sends only working-set values
        self.ws_known = cfg["model"]["name"] in WORKING_SET_MODELS and (
            self.ws_pull or self.sparse_on
        )
        self.ws: dict[int, np.ndarray] = {}  # device -> its working set (sorted int64 keys)
        self.ws_union: np.ndarray | None = None  # keys of this rank's MODEL_KEYS messages
        self.ws_digest = 0
        self.ws_sent = False
        self.produced: dict[int, float] = {}  # device -> mass_checksum of all it produced
        self._exempt: np.ndarray | None = None
        self.encoders: dict = {}
        self.filters: dict = {}
        self.last_sparse: dict = {}
        self.pe: dict[str, object] = {}
        self.residuals: dict = {}
        self.ckpt_dir = Path(out_dir) / "checkpoints" / "gddr" if out_dir else None
        self.out_dir = out_dir
        self.delay_s = cfg["debug"]["delay_s"]
        self._delay_rng = random.SystemRandom()  # deliberately unseeded (a test hook)
        self._free: list[np.ndarray] = []
        self._inject = list(cfg["debug"]["inject"]) if self.rank == 1 else []
        self._inject_done: set[str] = set()
        self.doing = "set-up"  # what the rank is busy with (named in error reports)

    def _model_on(self, dev: str) -> tuple[torch.nn.Module, FlatParams]:
        if dev not in self.models:
            if dev == "cpu":
                self.models[dev] = (self.task.model, self.task.flat)
            else:
                if dev.startswith("cuda") and not torch.cuda.is_available():
                    from ..errors import ConfigError

                    raise ConfigError(
                        f"torch device '{dev}' requested (fleet.device / "
                        "fleet.device_map) but CUDA is not available here"
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
            self._model_on(self.torch_dev[d])
            devs.append(
                {
                    "id": d,
                    "torch": self.torch_dev[d],
                    "kind": "gpu" if self.torch_dev[d].startswith("cuda") else "cpu",
                    "samples": int(self.data.num_samples(d)),
                }
            )
        if self.ws_known:
            from ..policies.keyrange import ParamLayout
            from .policies import device_working_set

            layout = ParamLayout.from_flat(self.task.flat)
            for d in self.devices:
                self.ws[d] = device_working_set(layout, self.data.train(d))
            if self.ws_pull and self.ws:
                from ..policies.keyrange import key_digest

                self.ws_union = np.unique(np.concatenate(list(self.ws.values())))
                self.ws_digest = key_digest(self.ws_union)
        info = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "devices": devs,
            "numel": int(self.task.flat.numel),
            "signature": self.task.signature,
        }
        self.warm_up()
        payload = np.frombuffer(json.dumps(info).encode("utf-8"), np.uint8)
        self.t.send(0, Kind.REGISTER, payload=payload)

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
            model, _ = self._model_on(dev)
            local_train(
                model,
                self.data.train(d),
                epochs=1,
                steps=1,
                batch_size=1,
                lr=0.0,
                momentum=0.0,
                weight_decay=0.0,
                generator=torch.Generator(),
                task=self.data.info.task,
                device=dev,
            )

    def run(self) -> int:
        """Serve the coordinator until STOP; returns the exit status it asks for.

        MODEL messages are kept by version (a TRAIN names the version its task starts
        from); TRAINs queue up and are trained one at a time, in the order they came. With
        working-set pulls (``ps.pull``) a MODEL_KEYS message carries only the values at this
        rank's working set; they are scattered into a full-size buffer of that version.
        """
        limit = 2 * self.cfg["comm"]["failure_timeout_s"]  # without ULFM: silence of rank 0
        heard = time.monotonic()
        while True:
            ready = self.queue and self._ready(self.queue[0])
            msgs = self.t.poll(timeout=0.0 if ready else (0.5 if self.queue else 5.0))
            now = time.monotonic()
            if msgs:
                heard = now
            elif limit and not self.queue and now - heard > limit:
                self.t.declare_failed(0, f"silent for {limit:.0f} s (comm.failure_timeout_s x 2)")
            if 0 in self.t.take_failures() or 0 in self.t.failed:
                print(
                    f"edgefl: rank {self.rank}: the coordinator (rank 0) is gone; this worker "
                    "stops (resume the run from its latest checkpoint with --resume)",
                    file=sys.stderr,
                    flush=True,
                )
                return 3
            for msg in msgs:
                if msg.kind == Kind.STOP:
                    self.peer_failures = bool(msg.aux[1]) or bool(self.t.failed)
                    self.t.send(0, Kind.HEARTBEAT)  # acknowledges the STOP
                    self.t.wait_sends()
                    return int(msg.aux[0])
                if msg.kind == Kind.MODEL:
                    buf = self._free.pop() if self._free else np.empty_like(self.global_model)
                    np.copyto(buf, msg.payload)
                    self.versions[msg.round] = buf
                    self.t.release(msg)
                elif msg.kind == Kind.MODEL_KEYS:
                    self._install_keys(msg)
                elif msg.kind == Kind.SHARD_MODEL and self.servers:
                    self._install_range(msg)
                elif msg.kind == Kind.SHARD_OWNERS and self.servers:
                    self.shard_owners = [int(x) for x in msg.payload]
                    self.owner_epoch = int(msg.aux[0])
                    log.warning("rank %d: shard owners now %s", self.rank, self.shard_owners)
                    self.t.release(msg)
                elif msg.kind == Kind.RESEND:
                    self._resend(msg.device, msg.round)
                elif msg.kind == Kind.HEARTBEAT and self.ws_pull and not self.ws_sent:
                    self._send_working_sets()  # rank 0 registered every rank: asks for them
                elif msg.kind == Kind.ORDER:
                    self.orders[msg.device] = np.array(msg.payload, np.int64)
                    self.t.release(msg)
                elif msg.kind == Kind.TRAIN:
                    version = int(msg.aux[0])
                    fl = int(msg.aux[3])
                    cont = fl & CONTINUE and not fl & REFRESH and msg.device in self.local
                    cont = cont or fl & FLUSH
                    if not cont and version not in self.versions and not self.servers:
                        log.warning(
                            "rank %d: TRAIN of device %d from model version %d, which never "
                            "came; ignored",
                            self.rank,
                            msg.device,
                            version,
                        )
                        continue
                    spec = (int(msg.aux[1]), int(msg.aux[2]), int(msg.aux[3]))
                    self.queue.append((msg.device, msg.round, version, spec))
                else:
                    log.warning("rank %d: ignoring %s", self.rank, msg.kind.name)
            if self.queue and self._ready(self.queue[0]):
                device, task, version, spec = self.queue.popleft()
                self.train(device, task, version, *spec)
                self._forget_versions()

    def _ready(self, item: tuple) -> bool:
        """Can this queued task start (sharded pulls: has its model version fully arrived)?"""
        if not self.servers:
            return True
        fl = item[3][2]
        return bool(fl & (CONTINUE | FLUSH)) or item[2] in self.versions

    def _install_range(self, msg) -> None:
        """SHARD_MODEL from shard rank s: keys [aux0, aux1) of model version ``msg.round``
        (one range the shard owns; aux2 = the owner map's epoch); the version is usable once
        every range arrived. A range from an older owner map is ignored (its owner died)."""
        from ..errors import EdgeflError

        s = msg.src
        i = self.range_of.get((int(msg.aux[0]), int(msg.aux[1])), -1)
        if int(msg.aux[2]) < self.owner_epoch and 0 <= i:
            self.t.release(msg)
            return
        ok = 0 <= i and self.shard_owners[i] == s and msg.payload.size == self.shard_ranges[i].size
        if not ok:
            self.t.release(msg)
            raise EdgeflError(
                f"rank {self.rank}: SHARD_MODEL from rank {s} with {msg.payload.size} values "
                f"for keys [{int(msg.aux[0])}, {int(msg.aux[1])}) does not match the shard's "
                "key range (ps.servers)"
            )
        r = self.shard_ranges[i]
        v = int(msg.round)
        if v not in self.partial:
            buf = self._free.pop() if self._free else np.empty_like(self.global_model)
            self.partial[v] = (buf, set())
        buf, got = self.partial[v]
        buf[r.start : r.stop] = msg.payload
        got.add(i)
        self.t.release(msg)
        if len(got) == self.servers:
            del self.partial[v]
            self.versions[v] = buf  # (a re-sent version after a failover: the same values)

    def _push_shards(self, device: int, task: int, version: int, delta, aux: tuple) -> None:
        """Sharded push: each shard gets the update's values of its key range (SHARD_PUSH,
        aux = (start, stop, version the task started from)); rank 0 gets a REPORT carrying
        the update's header values (samples, loss, seconds, iterations)."""
        left = [len(self.shard_ranges)]

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._free.append(delta)

        for s, r in zip(self.shard_owners, self.shard_ranges):
            self.t.send(
                s, Kind.SHARD_PUSH, device=device, round=task,
                aux=(float(r.start), float(r.stop), float(version), 0.0),
                payload=delta[r.start : r.stop], release=release,
            )  # fmt: skip
        self.t.send(0, Kind.REPORT, device=device, round=task, aux=aux)

    def _send_working_sets(self) -> None:
        """One WORKSET per device (its sorted keys, int32 when they fit), then a HEARTBEAT
        that tells rank 0 this rank sent them all (rank 0 rejects malformed ones)."""
        numel = self.task.flat.numel
        dt = np.int32 if numel < 2**31 else np.int64
        bad = self.cfg["ps"]["debug_bad_working_set"]
        for i, d in enumerate(self.devices):
            keys = self.ws[d].astype(dt)
            if bad != "none" and self.rank == 1 and i == 0:
                keys = _malformed(keys, bad, numel)
            self.t.send(0, Kind.WORKSET, device=d, payload=keys)
        self.t.send(0, Kind.HEARTBEAT)
        self.ws_sent = True

    def _install_keys(self, msg) -> None:
        """MODEL_KEYS: the global model's values at this rank's working-set keys become
        model version ``msg.round``. Keys outside it keep the values of the newest version
        held (zeros at first): no device's data touches them, so they never reach an update."""
        from ..errors import EdgeflError

        keys = self.ws_union
        n, digest = int(msg.aux[0]), int(msg.aux[1])
        if keys is None or n != keys.size or msg.payload.size != n or digest != self.ws_digest:
            self.t.release(msg)
            have = 0 if keys is None else keys.size
            raise EdgeflError(
                f"rank {self.rank}: MODEL_KEYS of model version {msg.round} carries "
                f"{msg.payload.size} values for {n} keys (digest {digest:x}); this rank's "
                f"working set has {have} keys (digest {self.ws_digest:x})"
            )
        buf = self._free.pop() if self._free else np.empty_like(self.global_model)
        if self.versions:
            np.copyto(buf, self.versions[max(self.versions)])
        else:
            buf.fill(0.0)
        buf[keys] = msg.payload
        self.versions[msg.round] = buf
        self.t.release(msg)

    def _forget_versions(self) -> None:
        """Drop model versions no queued task needs (the newest one is kept)."""
        if len(self.versions) <= 1:
            return
        keep = {q[2] for q in self.queue}
        keep.update(st.base for st in self.local.values())
        keep.add(max(self.versions))
        for v in [v for v in self.versions if v not in keep]:
            self._free.append(self.versions.pop(v))

    def train(
        self, device: int, task: int, version: int, samples: int = 0, batch: int = 0, flags=0
    ) -> None:
        """Run one task (local iteration) of ``device`` and report it.

        Args:
            task: the device's task number (seeds its shuffles).
            version: the model version the task starts from (ignored when ``flags`` has
                CONTINUE: the device goes on from its own local model).
            samples: training samples D to use this iteration (0 = all of its training
                split); a seeded random subset when fewer.
            batch: mini-batch size b (0 = ``train.batch_size``).
            flags: CONTINUE (1): keep training the local model; FORCE_PUSH (2): push now.

        With ``algorithm.gate = "always"`` every task ends with an UPDATE (the delta from
        the starting model). With a gate (HermesGUP) the device evaluates its held-out local
        loss after the iteration and either pushes its accumulated delta since it last got
        the global model (UPDATE) or reports the iteration without a payload (REPORT).
        """
        self.doing = f"training device {device} (task {task}, model version {version})"
        if flags & FLUSH:
            self._flush(device, task)
            return
        self.tasks_started += 1
        dbg = self.cfg["debug"]
        if self.rank in dbg["kill_ranks"] and self.tasks_started >= dbg["kill_after_tasks"]:
            print(f"edgefl: debug.kill_ranks: rank {self.rank} kills itself", flush=True)
            if self.out_dir:
                stamp = Path(self.out_dir) / f"kill-rank{self.rank}.time"
                stamp.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        every = dbg["inject_every"]
        if every and self.rank == 1 and self.tasks_started % every == 0:
            self._inject = list(dbg["inject"])
        if self.delay_s:
            time.sleep(self._delay_rng.random() * self.delay_s)
        c = self.cfg["train"]
        dev = self.torch_dev[device]
        model, flat = self._model_on(dev)
        st = self.local.get(device) if flags & CONTINUE else None
        if st is not None and flags & REFRESH:  # the coordinator broadcast a new model
            st.params = self.versions[version].copy()
            st.base = version
            self._gate(device).on_model_received()
        if st is None:
            st = _LocalState(version, self.versions[version].copy() if self.gated else None)
            if self.gated:
                self.local[device] = st
                self._gate(device).on_model_received()
        flat.from_host(st.params if self.gated else self.versions[version])
        train_ds, holdout = self._split(device)
        if 0 < samples < len(train_ds):
            g = torch.Generator().manual_seed(derive_seed(self.cfg["seed"], device, task, SUBSET))
            idx = torch.randperm(len(train_ds), generator=g)[:samples].sort().values
            train_ds = torch.utils.data.Subset(train_ds, idx.tolist())
        gen = torch.Generator().manual_seed(derive_seed(self.cfg["seed"], device, task, TRAIN))
        t0 = time.perf_counter()
        ctx = None
        if self.kkt_on:
            ctx = self._kkt_context(device, model, train_ds, dev, self.versions[version], batch)
        if self.orderer is not None:
            loss = self._ordered(device, task, model, train_ds, dev)
        else:
            loss, _ = local_train(
                model,
                train_ds,
                epochs=c["local_epochs"],
                steps=c["local_steps"],
                batch_size=batch or c["batch_size"],
                lr=c["lr"],
                momentum=c["momentum"],
                weight_decay=c["weight_decay"],
                generator=gen,
                task=self.data.info.task,
                device=dev,
            )
        if dev.startswith("cuda"):
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        n_used = len(train_ds)
        if self.gated:
            np.copyto(st.params, flat.to_host())
            st.iterations += 1
            with torch.no_grad():
                hold_loss = evaluate(model, holdout, self.data.info.task, device=dev)[0]
            gate = self._gate(device)
            push = gate.observe(hold_loss) or bool(flags & FORCE_PUSH)
            cap = self.cfg["hermes"]["max_local_iterations"]
            push = push or (cap > 0 and st.iterations >= cap)
            if not push:
                last = gate.last
                z = float(getattr(last, "score", 0.0) or 0.0) if last is not None else 0.0
                z = z if math.isfinite(z) else 0.0
                self.t.send(
                    0, Kind.REPORT, device=device, round=task,
                    aux=(float(n_used), float(hold_loss), seconds, z),
                )  # fmt: skip
                return
            loss = hold_loss
            del self.local[device]
        start = self.versions[st.base]
        delta = self._free.pop() if self._free else np.empty_like(self.global_model)
        np.subtract(st.params if self.gated else flat.to_host(), start, out=delta)
        if device in self.cfg["debug"]["byzantine"]:
            k = self.cfg["debug"]["byzantine_scale"]
            delta *= np.float32(-k if self.cfg["debug"]["byzantine_mode"] == "signflip" else k)
        aux = (float(self.data.num_samples(device)), float(loss), seconds, float(st.iterations))
        if self.residual_on:
            self._send_residual(device, task, delta, aux, flags >> 8)
            self._free.append(delta)
            return
        if self.sparse_on:
            self._send_sparse(device, task, delta, aux, ctx)
            self._free.append(delta)
            return
        if self.servers:
            self._push_shards(device, task, version, delta, aux)
            return
        if self._inject:
            self._forge(device, task, delta, aux)
        seq = self.t.send(
            0,
            Kind.UPDATE,
            device=device,
            round=task,
            aux=aux,
            payload=delta,
            release=lambda: self._free.append(delta),
        )
        if "duplicate" in self._inject_done:
            # re-deliver the same sequence number with garbage: it must be ignored
            junk = np.full_like(delta, 1e6)
            self.t.send(0, Kind.UPDATE, device=device, round=task, aux=aux, payload=junk, seq=seq)
            self._inject_done.discard("duplicate")

    def _ordered(self, device: int, task: int, model, ds, dev: str) -> float:
        """CD-GraB & co.: one epoch in the order rank 0 sent; ships the examples' gradients
        (or sketches; per unit) in visit order before the update."""
        from ..models.ordered import ordered_epoch
        from ..models.per_example import PerExampleGrads

        order = self.orders.get(device)
        if order is None:
            raise RuntimeError(f"device {device}: no example order received before task {task}")
        o = self.orderer
        n = len(ds)
        ex_order = o.example_order(order, n) if o.num_units(n) != n else order
        if dev not in self.pe:
            self.pe[dev] = PerExampleGrads(model, self.data.info.task)
        c = self.cfg["train"]
        # streamed: each step's rows go to rank 0 at once (example units only: a microbatch's
        # gradient is known when all its examples were visited)
        stream = o.needs_grads and self.cfg["ordering"]["ship"] == "step" and o.num_units(n) == n

        def ship(first: int, rows: np.ndarray) -> None:
            self._send_grads(device, task, first, rows)

        loss, g = ordered_epoch(
            model, ds, ex_order, batch_size=c["batch_size"], lr=c["lr"], momentum=c["momentum"],
            weight_decay=c["weight_decay"], task=self.data.info.task, grads=self.pe[dev],
            device=dev, on_step=ship if stream else None,
        )  # fmt: skip
        if o.needs_grads and not stream:
            if o.num_units(n) != n:  # microbatch units: the mean gradient of each unit
                mb = self.cfg["ordering"]["microbatch"]
                pos = np.empty(n, np.int64)
                pos[ex_order] = np.arange(n)
                rows = []
                for u in order:
                    members = np.arange(u * mb, min((u + 1) * mb, n))
                    rows.append(g[pos[members]].mean(axis=0))
                g = np.stack(rows).astype(np.float32)
            self._send_grads(device, task, 0, g)
        return loss

    def _send_grads(self, device: int, task: int, first: int, rows: np.ndarray) -> None:
        """One GRADS message: ``rows`` (units ``first ..`` of the epoch, visit order),
        projected by the orderer's sketch; aux = (rows, width, first, 0)."""
        g = np.ascontiguousarray(self.orderer.project(rows), dtype=np.float32)
        self.t.send(
            0, Kind.GRADS, device=device, round=task,
            aux=(float(g.shape[0]), float(g.shape[1]), float(first), 0.0), payload=g.reshape(-1),
        )  # fmt: skip

    def _residual(self, device: int):
        if device not in self.residuals:
            from ..policies.residual import GDDRResidual

            g = self.cfg["gddr"]
            self.residuals[device] = GDDRResidual(
                self.global_model.size,
                device,
                self.cfg["seed"],
                alpha=g["alpha"],
                tau=g["tau"],
                installments=g["installments"],
                installment_ratio=g["installment_ratio"],
            )
        return self.residuals[device]

    def _send_residual(self, device: int, task: int, delta, aux: tuple, tau: int) -> None:
        """GDDR: send only the released coordinates (+ the update's norm, last value);
        the residual checkpoint of a due step is written before the message leaves, so a
        coordinator that saw the message can always find it."""
        res = self._residual(device)
        if tau:
            res.set_tau(tau)
        step = res.last_step + 1
        rel = res.step(delta, step)
        payload = np.empty(rel.values.size + 1, np.float32)
        payload[:-1] = rel.values
        payload[-1] = rel.norm
        every = self.cfg["gddr"]["checkpoint_every"]
        if self.ckpt_dir is not None and every and (step + 1) % every == 0:
            from ..ckpt.residual import residual_checkpoint_name, save_residual

            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            save_residual(self.ckpt_dir / residual_checkpoint_name(device), res.state_dict())
        self.t.send(
            0, Kind.RESIDUAL, device=device, round=task, aux=(*aux[:3], float(rel.tau)),
            payload=payload,
        )  # fmt: skip

    def _kkt_context(self, device: int, model, ds, dev: str, start: np.ndarray, batch: int):
        """What the KKT filter tests against: the global weights the task starts from and
        the gradient of the device's mean training loss there, scaled by ``train.lr`` x the
        task's local SGD steps (the first-order size of its delta, so it compares with
        ``server.l1``, the prox threshold in delta units). Over the device's working set
        (logreg) or every key."""
        from ..policies.filters import FilterContext

        c = self.cfg["train"]
        n = len(ds)
        g = loss_gradient(model, ds, self.data.info.task, dev)
        bs = batch or c["batch_size"]
        bs = n if bs == 0 or bs >= n else bs
        steps = c["local_steps"] if c["local_steps"] > 0 else c["local_epochs"] * -(-n // bs)
        keys = self.ws.get(device)
        if keys is None:
            keys = np.arange(start.size, dtype=np.int64)
        scale = float(c["lr"]) * steps
        return FilterContext(keys, start[keys], g[keys].astype(np.float64) * scale)

    def _exempt_keys(self) -> np.ndarray:
        """Keys the KKT filter never skips: every parameter named ``*bias`` (dense,
        unpenalised in the L1 model), as in ``edgefl bench ps``."""
        if self._exempt is None:
            from ..policies.keyrange import ParamLayout

            layout = ParamLayout.from_flat(self.task.flat)
            parts = [layout.range_of(n).keys() for n in layout.names if n.endswith("bias")]
            self._exempt = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._exempt

    def _send_sparse(self, device: int, task: int, delta, aux: tuple, ctx=None) -> None:
        """Parameter-server push: filter (what is held back stays in the device's filter
        residual), then encode (dense / index-value / cached key list, whichever is smaller)."""
        from ..policies.compress import Encoder, key_hash, round_values
        from ..policies.filters import mass_checksum
        from .policies import make_ps_filter_chain

        ps = self.cfg["ps"]
        if device not in self.encoders:
            q = None
            if ps["value_dtype"] != "float32":
                dt = ps["value_dtype"]

                def q(v, dt=dt):
                    return round_values(v, dt)

            self.filters[device] = make_ps_filter_chain(self.cfg, q, self._exempt_keys())
            self.encoders[device] = Encoder(
                delta.size, ps["value_dtype"], ps["key_cache"], ps["cache_entries"]
            )
            if ps["key_cache"] and self.ws_sent and device in self.ws:
                # rank 0 caches the key list of an accepted WORKSET as this device's first
                # entry (if it rejected it, the first push is a cache miss and is resent)
                ws = self.ws[device]
                self.encoders[device].cache.put(key_hash(ws, delta.size), ws)
        keys = np.flatnonzero(delta)
        vals = delta[keys]
        self.produced[device] = self.produced.get(device, 0.0) + mass_checksum(keys, vals)
        k, v = self.filters[device].apply(keys, vals, ctx)
        self._push_sparse(device, task, k, v, aux)

    def _push_sparse(self, device: int, task: int, k: np.ndarray, v: np.ndarray, aux) -> None:
        """Encode ``(k, v)`` with the device's encoder and send it as SPARSE. With key caching
        and a working set (logreg), key lists are sent as bitmaps over the working set."""
        from ..policies.compress import key_hash

        enc = self.encoders[device]
        base = self.ws.get(device) if self.cfg["ps"]["key_cache"] and k.size else None
        if base is not None and not np.isin(k, base, assume_unique=True).all():
            base = None
        if base is not None and key_hash(base, enc.space) not in enc.cache:
            # the first push (or the first after a resend): the working set's key list in
            # full, with zeros where nothing is sent (the same update once decoded), so
            # rank 0 caches it and later pushes name their keys as a bitmap over it
            padded = np.zeros(base.size, np.float32)
            padded[np.searchsorted(base, k)] = v
            k, v = base, padded
            enc.allow_dense = False  # a dense message would not cache the list
            try:
                msg = enc.encode(k, v)
            finally:
                enc.allow_dense = True
        else:  # per-round filtered lists are not cached (they would evict the base)
            msg = enc.encode(k, v, base=base, remember=base is None)
        self.last_sparse[device] = (task, k, v, aux)
        self.t.send(0, Kind.SPARSE, device=device, round=task, aux=aux, payload=msg.payload)

    def _resend(self, device: int, task: int) -> None:
        """Rank 0 lacked a cached key list: forget the cache, send the full index list."""
        last = self.last_sparse.get(device)
        if last is None or last[0] != task:
            log.warning("rank %d: RESEND of device %d task %d: nothing to resend", self.rank,
                        device, task)  # fmt: skip
            return
        _, k, v, aux = last
        enc = self.encoders[device]
        enc.reset_cache()
        self.t.send(0, Kind.SPARSE, device=device, round=task, aux=aux,
                    payload=enc.encode(k, v).payload)  # fmt: skip

    def _flush(self, device: int, task: int) -> None:
        """End of training: send everything the device's residual still holds (dense)."""
        held = np.zeros(self.global_model.size, np.float32)
        if device in self.residuals:
            held[:] = self.residuals[device].flush()
        aux = (float(self.data.num_samples(device)), 0.0, 0.0, 0.0)
        if device in self.filters:  # a filter's held-back mass (parameter-server pushes)
            chain = self.filters[device]
            k, v = chain.flush()
            kkt = [f for f in chain.filters if f.name == "kkt"]
            # (samples, checksum of all it produced, KKT entries skipped, KKT entries seen):
            # rank 0 checks that everything produced arrived (summary.json "ps")
            aux = (aux[0], self.produced.get(device, 0.0), float(sum(f.skipped for f in kkt)),
                   float(sum(f.seen for f in kkt)))  # fmt: skip
            self._push_sparse(device, task, k, v, aux)  # encoded like every push
            return
        self.t.send(0, Kind.UPDATE, device=device, round=task, aux=aux, payload=held)

    def _gate(self, device: int):
        if device not in self.gates:
            from ..policies.gate import make_gate

            self.gates[device] = make_gate(self.cfg["algorithm"]["gate"], self.cfg["hermes"])
        return self.gates[device]

    def _split(self, device: int):
        """(training split, held-out split) of ``device``; the held-out part (a seeded
        ``hermes.holdout_fraction`` of its samples) exists only when a gate needs it."""
        if device in self.splits:
            return self.splits[device]
        ds = self.data.train(device)
        if not self.gated or len(ds) < 2:
            out = (ds, ds)
        else:
            n = len(ds)
            h = min(n - 1, max(1, int(round(self.cfg["hermes"]["holdout_fraction"] * n))))
            g = torch.Generator().manual_seed(derive_seed(self.cfg["seed"], device, HOLDOUT))
            perm = torch.randperm(n, generator=g).tolist()
            sub = torch.utils.data.Subset
            out = (sub(ds, sorted(perm[h:])), sub(ds, sorted(perm[:h])))
        self.splits[device] = out
        return out

    def _forge(self, device: int, round_: int, delta: np.ndarray, aux: tuple) -> None:
        """Debug hook (config ``debug.inject``): send malformed messages once, on rank 1."""
        n = delta.size
        for what in self._inject:
            if what == "bad-kind":
                self.t.send(0, 99, device=device, round=round_)  # type: ignore[arg-type]
            elif what == "bad-length":
                self.t.send(
                    0,
                    Kind.UPDATE,
                    device=device,
                    round=round_,
                    aux=aux,
                    payload=np.zeros(n + 3, np.float32),
                )
            elif what == "bad-dtype":
                self.t.send(
                    0,
                    Kind.UPDATE,
                    device=device,
                    round=round_,
                    aux=aux,
                    payload=np.zeros(n, np.float64),
                )
            elif what == "foreign-device":
                other = self.cfg["fleet"]["devices"] + 7
                self.t.send(
                    0,
                    Kind.UPDATE,
                    device=other,
                    round=round_,
                    aux=aux,
                    payload=np.zeros(n, np.float32),
                )
        self._inject_done = set(self._inject)
        self._inject = []
        self.t.wait_sends()


CONTINUE = 1  # TRAIN flags (aux[3]); bits 8+ carry the GDDR tau (0 = keep)
FORCE_PUSH = 2
FLUSH = 4
REFRESH = 8  # with CONTINUE: adopt model `version` first (Hermes broadcast = all)
SUBSET = 3  # derive_seed purposes of the worker's own streams
HOLDOUT = 4


class _LocalState:
    """A gated device between pushes: its local model and the version it started from."""

    __slots__ = ("base", "params", "iterations")

    def __init__(self, base: int, params: np.ndarray | None) -> None:
        self.base = base
        self.params = params
        self.iterations = 0


def loss_gradient(
    model: torch.nn.Module,
    dataset,
    task: str,
    device: str = "cpu",
    batch_size: int = 1024,
) -> np.ndarray:
    """Gradient of the mean training loss over ``dataset`` at the model's current parameters.

    One forward/backward pass (batches of ``batch_size`` samples, default 1024, weighted by
    their size) with torch autograd, in eval mode so it draws no randomness and moves no
    batch-norm statistics; parameters and their ``.grad`` are left as they were (None).

    Args:
        model: any module of ``edgefl.models`` (loss: ``models.train.loss_fn``).
        dataset: a dataset of ``(x, y)`` pairs.
        task: ``"classification"`` or ``"lm"``.
        device: torch device of the model.
        batch_size: samples per forward pass.

    Returns:
        float32 numpy vector in ``FlatParams`` order (``named_parameters`` order).
    """
    from ..models.train import loss_fn

    n = len(dataset)
    params = [p for _, p in model.named_parameters()]
    was_training = model.training
    model.eval()
    for p in params:
        p.grad = None
    try:
        if n:
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                (loss_fn(model(xb), yb, task) * (yb.shape[0] / n)).backward()
        g = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
    finally:
        for p in params:
            p.grad = None
        model.train(was_training)
    return g.detach().cpu().numpy().astype(np.float32, copy=False)


def _malformed(keys: np.ndarray, how: str, numel: int) -> np.ndarray:
    """Test hook ``ps.debug_bad_working_set``: a key list rank 0 must reject."""
    if how == "unsorted":
        return np.ascontiguousarray(keys[::-1])
    if how == "duplicate":
        return np.concatenate([keys[:1], keys])
    return np.concatenate([keys, np.array([numel], keys.dtype)])  # out-of-range


def error_payload(text: str) -> np.ndarray:
    """An ERROR message body (UTF-8 bytes as uint8)."""
    return np.frombuffer(text.encode("utf-8")[:65536], np.uint8).copy()
