"""How many MPI ranks a job gets: ``fleet.ranks``, or for ``"auto"`` what fits this machine."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has no affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def rank_count(cfg: dict, cores: int | None = None) -> int:
    """The ranks ``edgefl simulate`` and ``edgefl.simulate`` launch for ``cfg``: the
    coordinator, the ``ps.servers`` shard ranks and the worker ranks.

    ``fleet.ranks = "auto"``: one worker per usable core (``cores``, default
    :func:`usable_cores`; under the virtual clock rank 0 mostly waits, so it gets no core
    of its own). A number is taken as given. Either way there are no more worker ranks than
    devices (an idle worker rank would only cost memory).
    """
    fleet, servers = cfg["fleet"], cfg["ps"]["servers"]
    return min(_asked(cfg, cores), fleet["devices"] + 1 + servers)


def _asked(cfg: dict, cores: int | None) -> int:
    """The ranks ``fleet.ranks`` asks for before the device cap (``"auto"``: coordinator,
    shards and one worker per usable core)."""
    ranks = cfg["fleet"]["ranks"]
    if ranks == "auto":
        ranks = 1 + cfg["ps"]["servers"] + (usable_cores() if cores is None else max(1, cores))
    return ranks


def rank_reason(cfg: dict, ranks: int, cores: int | None = None) -> str:
    """Why the job has the worker ranks it has, for the launch banner: ``"one worker rank
    per core"`` (``fleet.ranks = "auto"``) or ``"fleet.ranks = N"``, ``"at most one per
    device"`` when the device count capped it, and a warning when the worker ranks are more
    than the usable cores (each is a process of its own: oversubscribed, every round is
    slower)."""
    servers = cfg["ps"]["servers"]
    cores = usable_cores() if cores is None else max(1, cores)
    asked = cfg["fleet"]["ranks"]
    why = "one worker rank per core" if asked == "auto" else f"fleet.ranks = {asked}"
    if ranks < _asked(cfg, cores):
        why += ", at most one per device"
    workers = ranks - 1 - servers
    if workers > cores:
        why += (
            f"; {workers} worker processes on {cores} cores: oversubscribed, slower rounds"
            " (fewer fleet.ranks, or --backend inline)"
        )
    return why
