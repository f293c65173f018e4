"""The runtime's side of the plugin contexts: :class:`CoordinatorContext` and
:class:`WorkerContext` (:mod:`edgefl.algorithms.context`) bound to rank 0's
:class:`~edgefl.runtime.coordinator.Coordinator` or a :class:`~edgefl.runtime.worker.Worker`.

Every member is a thin, documented view or service; plugins never hold the core itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..algorithms.context import CoordinatorContext, Payload, WorkerContext
from ..comm import Kind, Message
from ..data.holdout import holdout_size
from .events import WorkerFailed, error_text

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator
    from .worker import Worker


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class RuntimeCoordinatorContext(CoordinatorContext):
    """Rank 0's context (one per job, shared by the coordinator halves)."""

    def __init__(self, core: Coordinator) -> None:
        self._core = core
        self._holdout: float | None = None

    # -- both halves ------------------------------------------------------------------------
    @property
    def cfg(self) -> Mapping[str, Any]:
        return self._core.cfg

    @property
    def out_dir(self) -> Path | None:
        return self._core.out_dir

    @property
    def numel(self) -> int:
        return int(self._core.global_model.size)

    @property
    def flat(self) -> Any:
        return self._core.task.flat

    def send(self, rank: int, kind: int, device: int = -1, round: int = 0, aux: tuple = (),
             payload: Payload = None) -> None:  # fmt: skip
        self._core.t.send(rank, kind, device=device, round=round, aux=aux, payload=payload)

    def release(self, msg: Message) -> None:
        self._core.t.release(msg)

    def plugin(self, name: str) -> Any | None:
        return self._core.plugin(name)

    # -- the model --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._core.version

    @property
    def global_model(self) -> np.ndarray:
        return _read_only(self._core.global_model)

    def add_to_model(self, indices: np.ndarray, values: np.ndarray) -> None:
        self._core.global_model[indices] += values

    def test_loss(self, delta: np.ndarray | None = None) -> float:
        from ..models.train import evaluate

        core = self._core
        g = core.global_model
        keep = None
        if delta is not None:
            keep = g.copy()
            g += delta
        try:
            with torch.no_grad():
                return evaluate(
                    core.task.model, core.test_set, core.task.data.info.task, loss=core.loss
                )[0]
        finally:
            if keep is not None:
                g[:] = keep

    @property
    def model(self) -> Any:
        return self._core.task.model

    @property
    def test_set(self) -> Any:
        return self._core.test_set

    @property
    def aggregator(self) -> Any:
        return self._core.aggregator

    def update_weight(self, d: int) -> float:
        return self._core.policy.weight(d)

    # -- devices ----------------------------------------------------------------------------
    @property
    def devices(self) -> Mapping[int, Mapping[str, Any]]:
        return MappingProxyType(self._core.devices)

    def rank_of(self, d: int) -> int:
        return int(self._core.devices[d]["rank"])

    @property
    def workers(self) -> list[int]:
        return list(self._core.workers)

    @property
    def failed_ranks(self) -> set[int]:
        return set(self._core.t.failed)

    @property
    def rank_info(self) -> Mapping[int, Mapping[str, Any]]:
        return MappingProxyType(self._core.rank_info)

    @property
    def busy(self) -> Mapping[int, tuple[int, int, float]]:
        return MappingProxyType(self._core.inflight)

    def train_size(self, d: int) -> int:
        return self._core.n_train[d]

    def hold_out(self, fraction: float) -> None:
        if self._holdout is not None and self._holdout != fraction:
            raise ValueError(f"two hold-out fractions in one run ({self._holdout} and {fraction})")
        self._holdout = fraction
        core = self._core
        for d, v in core.devices.items():
            core.n_train[d] = v["samples"] - holdout_size(v["samples"], fraction)

    def memory_cap(self, d: int) -> int:
        p = self._core.profiles
        return int(p[d].mem_cap) if p is not None else 0

    def request_refresh(self, d: int) -> None:
        self._core.refresh[d] = True

    @property
    def control_messages(self) -> int:
        return int(self._core.control_msgs)

    @property
    def resuming(self) -> bool:
        return self._core.resume is not None

    # -- messages and bookkeeping -----------------------------------------------------------
    def reject(self, rank: int, why: str) -> None:
        self._core.t.reject(rank, why)

    def poll(self, timeout: float) -> list[Message]:
        msgs = self._core.t.poll(timeout=timeout)
        for msg in msgs:
            if msg.kind == Kind.ERROR:
                raise WorkerFailed(error_text(msg))
        return msgs

    def wait_for(self, key: tuple[int, int]) -> Message:
        return self._core.wait_for(key)

    def send_model_to(self, rank: int) -> None:
        self._core.model_to_rank(rank, wait=True)

    def book_up(self, d: int, nbytes: int) -> None:
        self._core.book_up(d, nbytes)

    def log_event(self, event: str, now: float, device: int, task: int) -> None:
        self._core.log_event(event, now, device, task)


class RuntimeWorkerContext(WorkerContext):
    """A worker rank's context (one per rank, shared by its worker halves)."""

    def __init__(self, worker: Worker) -> None:
        self._w = worker

    @property
    def cfg(self) -> Mapping[str, Any]:
        return self._w.cfg

    @property
    def out_dir(self) -> Path | None:
        out = self._w.out_dir
        return Path(out) if out else None

    @property
    def numel(self) -> int:
        return int(self._w.task.flat.numel)

    def send(self, rank: int, kind: int, device: int = -1, round: int = 0, aux: tuple = (),
             payload: Payload = None) -> None:  # fmt: skip
        self._w.t.send(rank, kind, device=device, round=round, aux=aux, payload=payload)

    def release(self, msg: Message) -> None:
        self._w.t.release(msg)

    def plugin(self, name: str) -> Any | None:
        return next((p for p in self._w.plugins if p.name == name), None)

    @property
    def rank(self) -> int:
        return self._w.rank

    @property
    def devices(self) -> list[int]:
        return list(self._w.devices)

    @property
    def flat(self) -> Any:
        return self._w.task.flat

    @property
    def task_kind(self) -> str:
        return self._w.data.info.task

    @property
    def loss(self) -> Callable | None:
        return self._w.loss

    def make_optimizer(self, params: list, lr: float) -> Any:
        return self._w.make_optimizer(params, lr)

    def train_set(self, d: int) -> Any:
        return self._w.data.train(d)

    def num_samples(self, d: int) -> int:
        return int(self._w.data.num_samples(d))

    def hold_out(self, fraction: float) -> None:
        self._w.hold_out(fraction)

    def split(self, d: int) -> tuple[Any, Any] | None:
        return self._w.split(d)

    def queued_versions(self) -> set[int]:
        return {q[2] for q in self._w.queue}

    def global_model(self, version: int, d: int) -> Any:
        w = self._w
        model, flat = w.model_on(w.torch_dev[d])
        flat.from_host(w.versions[version])
        return model

    def install_model(self, version: int, keys: np.ndarray, values: np.ndarray) -> None:
        w = self._w
        buf = w.buffer()
        if w.versions:
            np.copyto(buf, w.versions[max(w.versions)])
        else:
            buf.fill(0.0)
        buf[keys] = values
        w.versions[version] = buf


__all__ = ["RuntimeCoordinatorContext", "RuntimeWorkerContext"]
