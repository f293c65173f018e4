"""The virtual clock: when a task's download, compute and upload happen, from the profiles.

Pure functions of (profile, run seed, device, task number, dispatch time, bytes, samples):
no wall-clock reading anywhere, so the same config and seed give the same times on any
machine under any load (docs/architecture.md, Clocks). The coordinator plans every task when it
dispatches it; a task that would cross the device going offline or crashing is *lost* at
that moment (its work is not run at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profiles import Profile, jitter_factor


@dataclass(frozen=True)
class TaskPlan:
    """The virtual times (seconds since the start of the run) of one task.

    Args:
        device: device id.
        task: the device's task number.
        start: dispatch time (the model leaves the coordinator).
        model_at: the model has arrived on the device (download done).
        compute_end: local training done.
        arrive: the update has arrived at the coordinator (upload done).
        lost_at: when the task is lost (device offline or crashed), or inf.
        reason: "" | "offline" | "crash".
    """

    device: int
    task: int
    start: float
    model_at: float
    compute_end: float
    arrive: float
    lost_at: float = math.inf
    reason: str = ""

    @property
    def lost(self) -> bool:
        return self.lost_at < math.inf

    @property
    def end(self) -> float:
        """When the device is free again (arrival or loss)."""
        return min(self.arrive, self.lost_at)

    def intervals(self) -> list[tuple[str, float, float]]:
        """(state, start, end) of the task's download / compute / upload, cut at a loss."""
        out = []
        for state, a, b in (
            ("download", self.start, self.model_at),
            ("compute", self.model_at, self.compute_end),
            ("upload", self.compute_end, self.arrive),
        ):
            b = min(b, self.lost_at)
            if b > a:
                out.append((state, a, b))
        return out


def plan_task(
    profile: Profile,
    seed: int,
    device: int,
    task: int,
    now: float,
    bytes_down: int,
    bytes_up: int,
    samples: int,
    reference_s_per_sample: float,
    download: bool = True,
    upload: bool = True,
) -> TaskPlan:
    """Plan a task dispatched at ``now`` (virtual seconds).

    Args:
        bytes_down / bytes_up: message bytes each way (header + payload).
        samples: training samples the task processes (epochs x local samples, or steps x
            batch); its compute time is ``profile.compute_s(samples, ...)`` times the
            device's seeded jitter for this task.
        download / upload: False when the task has no download (a gated device continuing
            from its own model) or no upload yet (it is planned when the device pushes);
            ``arrive`` is then the end of the compute.
    """
    model_at = now + profile.down_s(bytes_down) if download else now
    factor = jitter_factor(profile, seed, device, task)
    compute_end = model_at + profile.compute_s(samples, reference_s_per_sample, factor)
    arrive = compute_end + profile.up_s(bytes_up) if upload else compute_end
    crash = profile.failure.crash_time(seed, device)
    offline = profile.availability.online_until(now, seed, device)
    lost_at, reason = math.inf, ""
    if min(crash, offline) < arrive:
        lost_at = min(crash, offline)
        reason = "crash" if crash <= offline else "offline"
    return TaskPlan(device, task, now, model_at, compute_end, arrive, lost_at, reason)


__all__ = ["TaskPlan", "plan_task"]
