"""Rank 0's half of Hermes: allocation, loss-weighted aggregation, broadcast, metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...policies.consistency import Apply
from ..base import CoordinatorPlugin, TaskSpec
from ..context import CoordinatorContext
from .metrics import HermesMetrics


class HermesCoordinator(CoordinatorPlugin):
    """Sizes each device's work (samples D, batch b) from its measured iteration times,
    folds pushes into the loss-weighted average, tells busy gated devices to adopt a new
    global model (``hermes.broadcast = "all"``) and keeps the WI / API metrics."""

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        from edgefl.algorithms.hermes.allocation import make_allocator

        from .loss_weighted import LOSS_AGGREGATIONS

        super().__init__(ctx, name)
        cfg = ctx.cfg
        alg = cfg["algorithm"]
        self.metrics = HermesMetrics()
        gated = alg["gate"] != "always"
        if gated:  # a gated device holds out a seeded part of its samples for its gate
            ctx.hold_out(cfg["hermes"]["holdout_fraction"])
        for d in ctx.devices:
            self.metrics.add_device(d)
        self.allocating = alg["allocation"] != "fixed"
        self.allocator = make_allocator(
            alg["allocation"], cfg["allocation"], epochs=cfg["train"]["local_epochs"]
        )
        for d in sorted(ctx.devices):
            cap, n = ctx.memory_cap(d), ctx.train_size(d)
            first = None
            if self.allocating:
                first = max(1, int(cfg["allocation"]["initial_fraction"] * n))
            self.allocator.add_device(d, n, memory_cap=cap or None, samples=first,
                                      batch=cfg["train"]["batch_size"] or 32)  # fmt: skip
        self.loss_agg = alg["aggregation"] in LOSS_AGGREGATIONS
        self.broadcast = gated and cfg["hermes"]["broadcast"] == "all"
        self._global_loss: tuple[int, float] | None = None

    def shape_task(self, d: int, spec: TaskSpec) -> None:
        if self.allocating:
            a = self.allocator.allocation(d)
            spec.samples, spec.batch = a.samples, a.batch

    def on_iteration(self, d: int, seconds: float) -> None:
        self.metrics.record_iteration(d, seconds)
        if self.allocating and seconds > 0:
            self.allocator.update({d: seconds})

    def aggregate(self, ap: Apply) -> np.ndarray | None:
        """Loss-weighted aggregation: each update is folded into the running average by
        its candidate test loss (the global model with the update applied).

        An asynchronous policy (ASP, SSP: ``ap.mode == "terms"``) gives each arrival its
        share of the fleet, ``coef`` (1 / devices, or the device's sample share), as it does
        without Hermes: the update enters the average scaled by it, so a push moves the
        model as far as the same update under plain ASP. (Folding in the whole delta made
        every push about ``devices`` times ASP's step; with the average applied after each
        push and the clients' momentum, Hermes diverged at ``server.lr = 1``:
        tests/test_hermes_runtime.py, docs/hermes.md section 3.)"""
        if not self.loss_agg:
            return None
        agg = self.ctx.aggregator
        gl = self._global_test_loss()
        arr = sorted(ap.arrivals, key=lambda x: x.device) if ap.mode == "aggregate" else ap.arrivals
        coefs = ap.coefs if ap.mode == "terms" else [1.0] * len(arr)
        step = None
        for a, c in zip(arr, coefs, strict=True):
            cand = self._candidate_loss(a.delta)
            delta = a.delta if c == 1.0 else np.float32(c) * a.delta
            if agg.name == "loss-weighted":
                step = agg.push(delta, cand, gl)
            else:
                step = agg.push(a.device, delta, cand)
        return step

    def after_apply(self, ap: Apply, now: float) -> None:
        if self.broadcast:
            pushers = {a.device for a in ap.arrivals}
            for d in self.ctx.busy:
                if d not in pushers:
                    self.ctx.request_refresh(d)

    def _global_test_loss(self) -> float:
        """Test loss of the current global model (cached per version)."""
        v = self.ctx.version
        if self._global_loss is None or self._global_loss[0] != v:
            self._global_loss = (v, self.ctx.test_loss())
        return self._global_loss[1]

    def _candidate_loss(self, delta: np.ndarray) -> float:
        """Test loss of the global model with ``delta`` applied (the model is restored)."""
        return self.ctx.test_loss(delta)

    def summary(self) -> dict:
        """WI, API calls, iterations, iteration-time CV (any gate)."""
        devs = self.ctx.devices
        wi = {str(d): v["iterations"] / v["requests"] if v.get("requests") else 0.0
              for d, v in sorted(devs.items())}  # fmt: skip
        pulls = sum(v.get("requests", 0) for v in devs.values())
        pushes = sum(v["msgs_up"] for v in devs.values())
        cvs = self.metrics.cv_by_iteration()
        return {"hermes": {
            "wi": wi,
            "wi_mean": float(np.mean(list(wi.values()))) if wi else 0.0,
            "iterations": sum(v["iterations"] for v in devs.values()),
            "pulls": pulls,
            "pushes": pushes,
            "api_calls": pulls + pushes,
            "control_messages": self.ctx.control_messages,
            "bytes": sum(v["bytes_up"] + v["bytes_down"] for v in devs.values()),
            "iteration_time_cv_first": cvs[0] if cvs else None,
            "iteration_time_cv_last": cvs[-1] if cvs else None,
            # CV across devices of each device's mean over its last 5 iterations (the
            # per-task jitter of the profiles averages out; what allocation can control)
            "iteration_time_cv_settled": settled_cv(self.metrics.times),
            "iteration_time_cv": cvs,
            "allocations": {
                str(d): [a.samples, a.batch] for d, a in self.allocator.allocations().items()
            },
        }}  # fmt: skip

    def state_dict(self) -> dict:
        return {"metrics": self.metrics.state_dict(), "allocator": self.allocator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.metrics.load_state_dict(state["metrics"])
        self.allocator.load_state_dict(state["allocator"])


def settled_cv(times: Mapping[int, Sequence[float]], last: int = 5) -> float | None:
    """CV across devices of each device's mean iteration time over its last ``last``."""
    means = [float(np.mean(t[-last:])) for t in times.values() if t]
    if len(means) < 2 or np.mean(means) <= 0:
        return None
    return float(np.std(means) / np.mean(means))
