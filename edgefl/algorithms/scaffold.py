"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct client drift.

One module holds the whole algorithm: its config section, its two message kinds, the
control-variate arithmetic, rank 0's half, the worker half and the plugin class. Written
only against the plugin API (:mod:`edgefl.algorithms.base`) and the client hook
(:mod:`edgefl.training`). Rank 0 keeps the server control variate ``c``; each device keeps
its own ``c_i``. Every local step uses the gradient ``g + c - c_i``; after a task of ``K``
steps at learning rate ``lr`` the device sets ``c_i+ = c_i - c + (x - y_i) / (K lr)``
(option II of the paper, x the start model, y_i the trained one) and uploads its model delta
together with ``dc_i = c_i+ - c_i``; rank 0 adds ``sum(dc_i) / N`` (N = all devices) to ``c``
when the round's step is applied. Both variates are in checkpoints. torch is imported where
a task needs it (the registry reads :data:`SECTIONS` without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..comm.wire import HEADER_BYTES, DType, register_kind
from ..config.fields import field
from .base import (
    CoordinatorPlugin,
    Download,
    LocalJob,
    Plugin,
    Requirement,
    Upload,
    WorkerPlugin,
    one_of,
)
from .context import CoordinatorContext, WorkerContext

if TYPE_CHECKING:  # (annotations only)
    import torch

    from ..comm import Message
    from ..policies.consistency import Apply
    from ..training.gradterms import ConstantTerm

#: the ``[scaffold]`` config section (docs/configuration.md)
SECTIONS = {
    "scaffold": {
        "enabled": field(
            False,
            "bool",
            "SCAFFOLD: server and client control variates correct each local gradient.",
        ),
    },
}

# the server control variate c of model version ``round`` (float32, one per parameter)
CONTROL = register_kind("CONTROL", 25, "down", {DType.FLOAT32}, "any")
# a device's update: [model delta (model size), dc_i (one per parameter)], float32
CONTROL_UPDATE = register_kind("CONTROL_UPDATE", 26, "up", {DType.FLOAT32}, "any")


# -- the arithmetic (numpy; the gradient hook: torch) -------------------------------------
def correction_hook(
    params: Sequence[torch.Tensor], offsets: Sequence[int], correction: np.ndarray
) -> ConstantTerm:
    """A gradient hook adding ``correction`` (``c - c_i``, flat float32 over the
    parameters) to the parameters' gradients."""
    from ..training.gradterms import ConstantTerm

    return ConstantTerm(params, offsets, correction)


def client_delta(c: np.ndarray, delta: np.ndarray, steps: int, lr: float) -> np.ndarray:
    """``dc_i = c_i+ - c_i = -c - delta / (K lr)`` (option II; ``delta = y_i - x`` over the
    parameters), float32; zeros when no step was taken."""
    if steps <= 0 or lr <= 0:
        return np.zeros_like(c)
    scale = np.float32(1.0 / (steps * lr))
    return (-c - delta * scale).astype(np.float32)


def server_step(c: np.ndarray, deltas: dict[int, np.ndarray], devices: int) -> None:
    """``c += sum(dc_i) / N`` in place, summing in device order (deterministic)."""
    if not deltas:
        return
    total = np.zeros_like(c)
    for d in sorted(deltas):
        total += deltas[d]
    c += total / np.float32(devices)


def _param_numel(flat) -> int:
    return int(getattr(flat, "param_numel", flat.numel))  # parameters only (no buffers)


# -- rank 0 ---------------------------------------------------------------------------------
class ScaffoldCoordinator(CoordinatorPlugin):
    """The server control variate ``c`` (zeros at the start; in checkpoints): sent before
    each model, stepped with each round's ``dc_i``, split off each update."""

    update_kinds = (CONTROL_UPDATE,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        self.numel = _param_numel(ctx.flat)
        self.c = np.zeros(self.numel, np.float32)
        self.pending: dict[int, np.ndarray] = {}  # device -> dc_i of its accepted update

    def on_start(self) -> None:
        if self.ctx.resuming:  # tasks in flight are sent again without a model send
            for rank in sorted({v["rank"] for v in self.ctx.devices.values()}):
                self._send_control(rank)

    def send_model(self, down: Download) -> None:
        """The variate of the current version goes before the model."""
        self._send_control(down.rank)

    def _send_control(self, rank: int) -> None:
        self.ctx.send(rank, CONTROL, round=self.ctx.version, payload=self.c.copy())

    def down_bytes(self, d: int) -> int | None:
        return 3 * HEADER_BYTES + 4 * self.ctx.numel + self.c.nbytes

    def decode(self, d: int, task: int, msg: Message):
        n = self.ctx.numel
        if msg.payload.size != n + self.numel:
            why = f"SCAFFOLD update of device {d}: {msg.payload.size} values, want {n + self.numel}"
            return None, why, msg
        dc = np.array(msg.payload[n:], np.float32)
        if not np.isfinite(dc).all():
            return None, f"SCAFFOLD update of device {d}: non-finite control variate", msg
        self.pending[d] = dc
        return np.array(msg.payload[:n], np.float32), "", msg

    def after_apply(self, ap: Apply, now: float) -> None:
        used = {
            a.device: self.pending.pop(a.device) for a in ap.arrivals if a.device in self.pending
        }
        server_step(self.c, used, len(self.ctx.devices))

    def summary(self) -> dict:
        return {"scaffold": {"control_norm": float(np.linalg.norm(self.c))}}

    def state_dict(self) -> dict:
        st = {"c": self.c.copy()}
        st.update({f"pending_{d}": v.copy() for d, v in self.pending.items()})
        return st

    def load_state_dict(self, state: dict) -> None:
        self.c = np.array(state["c"], np.float32)
        self.pending = {
            int(k.split("_", 1)[1]): np.array(v, np.float32)
            for k, v in state.items()
            if k.startswith("pending_")
        }


# -- a worker -------------------------------------------------------------------------------
class ScaffoldWorker(WorkerPlugin):
    """Keeps the server variate of each model version it was sent (CONTROL) and every
    hosted device's own ``c_i`` (zeros until its first task; saved in checkpoints);
    corrects every local gradient by ``c - c_i`` and uploads the model delta with the
    change of ``c_i``."""

    message_kinds = (CONTROL,)
    stackable = True
    stack_note = "the correction `c - c_i` is a per-device gradient term (`ConstantTerm`)"

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        self.numel = _param_numel(ctx.flat)
        self.controls: dict[int, np.ndarray] = {}  # model version -> c
        self.ci: dict[int, np.ndarray] = {}  # device -> c_i

    def on_message(self, msg: Message) -> None:
        c = np.array(msg.payload, np.float32)
        self.ctx.release(msg)
        if c.size != self.numel:
            raise ValueError(f"CONTROL of version {msg.round}: {c.size} values, want {self.numel}")
        self.controls[msg.round] = c
        keep = self.ctx.queued_versions() | {max(self.controls)}
        for v in [v for v in self.controls if v not in keep]:
            del self.controls[v]

    def before_train(self, d: int, job: LocalJob) -> None:
        c = self.controls.get(job.version)
        if c is None:
            raise RuntimeError(
                f"device {d}: no SCAFFOLD control variate of model version {job.version}"
            )
        ci = self.ci.get(d)
        correction = c if ci is None else c - ci
        flat = job.flat
        params = [p for _, p in job.model.named_parameters()]
        job.fit_ctx.grad_hooks.append(
            correction_hook(params, flat.offsets[: len(params)], correction)
        )
        job.ctx["scaffold_c"] = c

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        if up.flush:
            return
        d, delta = up.device, up.delta
        c = job.ctx["scaffold_c"]
        dc = client_delta(c, delta[: self.numel], job.fit_ctx.steps, job.fit_task.lr)
        ci = self.ci.get(d)
        self.ci[d] = dc.copy() if ci is None else ci + dc
        up.encode(self.name, CONTROL_UPDATE, np.concatenate([delta, dc]))

    def device_state(self, d: int) -> dict:
        return {"ci": self.ci[d].copy()} if d in self.ci else {}

    def load_device_state(self, d: int, state: dict) -> None:
        if "ci" in state:
            self.ci[d] = np.array(state["ci"], np.float32)


# -- the plugin -----------------------------------------------------------------------------
class Scaffold(Plugin):
    """``scaffold.enabled = true``: SCAFFOLD's control variates (option II)."""

    name = "scaffold"
    order = 100
    sections = SECTIONS
    coordinator = ScaffoldCoordinator
    worker = ScaffoldWorker
    summary_keys = {"scaffold": None}

    requires = tuple(
        Requirement("scaffold.enabled", one_of(True), key, allowed, why)
        for key, allowed, why in (
            ("algorithm.consistency", one_of("bsp"), "the server variate steps once per "
             "synchronous round with the round's control-variate changes"),
            ("algorithm.gate", one_of("always"), "a device's variate changes with every "
             "task it uploads; a gated device trains several tasks per upload"),
            ("algorithm.residual", one_of("none"), "the variate change is computed from "
             "the whole local change, which a residual buffer would withhold in part"),
            ("ps.sparse", one_of(False), "SCAFFOLD sends its own update kind (model delta "
             "and variate change together), which the sparse push filters do not encode"),
            ("ps.servers", one_of(0), "the server variate lives on rank 0"),
            ("ps.pull", one_of("full"), "the server variate goes with every full model "
             "download, which working-set pulls replace"),
            ("fedprox.enabled", one_of(False), "SCAFFOLD and FedProx are alternative "
             "corrections of client drift"),
            ("train.momentum", one_of(0.0), "option II's client variate (x - y_i) / (K lr) "
             "is the task's mean gradient only for plain SGD steps; with momentum the steps "
             "are larger, the corrections grow round by round and the model diverges "
             "(docs/client-drift.md: digits, CNN, momentum 0.9: test loss NaN by round 19)"),
            ("train.optimizer", one_of("sgd"), "option II's client variate (x - y_i) / (K lr) "
             "assumes plain SGD steps of size lr times the gradient, which adaptive "
             "optimizers do not take"),
        )
    )  # fmt: skip

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["scaffold"]["enabled"])


__all__ = [
    "CONTROL",
    "CONTROL_UPDATE",
    "SECTIONS",
    "Scaffold",
    "ScaffoldCoordinator",
    "ScaffoldWorker",
    "client_delta",
    "correction_hook",
    "server_step",
]
