"""What a plugin may see and do: :class:`CoordinatorContext` and :class:`WorkerContext`.

A plugin half is handed one context when the runtime builds it (``self.ctx``) and reaches
the run only through it: never the coordinator or worker object. The members here are the
stable plugin API (docs/write-your-own-algorithm.md says what is stable): each is a
read-only view or a service with one documented effect. The runtime implements both
classes (:mod:`edgefl.runtime.contexts`); tests implement them with fakes
(``tests/algorithms/fakes.py``) so a plugin half can be unit-tested without MPI.

Units: sizes in samples, model sizes in float32 values, byte counts in bytes (headers
included), times in seconds of the run's clock (virtual or wall).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # (annotations only)
    from ..comm import Message

#: a message payload: a float32 (or integer key) vector
Payload = np.ndarray | None


class _Both(ABC):
    """Members both halves have: the config, the run directory, messages."""

    @property
    @abstractmethod
    def cfg(self) -> Mapping[str, Any]:
        """The run's effective config (every section; treat it as read-only)."""

    @property
    @abstractmethod
    def out_dir(self) -> Path | None:
        """The run directory (None: nothing is written, as in tests)."""

    @property
    @abstractmethod
    def numel(self) -> int:
        """Number of float32 values of the flat model vector."""

    @property
    @abstractmethod
    def flat(self) -> Any:
        """The :class:`~edgefl.models.flat.FlatParams` of this rank's CPU model: the flat
        layout (``offsets``, ``buffer_slice``, ``param_numel``). On a worker a task's own
        model and view are ``job.model`` and ``job.flat``; on rank 0 it is the global
        model's."""

    @abstractmethod
    def send(
        self,
        rank: int,
        kind: int,
        device: int = -1,
        round: int = 0,
        aux: tuple = (),
        payload: Payload = None,
    ) -> None:
        """Send one message (non-blocking; ``payload`` must not change until it left: pass
        a copy of anything you go on writing). ``kind`` is a plugin's registered kind."""

    @abstractmethod
    def release(self, msg: Message) -> None:
        """Give a received message's buffer back (after its payload was copied or used)."""

    @abstractmethod
    def plugin(self, name: str) -> Any | None:
        """This rank's half of plugin ``name`` (None when it is not on): for plugins that
        declare they cooperate. Prefer a context member where one exists."""


