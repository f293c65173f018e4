"""GDDR residual buffers: delayed, sum-preserving release of update coordinates (pure, no MPI).

GDDR ("gradient descent with delayed reconvergence") lets part of each device's update skip
the current aggregation: withheld coordinates wait in a per-device residual and are released
later, so the update flow keeps its total while each message carries fewer values. It is
random-k sparsification with error feedback (Stich, Cordonnier, Jaggi, "Sparsified SGD with
memory", NeurIPS 2018; Karimireddy et al., "Error feedback fixes SignSGD", ICML 2019) with a
hard bound on how long a coordinate may be withheld.

Semantics (one :class:`GDDRResidual` per device; ``t`` is the device's step, strictly
increasing, e.g. the sequence number of the update message):

1. A withhold mask W_t ~ Bernoulli(``alpha``) over the coordinates is drawn from a generator
   seeded by ``derive_seed(run_seed, device, t, MASK_STREAM)``: a pure function of the run
   seed, so the coordinator can draw the same mask (:func:`withhold_mask`).
2. Every held coordinate has a *due step*, fixed when it became held: a coordinate that was
   not held and is withheld at step s gets due = s + tau_s, with tau_s the tau in force at s.
   It is force-released at the first step t >= due (so its values wait at most tau_s steps,
   after tau_s consecutive withholds). A tau change affects only entries opened afterwards,
   so no entry is dropped or released twice.
3. Released at t: R_t = {i : not W_t[i]} | {i : held[i] and due[i] <= t}. A released
   coordinate carries its accumulated residual plus its current value; the others add their
   current value to the residual. The message carries only the values of R_t, in ascending
   coordinate order; the coordinator rebuilds R_t with :class:`ReleaseDecoder`.
4. Optional installments (``gddr.installments`` = n > 1): the residual a held coordinate
   accumulated is not sent at once when it is released but moved to an installment bucket,
   which pays geometrically decreasing installments (ratio ``gddr.installment_ratio``) at
   that coordinate's next n releases. Installments ride along with released coordinates only,
   so they never change R_t (nor the decoder), and never change the total.

Invariant, per device, up to float64 rounding: sum of every value sent (float32) + the
residual held (float64: residual + installment buckets) = sum of every update produced.
Messages are float32; the float32 rounding error of each sent value stays in the residual
(error feedback of the rounding), so nothing is lost to the cast.

Payload density (fraction of coordinates sent per step). With i.i.d. masks the number k of
consecutive withholds of a coordinate is a Markov chain on 0..tau (k -> k+1 with probability
alpha, k -> 0 otherwise, and k = tau -> 0 surely); its stationary law is
pi_k = pi_0 * alpha^k, and a coordinate is released exactly when the chain returns to 0, so
the stationary density is :func:`stationary_density` = pi_0 = (1 - alpha) / (1 - alpha^(tau+1))
(0.6062 at alpha 0.4, tau 4). The issue's (1 - alpha) + alpha^tau (0.6256) counts the forced
release as if it happened after tau consecutive *mask draws* regardless of releases in
between; it over-states the density by 3.2% at alpha 0.4, tau 4 (:func:`issue_density`).

What the coordinator must track per device to decode (see :class:`ReleaseDecoder`): the due
step of every held coordinate (an int32 per coordinate, -1 = not held), the device's last
decoded step, and, for every message, the tau the device used for entries opened at that step
(the device reports it, :attr:`Release.tau`). It must decode each device's messages in step
order and none may be skipped (a skipped step would leave its new entries out of the mirror).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# The state format (STATE_FORMAT, MASK_STREAM, check_state) lives with the residual
# checkpoint, at the bottom of the layering; it is re-exported here.
from edgefl.algorithms.gddr.store import MASK_STREAM, NOT_HELD, STATE_FORMAT, check_state
from edgefl.errors import ConfigError
from edgefl.seeding import derive_seed

_NOT_HELD = NOT_HELD
_DUE_MAX = np.iinfo(np.int32).max


# ------------------------------------------------------------------------------ validation


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_alpha(alpha: float) -> float:
    """``gddr.alpha``: withhold probability, 0 <= alpha < 1 (default 0.4)."""
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ConfigError(f"config key 'gddr.alpha' = {alpha!r}: must be a number") from None
    if isinstance(alpha, bool) or not (0.0 <= a < 1.0):
        raise ConfigError(f"config key 'gddr.alpha' = {alpha!r}: must be >= 0 and < 1")
    return a


def check_tau(tau: int, key: str = "gddr.tau") -> int:
    """``gddr.tau`` (and the adaptive bounds): most steps a value may wait, an int >= 1."""
    if not _is_int(tau) or tau < 1:
        raise ConfigError(f"config key '{key}' = {tau!r}: must be an integer >= 1")
    if tau > 1_000_000:
        raise ConfigError(f"config key '{key}' = {tau!r}: must be <= 1000000")
    return int(tau)


def check_installments(installments: int, ratio: float) -> tuple[int, float]:
    """``gddr.installments`` (int >= 1) and ``gddr.installment_ratio`` (0 < ratio <= 1)."""
    if not _is_int(installments) or not (1 <= installments <= 127):
        raise ConfigError(
            f"config key 'gddr.installments' = {installments!r}: must be an integer in 1..127"
        )
    try:
        q = float(ratio)
    except (TypeError, ValueError):
        q = float("nan")
    if isinstance(ratio, bool) or not (0.0 < q <= 1.0):
        raise ConfigError(f"config key 'gddr.installment_ratio' = {ratio!r}: must be > 0 and <= 1")
    return int(installments), q


# ------------------------------------------------------------------------------ formulas


def stationary_density(alpha: float, tau: int) -> float:
    """Exact long-run fraction of coordinates released per step: (1-alpha)/(1-alpha^(tau+1))."""
    a = check_alpha(alpha)
    t = check_tau(tau)
    return (1.0 - a) / (1.0 - a ** (t + 1))


def issue_density(alpha: float, tau: int) -> float:
    """The issue's approximation (1 - alpha) + alpha^tau (over-states the exact density)."""
    a = check_alpha(alpha)
    t = check_tau(tau)
    return (1.0 - a) + a**t


