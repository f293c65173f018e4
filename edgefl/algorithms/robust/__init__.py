"""Robust aggregation (docs/robustness.md). The robust rules themselves (median, trimmed
mean, (multi-)Krum, norm clipping) are choices of the aggregation axis
(:mod:`edgefl.algorithms.robust.rules`); this plugin is the norm bound that drops or clips
outlying updates before any rule sees them (``robust.norm_bound``,
``robust.norm_bound_relative``)."""

from __future__ import annotations

from ...policies.aggregation import Update
from ...policies.consistency import Apply
from ..base import CoordinatorPlugin, Plugin


class NormBoundCoordinator(CoordinatorPlugin):
    """Filters every model change's arrivals through :class:`~edgefl.algorithms.robust.rules.
    UpdateFilter`; a rejected update is logged against its device and released."""

    def __init__(self, core, name: str) -> None:
        from edgefl.algorithms.robust.rules import UpdateFilter

        super().__init__(core, name)
        self.filter = UpdateFilter.from_options(numel=core.global_model.size,
                                                **core.cfg["robust"])  # fmt: skip

    def transform(self, ap: Apply) -> Apply:
        core = self.core
        ups = [Update(a.device, a.delta, a.samples, a.loss, core.version) for a in ap.arrivals]
        res = self.filter(ups)
        for d, reason in res.rejected:
            core.t.reject(core.devices[d]["rank"], f"update of device {d}: {reason}")
        keep = {u.device: u for u in res.accepted}
        arr, coefs = [], []
        for i, a in enumerate(ap.arrivals):
            if a.device in keep:
                a.delta = keep[a.device].delta
                arr.append(a)
                if ap.coefs:
                    coefs.append(ap.coefs[i])
            else:
                core.t.release(a.msg)  # type: ignore[attr-defined]
        return Apply(ap.mode, arr, coefs)


class NormBound(Plugin):
    """On when ``robust.norm_bound`` or ``robust.norm_bound_relative`` is set."""

    name = "norm_bound"
    coordinator = NormBoundCoordinator

    @classmethod
    def enabled(cls, cfg: dict) -> bool:
        r = cfg["robust"]
        return bool(r["norm_bound"] or r["norm_bound_relative"])


__all__ = ["NormBound"]
