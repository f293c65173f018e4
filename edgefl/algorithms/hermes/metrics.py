"""Hermes metrics: worker independence, API calls, bytes, iterations, iteration-time history.

Worker independence (WI, Basani et al., HiPC 2024, arXiv:2410.20495) is the number of local
iterations a device runs per global model it requests: 1 for BSP/ASP workers (a pull after
every iteration), larger when a gate such as HermesGUP lets the device keep training locally.
API calls count messages of *all* kinds (updates, model requests and replies, allocations,
control), as the paper counts calls to its message API.

Pure bookkeeping: the runtime calls the ``record_*`` methods; :meth:`HermesMetrics.summary`
returns a JSON-ready dict for ``metrics.jsonl`` and the final summary.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

from edgefl.algorithms.hermes.allocation import cv


def worker_independence(iterations: int, requests: int) -> float:
    """WI = local iterations / global-model requests (dimensionless).

    With 0 requests the device has only used the model it started with, which counts as one
    request: WI = iterations (so the value is always finite and JSON-encodable).
    """
    if iterations < 0 or requests < 0:
        raise ValueError(f"counts must be >= 0, got iterations={iterations}, requests={requests}")
    return float(iterations) / max(int(requests), 1)


class HermesMetrics:
    """Accumulates per-device counters and the fleet's message/byte totals.

    Per device: local iterations, global-model requests, pushes (major updates), and the
    history of measured iteration times (seconds) for the CV-before/after figure. Fleet-wide:
    messages and bytes, each in total and by message kind.
    """

    def __init__(self) -> None:
        self.iterations: dict[int, int] = {}
        self.requests: dict[int, int] = {}
        self.pushes: dict[int, int] = {}
        # (a device's history as packed doubles: 8 bytes an iteration, where a list of
        # floats took 32; every device's, every round, for the whole run)
        self.times: dict[int, array] = {}
        self.messages_by_kind: dict[str, int] = {}
        self.bytes_by_kind: dict[str, int] = {}

    # ---- recording -------------------------------------------------------------------------

    def add_device(self, device: int) -> None:
        """Make ``device`` appear in per-device outputs even before it reports anything."""
        d = int(device)
        self.iterations.setdefault(d, 0)
        self.requests.setdefault(d, 0)
        self.pushes.setdefault(d, 0)
        self.times.setdefault(d, array("d"))

    def record_iteration(self, device: int, seconds: float | None = None) -> None:
        """One local iteration of ``device``; ``seconds`` (its duration) goes to the history."""
        self.add_device(device)
        self.iterations[int(device)] += 1
        if seconds is not None:
            if not seconds >= 0:
                raise ValueError(f"iteration time must be >= 0 seconds, got {seconds}")
            self.times[int(device)].append(float(seconds))

    def record_request(self, device: int) -> None:
        """``device`` requested (and will receive) the global model."""
        self.add_device(device)
        self.requests[int(device)] += 1

    def record_push(self, device: int) -> None:
        """``device`` pushed an update (a major update under HermesGUP)."""
        self.add_device(device)
        self.pushes[int(device)] += 1

    def record_message(self, kind: str, nbytes: int, count: int = 1) -> None:
        """``count`` messages of ``kind`` carrying ``nbytes`` bytes in total (headers included
        if the caller counts them)."""
        if nbytes < 0 or count < 0:
            raise ValueError(f"nbytes and count must be >= 0, got {nbytes}, {count}")
        self.messages_by_kind[kind] = self.messages_by_kind.get(kind, 0) + int(count)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + int(nbytes)

    # ---- results -----------------------------------------------------------------------------

    @property
    def api_calls(self) -> int:
        """Messages of all kinds."""
        return sum(self.messages_by_kind.values())

    @property
    def bytes(self) -> int:
        """Bytes of all messages."""
        return sum(self.bytes_by_kind.values())

    @property
    def total_iterations(self) -> int:
        """Local iterations summed over devices."""
        return sum(self.iterations.values())

    def wi(self, device: int) -> float:
        """Worker independence of one device."""
        d = int(device)
        return worker_independence(self.iterations.get(d, 0), self.requests.get(d, 0))

    def wi_mean(self) -> float:
        """Mean WI over the devices (0.0 with none)."""
        ids = sorted(self.iterations)
        return sum(self.wi(i) for i in ids) / len(ids) if ids else 0.0

    def cv_by_iteration(self) -> list[float]:
        """CV (population std / mean) across devices of their j-th measured iteration time,
        for j = 0, 1, ... as long as every device with a history has a j-th time."""
        hist = [h for h in self.times.values() if h]
        if not hist:
            return []
        n = min(len(h) for h in hist)
        return [cv([h[j] for h in hist]) for j in range(n)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready totals: iterations, api_calls, bytes, wi_mean, per-device WI, pushes,
        messages/bytes by kind, CV of the first and the last common iteration time."""
        ids = sorted(self.iterations)
        cvs = self.cv_by_iteration()
        return {
            "iterations": self.total_iterations,
            "api_calls": self.api_calls,
            "bytes": self.bytes,
            "wi_mean": self.wi_mean(),
            "wi": {str(i): self.wi(i) for i in ids},
            "pushes": sum(self.pushes.values()),
            "requests": sum(self.requests.values()),
            "messages_by_kind": dict(sorted(self.messages_by_kind.items())),
            "bytes_by_kind": dict(sorted(self.bytes_by_kind.items())),
            "cv_first": cvs[0] if cvs else None,
            "cv_last": cvs[-1] if cvs else None,
        }

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (lists in ascending device order)."""
        ids = sorted(self.iterations)
        return {
            "devices": ids,
            "iterations": [self.iterations[i] for i in ids],
            "requests": [self.requests[i] for i in ids],
            "pushes": [self.pushes[i] for i in ids],
            "times": [list(self.times[i]) for i in ids],
            "messages_by_kind": dict(self.messages_by_kind),
            "bytes_by_kind": dict(self.bytes_by_kind),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ids = [int(i) for i in state["devices"]]
        self.iterations = {i: int(x) for i, x in zip(ids, state["iterations"])}
        self.requests = {i: int(x) for i, x in zip(ids, state["requests"])}
        self.pushes = {i: int(x) for i, x in zip(ids, state["pushes"])}
        self.times = {i: array("d", [float(t) for t in ts]) for i, ts in zip(ids, state["times"])}
        self.messages_by_kind = {str(k): int(v) for k, v in state["messages_by_kind"].items()}
        self.bytes_by_kind = {str(k): int(v) for k, v in state["bytes_by_kind"].items()}
