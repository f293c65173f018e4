"""A worker's half of parameter-server pushes and pulls."""

from __future__ import annotations

import logging

import numpy as np

from ...comm import Kind, Message
from ...errors import EdgeflError
from ..base import LocalJob, Upload, WorkerPlugin
from ..context import WorkerContext
from .kinds import MODEL_KEYS, RESEND, SPARSE, WORKSET
from .workset import (
    WORKING_SET_MODELS,
    device_working_set,
    loss_gradient,
    malformed,
    working_set_pulls,
)

log = logging.getLogger("edgefl.worker")


class PSWorker(WorkerPlugin):
    """Computes the devices' working sets (logreg) and sends them when rank 0 asks; installs
    MODEL_KEYS versions; filters and encodes every push (SPARSE) and answers RESEND; at the
    end flushes what the filters held back."""

    message_kinds = (MODEL_KEYS, RESEND, Kind.HEARTBEAT)
    stackable = True
    stack_note = "the KKT filter reads the start model's gradient before training only"

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        cfg = ctx.cfg
        self.sparse = cfg["ps"]["sparse"]
        self.kkt = self.sparse and "kkt" in cfg["ps"]["filters"]
        self.ws_pull = working_set_pulls(cfg)  # rank 0 sends only working-set values
        self.ws_known = cfg["model"]["name"] in WORKING_SET_MODELS and (self.ws_pull or self.sparse)
        self.ws: dict[int, np.ndarray] = {}  # device -> its working set (sorted int64 keys)
        self.ws_union: np.ndarray | None = None  # keys of this rank's MODEL_KEYS messages
        self.ws_digest = 0
        self.ws_sent = False
        self.produced: dict[int, float] = {}  # device -> mass_checksum of all it produced
        self._exempt: np.ndarray | None = None
        self.encoders: dict = {}
        self.filters: dict = {}
        self.last_sparse: dict = {}

    # -- working sets -----------------------------------------------------------------------
    def on_register(self, info: dict) -> None:
        if not self.ws_known:
            return
        from ...policies.keyrange import ParamLayout, key_digest

        ctx = self.ctx
        layout = ParamLayout.from_flat(ctx.flat)
        for d in ctx.devices:
            self.ws[d] = device_working_set(layout, ctx.train_set(d))
        if self.ws_pull and self.ws:
            self.ws_union = np.unique(np.concatenate(list(self.ws.values())))
            self.ws_digest = key_digest(self.ws_union)

    def on_message(self, msg: Message) -> None:
        if msg.kind == MODEL_KEYS:
            self._install_keys(msg)
        elif msg.kind == RESEND:
            self._resend(msg.device, msg.round)
        elif self.ws_pull and not self.ws_sent:  # HEARTBEAT: rank 0 asks for the sets
            self._send_working_sets()
        else:
            log.warning("rank %d: ignoring %s", self.ctx.rank, msg.kind.name)

    def _send_working_sets(self) -> None:
        """One WORKSET per device (its sorted keys, int32 when they fit), then a HEARTBEAT
        that tells rank 0 this rank sent them all (rank 0 rejects malformed ones)."""
        ctx = self.ctx
        numel = ctx.numel
        dt = np.int32 if numel < 2**31 else np.int64
        bad = ctx.cfg["ps"]["debug_bad_working_set"]
        for i, d in enumerate(ctx.devices):
            keys = self.ws[d].astype(dt)
            if bad != "none" and ctx.rank == 1 and i == 0:
                keys = malformed(keys, bad, numel)
            ctx.send(0, WORKSET, device=d, payload=keys)
        ctx.send(0, Kind.HEARTBEAT)
        self.ws_sent = True

    def _install_keys(self, msg: Message) -> None:
        """MODEL_KEYS: the global model's values at this rank's working-set keys become model
        version ``msg.round``. Keys outside it keep the values of the newest version held
        (zeros at first): no device's data touches them, so they never reach an update."""
        ctx = self.ctx
        keys = self.ws_union
        n, digest = int(msg.aux[0]), int(msg.aux[1])
        if keys is None or n != keys.size or msg.payload.size != n or digest != self.ws_digest:
            ctx.release(msg)
            have = 0 if keys is None else keys.size
            raise EdgeflError(
                f"rank {ctx.rank}: MODEL_KEYS of model version {msg.round} carries "
                f"{msg.payload.size} values for {n} keys (digest {digest:x}); this rank's "
                f"working set has {have} keys (digest {self.ws_digest:x})"
            )
        ctx.install_model(msg.round, keys, msg.payload)
        ctx.release(msg)

    # -- pushes -----------------------------------------------------------------------------
    def before_train(self, d: int, job: LocalJob) -> None:
        """The KKT filter tests against the global weights the task starts from and the
        gradient of the device's mean training loss there, scaled by ``train.lr`` x the
        task's local SGD steps (the first-order size of its delta, so it compares with
        ``server.l1``, the prox threshold in delta units); over the device's working set
        (logreg) or every key."""
        if not self.kkt:
            return
        from .filters import FilterContext

        c = self.ctx.cfg["train"]
        ds, start = job.dataset, job.start
        n = len(ds)
        g = loss_gradient(job.model, ds, self.ctx.task_kind, job.torch_device, loss=self.ctx.loss)
        bs = job.spec.batch or c["batch_size"]
        bs = n if bs == 0 or bs >= n else bs
        steps = c["local_steps"] if c["local_steps"] > 0 else c["local_epochs"] * -(-n // bs)
        keys = self.ws.get(d)
        if keys is None:
            keys = np.arange(start.size, dtype=np.int64)
        scale = float(c["lr"]) * steps
        job.ctx["kkt"] = FilterContext(keys, start[keys], g[keys].astype(np.float64) * scale)

    def _exempt_keys(self) -> np.ndarray:
        """Keys the KKT filter never skips: every parameter named ``*bias`` (dense,
        unpenalised in the L1 model), as in ``edgefl bench ps``."""
        if self._exempt is None:
            from ...policies.keyrange import ParamLayout

            layout = ParamLayout.from_flat(self.ctx.flat)
            parts = [layout.range_of(n).keys() for n in layout.names if n.endswith("bias")]
            self._exempt = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._exempt

    def _setup_device(self, d: int, size: int) -> None:
        from .compress import Encoder, key_hash, round_values
        from .filters import make_ps_filter_chain

        ps = self.ctx.cfg["ps"]
        q = None
        if ps["value_dtype"] != "float32":
            dt = ps["value_dtype"]

            def q(v, dt=dt):
                return round_values(v, dt)

        self.filters[d] = make_ps_filter_chain(self.ctx.cfg, q, self._exempt_keys())
        self.encoders[d] = Encoder(size, ps["value_dtype"], ps["key_cache"], ps["cache_entries"])
        if ps["key_cache"] and self.ws_sent and d in self.ws:
            # rank 0 caches the key list of an accepted WORKSET as this device's first entry
            # (if it rejected it, the first push is a cache miss and is resent)
            self.encoders[d].cache.put(key_hash(self.ws[d], size), self.ws[d])

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        """Filter (what is held back stays in the device's filter residual), then encode
        (dense / index-value / cached key list, whichever is smaller) as SPARSE. The end of
        training: the filters' held-back mass (:meth:`_flush`)."""
        if up.flush:
            self._flush(up)
            return
        if not self.sparse:
            return
        from .filters import mass_checksum

        d, delta = up.device, up.delta
        if d not in self.encoders:
            self._setup_device(d, delta.size)
        keys = np.flatnonzero(delta)
        vals = delta[keys]
        self.produced[d] = self.produced.get(d, 0.0) + mass_checksum(keys, vals)
        k, v = self.filters[d].apply(keys, vals, job.ctx.get("kkt"))
        up.encode(self.name, SPARSE, self._push(d, up.task, k, v, up.aux))

    def _push(self, device: int, task: int, k: np.ndarray, v: np.ndarray, aux) -> np.ndarray:
        """``(k, v)`` encoded with the device's encoder: the SPARSE payload. With key caching
        and a working set (logreg), key lists are sent as bitmaps over the working set."""
        from .compress import key_hash

        enc = self.encoders[device]
        base = self.ws.get(device) if self.ctx.cfg["ps"]["key_cache"] and k.size else None
        if base is not None and not np.isin(k, base, assume_unique=True).all():
            base = None
        if base is not None and key_hash(base, enc.space) not in enc.cache:
            # the first push (or the first after a resend): the working set's key list in
            # full, with zeros where nothing is sent (the same update once decoded), so rank
            # 0 caches it and later pushes name their keys as a bitmap over it
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
        return msg.payload

    def _resend(self, device: int, task: int) -> None:
        """Rank 0 lacked a cached key list: forget the cache, send the full index list."""
        last = self.last_sparse.get(device)
        if last is None or last[0] != task:
            log.warning("rank %d: RESEND of device %d task %d: nothing to resend",
                        self.ctx.rank, device, task)  # fmt: skip
            return
        _, k, v, aux = last
        enc = self.encoders[device]
        enc.reset_cache()
        self.ctx.send(0, SPARSE, device=device, round=task, aux=aux,
                         payload=enc.encode(k, v).payload)  # fmt: skip

    def _flush(self, up: Upload) -> None:
        """End of training: the filters' held-back mass, encoded like every push; aux =
        (samples, checksum of all it produced, KKT entries skipped, KKT entries seen), so
        rank 0 can check that everything produced arrived (summary.json "ps")."""
        d = up.device
        if d not in self.filters:
            return
        chain = self.filters[d]
        k, v = chain.flush()
        kkt = [f for f in chain.filters if f.name == "kkt"]
        aux = (float(self.ctx.num_samples(d)), self.produced.get(d, 0.0),
               float(sum(f.skipped for f in kkt)), float(sum(f.seen for f in kkt)))  # fmt: skip
        up.encode(self.name, SPARSE, self._push(d, up.task, k, v, aux), aux)

    def device_state(self, d: int) -> dict:
        if d not in self.filters:
            return {}
        kkt = [f for f in self.filters[d].filters if f.name == "kkt"]
        return {"filters": self.filters[d].state_dict(), "produced": self.produced.get(d, 0.0),
                "kkt": [[int(f.skipped), int(f.seen)] for f in kkt],
                "cache": self.encoders[d].cache.state_dict()}  # fmt: skip

    def load_device_state(self, d: int, state: dict) -> None:
        if "filters" not in state:
            return
        self._setup_device(d, self.ctx.numel)
        self.filters[d].load_state_dict(state["filters"])
        self.produced[d] = float(state.get("produced", 0.0))
        if "cache" in state:
            self.encoders[d].cache.load_state_dict(state["cache"])
        kkt = [f for f in self.filters[d].filters if f.name == "kkt"]
        for f, (skipped, seen) in zip(kkt, state.get("kkt", [])):
            f.skipped, f.seen = skipped, seen
