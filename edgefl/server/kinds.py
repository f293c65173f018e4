"""The message kinds of the sharded server group (ps.servers = S > 0; ranks 1..S are shards,
docs/parameter-server.md), registered with the transport."""

from __future__ import annotations

from ..comm.wire import DType, register_kind

F32, F64 = {DType.FLOAT32}, {DType.FLOAT64}
# keys [aux0, aux1) of model version `round`: rank 0 -> shard (start/resume), shard ->
# worker (pull), shard -> rank 0 (after an apply); aux2 = the owner-map epoch
SHARD_MODEL = register_kind("SHARD_MODEL", 16, "both", F32, "any")
# worker -> shard: keys [aux0, aux1) of the update of (device, task `round`); aux2 = the
# model version the task started from
SHARD_PUSH = register_kind("SHARD_PUSH", 17, "both", F32, "any")
# rank 0 -> shard: send your range of version aux1 to rank aux0
SHARD_PULL = register_kind("SHARD_PULL", 18, "down", {DType.NONE}, "none")
# rank 0 -> shard: aggregate into version `round` the updates named by the float64 rows
# (device, task, samples, loss)
SHARD_APPLY = register_kind("SHARD_APPLY", 19, "down", F64, "any")
# shard -> rank 0 (asked by a HEARTBEAT): float64 (bytes sent, bytes received, messages
# sent, messages received, replication bytes sent)
SHARD_STATS = register_kind("SHARD_STATS", 20, "up", F64, "any")
# shard -> replica holder (ps.replicas > 1): keys [aux0, aux1) of model version `round`
SHARD_REPLICA = register_kind("SHARD_REPLICA", 21, "both", F32, "any")
# rank 0 -> shards and workers after a shard failed: the owner rank of every range
# (float64), version `round` is current, aux0 = owner-map epoch; shard -> rank 0: the
# answer, float64 [1 = holds version `round` of its ranges, 0 not]
SHARD_OWNERS = register_kind("SHARD_OWNERS", 22, "both", F64, "any")
