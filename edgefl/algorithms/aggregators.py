"""The ``algorithm.aggregation`` registry: every aggregator name and :func:`make_aggregator`.

It sits above both aggregator modules, so dependencies point one way:
:mod:`edgefl.policies.aggregation` (update type, :class:`~.aggregation.Aggregator` API,
weighted means) <- :mod:`edgefl.algorithms.robust.rules` (Byzantine-robust aggregators) <- this
module. Neither aggregator module imports it.
"""

from __future__ import annotations

from edgefl.algorithms.robust.rules import ROBUST_AGGREGATORS, ROBUST_KEYS, build_robust
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import AGGREGATORS, Aggregator


def all_aggregators() -> dict[str, type[Aggregator]]:
    """Every ``algorithm.aggregation`` name and its class, weighted means first."""
    return {**AGGREGATORS, **ROBUST_AGGREGATORS}


def make_aggregator(name: str, expected_updates: int | None = None, **options) -> Aggregator:
    """Aggregator by config name (``algorithm.aggregation``).

    Args:
        name: one of :func:`all_aggregators` (mean, sample-weighted, median, trimmed-mean,
            krum, multi-krum, norm-clip).
        expected_updates: updates per round the run expects (None = unknown); lets Krum
            reject an assumed Byzantine count that is too large before the run starts.
        **options: the ``[robust]`` config keys by their leaf name (``trim_fraction``,
            ``krum_f``, ``multi_krum_m``, ``clip_norm``, ``norm_bound``,
            ``norm_bound_relative``, ``norm_bound_mode``); each aggregator takes the ones
            it uses, so the whole ``cfg["robust"]`` table may be passed.

    Raises ConfigError naming the key for an unknown name or a bad option.
    """
    registry = all_aggregators()
    cls = registry.get(name)
    if cls is None:
        raise ConfigError(
            f"config key 'algorithm.aggregation' = {name!r}: expected one of " + ", ".join(registry)
        )
    unknown = sorted(set(options) - set(ROBUST_KEYS))
    if unknown:
        raise ConfigError(
            f"config key 'robust.{unknown[0]}': unknown option; expected one of "
            + ", ".join(ROBUST_KEYS)
        )
    if name in AGGREGATORS:
        return cls()
    return build_robust(name, expected_updates, options)


__all__ = ["all_aggregators", "make_aggregator"]
