"""Aggregation of device updates on the coordinator (pure numpy, no MPI).

Every aggregator combines a round's updates in ascending device order, so the result does
not depend on the order in which messages arrived (the determinism contract). This module is
the bottom of the aggregation layer: the update type, the :class:`Aggregator` API and the
weighted means (FedAvg, plain mean). The Byzantine-robust aggregators (median, trimmed mean,
Krum, Multi-Krum, norm clipping) build on it in :mod:`edgefl.algorithms.robust.rules`; the registry
of every ``algorithm.aggregation`` name, :func:`~edgefl.algorithms.aggregators.make_aggregator`,
sits above both in :mod:`edgefl.algorithms.aggregators` (so this module imports neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Update:
    """One device's contribution to a round.

    Args:
        device: device id.
        delta: local model minus the global model it started from (float32, model size).
        samples: training samples the device holds (its FedAvg weight).
        loss: mean local training loss of the round.
        round: the global round the update belongs to.
    """

    device: int
    delta: np.ndarray
    samples: int
    loss: float
    round: int = 0


def ordered_updates(updates: Sequence[Update]) -> list[Update]:
    """The updates sorted by (device, round), after checking they can be combined.

    Raises ValueError for an empty round or deltas that are not 1-D of one common size.
    """
    if not updates:
        raise ValueError("aggregate() needs at least one update")
    ordered = sorted(updates, key=lambda u: (u.device, u.round))
    size = ordered[0].delta.size
    for u in ordered:
        if u.delta.ndim != 1 or u.delta.size != size:
            raise ValueError(
                f"update of device {u.device} has shape {u.delta.shape}, expected ({size},)"
            )
    return ordered


class Aggregator:
    """Combines updates into one delta.

    Subclasses implement either :meth:`weights` (a weighted mean, the default
    :meth:`combine`) or :meth:`combine` itself (robust aggregators).
    """

    name = "abstract"

    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        """Non-negative weight per update (same order); they are normalised to sum to 1."""
        raise NotImplementedError(f"{self.name} is not a weighted mean")

    def combine(self, ordered: list[Update]) -> np.ndarray:
        """The aggregate (float64, model size) of updates already in ascending device order.

        Default: the mean weighted by :meth:`weights`, accumulated in float64.
        """
        w = np.asarray(self.weights(ordered), dtype=np.float64)
        total = w.sum()
        if not np.isfinite(total) or total <= 0:
            raise ValueError(f"{self.name}: weights sum to {total}")
        acc = np.zeros(ordered[0].delta.size, np.float64)
        for wi, u in zip(w, ordered):
            acc += (wi / total) * u.delta
        return acc

    def aggregate(self, updates: Sequence[Update], out: np.ndarray | None = None) -> np.ndarray:
        """Combine ``updates`` in ascending device order.

        Returns ``out`` (float32, model size; allocated when None) holding the aggregate.
        """
        acc = self.combine(ordered_updates(updates))
        if out is None:
            out = np.empty(acc.size, np.float32)
        np.copyto(out, acc, casting="same_kind")
        return out


class SampleWeighted(Aggregator):
    """FedAvg (McMahan et al., AISTATS 2017): weight = the device's sample count."""

    name = "sample-weighted"

    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        return np.array([max(u.samples, 0) for u in updates], np.float64)


class Mean(Aggregator):
    """Plain mean: every update weighs the same."""

    name = "mean"

    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        return np.ones(len(updates))


# The weighted means; the robust ones are registered in robust.ROBUST_AGGREGATORS and both
# are merged by edgefl.algorithms.aggregators.all_aggregators.
AGGREGATORS: dict[str, type[Aggregator]] = {a.name: a for a in (SampleWeighted, Mean)}