def geometric_weight(k: np.ndarray | int, ratio: float) -> np.ndarray:
    """Share of a remainder paid by the first of ``k`` geometric installments of ratio ``ratio``.

    (1 - ratio) / (1 - ratio^k), or 1/k for ratio 1; 1 for k = 1 (the last one pays all).
    Paying this share of the remainder at every step yields amounts proportional to
    1, ratio, ratio^2, ..., ratio^(k-1).
    """
    k = np.asarray(k, dtype=np.float64)
    if ratio == 1.0:
        return 1.0 / k
    return (1.0 - ratio) / (1.0 - np.power(ratio, k))


def split_exact(remaining: np.ndarray, share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split float64 ``remaining`` into (amount, rest) with amount + rest == remaining exactly.

    amount ~= remaining * share (0 <= share <= 1). rest = fl(remaining - a) and then
    amount = remaining - rest, which is exact by Sterbenz's lemma (either a >= remaining/2, or
    rest >= remaining/2), so a sequence of splits sums to the original exactly in real
    arithmetic: installments and replay never create or lose value.
    """
    a = remaining * share
    rest = remaining - a
    return remaining - rest, rest


# ------------------------------------------------------------------------------ masks


def withhold_mask(run_seed: int, device: int, step: int, size: int, alpha: float) -> np.ndarray:
    """Bernoulli(``alpha``) withhold mask (bool, ``size`` coordinates) of ``device`` at ``step``.

    A pure function of its arguments: uniform float32 draws from
    ``np.random.default_rng(derive_seed(run_seed, device, step, MASK_STREAM))`` compared with
    float32(alpha), so worker and coordinator draw bit-identical masks.
    """
    if alpha <= 0.0:
        return np.zeros(size, dtype=bool)
    rng = np.random.default_rng(derive_seed(run_seed, device, step, MASK_STREAM))
    return rng.random(size, dtype=np.float32) < np.float32(alpha)


def _advance_schedule(
    withhold: np.ndarray, due: np.ndarray, step: int, tau: int
) -> tuple[np.ndarray, np.ndarray]:
    """Apply one step to ``due`` in place; returns (released indices, was-held mask)."""
    held = due >= 0
    release = np.logical_not(withhold)
    release |= held & (due <= step)
    idx = np.flatnonzero(release)  # index arrays: much faster than scattered boolean masks
    opened = np.flatnonzero(withhold & ~held)
    due[idx] = _NOT_HELD
    due[opened] = step + tau
    return idx, held


def _check_due_range(step: int, tau: int) -> None:
    if step + tau > _DUE_MAX:
        raise ValueError(f"GDDR step {step} + tau {tau} exceeds the int32 due-step range")


def expected_release_mask(
    run_seed: int, device: int, step: int, alpha: float, due: np.ndarray, tau: int
) -> tuple[np.ndarray, np.ndarray]:
    """Coordinator-side regeneration of one step of a device's release set.

    Args:
        run_seed: the run seed (config ``seed``).
        device: device id.
        step: the device's step (message step), > every earlier step of this device.
        alpha: ``gddr.alpha``.
        due: the device's due steps before ``step`` (int32, -1 = not held); not modified.
        tau: the tau the device used for entries opened at ``step`` (:attr:`Release.tau`).

    Returns:
        (release mask (bool), due steps after ``step``). The worker computes its release set
        with the same two functions, so the sets are identical whenever ``due`` mirrors the
        worker's (it does if every step of the device was decoded in order).
    """
    new_due = np.array(due, dtype=np.int32, copy=True)
    _check_due_range(step, tau)
    w = withhold_mask(run_seed, device, step, new_due.size, check_alpha(alpha))
    idx, _ = _advance_schedule(w, new_due, step, check_tau(tau))
    release = np.zeros(new_due.size, dtype=bool)
    release[idx] = True
    return release, new_due


# ------------------------------------------------------------------------------ worker side


@dataclass(frozen=True)
class Release:
    """What one :meth:`GDDRResidual.step` sends.

    Args:
        step: the device step it belongs to.
        tau: tau the device used for entries opened at this step (goes in the message header;
            the coordinator's decoder needs it).
        indices: released coordinates, ascending (int64). They need not travel: the
            coordinator regenerates them (:class:`ReleaseDecoder`).
        values: float32 values to send, one per index: residual + installment + current value.
        norm: L2 norm of the update produced at this step (float64; for adaptive tau).
        size: model coordinates.
    """

    step: int
    tau: int
    indices: np.ndarray
    values: np.ndarray
    norm: float
    size: int

    @property
    def density(self) -> float:
        """Fraction of the model's coordinates this message carries."""
        return self.indices.size / self.size if self.size else 0.0


class GDDRResidual:
    """Worker-side GDDR residual of one device (see the module docstring for the semantics).

    Args:
        size: model coordinates (length of every update).
        device: device id (part of the mask seed).
        run_seed: run seed (config ``seed``; part of the mask seed).
        alpha: ``gddr.alpha``, withhold probability, 0 <= alpha < 1 (default 0.4).
        tau: ``gddr.tau``, most steps a value may be withheld, >= 1 (default 4). Changed later
            with :meth:`set_tau` (adaptive tau); a change affects entries opened afterwards.
        installments: ``gddr.installments``, installments a released residual is paid in
            (default 1: all at once).
        installment_ratio: ``gddr.installment_ratio``, ratio between consecutive installments,
            0 < ratio <= 1 (default 0.5).

    Memory: 21 bytes per coordinate (float64 residual, float64 bucket, int32 due, int8 count).
    """

    def __init__(
        self,
        size: int,
        device: int,
        run_seed: int,
        alpha: float = 0.4,
        tau: int = 4,
        installments: int = 1,
        installment_ratio: float = 0.5,
    ) -> None:
        if not _is_int(size) or size < 0:
            raise ValueError(f"GDDRResidual size must be a non-negative int, got {size!r}")
        self.size = int(size)
        self.device = int(device)
        self.run_seed = int(run_seed)
        self.alpha = check_alpha(alpha)
        self._tau = check_tau(tau)
        self.installments, self.installment_ratio = check_installments(
            installments, installment_ratio
        )
        self._res = np.zeros(self.size, np.float64)
        self._bucket = np.zeros(self.size, np.float64)
        self._left = np.zeros(self.size, np.int8)
        self._due = np.full(self.size, _NOT_HELD, np.int32)
        self.last_step = -1
        self.produced_steps = 0

    # -- tau
    @property
    def tau(self) -> int:
        """tau used for entries opened at the next step."""
        return self._tau

    def set_tau(self, tau: int) -> None:
        """Use ``tau`` for entries opened from the next step on (held entries keep their due)."""
        self._tau = check_tau(tau)

    # -- inspection
    @property
    def due(self) -> np.ndarray:
        """Due step of every coordinate (int32, -1 = not held); a read-only view."""
        v = self._due.view()
        v.flags.writeable = False
        return v

    @property
    def held_count(self) -> int:
        """Coordinates currently withheld (with a due step)."""
        return int(np.count_nonzero(self._due >= 0))

    def held(self) -> np.ndarray:
        """Everything produced and not yet sent, per coordinate (float64; residual + buckets)."""
        return self._res + self._bucket

    # -- stepping
    def step(self, g: np.ndarray, t: int) -> Release:
        """Process the update ``g`` produced at device step ``t``; returns what to send.

        ``g``: flat float array of ``size`` finite values (float32 on the wire).
        ``t``: > the previous step (steps may skip: a held entry then comes due at the first
        step >= its due step). A non-finite ``g`` raises ValueError and changes nothing.
        """
        g = np.asarray(g)
        if g.shape != (self.size,) or g.dtype.kind != "f":
            raise ValueError(
                f"GDDR update is {g.dtype}{list(g.shape)}, expected a float[{self.size}]"
            )
        g64 = g.astype(np.float64, copy=False)
        norm2 = float(np.dot(g64, g64))
        # a float32 update with a finite squared norm is finite everywhere
        if not math.isfinite(norm2) and not np.isfinite(g64).all():
            raise ValueError(f"GDDR update of device {self.device} at step {t} is not finite")
        idx, vals = self.advance64(g64, t)
        out = vals.astype(np.float32)
        # float32 rounding error stays in the residual (exact: Sterbenz), so nothing is lost
        self._res[idx] = vals - out.astype(np.float64)
        self.produced_steps += 1
        return Release(
            step=int(t),
            tau=self._tau,
            indices=idx,
            values=out,
            norm=math.sqrt(norm2),
            size=self.size,
        )

    def advance64(self, g64: np.ndarray | None, t: int) -> tuple[np.ndarray, np.ndarray]:
        """One step in float64 without the float32 cast: returns (indices, float64 values).

        ``g64=None`` means a zero update (replay shadows, ``edgefl.algorithms.gddr.replay``). Unlike
        :meth:`step`, it does not check ``g64`` and keeps no rounding carry; use :meth:`step`
        for real updates.
        """
        if not _is_int(t) or t < 0:
            raise ValueError(f"GDDR step must be a non-negative int, got {t!r}")
        t = int(t)
        if t <= self.last_step:
            raise ValueError(
                f"GDDR step {t} of device {self.device} is not after the last step {self.last_step}"
            )
        _check_due_range(t, self._tau)
        w = withhold_mask(self.run_seed, self.device, t, self.size, self.alpha)
        idx, was_held = _advance_schedule(w, self._due, t, self._tau)
        if self.installments > 1:
            # a released entry's residual goes to its bucket, whose schedule restarts
            cidx = idx[was_held[idx]]
            self._bucket[cidx] += self._res[cidx]
            self._res[cidx] = 0.0
            self._left[cidx] = self.installments
        if g64 is not None:
            np.add(self._res, g64, out=self._res)
        vals = self._res[idx]  # residual (or rounding carry) + current value; a copy
        self._res[idx] = 0.0
        if self.installments > 1:
            paying = self._left[idx] > 0
            pidx = idx[paying]
            if pidx.size:
                share = geometric_weight(self._left[pidx], self.installment_ratio)
                amount, rest = split_exact(self._bucket[pidx], share)
                self._bucket[pidx] = rest
                self._left[pidx] -= 1
                vals[paying] += amount
        self.last_step = t
        return idx, vals

    def flush(self) -> np.ndarray:
        """Everything held (float64, dense, ``size``), at the end of training; empties the state.

        The step counter is kept. Send it once (dense) and call :meth:`ReleaseDecoder.flush`.
        """
        out = self._res + self._bucket
        self._res[:] = 0.0
        self._bucket[:] = 0.0
        self._left[:] = 0
        self._due[:] = _NOT_HELD
        return out

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a restore needs (copies): values, due steps, step counter, tau, config.

        The mask generator is stateless (re-seeded from (run seed, device, step) every step),
        so the step counter is its whole state.
        """
        return {
            "format": STATE_FORMAT,
            "size": self.size,
            "device": self.device,
            "run_seed": self.run_seed,
            "mask_stream": MASK_STREAM,
            "alpha": self.alpha,
            "tau": self._tau,
            "installments": self.installments,
            "installment_ratio": self.installment_ratio,
            "last_step": self.last_step,
            "produced_steps": self.produced_steps,
            "residual": self._res.copy(),
            "bucket": self._bucket.copy(),
            "bucket_left": self._left.copy(),
            "due": self._due.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output; ValueError if it belongs to another model,
        device or run (size, device, run seed, mask stream, alpha, installments must match)."""
        check_state(state)
        for key, mine in (
            ("size", self.size),
            ("device", self.device),
            ("run_seed", self.run_seed),
            ("alpha", self.alpha),
            ("installments", self.installments),
            ("installment_ratio", self.installment_ratio),
        ):
            if state[key] != mine:
                raise ValueError(f"GDDR state has {key} = {state[key]!r}, this residual {mine!r}")
        self._tau = check_tau(int(state["tau"]))
        self.last_step = int(state["last_step"])
        self.produced_steps = int(state["produced_steps"])
        self._res = np.array(state["residual"], np.float64, copy=True)
        self._bucket = np.array(state["bucket"], np.float64, copy=True)
        self._left = np.array(state["bucket_left"], np.int8, copy=True)
        self._due = np.array(state["due"], np.int32, copy=True)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> GDDRResidual:
        """A residual restored from ``state`` (its own size, device, seed and settings)."""
        check_state(state)
        r = cls(
            int(state["size"]),
            int(state["device"]),
            int(state["run_seed"]),
            alpha=float(state["alpha"]),
            tau=int(state["tau"]),
            installments=int(state["installments"]),
            installment_ratio=float(state["installment_ratio"]),
        )
        r.load_state_dict(state)
        return r


# ------------------------------------------------------------------------------ coordinator


class ReleaseDecoder:
    """Coordinator-side mirror of one device's release schedule (indices never travel).

    It holds what the coordinator must track for the device: the due step of every held
    coordinate (int32 per coordinate, -1 = not held; 4 bytes per coordinate and device), the
    last decoded step, and a log of (step, tau) pairs decoded (for replay after a failure,
    :meth:`steps_after`). Feed it every message of the device in step order with the tau the
    device reported (:attr:`Release.tau`); it returns the indices the values belong to.

    Args:
        size: model coordinates.
        device: device id.
        run_seed: run seed (config ``seed``).
        alpha: ``gddr.alpha`` (default 0.4).
        history: (step, tau) pairs kept for :meth:`steps_after` (default 4096; keep it at
            least ``gddr.checkpoint_every`` plus the worst message lag).
    """

    def __init__(
        self, size: int, device: int, run_seed: int, alpha: float = 0.4, history: int = 4096
    ) -> None:
        if not _is_int(size) or size < 0:
            raise ValueError(f"ReleaseDecoder size must be a non-negative int, got {size!r}")
        self.size = int(size)
        self.device = int(device)
        self.run_seed = int(run_seed)
        self.alpha = check_alpha(alpha)
        self.history = int(history)
        self._due = np.full(self.size, _NOT_HELD, np.int32)
        self.last_step = -1
        self._log: list[tuple[int, int]] = []
        self._dropped_through = -1  # newest step dropped from the log

    @property
    def due(self) -> np.ndarray:
        """Mirror of the device's due steps (int32, -1 = not held); a read-only view."""
        v = self._due.view()
        v.flags.writeable = False
        return v

    def advance(self, step: int, tau: int) -> np.ndarray:
        """Indices (int64, ascending) the device released at ``step``, which used ``tau``."""
        if not _is_int(step) or step <= self.last_step:
            raise ValueError(
                f"decoder of device {self.device}: step {step!r} is not after the last "
                f"decoded step {self.last_step} (decode every step, in order)"
            )
        tau = check_tau(tau)
        _check_due_range(int(step), tau)
        w = withhold_mask(self.run_seed, self.device, int(step), self.size, self.alpha)
        idx, _ = _advance_schedule(w, self._due, int(step), tau)
        self._record(int(step), tau)
        return idx

    def decode(
        self, step: int, tau: int, values: np.ndarray, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Scatter a message's ``values`` into a dense float32 vector (``out`` if given).

        ValueError if the number of values is not the number of released coordinates (the
        mirror is then out of step with the device; the message must be rejected). The mirror
        advances only if the count matches.
        """
        values = np.asarray(values)
        if not _is_int(step) or step <= self.last_step:
            raise ValueError(
                f"decoder of device {self.device}: step {step!r} is not after the last "
                f"decoded step {self.last_step} (decode every step, in order)"
            )
        release, new_due = expected_release_mask(
            self.run_seed, self.device, int(step), self.alpha, self._due, tau
        )
        idx = np.flatnonzero(release)
        if values.shape != idx.shape:
            raise ValueError(
                f"GDDR message of device {self.device} step {step}: {values.size} values, "
                f"the mask releases {idx.size}"
            )
        self._due = new_due
        self._record(int(step), int(tau))
        if out is None:
            out = np.zeros(self.size, np.float32)
        else:
            out[:] = 0
        out[idx] = values
        return out

    def _record(self, step: int, tau: int) -> None:
        self.last_step = step
        self._log.append((step, tau))
        if len(self._log) > self.history:
            drop = len(self._log) - self.history
            self._dropped_through = self._log[drop - 1][0]
            del self._log[:drop]

    def flush(self) -> None:
        """The device flushed (sent everything dense): nothing is held any more."""
        self._due[:] = _NOT_HELD

    def steps_after(self, step: int) -> list[tuple[int, int]]:
        """Decoded (step, tau) pairs with step > ``step``, oldest first.

        ValueError if the log no longer reaches back that far.
        """
        if step < self._dropped_through:
            raise ValueError(
                f"decoder of device {self.device}: history starts at step {self._log[0][0]}, "
                f"cannot list the steps after {step}"
            )
        return [(s, t) for s, t in self._log if s > step]

    @classmethod
    def from_residual_state(cls, state: dict[str, Any], history: int = 4096) -> ReleaseDecoder:
        """The mirror as it stood when the worker's ``state`` (a state_dict) was taken."""
        check_state(state)
        d = cls(
            int(state["size"]),
            int(state["device"]),
            int(state["run_seed"]),
            float(state["alpha"]),
            history=history,
        )
        d._due = np.array(state["due"], np.int32, copy=True)
        d.last_step = int(state["last_step"])
        return d

    def state_dict(self) -> dict[str, Any]:
        """Due steps, last step and the (step, tau) log (copies), for coordinator checkpoints."""
        log = np.array(self._log, dtype=np.int64).reshape(-1, 2)
        return {
            "size": self.size,
            "device": self.device,
            "run_seed": self.run_seed,
            "alpha": self.alpha,
            "history": self.history,
            "last_step": self.last_step,
            "due": self._due.copy(),
            "log": log,
            "dropped_through": self._dropped_through,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; ValueError if size, device, seed or alpha differ."""
        for key, mine in (
            ("size", self.size),
            ("device", self.device),
            ("run_seed", self.run_seed),
            ("alpha", self.alpha),
        ):
            if state[key] != mine:
                raise ValueError(f"decoder state has {key} = {state[key]!r}, this one {mine!r}")
        due = np.asarray(state["due"])
        if due.shape != (self.size,):
            raise ValueError(f"decoder state 'due' has shape {due.shape}")
        self._due = np.array(due, np.int32, copy=True)
        self.last_step = int(state["last_step"])
        self.history = int(state["history"])
        self._log = [(int(s), int(t)) for s, t in np.asarray(state["log"]).reshape(-1, 2)]
        self._dropped_through = int(state["dropped_through"])
