"""Rank 0's half of federated evaluation: collect the devices' FED_EVAL results per
global version and add them to the metrics rows (docs/evaluation.md)."""

from __future__ import annotations

import logging
import math
import time

import torch

from ...comm import Message
from ...comm.wire import HEADER_BYTES
from ..base import CoordinatorPlugin, TaskSpec
from ..context import CoordinatorContext
from .kinds import EVAL_ASK, FED_EVAL
from .metrics import decode, load_metrics, metric_means, weighted_means

log = logging.getLogger("edgefl.coordinator")


class FedEvalCoordinator(CoordinatorPlugin):
    """Collects results by evaluated version and lands each version in one row.

    A device evaluates version v when a task of it starts from v, i.e. after row v was
    written, and sends the result before it trains (so rank 0 has it before the task's
    update or report). Version v lands in the first row written once (a) the global model
    has moved past v (no task can start from v any more) and (b) every task booked to
    evaluate v has ended (its update or report was taken, in event order: deterministic
    under the virtual clock), was followed by another task of its device, or its device
    died. Under BSP that is row v + 1. A row carries at most one version (the oldest ready
    one; ``fed_version`` names it). The final row (``run.rounds``) also takes the oldest
    version still waiting; versions still pending when the run ends are dropped (counted
    in summary.json).

    With ``evaluation.final`` (default on) the final model is evaluated too: after
    training (``on_end``) every live device is sent the final version and asked to evaluate
    it (EVAL_ASK); the answers are summary.json ``fed_eval.final`` (per device and the
    sample-weighted means), not a metrics row.
    """

    message_kinds = (FED_EVAL,)

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        super().__init__(ctx, name)
        cfg = ctx.cfg
        self.every = int(cfg["evaluation"]["every"])
        self.metrics = load_metrics(cfg["evaluation"]["metrics"])
        self.keys = ["loss", "accuracy", *self.metrics]
        self.gated = cfg["algorithm"]["gate"] != "always"
        if not self.gated:  # (with a gate Hermes' split is used: Hermes holds out)
            ctx.hold_out(float(cfg["evaluation"]["holdout"]))
        self.pending: dict[int, dict[str, dict]] = {}  # version -> device -> result
        self.open: dict[int, set[int]] = {}  # version -> devices whose task evaluating it runs
        self.booked: dict[int, int] = {}  # device -> version its running task evaluates
        self.last: dict | None = None  # the latest landed version's means (summary.json)
        self.landed = 0
        self.dropped: list[int] = []
        self.final = bool(cfg["evaluation"].get("final", True))
        self.final_result: dict | None = None
        self.dead: set[int] = set()  # devices dead for good (no final evaluation)

    # -- collecting ---------------------------------------------------------------------
    def _ended(self, d: int) -> None:
        """Device ``d``'s task booked to evaluate a version is over."""
        v = self.booked.pop(d, None)
        if v is not None:
            self.open.get(v, set()).discard(d)

    def shape_task(self, d: int, spec: TaskSpec) -> None:
        """Book a task that will evaluate the current version (the worker's rule)."""
        self._ended(d)  # (a device runs one task at a time: its previous one is over)
        v = self.ctx.version
        if v % self.every or spec.flushes:
            return
        if not self.gated or not spec.continues or spec.refreshes:
            self.booked[d] = v
            self.open.setdefault(v, set()).add(d)

    def on_iteration(self, d: int, seconds: float) -> None:
        self._ended(d)

    def on_device_dead(self, d: int, now: float) -> None:
        self._ended(d)
        self.dead.add(d)

    def on_message(self, msg: Message) -> None:
        ctx, d = self.ctx, msg.device
        try:
            r = decode(msg.payload, list(self.metrics))
        except ValueError as e:
            ctx.reject(msg.src, f"FED_EVAL of device {d}: {e}")
            return
        if d not in ctx.devices or r["version"] != msg.round:
            ctx.reject(msg.src, f"FED_EVAL of device {d}: version {r['version']} mismatch")
            return
        ctx.book_up(d, HEADER_BYTES + msg.nbytes)
        res = {"samples": r["samples"], **{k: r[k] for k in self.keys}}
        self.pending.setdefault(int(msg.round), {})[str(d)] = res

    # -- the rows -----------------------------------------------------------------------
    def _ready(self, v: int) -> bool:
        return v < self.ctx.version and not self.open.get(v)

    def on_row(self, row: dict) -> None:
        """Land one evaluated version in ``row`` (``fed_version``, ``fed_eval``, ``fed_*``
        means) and add ``test_<metric>`` where the row evaluated the test set."""
        final = row["round"] >= self.ctx.cfg["run"]["rounds"]
        for v in [v for v, devs in self.open.items() if not devs and v not in self.pending]:
            del self.open[v]  # (no result came: its devices died or their tasks were lost)
        waiting = sorted(self.pending)
        ready = [v for v in waiting if self._ready(v)] or (waiting if final else [])
        if ready:
            self._land(row, ready[0])
        if final:
            self.dropped += sorted(self.pending)
            if self.pending:
                log.info("federated evaluation: versions %s still pending at the end are "
                         "dropped", sorted(self.pending))  # fmt: skip
            self.pending.clear()
        if self.metrics and row.get("test_accuracy") is not None:
            ctx = self.ctx
            with torch.random.fork_rng(devices=[]):
                means = metric_means(ctx.model, ctx.test_set, self.metrics)
            row.update({f"test_{k}": v for k, v in means.items()})

    def _land(self, row: dict, v: int) -> None:
        res = self.pending.pop(v)
        self.open.pop(v, None)
        per = {d: res[d] for d in sorted(res, key=int)}
        means = {f"fed_{k}": m for k, m in weighted_means(per, self.keys).items()}
        row["fed_version"] = v
        row["fed_eval"] = per
        row.update(means)
        self.last = {"version": v, "devices": len(per), **means}
        self.landed += 1

    # -- the final model ------------------------------------------------------------------
    def on_end(self) -> None:
        """``evaluation.final``: every live device evaluates the final global model; waits
        up to ``comm.failure_timeout_s`` (60 s when that is 0) for the answers, and a device
        whose rank fails meanwhile is listed as missing."""
        if not self.final:
            return
        ctx, v = self.ctx, self.ctx.version
        if ctx.cfg["ps"]["servers"]:
            # the final model would reach the workers in pieces from the shards, which an
            # EVAL_ASK from rank 0 could overtake
            self.final_result = {"version": v, "skipped": "ps.servers > 0 (sharded server)"}
            log.info("federated evaluation of the final model: skipped under ps.servers")
            return
        failed = ctx.failed_ranks
        asked = [d for d in sorted(ctx.devices) if d not in self.dead
                 and ctx.rank_of(d) not in failed]  # fmt: skip
        self.pending.pop(v, None)  # (a task that started from v evaluated the same model)
        for rank in sorted({ctx.rank_of(d) for d in asked}):
            ctx.send_model_to(rank)
        for d in asked:
            ctx.send(ctx.rank_of(d), EVAL_ASK, device=d, round=v)
        limit = float(ctx.cfg["comm"]["failure_timeout_s"]) or 60.0
        deadline = time.monotonic() + limit
        waiting = set(asked)
        while waiting and time.monotonic() < deadline:
            for msg in ctx.poll(0.2):
                if msg.kind == FED_EVAL:
                    self.on_message(msg)
                else:
                    ctx.release(msg)  # (late updates of tasks nobody waits for)
            got = self.pending.get(v, {})
            failed = ctx.failed_ranks
            waiting = {d for d in waiting if str(d) not in got and ctx.rank_of(d) not in failed}
        res = self.pending.pop(v, {})
        per = {d: res[d] for d in sorted(res, key=int)}
        means = {f"fed_{k}": m for k, m in weighted_means(per, self.keys).items()} if per else {}
        missing = [d for d in asked if str(d) not in per]
        self.final_result = {"version": v, "devices": per, **means, "missing": missing}
        if per:
            accs = [r["accuracy"] for r in per.values() if math.isfinite(r["accuracy"])]
            spread = f" (min {min(accs):.4f}, max {max(accs):.4f})" if accs else ""
            acc = means.get("fed_accuracy", math.nan)
            print(f"federated evaluation of the final model (version {v}, {len(per)} devices): "
                  f"accuracy {acc:.4f}{spread}, loss {means.get('fed_loss', math.nan):.4f}",
                  flush=True)  # fmt: skip
        if missing:
            log.warning("federated evaluation of the final model: no answer from devices %s",
                        missing)  # fmt: skip

    # -- summary and checkpoints ----------------------------------------------------------
    def summary(self) -> dict:
        return {
            "fed_eval": {
                "every": self.every,
                "versions_landed": self.landed,
                "versions_dropped": sorted(self.dropped + list(self.pending)),
                "last": self.last,
                "final": self.final_result,
            }
        }

    def state_dict(self) -> dict:
        """The summary's counters and the latest landed means; results still pending are
        not saved (a resumed run drops them)."""
        return {"landed": self.landed, "dropped": list(self.dropped), "last": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.landed = int(state.get("landed", 0))
        self.dropped = [int(v) for v in state.get("dropped", [])]
        self.last = state.get("last")
