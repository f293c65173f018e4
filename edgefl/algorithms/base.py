"""The plugin protocol: what an algorithm hooks into the runtime core.

An algorithm is a :class:`Plugin`: a name, a config check, and up to two halves that the
runtime instantiates on the ranks where they run:

- :class:`CoordinatorPlugin` on rank 0 (one instance per job),
- :class:`WorkerPlugin` on every worker rank (one instance per rank; per-device state is
  keyed by device id).

The core calls the hooks at fixed points of its loops. Every hook has a do-nothing
default, so a plugin overrides only what it needs. :mod:`edgefl.algorithms.hooks` lists
them all with their dispatch mode (``all``: a notification to every plugin; ``chain``;
``first``: the first answer wins; ``owner``: a decision only one plugin of a job may
override, checked at load time; ``kind``: the owner of a message kind; ``own``: per
plugin). Where the mode runs several plugins, they run in plugin order: by
:attr:`Plugin.order`, then as listed (the built-ins before ``algorithm.plugins``); where
they are listed in :data:`edgefl.algorithms.BUILTIN` does not matter. A half reaches the
run only through its context, ``self.ctx``
(:class:`~edgefl.algorithms.context.CoordinatorContext` or
:class:`~edgefl.algorithms.context.WorkerContext`): never the coordinator or worker object,
and never the transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..comm.taskflags import CONTINUE, FLUSH, REFRESH
from .context import CoordinatorContext, WorkerContext

if TYPE_CHECKING:  # (annotations only)
    from ..comm import Message
    from ..policies.consistency import Apply, Arrival


@dataclass
class TaskSpec:
    """What a TRAIN tells a worker about one task (aux of the message).

    Args:
        samples: training samples to use (0 = the device's whole training split).
        batch: mini-batch size (0 = ``train.batch_size``).
        flags: the runtime's task flags (:mod:`edgefl.comm.taskflags`; read them through
            :attr:`continues`, :attr:`refreshes` and :attr:`flushes`).
        arg: a small non-negative integer a plugin passes to its worker half (0 = none;
            below 2**23). Only one plugin of a job may use it (GDDR's tau does).
    """

    samples: int = 0
    batch: int = 0
    flags: int = 0
    arg: int = 0

    @property
    def continues(self) -> bool:
        """A gated device goes on from its own local model (no model download)."""
        return bool(self.flags & CONTINUE)

    @property
    def refreshes(self) -> bool:
        """With :attr:`continues`: the device first adopts the current global model."""
        return bool(self.flags & REFRESH)

    @property
    def flushes(self) -> bool:
        """The end of training: the device sends what it still holds back."""
        return bool(self.flags & FLUSH)


@dataclass
class LocalJob:
    """One task as a worker trains it (handed to the worker hooks).

    Args:
        device: device id.
        task: the device's task number (seeds its random streams).
        version: model version the task starts from.
        spec: the TRAIN's :class:`TaskSpec`.
        model: the torch module to train (parameters already set to the start model).
        dataset: the device's training examples for this task.
        torch_device: e.g. ``"cpu"`` or ``"cuda:0"``.
        start: the start model (flat float32, read-only).
        ctx: plugin data for later hooks of the same task.
        fit_task: the :class:`edgefl.training.FitTask` handed to the client hook.
        fit_ctx: the :class:`edgefl.training.FitContext` handed to the client hook
            (plugins add loss penalties and gradient hooks to it in ``before_train``).
        metrics: the client's metrics of the task (by name), once trained.
        flat: ``model``'s :class:`~edgefl.models.flat.FlatParams` view (offsets, buffers).
        new_model: the task starts from a global model: always without a gate; with a
            gate (Hermes) when the device adopted a new global model for it (its first
            task after a push, or a REFRESH), not when it goes on from its own.
        holdout_loss: the trained model's mean loss on the device's held-out split when
            the worker measured it already (a stack of gated devices measures all of them
            at once, within float32 rounding of ``evaluate``); None: a gate evaluates
            ``model`` itself.
    """

    device: int
    task: int
    version: int
    spec: TaskSpec
    model: Any = None
    dataset: Any = None
    torch_device: str = "cpu"
    start: np.ndarray | None = None
    aux: tuple = ()
    ctx: dict = field(default_factory=dict)
    fit_task: Any = None
    fit_ctx: Any = None
    metrics: dict = field(default_factory=dict)
    flat: Any = None
    new_model: bool = False
    holdout_loss: float | None = None


@dataclass
class Upload:
    """One task's update on its way out of a worker, through the worker plugins'
    :meth:`WorkerPlugin.encode` chain (the worker side of the update pipeline; rank 0's
    side is ``decode`` by the message kind's owner, then the ``transform`` chain).

    A plugin either edits ``delta`` in place (a dense transform: FedBN zeroes its buffers)
    or encodes the update (:meth:`encode`: a kind, a payload and an aux of its own; GDDR's
    residual, the parameter server's sparse push, SCAFFOLD's control variate). At most one
    plugin encodes an upload; the core then sends the one message, else the dense
    ``delta`` as an UPDATE.

    Args:
        device: device id.
        task: the task the update answers (its TRAIN's task number).
        delta: the dense model change (float32, ``numel`` values; the core's buffer: edit
            it in place, do not keep it; an encoded payload may be ``delta`` itself or a
            view of it: the core keeps the buffer until the message left).
        aux: the UPDATE's aux: (training samples, loss, seconds, local iterations).
        flush: the end of training (a FLUSH task): ``delta`` is all zeros and the plugin
            that holds mass back (a residual, a filter) encodes what it holds.
    """

    device: int
    task: int
    delta: np.ndarray
    aux: tuple
    flush: bool = False
    kind: int | None = None  # (kind, payload, by: set by encode)
    payload: np.ndarray | None = None
    by: str = ""

    def encode(self, by: str, kind: int, payload: np.ndarray, aux: tuple | None = None) -> None:
        """Send ``payload`` as a message of ``kind`` (a kind ``by``'s plugin registered, or
        UPDATE) instead of the dense delta; ``aux`` replaces the UPDATE's aux. Raises
        RuntimeError when another plugin already encoded this upload (two encoders of one
        update would silently drop one)."""
        if self.by:
            raise RuntimeError(
                f"device {self.device} task {self.task}: plugins '{self.by}' and '{by}' "
                "both encode the update (one plugin encodes an update)"
            )
        self.by, self.kind, self.payload = by, int(kind), payload
        if aux is not None:
            self.aux = tuple(aux)


@dataclass
class Download:
    """The model on its way to a worker rank, through the rank-0 plugins'
    :meth:`CoordinatorPlugin.send_model` chain: a plugin sends what must precede the model
    (SCAFFOLD's control variate) with ``ctx.send``, or sends the model in a form of its own
    (:meth:`encode`: the parameter server's working-set values). At most one plugin encodes
    a download; the core then sends that message, else the whole model (MODEL).

    Args:
        rank: the worker rank.
        version: the model version sent.
    """

    rank: int
    version: int
    kind: int | None = None  # (kind, payload, aux, by: set by encode)
    payload: np.ndarray | None = None
    aux: tuple = ()
    by: str = ""

    def encode(self, by: str, kind: int, payload: np.ndarray, aux: tuple = ()) -> None:
        """Send ``payload`` as a message of ``kind`` instead of the whole model. Raises
        RuntimeError when another plugin already encoded this download."""
        if self.by:
            raise RuntimeError(
                f"model to rank {self.rank}: plugins '{self.by}' and '{by}' both encode it "
                "(one plugin encodes a download)"
            )
        self.by, self.kind, self.payload, self.aux = by, int(kind), payload, tuple(aux)


class CoordinatorPlugin:
    """Rank-0 half of an algorithm; ``self.ctx`` is its :class:`CoordinatorContext`. The
    hooks are documented in the module docstring."""

    update_kinds: ClassVar[tuple[int, ...]] = ()  # update kinds this half decodes
    message_kinds: ClassVar[tuple[int, ...]] = ()  # other upward kinds it handles
    #: an all-zero end-of-training flush still makes a model version (see flush_devices)
    flush_always_applies: ClassVar[bool] = False

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        self.ctx = ctx
        self.name = name

    def on_registered(self) -> None: ...

    def on_start(self) -> None: ...

    def shape_task(self, d: int, spec: TaskSpec) -> None: ...

    def send_model(self, down: Download) -> None: ...

    def down_bytes(self, d: int) -> int | None:
        return None

    def on_message(self, msg: Message) -> None: ...

    def decode(self, d: int, task: int, msg: Message) -> tuple[np.ndarray | None, str, Message]:
        return msg.payload, "", msg

    def on_iteration(self, d: int, seconds: float) -> None: ...

    def transform(self, ap: Apply) -> Apply:
        return ap

    def aggregate(self, ap: Apply) -> np.ndarray | None:
        return None

    def after_apply(self, ap: Apply, now: float) -> None: ...

    def on_device_dead(self, d: int, now: float) -> None: ...

    def on_device_moved(self, d: int, rank: int, now: float, state: dict) -> None: ...

    def flush_devices(self) -> list[int]:
        return []

    def on_flushed(self, d: int, arrival: Arrival) -> None: ...

    def summary(self) -> dict | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...

    def on_row(self, row: dict) -> None: ...

    def on_end(self) -> None:
        """Training is over (the last version made, held-back updates flushed), the
        workers not yet stopped: a last exchange with them (``ctx.send_model_to``,
        ``ctx.send``, ``ctx.poll``), e.g. evaluating the final model. Not called when
        the run was interrupted, diverged or failed."""


class WorkerPlugin:
    """Worker-rank half of an algorithm; ``self.ctx`` is its :class:`WorkerContext`. The
    hooks are documented in the module docstring."""

    message_kinds: ClassVar[tuple[int, ...]] = ()  # downward kinds this half handles
    #: a half that overrides a training hook (``before_train``, ``train``, ``after_train``,
    #: ``gate``) and still lets its devices train in a stacked group (``train.vectorize =
    #: "auto"``: one computation for many devices, no per-device model object during the
    #: steps) says so here; otherwise such a half keeps its rank on the one-by-one path.
    #: A stackable half adds gradient terms only as :mod:`edgefl.training.gradterms`
    #: objects (the stacked step adds them per device) and no loss penalties; the float
    #: buffers its ``before_train`` writes into ``job.model`` are the ones the device's
    #: stack starts from, and its ``after_train`` finds the device's trained parameters
    #: and buffers in ``job.model``, as one by one.
    stackable: ClassVar[bool] = False
    #: one line for the support table (docs/performance.md): how its training hooks take
    #: part in stacked training, or why they keep a rank off it
    stack_note: ClassVar[str] = ""

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        self.ctx = ctx
        self.name = name

    def on_register(self, info: dict) -> None: ...

    def on_message(self, msg: Message) -> None: ...

    def gate(self, d: int, job: LocalJob, holdout: Any, iterations: int) -> tuple | None:
        return None

    def before_train(self, d: int, job: LocalJob) -> None: ...

    def train(self, d: int, job: LocalJob) -> float | None:
        return None

    def after_train(self, d: int, job: LocalJob) -> None: ...

    def encode(self, up: Upload, job: LocalJob | None) -> None: ...

    def device_state(self, d: int) -> dict:
        return {}

    def load_device_state(self, d: int, state: dict) -> None: ...


def _show(value: Any) -> str:
    """A config value as an error message shows it (TOML booleans, Python repr else)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _same(a: Any, b: Any) -> bool:
    """Config equality that keeps booleans apart from numbers (``False != 0`` here)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


@dataclass(frozen=True)
class Values:
    """A set of values of one config key, as data (what a :class:`Requirement` allows, or
    the values of its trigger key that make it apply). Build it with :func:`one_of`,
    :func:`not_one_of`, :func:`above` or :func:`has`.

    Args:
        op: ``"in"`` (one of ``items``), ``"not in"`` (none of them), ``">"`` (a number above
            ``items[0]``) or ``"has"`` (a list that contains ``items[0]``).
        items: the values the operator compares with.
    """

    op: str
    items: tuple = ()

    def __contains__(self, value: Any) -> bool:
        if self.op == "in":
            return any(_same(value, x) for x in self.items)
        if self.op == "not in":
            return not any(_same(value, x) for x in self.items)
        if self.op == ">":
            num = isinstance(value, (int, float)) and not isinstance(value, bool)
            return num and value > self.items[0]
        if self.op == "has":
            return isinstance(value, (list, tuple)) and self.items[0] in value
        raise ValueError(f"unknown Values operator {self.op!r}")

    def say(self) -> str:
        """The set as a message writes it after the key: ``= 'bsp'``, ``in ('a', 'b')``,
        ``!= 'none'``, ``> 0``, ``containing 'kkt'``."""
        shown = [_show(x) for x in self.items]
        if self.op in ("in", "not in") and len(shown) == 1:
            return ("= " if self.op == "in" else "!= ") + shown[0]
        if self.op in ("in", "not in"):
            return f"{self.op} ({', '.join(shown)})"
        if self.op == ">":
            return f"> {shown[0]}"
        return f"containing {shown[0]}"


def one_of(*values: Any) -> Values:
    """The listed values."""
    return Values("in", values)


def not_one_of(*values: Any) -> Values:
    """Every value but the listed ones."""
    return Values("not in", values)


def above(x: float) -> Values:
    """Numbers greater than ``x``."""
    return Values(">", (x,))


def has(item: Any) -> Values:
    """Lists that contain ``item``."""
    return Values("has", (item,))


def config_value(cfg: dict, key: str) -> Any:
    """The value of dotted config key ``key`` (None when the config has no such key)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class Requirement:
    """What one setting needs of another key, declared as data (:attr:`Plugin.requires`).

    While config key ``when`` takes a value in ``active``, key ``key`` must take a value in
    ``allowed``, ``because`` (one clause: the reason, e.g. what the mathematics or the
    message protocol needs). :func:`edgefl.algorithms.check_requirements` checks every
    declared requirement before any rank starts and raises the one-line error
    :meth:`error` names both keys in.

    Example (example ordering needs synchronous rounds)::

        Requirement("algorithm.ordering", not_one_of("none"), "algorithm.consistency",
                    one_of("bsp"), "a device trains one epoch per round in the order ...")
    """

    when: str
    active: Values
    key: str
    allowed: Values
    because: str

    def applies(self, cfg: dict) -> bool:
        """Does the trigger key take an ``active`` value in ``cfg``?"""
        return config_value(cfg, self.when) in self.active

    def holds(self, cfg: dict) -> bool:
        """Is the requirement met (or does it not apply)?"""
        return not self.applies(cfg) or config_value(cfg, self.key) in self.allowed

    def error(self, cfg: dict) -> str:
        """The one-line message of a failed requirement, e.g. ``config key 'ps.servers' = 2:
        needs algorithm.consistency = 'bsp' (got algorithm.consistency = 'asp') because
        ...``."""
        w, v = config_value(cfg, self.when), config_value(cfg, self.key)
        return (
            f"config key '{self.when}' = {_show(w)}: needs {self.key} {self.allowed.say()} "
            f"(got {self.key} = {_show(v)}) because {self.because}"
        )


class Plugin:
    """An algorithm: its name, when it is on, its config check and its two halves.

    Subclass it (``name``, ``coordinator``, ``worker``; override :meth:`enabled` and
    :meth:`check_config`) and name it in ``algorithm.plugins = ["module:Class"]`` to load
    your own; the built-in ones are listed in :data:`edgefl.algorithms.BUILTIN`.

    What a plugin needs of the other config keys is declared in :attr:`requires` (a tuple
    of :class:`Requirement`); the shared checker refuses a config that breaks one with a
    one-line ConfigError naming both keys and the reason, and ``edgefl config matrix``
    (docs/composition.md) lists the refusals. A built-in plugin's requirements are checked
    whether it is on or not (each has its own trigger key); a user plugin's when it is
    listed. :meth:`check_config` is for everything else (bad values of its own keys).
    """

    name: ClassVar[str] = "plugin"
    coordinator: ClassVar[type[CoordinatorPlugin] | None] = None
    worker: ClassVar[type[WorkerPlugin] | None] = None
    requires: ClassVar[tuple[Requirement, ...]] = ()
    #: the config sections the plugin owns, ``{section: {key: Field}}`` (a built-in's are its
    #: package's config.py ``SECTIONS``, which reach the schema through the registry)
    sections: ClassVar[dict[str, Any]] = {}
    #: position in the hooks that run several plugins (lower first; ties: as listed). The
    #: built-ins declare theirs (FedBN's buffers are restored before anyone evaluates the
    #: model, the norm bound filters before Hermes weighs, ...); a user's plugin runs after
    #: them by default.
    order: ClassVar[int] = 1000

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        """Is the plugin on for this config? (a user's listed plugin: always)"""
        return True

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """Raise ConfigError (naming the key) for a bad or unsupported setting."""
