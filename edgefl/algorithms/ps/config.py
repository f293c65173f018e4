"""The config section(s) of the ps plugin (the registry,
edgefl.algorithms.config_sections, hands it to the schema; documented in
docs/configuration.md)."""

from __future__ import annotations

from ...config.fields import Field, field  # noqa: F401

SECTIONS = {
    "ps": {
        "sparse": field(
            False,
            "bool",
            "Push updates as sparse, compressed messages (filters, index/value encoding, "
            "key caching; docs/parameter-server.md).",
        ),
        "filters": field(
            [],
            "list[str]",
            "Worker-side filters of sparse pushes, in order: significant, kkt (kkt needs "
            "server.l1 > 0).",
            choices=("significant", "kkt"),
        ),
        "sig_threshold": field(
            0.0, "float", "significant: send entries whose change exceeds this.", min=0.0
        ),
        "kkt_margin": field(
            0.0,
            "float",
            "kkt: skip a zero weight only if lr x steps x |gradient| <= server.l1 - this "
            "(delta units; larger skips less).",
            min=0.0,
        ),
        "kkt_carry": field(
            False,
            "bool",
            "kkt: add skipped values to the coordinate's next update instead of holding them "
            "until the final flush.",
        ),
        "pull": field(
            "full",
            "str",
            "What rank 0 sends a worker: the full model, or only the keys its devices' data "
            "touches (working-set; logreg only, other models pull every key).",
            choices=("full", "working-set"),
        ),
        "debug_bad_working_set": field(
            "none",
            "str",
            "Test hook: rank 1 sends its first device's working set malformed (rank 0 must "
            "reject it and pull the full model to that rank).",
            choices=("none", "unsorted", "out-of-range", "duplicate"),
        ),
        "value_dtype": field(
            "float32",
            "str",
            "Values on the wire: float32, float16 or bfloat16.",
            choices=("float32", "float16", "bfloat16"),
        ),
        "key_cache": field(False, "bool", "Send a hash for an index list the receiver holds."),
        "cache_entries": field(16, "int", "Key lists cached per device (LRU).", min=1),
        "servers": field(
            0,
            "int",
            "Server shards S: ranks 1..S each own an even key range of the model; workers "
            "push and pull the ranges there, rank 0 keeps control (0 = rank 0 serves the "
            "whole model; > 0 needs BSP FedAvg; docs/parameter-server.md).",
            min=0,
        ),
        "replicas": field(
            1,
            "int",
            "Copies k of every shard's key range (ps.servers > 0): shard s's range is also "
            "held by the next k - 1 shards in ring order, which take it over if s dies "
            "(1 = no replication; 1 <= k <= ps.servers; docs/parameter-server.md).",
            min=1,
        ),
    },
}
