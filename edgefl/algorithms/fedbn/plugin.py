"""The model-buffer plugins: ``ModelBuffers`` (the checks of a model with float buffers,
always on, no halves) and ``FedBN`` (``model.buffers = "local"``: the worker half)."""

from __future__ import annotations

from ..base import Plugin
from .worker import FedBNWorker


class ModelBuffers(Plugin):
    """Always on: refuses settings that a model with float buffers cannot run with
    (:func:`~edgefl.algorithms.fedbn.checks.check_buffers`); runs nothing during a job."""

    name = "model_buffers"
    order = 10

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        from .checks import check_buffers

        check_buffers(cfg)


class FedBN(Plugin):
    """``model.buffers = "local"``: each device keeps its own float buffers (FedBN)."""

    name = "fedbn"
    order = 20  # buffers restored before anyone evaluates; zeroed before anyone encodes
    worker = FedBNWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return cfg["model"]["buffers"] == "local"


__all__ = ["FedBN", "ModelBuffers"]
