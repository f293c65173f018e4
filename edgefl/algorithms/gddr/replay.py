"""Replay of a dead device's GDDR residual on the coordinator (pure, no MPI).

When a device dies, what it withheld and never sent is missing from the global sum. The
coordinator loads the device's latest residual checkpoint (:mod:`.store`) and folds
the part of it that has not reached the model into the global model with exponential decay:
over the next ``gddr.replay_steps`` steps, amounts proportional to 1, d, d^2, ... with
d = ``gddr.replay_decay``. The amounts sum to the outstanding residual exactly in real
arithmetic (:func:`edgefl.algorithms.gddr.residual.split_exact`).

Bookkeeping: what is outstanding, and why late messages are harmless
-------------------------------------------------------------------
The checkpoint was taken after device step c. Messages of steps after c that the coordinator
received already carried part of the checkpointed residual (entries released at those steps,
and installments). Conversely, a message of the dead device that arrives after the replay
started (it was in flight) may release entries the replay is also applying.

An entry is identified by (device, coordinate, opening step); its due step alone is not
enough: after a tau change two successive entries of one coordinate can share a due step
(opened at s with tau 8 and at s + 3 with tau 5), and with installments an entry is paid in
parts. Instead of a set of keys the coordinator keeps a *shadow* of the device: the residual
restored from the checkpoint, advanced with a zero update through every step the device sent
after c. The release schedule does not depend on values and a step is linear in (residual,
update), so the shadow's "sent" values at step t are exactly the part of the device's real
message at t that came from the checkpointed residual, and what the shadow still holds is
exactly the checkpointed value that has not reached the coordinator.

- :meth:`ResidualReplay.start` restores the shadow, advances it through the (step, tau)
  pairs the coordinator received after c (``ReleaseDecoder.steps_after(c)``), and schedules
  what it still holds. Received steps at or before c are ignored; if the coordinator's last
  step is older than c, the messages in between were lost and nothing of the checkpoint
  reached the model, which is what the shadow says.
- :meth:`ResidualReplay.reconcile` takes a late message of the dead device and returns its
  values minus the shadow's values for that step (the checkpointed part, which the replay is
  already applying), so the total applied per entry is its value, once.
- A second :meth:`start` for the same device (ULFM and a time-out both reporting it) is a
  no-op.

Each device contributes, overall, everything it sent plus its checkpointed residual; only
what it produced after its last checkpoint and never sent is lost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgefl.algorithms.gddr.residual import GDDRResidual, check_state, geometric_weight, split_exact
from edgefl.errors import ConfigError


def check_replay(decay: float, steps: int) -> tuple[float, int]:
    """``gddr.replay_decay`` (0 < decay < 1) and ``gddr.replay_steps`` (int >= 1)."""
    try:
        d = float(decay)
    except (TypeError, ValueError):
        d = float("nan")
    if isinstance(decay, bool) or not (0.0 < d < 1.0):
        raise ConfigError(f"config key 'gddr.replay_decay' = {decay!r}: must be > 0 and < 1")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ConfigError(f"config key 'gddr.replay_steps' = {steps!r}: must be an integer >= 1")
    return d, int(steps)


def decay_fractions(decay: float, steps: int) -> np.ndarray:
    """Shares of the residual applied at each replay step: (1-d) d^j / (1-d^n), j < n."""
    d, n = check_replay(decay, steps)
    j = np.arange(n, dtype=np.float64)
    return (1.0 - d) * np.power(d, j) / (1.0 - d**n)


@dataclass(frozen=True)
class ReplayAmount:
    """One step's replay of one device: add ``values`` at ``indices`` of the global update.

    Args:
        device: the dead device.
        indices: coordinates (int64, ascending).
        values: amounts (float64), same length.
        step_index: 0 for the first replay step of this device, up to ``steps - 1``.
    """

    device: int
    indices: np.ndarray
    values: np.ndarray
    step_index: int


@dataclass(frozen=True)
class ReplayStart:
    """What :meth:`ResidualReplay.start` scheduled (for the log and the run summary).

    Args:
        device: the dead device.
        checkpoint_step: device step the checkpoint was taken after.
        skipped_steps: received steps after the checkpoint the shadow was advanced through.
        coordinates: coordinates with a non-zero outstanding value.
        total: sum of the outstanding values (float64).
        abs_total: sum of their absolute values.
    """

    device: int
    checkpoint_step: int
    skipped_steps: int
    coordinates: int
    total: float
    abs_total: float


class _Active:
    def __init__(self, indices: np.ndarray, remaining: np.ndarray, steps_left: int) -> None:
        self.indices = indices
        self.remaining = remaining
        self.steps_left = steps_left
        self.done = 0


class ResidualReplay:
    """Coordinator-side replay of dead devices' residuals (see the module docstring).

    Args:
        decay: ``gddr.replay_decay``, ratio between consecutive replay amounts, 0 < d < 1
            (default 0.5).
        steps: ``gddr.replay_steps``, coordinator steps the replay is spread over (default 5).
    """

    def __init__(self, decay: float = 0.5, steps: int = 5) -> None:
        self.decay, self.steps = check_replay(decay, steps)
        self._shadows: dict[int, GDDRResidual] = {}
        self._active: dict[int, _Active] = {}
        self._checkpoint_step: dict[int, int] = {}

    @property
    def replaying(self) -> list[int]:
        """Devices with replay amounts still to apply, ascending."""
        return sorted(self._active)

    def started(self, device: int) -> bool:
        """True once :meth:`start` scheduled ``device`` (finished or not)."""
        return device in self._shadows

    def start(
        self, state: dict[str, Any], received: Iterable[tuple[int, int]] = ()
    ) -> ReplayStart | None:
        """Schedule the replay of a dead device's residual checkpoint.

        Args:
            state: the device's residual state (``load_residual`` / ``GDDRResidual.state_dict``).
            received: (step, tau) of every message of this device the coordinator decoded,
                oldest first (``ReleaseDecoder.steps_after(checkpoint step)``; earlier steps
                are ignored).

        Returns the schedule summary, or None if this device's replay already started.
        ValueError if ``state`` is malformed or ``received`` is not increasing.
        """
        try:
            check_state(state)
        except ValueError as exc:
            raise ValueError(f"residual replay: {exc}") from None
        device = int(state["device"])
        if device in self._shadows:
            return None
        shadow = GDDRResidual.from_state_dict(state)
        c = shadow.last_step
        skipped = 0
        for step, tau in received:
            if step <= c:
                continue
            shadow.set_tau(tau)
            shadow.advance64(None, int(step))
            skipped += 1
        held = shadow.held()
        idx = np.flatnonzero(held)
        vals = held[idx]
        self._shadows[device] = shadow
        self._checkpoint_step[device] = c
        if idx.size:
            self._active[device] = _Active(idx, vals.copy(), self.steps)
        return ReplayStart(
            device=device,
            checkpoint_step=c,
            skipped_steps=skipped,
            coordinates=int(idx.size),
            total=math.fsum(vals.tolist()),
            abs_total=float(np.abs(vals).sum()),
        )

    def next_amounts(self) -> list[ReplayAmount]:
        """This coordinator step's replay amounts, one per replaying device (ascending).

        Call once per global step and add each amount to the global update (weighted like the
        device's own updates). A device leaves :attr:`replaying` after its last amount.
        """
        out: list[ReplayAmount] = []
        for device in sorted(self._active):
            a = self._active[device]
            share = float(geometric_weight(a.steps_left, self.decay))
            amount, rest = split_exact(a.remaining, np.float64(share))
            out.append(ReplayAmount(device, a.indices, amount, a.done))
            a.remaining = rest
            a.steps_left -= 1
            a.done += 1
            if a.steps_left == 0:
                del self._active[device]
        return out

    def reconcile(self, device: int, step: int, tau: int, values: np.ndarray) -> np.ndarray:
        """Values of a late message of a replayed device, minus its checkpointed part.

        Args:
            device: the dead device.
            step: the message's step; at or before the shadow's last step nothing is removed
                (the message predates the checkpoint or was already accounted for).
            tau: the tau in the message header.
            values: the message's values (one per released coordinate, as decoded).

        Returns float64 values to apply instead of ``values``. ValueError if the device was
        not started or the value count does not match the shadow's release set.
        """
        shadow = self._shadows.get(device)
        if shadow is None:
            raise ValueError(f"residual replay: device {device} was not started")
        v = np.asarray(values, dtype=np.float64)
        if step <= shadow.last_step:
            return v.copy()
        probe = GDDRResidual.from_state_dict(shadow.state_dict())
        probe.set_tau(tau)
        idx, part = probe.advance64(None, int(step))
        if idx.shape != v.shape:
            raise ValueError(
                f"residual replay: late message of device {device} step {step} has "
                f"{v.size} values, the schedule releases {idx.size}"
            )
        self._shadows[device] = probe
        return v - part

    def reconcile_flush(self, device: int, values: np.ndarray) -> np.ndarray:
        """A late dense flush of a replayed device minus what its shadow still holds."""
        shadow = self._shadows.get(device)
        if shadow is None:
            raise ValueError(f"residual replay: device {device} was not started")
        v = np.asarray(values, dtype=np.float64)
        if v.shape != (shadow.size,):
            raise ValueError(f"residual replay: flush of device {device} has shape {v.shape}")
        return v - shadow.flush()

    def forget(self, device: int) -> None:
        """Drop a finished device's shadow (no more late messages expected; frees memory).

        A later :meth:`start` for it schedules a new replay.
        """
        if device in self._active:
            raise ValueError(f"residual replay: device {device} is still replaying")
        self._shadows.pop(device, None)
        self._checkpoint_step.pop(device, None)

    def state_dict(self) -> dict[str, Any]:
        """Shadows and schedules (copies) for coordinator checkpoints."""
        devices: dict[str, Any] = {}
        for device, shadow in self._shadows.items():
            entry: dict[str, Any] = {
                "shadow": shadow.state_dict(),
                "checkpoint_step": self._checkpoint_step[device],
            }
            a = self._active.get(device)
            if a is not None:
                entry["indices"] = a.indices.copy()
                entry["remaining"] = a.remaining.copy()
                entry["steps_left"] = a.steps_left
                entry["done"] = a.done
            devices[str(device)] = entry
        return {"decay": self.decay, "steps": self.steps, "devices": devices}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.decay, self.steps = check_replay(state["decay"], int(state["steps"]))
        self._shadows.clear()
        self._active.clear()
        self._checkpoint_step.clear()
        for key, entry in state["devices"].items():
            device = int(key)
            self._shadows[device] = GDDRResidual.from_state_dict(entry["shadow"])
            self._checkpoint_step[device] = int(entry["checkpoint_step"])
            if "indices" in entry:
                a = _Active(
                    np.array(entry["indices"], np.int64),
                    np.array(entry["remaining"], np.float64),
                    int(entry["steps_left"]),
                )
                a.done = int(entry["done"])
                self._active[device] = a
