"""Model buffers (BatchNorm running statistics): federated with the parameters, or kept per
device (FedBN, Li et al., ICLR 2021; ``model.buffers = "local"``).

One module holds both plugins:

- ``ModelBuffers`` (always on, no halves): what a model with float buffers cannot run
  with, refused before any rank starts (:func:`conflicts`, :func:`check_buffers`; the
  checks need the model, does it have persistent float buffers?, so they cannot be
  declared as :class:`~edgefl.algorithms.base.Requirement` data);
- ``FedBN`` (``model.buffers = "local"``): its worker half keeps every device's own buffer
  values. The flat vector's buffer entries
  (:attr:`~edgefl.models.flat.FlatParams.buffer_slice`) hold the running statistics.
  Before each task of a device its own values are written into the model (a device's
  first task: the initial model's, which are also the global model's, since no update
  ever changes them); after the task they are stored for the device and zeroed in its
  update (``encode``), so aggregation, compression and residuals see no change there.
  They are stored after every local iteration (``after_train``), so a gated device
  (Hermes), which keeps its local model between pushes, continues or refreshes from them
  too.

Federating needs no plugin: :class:`~edgefl.models.flat.FlatParams` puts the float buffers
in the flat vector after the parameters, so they travel and are aggregated like them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import LocalJob, Plugin, Upload, WorkerPlugin
from .context import WorkerContext

# -- the checks (pure) ---------------------------------------------------------------------
_NOT_WEIGHTS = "running statistics are not weights"


def conflicts(cfg: dict) -> list[tuple[str, Any, str]]:
    """(config key, its value, why) of every setting of ``cfg`` that float buffers cannot
    run with under its ``model.buffers`` mode (empty: nothing to check)."""
    local = cfg["model"]["buffers"] == "local"
    out: list[tuple[str, Any, str]] = []
    if cfg["dp"]["enabled"]:
        why = (
            "DP-FedAvg adds Gaussian noise to every coordinate of the mean update, so the "
            "global running statistics would move"
            + ("" if local else " at random and a running variance can turn negative")
        )
        out.append(("dp.enabled", True, why))
    if cfg["server"]["l1"] > 0:
        why = f"the L1 prox shrinks every coordinate towards 0 and {_NOT_WEIGHTS}"
        out.append(("server.l1", cfg["server"]["l1"], why))
    if cfg["algorithm"]["ordering"] != "none":
        why = (
            "example ordering needs per-example gradients, which batch statistics "
            "(BatchNorm couples the examples of a batch) do not define"
        )
        out.append(("algorithm.ordering", cfg["algorithm"]["ordering"], why))
    if not local and cfg["server"]["optimizer"] != "sgd":
        why = (
            "a momentum or adaptive step moves the federated running statistics past the "
            "devices' mean (a running variance can turn negative); use model.buffers = "
            "'local', where their updates are zero"
        )
        out.append(("server.optimizer", cfg["server"]["optimizer"], why))
    return out


def buffer_names_of(cfg: dict) -> list[str]:
    """Names of the float buffers the flat vector of ``cfg``'s model holds (builds the
    model on the CPU, with the data source's info)."""
    import torch

    from ..data import load_federated
    from ..models import build_model
    from ..models.flat import float_buffers

    data = load_federated(
        cfg["data"]["source"], dict(cfg["data"]["args"]), cfg["fleet"]["devices"], cfg["seed"]
    )
    with torch.no_grad():
        model = build_model(
            cfg["model"]["name"], data.info, dict(cfg["model"]["args"]), cfg["seed"]
        )
    return [n for n, _ in float_buffers(model)]


def check_buffers(cfg: dict, names: list[str] | None = None) -> None:
    """Raise the one-line ConfigError of the first setting of ``cfg`` that the model's float
    buffers cannot run with (``names``: the buffer names, None = build the model to see)."""
    found = conflicts(cfg)
    if not found:
        return
    names = buffer_names_of(cfg) if names is None else names
    if not names:
        return
    key, value, why = found[0]
    shown = "true" if value is True else repr(value)
    more = f", ... ({len(names)} in all)" if len(names) > 2 else ""
    raise ConfigError(
        f"config key '{key}' = {shown}: cannot run with model.buffers = "
        f"'{cfg['model']['buffers']}' and a model with float buffers "
        f"({', '.join(names[:2])}{more}) because {why}"
    )


# -- FedBN's worker half -------------------------------------------------------------------
class FedBNWorker(WorkerPlugin):
    """Per-device buffer values: ``{device: float32 array}`` (the flat buffer entries)."""

    # (stacked: each device starts from the buffers before_train wrote into its model and
    # after_train finds its own trained ones there, as one by one)
    stackable = True
    stack_note = (
        "each device's own buffers are stacked with its parameters: written into its model "
        "before training, kept from it after"
    )

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        flat = ctx.flat
        self.sl: slice = flat.buffer_slice
        # the initial values, taken before the rank's warm-up step touches the model
        self.initial: np.ndarray = flat.buffer_values()
        self.values: dict[int, np.ndarray] = {}

    def _flat(self, job: LocalJob):
        return job.flat

    def _keep(self, d: int, job: LocalJob) -> None:
        self.values[d] = self._flat(job).buffer_values()

    def before_train(self, d: int, job: LocalJob) -> None:
        self._flat(job).load_buffers(self.values.get(d, self.initial))

    def after_train(self, d: int, job: LocalJob) -> None:
        self._keep(d, job)

    def encode(self, up: Upload, job: LocalJob | None) -> None:
        up.delta[self.sl] = 0.0  # (a dense transform: the update goes on down the chain)

    def device_state(self, d: int) -> dict:
        return {"buffers": self.values[d].copy()} if d in self.values else {}

    def load_device_state(self, d: int, state: dict) -> None:
        if "buffers" in state:
            arr = np.array(state["buffers"], np.float32).reshape(-1)
            if arr.size != self.initial.size:
                raise ValueError(
                    f"device {d}: saved model buffers have {arr.size} values, the model "
                    f"{self.initial.size}"
                )
            self.values[d] = arr


# -- the plugins --------------------------------------------------------------------------
class ModelBuffers(Plugin):
    """Always on: refuses settings that a model with float buffers cannot run with
    (:func:`check_buffers`); runs nothing during a job."""

    name = "model_buffers"
    order = 10

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        check_buffers(cfg)


class FedBN(Plugin):
    """``model.buffers = "local"``: each device keeps its own float buffers (FedBN)."""

    name = "fedbn"
    order = 20  # buffers restored before anyone evaluates; zeroed before anyone encodes
    worker = FedBNWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["model"]["buffers"] == "local"


__all__ = ["FedBN", "FedBNWorker", "ModelBuffers", "buffer_names_of", "check_buffers", "conflicts"]
