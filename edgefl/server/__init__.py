"""Where the global model lives and is updated: a server backend.

- :class:`~edgefl.server.local.LocalServer` (default): rank 0 holds the model and applies
  every change itself.
- :class:`~edgefl.server.sharded.ShardedServer` (``ps.servers = S > 0``): ranks 1..S each
  own a key range of the model and aggregate it (Li et al., OSDI 2014); rank 0 keeps
  control. Its worker side is :class:`~edgefl.server.sharded.ShardClient` and the shard
  ranks run :class:`~edgefl.server.shard.Shard`.

A backend is not a plugin: exactly one runs, and the core asks it where models come from,
how many bytes a download and an upload move, and to apply a model change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only)
    from ..runtime.coordinator import Coordinator


def make_server(core: Coordinator):
    """The coordinator-side backend for the config of ``core``."""
    if core.cfg["ps"]["servers"] > 0:
        from .sharded import ShardedServer

        return ShardedServer(core)
    from .local import LocalServer

    return LocalServer(core)


def make_client(worker: Any):
    """The worker-side backend (None: pull from and push to rank 0)."""
    if worker.cfg["ps"]["servers"] > 0:
        from .sharded import ShardClient

        return ShardClient(worker)
    return None
