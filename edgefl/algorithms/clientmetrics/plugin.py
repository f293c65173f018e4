"""The client-metrics plugin: on when a user client (``train.client``) is configured."""

from __future__ import annotations

from ..base import Plugin
from .coordinator import ClientMetricsCoordinator
from .worker import ClientMetricsWorker


class ClientMetrics(Plugin):
    """``train.client`` set: the client's metrics go to the metrics rows."""

    name = "client_metrics"
    order = 30  # its metrics go out before a plugin sends the update itself
    coordinator = ClientMetricsCoordinator
    worker = ClientMetricsWorker

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        return bool(cfg["train"]["client"])


__all__ = ["ClientMetrics"]
