"""Aggregation of device updates on the coordinator (pure numpy, no MPI).

Every aggregator combines a round's updates in ascending device order, so the result does
not depend on the order in which messages arrived (the determinism contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


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


class Aggregator(ABC):
    """Combines updates into one delta. Subclasses implement :meth:`weights`."""

    name = "abstract"

    @abstractmethod
    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        """Non-negative weight per update (same order); they are normalised to sum to 1."""

    def aggregate(self, updates: Sequence[Update], out: np.ndarray | None = None) -> np.ndarray:
        """Weighted mean of the deltas in ascending device order (float64 accumulation).

        Returns ``out`` (float32, model size) holding the aggregate.
        """
        if not updates:
            raise ValueError("aggregate() needs at least one update")
        ordered = sorted(updates, key=lambda u: u.device)
        w = np.asarray(self.weights(ordered), dtype=np.float64)
        total = w.sum()
        if not np.isfinite(total) or total <= 0:
            raise ValueError(f"{self.name}: weights sum to {total}")
        acc = np.zeros(ordered[0].delta.size, np.float64)
        for wi, u in zip(w, ordered):
            acc += (wi / total) * u.delta
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


AGGREGATORS: dict[str, type[Aggregator]] = {a.name: a for a in (SampleWeighted, Mean)}


def make_aggregator(name: str) -> Aggregator:
    """Aggregator by config name (``algorithm.aggregation``)."""
    try:
        return AGGREGATORS[name]()
    except KeyError:
        raise ConfigError(
            f"config key 'algorithm.aggregation' = {name!r}: expected one of "
            + ", ".join(AGGREGATORS)
        ) from None