class CoordinatorContext(_Both):
    """Rank 0's view of the run, for a coordinator half."""

    # -- the model ------------------------------------------------------------------------
    @property
    @abstractmethod
    def version(self) -> int:
        """The global model's version (rounds applied so far)."""

    @property
    @abstractmethod
    def global_model(self) -> np.ndarray:
        """The global model, flat float32, read-only (a view: it follows every step)."""

    @abstractmethod
    def add_to_model(self, indices: np.ndarray, values: np.ndarray) -> None:
        """``global_model[indices] += values`` (float32): mass a plugin adds to the model
        in :meth:`~edgefl.algorithms.base.CoordinatorPlugin.after_apply` (GDDR's replay)."""

    @abstractmethod
    def test_loss(self, delta: np.ndarray | None = None) -> float:
        """Mean test loss (``train.loss``) of the global model, or of the global model with
        ``delta`` added (the model is unchanged afterwards)."""

    @property
    @abstractmethod
    def model(self) -> Any:
        """The torch module whose parameters are the global model (evaluate it; do not
        train or edit it)."""

    @property
    @abstractmethod
    def test_set(self) -> Any:
        """The test examples (a torch Dataset), from the run's start."""

    @property
    @abstractmethod
    def aggregator(self) -> Any:
        """The run's update aggregator (``algorithm.aggregation``), for a plugin that
        replaces the aggregation step (``aggregate``)."""

    @abstractmethod
    def update_weight(self, d: int) -> float:
        """The weight the consistency policy gives device ``d``'s updates."""

    # -- devices --------------------------------------------------------------------------
    @property
    @abstractmethod
    def devices(self) -> Mapping[int, Mapping[str, Any]]:
        """device -> its record: ``rank`` (hosting it now), ``samples`` and its counters
        (``rounds``, ``iterations``, ``requests``, ``bytes_up``, ``bytes_down``,
        ``msgs_up``, ``msgs_down``, ``time_s``). Read-only."""

    @abstractmethod
    def rank_of(self, d: int) -> int:
        """The worker rank hosting device ``d`` now (it changes when ``d`` is re-hosted)."""

    @property
    @abstractmethod
    def workers(self) -> list[int]:
        """The worker ranks (registered at the start; dead ones included)."""

    @property
    @abstractmethod
    def failed_ranks(self) -> set[int]:
        """Ranks found dead so far."""

    @property
    @abstractmethod
    def rank_info(self) -> Mapping[int, Mapping[str, Any]]:
        """rank -> its REGISTER fields (worker halves add theirs in ``on_register``)."""

    @property
    @abstractmethod
    def busy(self) -> Mapping[int, tuple[int, int, float]]:
        """Devices with a task out: device -> (task, model version it started from, start
        time in seconds)."""

    @abstractmethod
    def train_size(self, d: int) -> int:
        """Samples device ``d`` trains on (its samples less any hold-out)."""

    @abstractmethod
    def hold_out(self, fraction: float) -> None:
        """Every device holds out ``holdout_size(n, fraction)`` of its ``n`` samples
        (:mod:`edgefl.data.holdout`; the worker half's ``split`` holds out the same):
        :meth:`train_size` shrinks accordingly. One fraction per run: a second, different
        one raises ValueError."""

    @abstractmethod
    def memory_cap(self, d: int) -> int:
        """Most samples device ``d`` can process in one iteration, from its simulated
        profile (0: no cap)."""

    @abstractmethod
    def request_refresh(self, d: int) -> None:
        """Gated device ``d`` adopts the current global model before its next local
        iteration (its next TRAIN carries the model)."""

    @property
    @abstractmethod
    def control_messages(self) -> int:
        """TRAINs sent without a model so far (a gated device going on locally)."""

    @property
    @abstractmethod
    def resuming(self) -> bool:
        """Is this run continuing from a checkpoint?"""

    # -- messages and bookkeeping ---------------------------------------------------------
    @abstractmethod
    def reject(self, rank: int, why: str) -> None:
        """Log ``why`` against ``rank`` (a malformed or refused message): counted in the
        run's rejections, never a crash."""

    @abstractmethod
    def poll(self, timeout: float) -> list[Message]:
        """Messages that arrived within ``timeout`` seconds (for an exchange before the
        first task, in ``on_registered``). A worker's ERROR raises the runtime's
        worker-failure error."""

    @abstractmethod
    def wait_for(self, key: tuple[int, int]) -> Message:
        """Block until the update of ``(device, task)`` arrives (e.g. after asking for a
        resend) and return it."""

    @abstractmethod
    def send_model_to(self, rank: int) -> None:
        """Send worker ``rank`` the current global model (through the ``send_model``
        chain, as a task's download) unless it already holds this version; for an
        exchange after training (``on_end``)."""

    @abstractmethod
    def book_up(self, d: int, nbytes: int) -> None:
        """Count one message of ``nbytes`` bytes (header included) sent up by ``d``."""

    @abstractmethod
    def log_event(self, event: str, now: float, device: int, task: int) -> None:
        """One line of events.jsonl (when ``sim.event_log`` is on)."""


class WorkerContext(_Both):
    """A worker rank's view, for a worker half."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This worker's MPI rank."""

    @property
    @abstractmethod
    def devices(self) -> list[int]:
        """The devices this rank hosts now (re-hosting adds to it)."""

    @property
    @abstractmethod
    def task_kind(self) -> str:
        """The data's task (``"classification"``, ``"regression"``, ...)."""

    @property
    @abstractmethod
    def loss(self) -> Callable | None:
        """The run's loss function (``train.loss``; None: the task's default)."""

    @abstractmethod
    def make_optimizer(self, params: list, lr: float) -> Any:
        """A local optimizer over ``params`` as ``train.optimizer`` says."""

    @abstractmethod
    def train_set(self, d: int) -> Any:
        """Device ``d``'s training examples (all of them: before any hold-out)."""

    @abstractmethod
    def num_samples(self, d: int) -> int:
        """Number of samples of device ``d``."""

    @abstractmethod
    def hold_out(self, fraction: float) -> None:
        """Hold ``fraction`` of every device's samples out of training (call it when the
        half is built; rank 0's half calls :meth:`CoordinatorContext.hold_out` with the
        same fraction). The one split rule (:func:`~edgefl.data.holdout.holdout_split`);
        a second, different fraction raises ValueError."""

    @abstractmethod
    def split(self, d: int) -> tuple[Any, Any] | None:
        """(training split, held-out split) of ``d``; None when no plugin holds data out.
        A device with a single sample trains and measures on that sample."""

    @abstractmethod
    def queued_versions(self) -> set[int]:
        """Model versions that tasks waiting on this rank start from."""

    @abstractmethod
    def global_model(self, version: int, d: int) -> Any:
        """Device ``d``'s torch module holding global model ``version`` (one this rank
        received), on the device's torch device; the next task loads its own start
        again. Raises KeyError for a version this rank does not hold."""

    @abstractmethod
    def install_model(self, version: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Model version ``version`` is the newest one held (zeros if none) with
        ``values`` at ``keys`` (a plugin that sends partial models)."""


__all__ = ["CoordinatorContext", "Payload", "WorkerContext"]
