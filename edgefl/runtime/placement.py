"""Which rank hosts which device, and which torch device each one trains on."""

from __future__ import annotations


def devices_of_rank(rank: int, num_devices: int, num_ranks: int, servers: int = 0) -> list[int]:
    """Device ids hosted by worker ``rank`` (round-robin over the worker ranks).

    Args:
        rank: the MPI rank.
        num_devices: devices of the fleet.
        num_ranks: MPI ranks of the job, coordinator included.
        servers: server shard ranks (``ps.servers``, default 0): ranks 1..servers host no
            device; the workers are ranks servers + 1 .. num_ranks - 1.
    """
    if rank <= servers:
        return []
    workers = num_ranks - 1 - servers
    return list(range(rank - 1 - servers, num_devices, workers))


def rank_of_device(device: int, num_ranks: int, servers: int = 0) -> int:
    """The worker rank hosting ``device`` (``servers``: shard ranks before the workers)."""
    return 1 + servers + device % (num_ranks - 1 - servers)


def is_shard(rank: int, servers: int) -> bool:
    """Is ``rank`` a server shard (ranks 1..servers with ``ps.servers = servers``)?"""
    return 1 <= rank <= servers


def torch_device_for(
    device: int, setting: str, device_map: dict, local_rank: int, cuda_count: int
) -> str:
    """Resolve the torch device string of one logical device.

    ``device_map`` (config ``fleet.device_map``) wins; then ``setting`` (``fleet.device``):
    ``auto`` is ``cuda:{local_rank % cuda_count}`` where CUDA exists, else ``cpu``; a bare
    ``cuda`` picks the same GPU as ``auto`` but fails where there is none.
    """
    choice = device_map.get(str(device), setting)
    if choice == "auto":
        return f"cuda:{local_rank % cuda_count}" if cuda_count > 0 else "cpu"
    if choice == "cuda":
        return f"cuda:{local_rank % max(cuda_count, 1)}"
    return choice
