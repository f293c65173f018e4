"""A worker's half of federated evaluation: hold out each device's split, evaluate the
global model a task starts from every K versions, report it to rank 0 (FED_EVAL)."""

from __future__ import annotations

from ...comm import Message
from ..base import LocalJob, WorkerPlugin
from ..context import WorkerContext
from .kinds import EVAL_ASK, FED_EVAL
from .metrics import encode, evaluate_on, load_metrics


class FedEvalWorker(WorkerPlugin):
    """Without a gate, asks its context to hold out ``evaluation.holdout`` of each device;
    with a gate Hermes asked for its fraction and that held-out split is evaluated on. In
    ``before_train`` a task that starts from global version v with v % K == 0 evaluates
    that model (a gated device only when it just got a global model, not when it goes on
    from its own local one) and sends the result before it trains. An EVAL_ASK (the end of
    the run, ``evaluation.final``) evaluates the global version it names the same way."""

    message_kinds = (EVAL_ASK,)

    stackable = True
    stack_note = "evaluates the start model before training; trains on the rest, stacked"

    def __init__(self, ctx: WorkerContext, name: str) -> None:
        super().__init__(ctx, name)
        c = ctx.cfg["evaluation"]
        self.every = int(c["every"])
        self.fraction = float(c["holdout"])
        self.metrics = load_metrics(c["metrics"])
        self.gated = ctx.cfg["algorithm"]["gate"] != "always"
        if not self.gated:  # (with a gate, Hermes asked for its hold-out: scored on it)
            ctx.hold_out(self.fraction)

    def _held_out(self, d: int):
        """The held-out split the job's training excluded (the context's one split: Hermes'
        fraction with a gate, else ``evaluation.holdout``)."""
        got = self.ctx.split(d)
        if got is not None:
            return got[1]
        raise RuntimeError(f"device {d}: no held-out split for federated evaluation")

    def before_train(self, d: int, job: LocalJob) -> None:
        if not job.new_model or job.version % self.every:
            return
        self._report(d, job.version, job.model, job.torch_device)

    def on_message(self, msg: Message) -> None:
        """EVAL_ASK of device ``msg.device``: evaluate global version ``msg.round``."""
        d, v = int(msg.device), int(msg.round)
        self.ctx.release(msg)
        if d not in self.ctx.devices:
            return  # (not hosted here: nothing to evaluate; rank 0 lists it as missing)
        model = self.ctx.global_model(v, d)
        self._report(d, v, model, str(next(model.parameters()).device))

    def _report(self, d: int, version: int, model, torch_device: str) -> None:
        ctx = self.ctx
        r = evaluate_on(model, self._held_out(d), ctx.task_kind, self.metrics, torch_device,
                        ctx.loss)  # fmt: skip
        r = {"version": int(version), "device": int(d), **r}
        ctx.send(0, FED_EVAL, device=d, round=int(version), payload=encode(r))
