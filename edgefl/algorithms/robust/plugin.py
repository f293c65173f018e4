"""The robust plugin: its Plugin class (name, when it is on, what it requires, its two halves)."""

from __future__ import annotations

from ...policies.aggregation import Update
from ...policies.consistency import Apply
from ..base import CoordinatorPlugin, Plugin, Requirement, above, not_one_of
from ..context import CoordinatorContext
from .config import SECTIONS


class NormBoundCoordinator(CoordinatorPlugin):
    """Filters every model change's arrivals through :class:`~edgefl.algorithms.robust.rules.
    UpdateFilter`; a rejected update is logged against its device and released."""

    def __init__(self, ctx: CoordinatorContext, name: str) -> None:
        from edgefl.algorithms.robust.rules import UpdateFilter

        super().__init__(ctx, name)
        self.filter = UpdateFilter.from_options(numel=ctx.numel,
                                                **ctx.cfg["robust"])  # fmt: skip

    def transform(self, ap: Apply) -> Apply:
        ctx = self.ctx
        ups = [Update(a.device, a.delta, a.samples, a.loss, ctx.version) for a in ap.arrivals]
        res = self.filter(ups)
        for d, reason in res.rejected:
            ctx.reject(ctx.devices[d]["rank"], f"update of device {d}: {reason}")
        keep = {u.device: u for u in res.accepted}
        arr, coefs = [], []
        for i, a in enumerate(ap.arrivals):
            if a.device in keep:
                a.delta = keep[a.device].delta
                arr.append(a)
                if ap.coefs:
                    coefs.append(ap.coefs[i])
            else:
                ctx.release(a.msg)
        return Apply(ap.mode, arr, coefs)


class NormBound(Plugin):
    """On when ``robust.norm_bound`` or ``robust.norm_bound_relative`` is set."""

    name = "norm_bound"
    order = 40  # filters arrivals before Hermes weighs them
    sections = SECTIONS
    coordinator = NormBoundCoordinator
    requires = tuple(
        Requirement(
            key, above(0), "algorithm.consistency", not_one_of("fedasync"),
            "FedAsync mixes each arriving model in directly (x <- (1 - a) x + a x_new): the "
            "update filters run on aggregate and weighted-sum steps only, so no update "
            "would be bounded",
        )
        for key in ("robust.norm_bound", "robust.norm_bound_relative")
    )  # fmt: skip

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        r = cfg["robust"]
        return bool(r["norm_bound"] or r["norm_bound_relative"])


__all__ = ["NormBound"]
