"""Rank 0: registers the workers, runs the rounds, aggregates, evaluates, checkpoints."""

from __future__ import annotations

import json
import logging
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
from ..policies.aggregation import Update, make_aggregator
from ..seeding import SAMPLE, derive_seed
from .output import MetricsLog, Progress, summary_table
from .placement import devices_of_rank
from .state import RESUME_MUST_MATCH, Task, checkpoint_state

log = logging.getLogger("edgefl.coordinator")


class WorkerFailed(EdgeflError):
    """A worker reported a fatal error (its text is the message)."""


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
        self.workers = list(range(1, transport.size))
        self.aggregator = make_aggregator(cfg["algorithm"]["aggregation"])
        self.global_model = task.flat.to_host()  # the live global model (float32, zero-copy)
        self.agg_buf = np.empty_like(self.global_model)
        self.devices: dict[int, dict] = {}
        self.start_round = 0
        self.wall_offset = 0.0
        self.history: list[dict] = []
        self.stopped = ""

    # -- set-up -----------------------------------------------------------------------------
    def register(self) -> None:
        """Wait for every worker's REGISTER and check it hosts the expected devices."""
        timeout = self.cfg["comm"]["register_timeout_s"]
        deadline = time.monotonic() + timeout
        waiting = set(self.workers)
        size = self.t.size
        while waiting:
            if time.monotonic() > deadline:
                raise EdgeflError(
                    f"ranks {sorted(waiting)} did not register within {timeout} s "
                    "(comm.register_timeout_s)"
                )
            for msg in self.t.poll(timeout=0.5):
                if msg.kind == Kind.ERROR:
                    raise WorkerFailed(_error_text(msg))
                if msg.kind != Kind.REGISTER:
                    log.warning(
                        "ignoring %s from rank %d during registration", msg.kind.name, msg.src
                    )
                    continue
                info = json.loads(bytes(msg.payload).decode("utf-8"))
                expect = devices_of_rank(msg.src, self.num_devices, size)
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
        self.history = [json.loads(x) for x in st["metrics_jsonl"]]
        for d, v in st["devices"].items():
            if int(d) in self.devices:
                for k in ("rounds", "bytes_up", "bytes_down", "msgs_up", "msgs_down", "time_s"):
                    self.devices[int(d)][k] = v.get(k, 0)

    # -- the rounds -------------------------------------------------------------------------
    def sample(self, round_: int) -> list[int]:
        """Devices participating in ``round_`` (deterministic in seed and round)."""
        frac = self.cfg["server"]["participation"]
        if frac >= 1.0:
            return list(range(self.num_devices))
        k = max(1, int(round(frac * self.num_devices)))
        rng = np.random.default_rng(derive_seed(self.cfg["seed"], -1, round_, SAMPLE))
        return sorted(int(d) for d in rng.choice(self.num_devices, size=k, replace=False))

    def broadcast(self, round_: int, part: list[int]) -> dict[int, int]:
        """Send the global model once per rank, then a TRAIN per participating device."""
        by_rank: dict[int, list[int]] = {}
        for d in part:
            by_rank.setdefault(self.devices[d]["rank"], []).append(d)
        down = {}
        for rank, devs in sorted(by_rank.items()):
            self.t.send(rank, Kind.MODEL, round=round_, payload=self.global_model)
            for d in devs:
                self.t.send(rank, Kind.TRAIN, device=d, round=round_)
                down[d] = 2 * HEADER_BYTES + self.global_model.nbytes
        return down

    def collect(self, round_: int, part: list[int]) -> list[tuple[Update, Message]]:
        """Receive one UPDATE per participating device (BSP)."""
        pending = set(part)
        got: list[tuple[Update, Message]] = []
        # (sorted by device at the end, so sums and logs never depend on arrival order)
        while pending:
            for msg in self.t.poll(timeout=1.0):
                if msg.kind == Kind.ERROR:
                    raise WorkerFailed(_error_text(msg))
                if msg.kind != Kind.UPDATE:
                    log.warning("ignoring %s from rank %d", msg.kind.name, msg.src)
                    continue
                if msg.round != round_ or msg.device not in pending:
                    log.warning(
                        "ignoring update of device %d for round %d (now round %d)",
                        msg.device,
                        msg.round,
                        round_,
                    )
                    self.t.release(msg)
                    continue
                pending.discard(msg.device)
                if not np.isfinite(msg.payload).all():
                    self.t.reject(msg.src, f"non-finite update from device {msg.device}")
                    self.t.release(msg)
                    continue
                samples, loss, seconds = int(msg.aux[0]), float(msg.aux[1]), float(msg.aux[2])
                got.append((Update(msg.device, msg.payload, samples, loss, round_), msg))
                dev = self.devices[msg.device]
                dev["time_s"] += seconds
                dev["last_time_s"] = seconds
        return sorted(got, key=lambda g: g[0].device)

    def run(self) -> int:
        """The round loop; returns the exit status (0 = completed)."""
        cfg = self.cfg
        rounds = cfg["run"]["rounds"]
        out = self.out_dir
        metrics = MetricsLog(out / "metrics.jsonl" if out else None, self.history)
        progress = Progress(cfg["output"]["progress"], rounds)
        model, test = self.task.model, self.task.data.test()
        task_kind = self.task.data.info.task
        t0 = time.monotonic() - self.wall_offset
        r = self.start_round
        last_eval: tuple[float, float] | None = None
        while r < rounds:
            r += 1
            part = self.sample(r)
            down = self.broadcast(r, part)
            got = self.collect(r, part)
            self.t.wait_sends()  # the global buffer is about to change
            row: dict = {"round": r, "participants": len(part), "updates": len(got)}
            if got:
                agg = self.aggregator.aggregate([u for u, _ in got], out=self.agg_buf)
                self.global_model += np.float32(cfg["server"]["lr"]) * agg
                n = sum(u.samples for u, _ in got)
                row["train_loss"] = float(sum(u.loss * u.samples for u, _ in got) / max(n, 1))
            per_dev = {}
            for d in part:
                dev = self.devices[d]
                dev["bytes_down"] += down[d]
                dev["msgs_down"] += 2
            for u, msg in got:
                dev = self.devices[u.device]
                up = HEADER_BYTES + msg.nbytes
                dev["bytes_up"] += up
                dev["msgs_up"] += 1
                dev["rounds"] += 1
                per_dev[str(u.device)] = {
                    "bytes_up": up,
                    "bytes_down": down[u.device],
                    "msgs_up": 1,
                    "msgs_down": 2,
                    "time_s": dev.get("last_time_s", 0.0),
                }
                self.t.release(msg)
            if r % cfg["run"]["eval_every"] == 0 or r == rounds:
                with torch.no_grad():
                    last_eval = evaluate(model, test, task_kind)
                row["test_loss"], row["test_accuracy"] = last_eval
            row["bytes_up"] = sum(v["bytes_up"] for v in per_dev.values())
            row["bytes_down"] = sum(down.values())
            row["msgs_up"] = len(got)
            row["msgs_down"] = 2 * len(part)
            row["wall_time_s"] = time.monotonic() - t0
            row["devices"] = per_dev
            metrics.append(row)
            progress.update(row)
            target = cfg["run"]["target_accuracy"]
            reached = target > 0 and row.get("test_accuracy", 0.0) >= target
            every = cfg["run"]["checkpoint_every"]
            stop_at = cfg["debug"]["stop_after_round"]
            if reached:
                self.stopped = f"target accuracy {target} reached at round {r}"
            elif stop_at and r == stop_at and r < rounds:
                self.stopped = f"debug.stop_after_round = {stop_at}"
            final = r == rounds or bool(self.stopped)
            if out is not None and ((every and r % every == 0) or final):
                self.checkpoint(r, metrics.rows, row["wall_time_s"])
            if self.stopped:
                break
        if progress.mode == "bar" and self.stopped:
            progress.close()
        wall = time.monotonic() - t0
        self.finish(metrics.rows, r, wall)
        return 0

    def checkpoint(self, round_: int, rows: list[dict], wall: float) -> Path:
        path = self.out_dir / "checkpoints" / checkpoint_name(round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = checkpoint_state(
            self.cfg, round_, self.task.flat, self.global_model, self.devices, rows, wall
        )
        save_checkpoint(path, state)
        return path

    def finish(self, rows: list[dict], rounds_done: int, wall: float) -> None:
        stats = self.t.stats
        info = {
            "rounds_done": rounds_done,
            "workers": len(self.workers),
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
        for w in self.workers:
            self.t.send(w, Kind.STOP, aux=(float(status),))
        self.t.wait_sends()


def _error_text(msg: Message) -> str:
    text = bytes(msg.payload).decode("utf-8", "replace") if msg.payload is not None else "?"
    return f"rank {msg.src}: {text}"


def _sha256(arr: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    import os

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = ["Coordinator", "WorkerFailed"]
