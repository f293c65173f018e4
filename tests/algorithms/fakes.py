"""Fake plugin contexts: a plugin half unit-tested alone, without MPI or a run.

:class:`FakeCoordinatorContext` and :class:`FakeWorkerContext` implement the contexts of
:mod:`edgefl.algorithms.context` over plain data a test sets up (a config, a flat model,
devices with their sample counts) and record what the half did: ``sent`` (every message,
as a :class:`Sent`), ``rejected`` ((rank, reason) pairs), ``booked`` ((device, bytes)),
``events``, ``refreshed``. ``inbox`` holds the messages :meth:`poll` and :meth:`wait_for`
hand out. Nothing here knows a plugin: a half sees only what its context says.

:func:`upload` and :func:`flush_upload` run a worker half's ``encode`` on the
:class:`~edgefl.algorithms.base.Upload` the worker core builds (a task's update, the end's
flush), and :func:`received` is the message rank 0 gets for an encoded one (what the core
sends), so a test can hand it to the coordinator half's ``decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from edgefl.algorithms.base import LocalJob, Upload
from edgefl.algorithms.context import CoordinatorContext, Payload, WorkerContext
from edgefl.comm import Message
from edgefl.config import load_config
from edgefl.data.holdout import holdout_size, holdout_split


@dataclass
class Sent:
    """One message a half sent."""

    rank: int
    kind: int
    device: int
    round: int
    aux: tuple
    payload: Any


def message(kind: int, src: int = 1, device: int = -1, round: int = 0, aux: tuple = (),
            payload: Payload = None) -> Message:  # fmt: skip
    """A received message as the transport hands it to a half."""
    return Message(kind=kind, src=src, device=device, round=round, aux=tuple(aux),
                   payload=payload)  # fmt: skip


def upload(half: Any, job: LocalJob, delta: np.ndarray) -> Upload:
    """A task's update through ``half.encode`` as the worker core builds it (device, task and
    aux of ``job``; ``delta`` is edited in place); the Upload after the hook."""
    up = Upload(job.device, job.task, delta, job.aux)
    half.encode(up, job)
    return up


def flush_upload(half: Any, d: int, task: int) -> Upload:
    """The end of training of device ``d`` through ``half.encode`` as the worker core builds
    it: all-zero delta, aux (samples, 0, 0, 0), no job; the Upload after the hook
    (``up.by == ""``: the half holds nothing back)."""
    ctx = half.ctx
    aux = (float(ctx.num_samples(d)), 0.0, 0.0, 0.0)
    up = Upload(d, task, np.zeros(ctx.numel, np.float32), aux, flush=True)
    half.encode(up, None)
    return up


def received(up: Upload, src: int = 1) -> Message:
    """The message rank 0 receives for an encoded Upload (the core sends ``up.kind`` with
    device, round = task, aux and payload), with a copy of the payload."""
    assert up.by, "nothing encoded the upload"
    return message(up.kind, src=src, device=up.device, round=up.task, aux=up.aux,
                   payload=np.array(up.payload, copy=True))  # fmt: skip


def config(doc: dict | None = None, *sets: str) -> dict:
    """The effective config: the defaults, ``doc`` (a nested dict, as a TOML file holds)
    and ``--set`` style overrides (``"algorithm.hermes.enabled=true"``)."""
    return load_config(doc=doc or {}, overrides=list(sets))


@dataclass
class _Common:
    cfg_: dict
    numel_: int
    out_dir_: Path | None = None
    flat_: Any = None
    plugins: dict = field(default_factory=dict)
    sent: list = field(default_factory=list)
    released: list = field(default_factory=list)

    @property
    def cfg(self) -> Mapping[str, Any]:
        return self.cfg_

    @property
    def out_dir(self) -> Path | None:
        return self.out_dir_

    @property
    def numel(self) -> int:
        return self.numel_

    @property
    def flat(self) -> Any:
        return self.flat_

    def send(self, rank: int, kind: int, device: int = -1, round: int = 0, aux: tuple = (),
             payload: Payload = None) -> None:  # fmt: skip
        p = None if payload is None else np.array(payload, copy=True)
        self.sent.append(Sent(rank, int(kind), device, round, tuple(aux), p))

    def release(self, msg: Message) -> None:
        self.released.append(msg)

    def plugin(self, name: str) -> Any | None:
        return self.plugins.get(name)

    def sent_kinds(self) -> list[int]:
        """The kinds sent so far, in order."""
        return [s.kind for s in self.sent]


class FakeCoordinatorContext(_Common, CoordinatorContext):
    """Rank 0's context over a flat model and a device table.

    Args:
        cfg: the effective config (:func:`config`).
        samples: device -> its number of samples; device ``d`` lives on rank
            ``1 + d % n_workers``.
        n_workers: number of worker ranks.
        model: the global model (float32; zeros of ``numel`` if None).
        numel: its length when ``model`` is None.
        test_loss_fn: what :meth:`test_loss` returns for a model vector (default: its
            squared norm, so a test can tell which model was evaluated).
    """

    def __init__(self, cfg: dict, samples: Mapping[int, int], n_workers: int = 2,
                 model: np.ndarray | None = None, numel: int = 8,
                 test_loss_fn: Callable[[np.ndarray], float] | None = None,
                 out_dir: Path | None = None) -> None:  # fmt: skip
        g = np.zeros(numel, np.float32) if model is None else np.asarray(model, np.float32)
        _Common.__init__(self, cfg_=cfg, numel_=int(g.size), out_dir_=out_dir)
        self.model_vec = g.copy()
        self.version_ = 0
        self.workers_ = list(range(1, n_workers + 1))
        self.devices_ = {
            d: {"rank": 1 + d % n_workers, "samples": int(n), "rounds": 0, "bytes_up": 0}
            for d, n in samples.items()
        }
        self.n_train = {d: int(n) for d, n in samples.items()}
        self.failed: set[int] = set()
        self.rank_info_: dict = {r: {} for r in self.workers_}
        self.inflight: dict = {}
        self.caps: dict = {}
        self.weights: dict = {}
        self.resuming_ = False
        self.control = 0
        self.holdout: float | None = None
        self.refreshed: list[int] = []
        self.models_sent: list[int] = []
        self.rejected: list[tuple[int, str]] = []
        self.booked: list[tuple[int, int]] = []
        self.events: list[tuple] = []
        self.inbox: list[Message] = []
        self.test_loss_fn = test_loss_fn or (lambda v: float(np.dot(v, v)))
        self.model_ = None
        self.test_set_ = None
        self.aggregator_ = None

    # the model
    @property
    def version(self) -> int:
        return self.version_

    @property
    def global_model(self) -> np.ndarray:
        v = self.model_vec.view()
        v.flags.writeable = False
        return v

    def add_to_model(self, indices: np.ndarray, values: np.ndarray) -> None:
        self.model_vec[indices] += values

    def test_loss(self, delta: np.ndarray | None = None) -> float:
        v = self.model_vec if delta is None else self.model_vec + delta
        return float(self.test_loss_fn(v))

    @property
    def model(self) -> Any:
        return self.model_

    @property
    def test_set(self) -> Any:
        return self.test_set_

    @property
    def aggregator(self) -> Any:
        return self.aggregator_

    def update_weight(self, d: int) -> float:
        return float(self.weights.get(d, 1.0))

    # devices
    @property
    def devices(self) -> Mapping[int, Mapping[str, Any]]:
        return MappingProxyType(self.devices_)

    def rank_of(self, d: int) -> int:
        return int(self.devices_[d]["rank"])

    @property
    def workers(self) -> list[int]:
        return list(self.workers_)

    @property
    def failed_ranks(self) -> set[int]:
        return set(self.failed)

    @property
    def rank_info(self) -> Mapping[int, Mapping[str, Any]]:
        return MappingProxyType(self.rank_info_)

    @property
    def busy(self) -> Mapping[int, tuple[int, int, float]]:
        return MappingProxyType(self.inflight)

    def train_size(self, d: int) -> int:
        return self.n_train[d]

    def hold_out(self, fraction: float) -> None:
        if self.holdout is not None and self.holdout != fraction:
            raise ValueError(f"two hold-out fractions ({self.holdout} and {fraction})")
        self.holdout = fraction
        for d, v in self.devices_.items():
            self.n_train[d] = v["samples"] - holdout_size(v["samples"], fraction)

    def memory_cap(self, d: int) -> int:
        return int(self.caps.get(d, 0))

    def request_refresh(self, d: int) -> None:
        self.refreshed.append(d)

    def send_model_to(self, rank: int) -> None:
        self.models_sent.append(rank)

    @property
    def control_messages(self) -> int:
        return self.control

    @property
    def resuming(self) -> bool:
        return self.resuming_

    # messages and bookkeeping
    def reject(self, rank: int, why: str) -> None:
        self.rejected.append((rank, why))

    def poll(self, timeout: float) -> list[Message]:
        out, self.inbox = self.inbox, []
        return out

    def wait_for(self, key: tuple[int, int]) -> Message:
        for i, m in enumerate(self.inbox):
            if (m.device, m.round) == key:
                return self.inbox.pop(i)
        raise AssertionError(f"the test queued no message for {key}")

    def book_up(self, d: int, nbytes: int) -> None:
        self.booked.append((d, int(nbytes)))

    def log_event(self, event: str, now: float, device: int, task: int) -> None:
        self.events.append((event, now, device, task))

    # test helpers
    def step(self, delta: np.ndarray) -> None:
        """Apply ``delta`` to the global model and count a version (as the core does)."""
        self.model_vec += np.asarray(delta, np.float32)
        self.version_ += 1


class FakeWorkerContext(_Common, WorkerContext):
    """A worker rank's context over per-device datasets.

    Args:
        cfg: the effective config (:func:`config`).
        data: device -> its training examples (a torch Dataset, e.g. a TensorDataset).
        numel: the flat model's length (or take it from ``flat``).
        rank: this rank.
        task_kind: the data's task.
    """

    def __init__(self, cfg: dict, data: Mapping[int, Any], numel: int = 8, rank: int = 1,
                 task_kind: str = "classification", flat: Any = None,
                 out_dir: Path | None = None) -> None:  # fmt: skip
        n = int(flat.numel) if flat is not None else numel
        _Common.__init__(self, cfg_=cfg, numel_=n, out_dir_=out_dir, flat_=flat)
        self.rank_ = rank
        self.data = dict(data)
        self.task_kind_ = task_kind
        self.splits: dict = {}
        self.holdout: float | None = None
        self.queued: set[int] = set()
        self.versions: dict[int, np.ndarray] = {}
        self.modules: dict[int, Any] = {}  # device -> its torch module (for global_model)

    @property
    def rank(self) -> int:
        return self.rank_

    @property
    def devices(self) -> list[int]:
        return sorted(self.data)

    @property
    def task_kind(self) -> str:
        return self.task_kind_

    @property
    def loss(self) -> Callable | None:
        return None

    def make_optimizer(self, params: list, lr: float) -> Any:
        return torch.optim.SGD(params, lr=lr)

    def train_set(self, d: int) -> Any:
        return self.data[d]

    def num_samples(self, d: int) -> int:
        return len(self.data[d])

    def hold_out(self, fraction: float) -> None:
        if self.holdout is not None and self.holdout != fraction:
            raise ValueError(f"two hold-out fractions ({self.holdout} and {fraction})")
        self.holdout = fraction

    def split(self, d: int) -> tuple[Any, Any] | None:
        if d not in self.splits and self.holdout is not None:
            ds = self.data[d]
            self.splits[d] = (
                (ds, ds) if len(ds) < 2 else holdout_split(ds, self.holdout, self.cfg["seed"], d)
            )
        return self.splits.get(d)

    def queued_versions(self) -> set[int]:
        return set(self.queued)

    def global_model(self, version: int, d: int) -> Any:
        """``modules[d]`` holding ``versions[version]`` (set both in the test)."""
        import torch

        if version not in self.versions:
            raise KeyError(version)
        module = self.modules[d]
        flat = torch.as_tensor(np.asarray(self.versions[version], np.float32))
        torch.nn.utils.vector_to_parameters(flat, module.parameters())
        return module

    def install_model(self, version: int, keys: np.ndarray, values: np.ndarray) -> None:
        base = self.versions[max(self.versions)] if self.versions else None
        buf = np.zeros(self.numel, np.float32) if base is None else base.copy()
        buf[keys] = values
        self.versions[version] = buf


__all__ = [
    "FakeCoordinatorContext",
    "FakeWorkerContext",
    "Sent",
    "config",
    "flush_upload",
    "message",
    "received",
    "upload",
]
