"""Rank 0's half of parameter-server pushes and pulls."""

from __future__ import annotations

import logging
import time

import numpy as np

from ...comm import Kind, Message
from ...comm.wire import HEADER_BYTES
from ...policies.consistency import Apply, Arrival
from ..base import CoordinatorPlugin, Download
from ..context import CoordinatorContext
from .kinds import MODEL_KEYS, RESEND, SPARSE, WORKSET
from .workset import working_set_pulls

log = logging.getLogger("edgefl.coordinator")


class PSCoordinator(CoordinatorPlugin):
    """Collects the devices' working sets after registration and sends each rank only its
    keys' values (MODEL_KEYS); decodes SPARSE pushes (asking for a RESEND on a key-cache
    miss); checks at the end that every device's produced mass arrived (summary ``ps``)."""

    update_kinds = (SPARSE,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        self.ws_dev: dict[int, np.ndarray] = {}  # device -> its accepted working set
        self.ws_rank: dict[int, tuple[np.ndarray, int]] = {}  # rank -> (union keys, digest)
        self.ws_rejected: list[int] = []  # devices whose WORKSET was rejected
        self.ws_up: dict[int, int] = {}  # device -> WORKSET bytes received (header included)
        self.decoders: dict = {}
        self.resends = 0
        # device -> [checksum of all it produced (its flush says), checksum of all decoded
        # here, sum of |decoded values|] (filters.mass_checksum)
        self.mass: dict[int, list[float]] = {}
        self.kkt = [0, 0]  # KKT entries skipped, seen (all devices)
        self.flushed_abs = 0.0  # sum of |values| of the final filter flushes

    # -- working-set pulls ------------------------------------------------------------------
    def on_registered(self) -> None:
        if working_set_pulls(self.ctx.cfg):
            deadline = time.monotonic() + self.ctx.cfg["comm"]["register_timeout_s"]
            self._collect_working_sets(deadline)

    def _collect_working_sets(self, deadline: float) -> None:
        """Ask every worker for its devices' working sets (a HEARTBEAT); each sends one
        WORKSET per device, then a HEARTBEAT. A malformed one (not sorted, not unique,
        outside the model) is rejected and logged; that rank then gets full models. A resumed
        run asks again."""
        from ...policies.keyrange import check_keys, key_digest

        ctx = self.ctx
        numel = ctx.numel
        for w in ctx.workers:
            ctx.send(w, Kind.HEARTBEAT)
        waiting = set(ctx.workers)
        while waiting:
            waiting -= ctx.failed_ranks
            if not waiting:
                break
            if time.monotonic() > deadline:
                log.warning("ranks %s sent no working sets within comm.register_timeout_s; "
                            "they get full models", sorted(waiting))  # fmt: skip
                break
            for msg in ctx.poll(0.5):
                if msg.kind == Kind.HEARTBEAT:
                    waiting.discard(msg.src)
                elif msg.kind == WORKSET:
                    d = msg.device
                    try:
                        keys = check_keys(msg.payload, numel, "keys")
                    except ValueError as e:
                        ctx.reject(msg.src, f"WORKSET of rank {msg.src}, device {d}: {e}")
                        self.ws_rejected.append(d)
                    else:
                        self.ws_dev[d] = keys.copy()
                        self.ws_up[d] = self.ws_up.get(d, 0) + HEADER_BYTES + msg.nbytes
                else:
                    log.warning("ignoring %s from rank %d (expected WORKSET)", msg.kind.name,
                                msg.src)  # fmt: skip
                ctx.release(msg)
        for w in ctx.workers:
            devs = [d for d, v in sorted(ctx.devices.items()) if v["rank"] == w]
            if not devs or any(d not in self.ws_dev for d in devs):
                continue
            keys = np.unique(np.concatenate([self.ws_dev[d] for d in devs]))
            if keys.size < numel:
                self.ws_rank[w] = (keys, key_digest(keys))
        full = sorted(set(ctx.workers) - set(self.ws_rank))
        log.info("working-set pulls to ranks %s; full models to ranks %s", sorted(self.ws_rank),
                 full)  # fmt: skip

    def on_start(self) -> None:
        if self.ctx.resuming:
            return  # (the resumed totals hold the first run's WORKSET uploads)
        for d, up in sorted(self.ws_up.items()):  # WORKSET uploads
            self.ctx.book_up(d, up)

    def send_model(self, down: Download) -> None:
        """Only the values at the rank's working sets (MODEL_KEYS; aux = (number of keys,
        their key_digest))."""
        ws = self.ws_rank.get(down.rank)
        if ws is not None:
            keys, digest = ws
            aux = (float(keys.size), float(digest))
            down.encode(self.name, MODEL_KEYS, self.ctx.global_model[keys], aux)

    def down_bytes(self, d: int) -> int | None:
        """MODEL_KEYS + TRAIN headers and the device's own working set's values (counted as
        for one device per node)."""
        if self.ctx.devices[d]["rank"] not in self.ws_rank:
            return None
        return 2 * HEADER_BYTES + 4 * self.ws_dev[d].size

    # -- sparse pushes ----------------------------------------------------------------------
    def decode(self, d: int, task: int, msg: Message):
        """Decode a push; if it names a key list rank 0 does not hold (key cache miss), ask
        the device to resend it with the full index list."""
        from .compress import KeyCacheMiss, MessageError

        ctx = self.ctx
        dec = self._decoder(d)
        for attempt in range(2):
            try:
                got = dec.decode(msg.payload)
                out = got.to_dense().astype(np.float32)
                keys = np.flatnonzero(out) if got.keys is None else got.keys
                self._book_mass(d, keys, out[keys])
                return out, "", msg
            except KeyCacheMiss:
                if attempt:  # the resend missed too: refused (no second RESEND)
                    break
                self.resends += 1
                ctx.book_up(d, HEADER_BYTES + msg.nbytes)  # the message that missed
                ctx.release(msg)
                ctx.send(ctx.devices[d]["rank"], RESEND, device=d, round=task)
                msg = ctx.wait_for((d, task))
            except MessageError as e:
                return None, f"sparse update of device {d}: {e}", msg
        return None, f"sparse update of device {d}: key list still unknown after a resend", msg

    def _decoder(self, d: int):
        from .compress import Decoder, key_hash

        dec = self.decoders.get(d)
        if dec is None:
            ctx = self.ctx
            numel = ctx.numel
            dec = self.decoders[d] = Decoder(numel, ctx.cfg["ps"]["cache_entries"])
            if ctx.cfg["ps"]["key_cache"] and d in self.ws_dev:
                # the device's accepted working set is its first cached key list: its pushes
                # can name subsets of it as bitmaps from the start
                dec.cache.put(key_hash(self.ws_dev[d], numel), self.ws_dev[d])
        return dec

    def _book_mass(self, d: int, keys: np.ndarray, values: np.ndarray) -> None:
        from .filters import mass_checksum

        m = self.mass.setdefault(d, [0.0, 0.0, 0.0])
        m[1] += mass_checksum(keys, values)
        m[2] += float(np.abs(values).sum(dtype=np.float64))

    def after_apply(self, ap: Apply, now: float) -> None:
        every = self.ctx.cfg["debug"]["forget_key_cache_every"]
        if every and self.ctx.version % every == 0:
            for dec in self.decoders.values():
                dec.reset_cache()

    def flush_devices(self) -> list[int]:
        return sorted(self.decoders) if self.ctx.cfg["ps"]["sparse"] else []

    def on_flushed(self, d: int, a: Arrival) -> None:
        """A device's final flush (SPARSE; UPDATE from a device that never pushed); its aux
        says (samples, mass_checksum of all it produced, KKT entries skipped, KKT entries
        seen). Its bytes count as the device's upload."""
        msg = a.msg
        self.mass.setdefault(d, [0.0, 0.0, 0.0])[0] = float(msg.aux[1])
        if msg.kind == Kind.UPDATE:  # (SPARSE ones were booked when decoded)
            keys = np.flatnonzero(a.delta)
            self._book_mass(d, keys, a.delta[keys])
        self.flushed_abs += float(np.abs(a.delta).sum(dtype=np.float64))
        self.kkt[0] += int(msg.aux[2])
        self.kkt[1] += int(msg.aux[3])
        self.ctx.book_up(d, HEADER_BYTES + msg.nbytes)

    def summary(self) -> dict:
        """summary.json "ps": working-set pulls and sparse pushes."""
        ps = self.ctx.cfg["ps"]
        numel = self.ctx.numel
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
                for d, m in sorted(self.mass.items())
            }
            out["flushed_abs"] = self.flushed_abs
            out["kkt_skipped"], out["kkt_seen"] = self.kkt
        return {"ps": out, "sparse_resends": self.resends}

    def state_dict(self) -> dict:
        """Counters (the decoders' key caches start empty on resume, as do the workers')."""
        mass = {str(d): np.array(m, np.float64) for d, m in sorted(self.mass.items())}
        return {"resends": self.resends, "mass": mass, "kkt": list(self.kkt),
                "flushed_abs": self.flushed_abs,
                "decoders": [int(d) for d in sorted(self.decoders)],
                "caches": {str(d): dec.cache.state_dict()
                           for d, dec in sorted(self.decoders.items())}}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.resends = int(state.get("resends", 0))
        self.mass = {int(d): [float(x) for x in m] for d, m in state.get("mass", {}).items()}
        self.kkt = [int(x) for x in state.get("kkt", [0, 0])]
        self.flushed_abs = float(state.get("flushed_abs", 0.0))
        for d in state.get("decoders", []):  # (so the end's flush asks these devices)
            dec = self._decoder(int(d))
            if str(d) in state.get("caches", {}):
                dec.cache.load_state_dict(state["caches"][str(d)])
