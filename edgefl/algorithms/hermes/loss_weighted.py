"""Loss-weighted aggregation of Hermes (coordinator side, pure numpy, no MPI).

Hermes (Basani et al., HiPC 2024, arXiv:2410.20495) aggregates asynchronously: each major
update g a device pushes is folded into a running average weighted by inverse test loss,

    saved <- (w1 * saved + w2 * g) / (w1 + w2),   w1 = 1 / L_global,   w2 = 1 / L_candidate,

where L_global is the test loss of the current global model and L_candidate the test loss of
the model obtained by applying g (the authors' master code evaluates base model + g on the
server's test set). edgefl's server optimizer then applies ``saved`` to the current global
model. (The authors' master applies it to the *initial* model, their workers sending the
sum of all their gradients so far, so there ``saved`` stands for the whole displacement;
docs/hermes.md section 3.) The first update (or any update while L_global is unknown) sets
saved = g. Under an asynchronous policy the Hermes coordinator passes g already scaled by
the policy's share of the fleet (coordinator.py), as plain ASP applies it.

Applied to the current global model after every push, ``saved`` acts like an adaptive
momentum buffer: with rho_t = w1 / (w1 + w2), saved_t = rho_t * saved_{t-1} + (1 - rho_t) * g_t,
so an update's total contribution over the following pushes sums to about 1 (exactly 1 for a
constant rho; the very first update, which starts the average with weight 1, sums to
1 / (1 - rho)). A better candidate (lower L_candidate) gets a larger share immediately.

``LossSoftmax`` is the softmax(-loss / temperature) variant over a buffer of the latest major
updates. Both follow :class:`edgefl.policies.aggregation.Aggregator`: ``aggregate(updates)``
combines one round's updates (in ascending device order, so arrival order does not matter),
and ``push`` serves asynchronous coordinators one update at a time.

Which loss is used: ``Update.loss`` by default (the device's local training loss, free but a
different quantity); pass ``losses={device: L_candidate}`` (test losses of global + delta,
computed by the coordinator with :func:`candidate`) to follow the paper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgefl.config import checks
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Aggregator, Update, ordered_updates

MIN_LOSS = 1e-12  # a loss of exactly 0 is treated as this (weight 1e12, not a division by 0)


def candidate(
    global_params: np.ndarray, delta: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """The model the coordinator evaluates for an update: ``global_params + delta`` (float32).

    Its test loss is the update's L_candidate. (With a server learning rate or optimizer, the
    caller may instead evaluate the model that optimizer step would produce.)
    """
    if global_params.shape != delta.shape:
        raise ValueError(f"shape mismatch: model {global_params.shape}, delta {delta.shape}")
    if out is None:
        out = np.empty(global_params.shape, np.float32)
    np.add(global_params, delta, out=out, casting="same_kind")
    return out


def _check_loss(loss: float, what: str) -> float:
    x = float(loss)
    if math.isnan(x) or x < 0 or math.isinf(x):
        raise ValueError(f"{what} must be a finite loss >= 0, got {loss}")
    return max(x, MIN_LOSS)


def _losses(updates: Sequence[Update], losses: Mapping[int, float] | None) -> np.ndarray:
    if losses is None:
        return np.array([_check_loss(u.loss, f"device {u.device} loss") for u in updates])
    try:
        return np.array([_check_loss(losses[u.device], f"device {u.device} loss") for u in updates])
    except KeyError as e:
        raise ValueError(f"losses has no entry for device {e.args[0]}") from None


class LossWeighted(Aggregator):
    """Hermes' running inverse-loss average (``algorithm.aggregation = "loss-weighted"``).

    Stateful: keeps ``saved`` (float64, model size) and the latest global test loss.
    :meth:`push` folds in one update (asynchronous coordinators); :meth:`aggregate` folds in a
    round's updates one by one in ascending device order and returns ``saved``. Call
    :meth:`set_global_loss` with the global model's test loss after each model change.

    :meth:`weights` gives the stateless inverse-loss weights 1 / L of a set of updates (what
    the running average reduces to within one round when saved is empty and the losses are
    equal); it is not used by :meth:`aggregate`.
    """

    name = "loss-weighted"

    def __init__(self) -> None:
        self.saved: np.ndarray | None = None
        self.global_loss: float | None = None
        self.pushes = 0

    def set_global_loss(self, loss: float | None) -> None:
        """Record the test loss of the current global model (the next w1 = 1 / loss)."""
        self.global_loss = None if loss is None else _check_loss(loss, "global loss")

    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        return 1.0 / _losses(updates, None)

    def push(
        self, delta: np.ndarray, candidate_loss: float, global_loss: float | None = None
    ) -> np.ndarray:
        """Fold one update into the running average and return ``saved`` as float32 (a copy).

        Args:
            delta: the pushed update g (model size).
            candidate_loss: test loss of the model after applying g (w2 = 1 / it).
            global_loss: test loss of the current global model (w1 = 1 / it); default: the
                value given to :meth:`set_global_loss`.
        """
        lc = _check_loss(candidate_loss, "candidate loss")
        if global_loss is not None:
            self.set_global_loss(global_loss)
        g = np.asarray(delta, dtype=np.float64).ravel()
        if self.saved is None or self.global_loss is None:
            self.saved = g.copy()
        else:
            if self.saved.size != g.size:
                raise ValueError(f"delta has {g.size} values, saved has {self.saved.size}")
            w1, w2 = 1.0 / self.global_loss, 1.0 / lc
            self.saved = (w1 * self.saved + w2 * g) / (w1 + w2)
        self.pushes += 1
        return self.saved.astype(np.float32)

    def aggregate(
        self,
        updates: Sequence[Update],
        out: np.ndarray | None = None,
        losses: Mapping[int, float] | None = None,
    ) -> np.ndarray:
        """Fold a round's updates in ascending device order; returns ``saved`` in ``out``.

        ``losses`` maps device id to the candidate's test loss (default: ``Update.loss``).
        Between updates of the same round the global loss stays the one set before the round.
        """
        return _to_out(self.combine(ordered_updates(updates), losses), out)

    def combine(
        self, ordered: list[Update], losses: Mapping[int, float] | None = None
    ) -> np.ndarray:
        """:meth:`aggregate` on updates already in ascending device order (float64 result)."""
        for u, lc in zip(ordered, _losses(ordered, losses)):
            self.push(u.delta, lc)
        assert self.saved is not None
        return self.saved.copy()

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints: ``saved`` (float64 array or None), global loss, pushes."""
        return {
            "saved": None if self.saved is None else self.saved.copy(),
            "global_loss": self.global_loss,
            "pushes": self.pushes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["saved"]
        self.saved = None if saved is None else np.array(saved, dtype=np.float64).ravel()
        gl = state["global_loss"]
        self.global_loss = None if gl is None else float(gl)
        self.pushes = int(state["pushes"])


class LossSoftmax(Aggregator):
    """softmax(-loss / temperature) weighting (``algorithm.aggregation = "loss-softmax"``).

    Within a round (:meth:`aggregate`) weight_i = exp(-L_i / T) / sum_j exp(-L_j / T) over the
    round's updates. Asynchronously (:meth:`push`) the same weighting runs over a buffer of the
    latest ``buffer`` major updates (a newer push from a device replaces its older one), and
    the result plays the role of ``saved``: applied after every push, each update contributes
    about once in total over its stay in the buffer when the losses are alike.

    The temperature sets how sharply lower losses win: two updates whose losses differ by dL
    weigh exp(dL / T) : 1. T near the typical loss level makes it about as loss-sensitive as
    1 / L weighting; T -> inf is the plain mean, T -> 0 picks the best update.

    Args:
        temperature: T > 0 (``hermes.softmax_temperature``, default 0.5).
        buffer: most updates kept for :meth:`push`, >= 1 (``hermes.softmax_buffer``,
            default 4; 1 = apply each major update alone).
    """

    name = "loss-softmax"

    def __init__(self, temperature: float = 0.5, buffer: int = 4) -> None:
        temperature = checks.number("hermes.softmax_temperature", temperature)
        if not temperature > 0:
            raise ConfigError(
                f"config key 'hermes.softmax_temperature' = {temperature!r}: must be > 0"
            )
        buffer = checks.integer("hermes.softmax_buffer", buffer)
        if buffer < 1:
            raise ConfigError(f"config key 'hermes.softmax_buffer' = {buffer!r}: must be >= 1")
        self.temperature = temperature
        self.buffer = buffer
        self._buf: list[tuple[int, np.ndarray, float]] = []  # (device, delta, loss), oldest first

    def softmax_weights(self, losses: Sequence[float] | np.ndarray) -> np.ndarray:
        """Normalised softmax(-L / T) weights (stable: shifted by the smallest loss)."""
        ls = np.asarray(losses, dtype=np.float64)
        z = -(ls - ls.min()) / self.temperature
        w = np.exp(z)
        return w / w.sum()

    def weights(self, updates: Sequence[Update]) -> np.ndarray:
        return self.softmax_weights(_losses(updates, None))

    def aggregate(
        self,
        updates: Sequence[Update],
        out: np.ndarray | None = None,
        losses: Mapping[int, float] | None = None,
    ) -> np.ndarray:
        """Softmax-weighted mean of a round's deltas (ascending device order).

        ``losses`` maps device id to the candidate's test loss (default: ``Update.loss``).
        """
        return _to_out(self.combine(ordered_updates(updates), losses), out)

    def combine(
        self, ordered: list[Update], losses: Mapping[int, float] | None = None
    ) -> np.ndarray:
        """:meth:`aggregate` on updates already in ascending device order (float64 result)."""
        w = self.softmax_weights(_losses(ordered, losses))
        return _weighted_sum([u.delta for u in ordered], w)

    def push(self, device: int, delta: np.ndarray, loss: float) -> np.ndarray:
        """Add one major update to the buffer; return the softmax-weighted buffer (float32)."""
        lc = _check_loss(loss, "candidate loss")
        g = np.array(delta, dtype=np.float32).ravel()
        if self._buf and self._buf[0][1].size != g.size:
            raise ValueError(f"delta has {g.size} values, buffer holds {self._buf[0][1].size}")
        self._buf = [e for e in self._buf if e[0] != int(device)]
        self._buf.append((int(device), g, lc))
        del self._buf[: max(0, len(self._buf) - self.buffer)]
        entries = sorted(self._buf, key=lambda e: e[0])  # ascending device: order-independent
        w = self.softmax_weights([e[2] for e in entries])
        return _weighted_sum([e[1] for e in entries], w).astype(np.float32)

    @property
    def buffered(self) -> list[int]:
        """Device ids in the buffer, oldest first."""
        return [e[0] for e in self._buf]

    def state_dict(self) -> dict[str, Any]:
        """State for checkpoints: buffered devices, deltas (2-D float32 array) and losses."""
        return {
            "devices": [e[0] for e in self._buf],
            "deltas": np.stack([e[1] for e in self._buf]) if self._buf else None,
            "losses": [e[2] for e in self._buf],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        devices = [int(d) for d in state["devices"]]
        deltas = state["deltas"]
        rows = [] if deltas is None else [np.array(r, dtype=np.float32) for r in deltas]
        if len(rows) != len(devices):
            raise ValueError("LossSoftmax state: devices and deltas differ in length")
        self._buf = [(d, r, float(x)) for d, r, x in zip(devices, rows, state["losses"])]


def _weighted_sum(deltas: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
    acc = np.zeros(np.asarray(deltas[0]).size, np.float64)
    for wi, d in zip(w, deltas):
        acc += wi * np.asarray(d, dtype=np.float64).ravel()
    return acc


def _to_out(acc: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        out = np.empty(acc.size, np.float32)
    np.copyto(out, acc, casting="same_kind")
    return out


LOSS_AGGREGATORS: dict[str, type[Aggregator]] = {
    LossWeighted.name: LossWeighted,
    LossSoftmax.name: LossSoftmax,
}


def make_loss_aggregator(name: str, hermes: Mapping[str, Any] | None = None) -> Aggregator:
    """``loss-weighted`` or ``loss-softmax`` from ``algorithm.aggregation`` and ``[hermes]``."""
    if name == LossWeighted.name:
        return LossWeighted()
    if name == LossSoftmax.name:
        h = hermes or {}
        kw = {}
        if "softmax_temperature" in h:
            kw["temperature"] = h["softmax_temperature"]
        if "softmax_buffer" in h:
            kw["buffer"] = h["softmax_buffer"]
        return LossSoftmax(**kw)
    raise ConfigError(
        f"config key 'algorithm.aggregation' = {name!r}: expected one of "
        + ", ".join(LOSS_AGGREGATORS)
    )


#: the aggregation-axis choices this module implements
LOSS_AGGREGATIONS = ("loss-weighted", "loss-softmax")
