"""Build the configured core policy objects and check a config before any rank starts.

What the core axes (aggregation, DP, server optimizer, consistency) need of each other and
what a sharded server group needs are declared here as data, :data:`CORE_NEEDS` and
:data:`SHARD_NEEDS` (:class:`~edgefl.algorithms.base.Requirement`); every plugin declares
its own in ``Plugin.requires``. One checker (:func:`edgefl.algorithms.check_requirements`)
refuses a config that breaks one with a one-line ConfigError naming both keys and the
reason, and ``edgefl config matrix`` (docs/composition.md) is generated from the same
declarations.
"""

from __future__ import annotations

from edgefl.algorithms import check_requirements, plugin_requirements
from edgefl.algorithms.aggregators import make_aggregator
from edgefl.algorithms.base import Requirement, above, not_one_of, one_of
from edgefl.algorithms.dp.dpfedavg import DP_COMPATIBLE_AGGREGATIONS
from edgefl.algorithms.robust.rules import ROBUST_AGGREGATORS
from edgefl.algorithms.server_opt.optimizers import BUILTIN as BUILTIN_OPTIMIZERS

from ..policies.aggregation import Aggregator


def make_update_aggregator(cfg: dict, num_devices: int) -> Aggregator:
    """The aggregator named by ``algorithm.aggregation`` with its options."""
    name = cfg["algorithm"]["aggregation"]
    if cfg["dp"]["enabled"]:
        from edgefl.algorithms.dp.dpfedavg import DPFedAvg

        return DPFedAvg.from_config(cfg)
    if name in ("loss-weighted", "loss-softmax"):
        from edgefl.algorithms.hermes.loss_weighted import make_loss_aggregator

        return make_loss_aggregator(name, cfg["hermes"])
    return make_aggregator(name, expected_updates=num_devices, **cfg["robust"])


# -- what the core axes need of each other ---------------------------------------------------
_ALONE = (
    "the asynchronous policies (ssp, asp, fedbuff, fedasync) apply every update on its own "
    "(a weighted term, or FedAsync's mixing) without the aggregator"
)
_MIXES = "FedAsync mixes each arriving model in (x <- (1 - a) x + a x_new) instead of a server step"

CORE_NEEDS: tuple[Requirement, ...] = (
    Requirement(
        "dp.enabled", one_of(True), "algorithm.aggregation",
        one_of(*DP_COMPATIBLE_AGGREGATIONS),
        "DP-FedAvg stands in for the weighted mean: it averages the clipped updates and "
        "adds Gaussian noise to that mean (no other rule's output is what the accountant "
        "bounds)",
    ),
    Requirement(
        "dp.enabled", one_of(True), "robust.norm_bound_relative", one_of(0.0),
        "a bound relative to the round's median norm makes one device's acceptance depend "
        "on the others' updates, which breaks the per-device sensitivity the DP accountant "
        "assumes (use robust.norm_bound, an absolute bound, or dp.clip alone)",
    ),
    Requirement(
        "dp.enabled", one_of(True), "algorithm.consistency", one_of("bsp"),
        f"DP-FedAvg clips and noises each round's aggregate; {_ALONE}, so no update would "
        "be clipped or noised",
    ),
    Requirement(
        "algorithm.aggregation", one_of(*ROBUST_AGGREGATORS), "algorithm.consistency",
        one_of("bsp"),
        f"a robust rule combines the updates of a round; {_ALONE}, so the rule would never "
        "run",
    ),
    Requirement(
        "algorithm.aggregation", one_of("mean"), "algorithm.consistency",
        not_one_of("fedbuff", "fedasync"),
        "FedBuff weighs its buffer by staleness and FedAsync mixes: neither uses the "
        "aggregation's weights (ssp and asp use 'mean' as equal weights)",
    ),
    Requirement(
        "server.optimizer", not_one_of("sgd"), "algorithm.consistency",
        not_one_of("fedasync"),
        f"{_MIXES}: there is no aggregated pseudo-gradient for a server optimizer to step on",
    ),
    Requirement(
        "server.lr", not_one_of(1.0), "algorithm.consistency", not_one_of("fedasync"),
        f"{_MIXES}, at its own rate (algorithm.fedasync_alpha); server.lr would not be used",
    ),
    Requirement(
        "server.l1", above(0), "algorithm.consistency", not_one_of("fedasync"),
        f"the L1 prox follows a server step; {_MIXES}, so it would never be applied",
    ),
)  # fmt: skip

# -- what a sharded server group (ps.servers = S > 0) needs -----------------------------------
# A shard holds one key range and sees only that range of every update: it can run exactly
# what is elementwise (each key's new value depends on that key's values only), applied per
# range as rank 0 applies it to the whole model, so the model is bit-identical.
ELEMENTWISE_AGGREGATIONS = ("sample-weighted", "mean", "median", "trimmed-mean")
_SHARDS = ("ps.servers", above(0))

SHARD_NEEDS: tuple[Requirement, ...] = tuple(
    Requirement(*_SHARDS, key, allowed, why)
    for key, allowed, why in (
        ("algorithm.consistency", one_of("bsp"),
         "the shards make one aggregate step per round (SHARD_APPLY); the single-update "
         "steps of ssp/asp/fedbuff and FedAsync's mixing with each device's base model "
         "version are not built on the shards"),
        ("algorithm.aggregation", one_of(*ELEMENTWISE_AGGREGATIONS),
         "a shard sees only its key range, so only coordinate-wise rules can run there: "
         "krum and multi-krum rank whole updates by their distances, norm-clip scales by "
         "the whole update's norm, loss-weighted and loss-softmax weigh by the test loss of "
         "the full candidate model"),
        ("algorithm.gate", one_of("always"),
         "with shards a REPORT to rank 0 announces an update pushed to the shards; the "
         "Hermes gate's REPORTs of iterations without a push would be read as updates"),
        ("algorithm.residual", one_of("none"),
         "GDDR's releases (RESIDUAL) are decoded at rank 0 and a dead device's residual is "
         "replayed there, but with shards rank 0 holds no update values"),
        ("robust.norm_bound", one_of(0.0),
         "the norm bound needs each update's whole norm; a shard sees only its range"),
        ("robust.norm_bound_relative", one_of(0.0),
         "the relative norm bound compares whole update norms; a shard sees only its range"),
        ("dp.enabled", one_of(False),
         "DP-FedAvg clips every update by its whole norm; a shard sees only its range"),
        ("ps.sparse", one_of(False),
         "sparse pushes (filters, key caches) are decoded at rank 0, not at the shards"),
        ("ps.pull", one_of("full"),
         "working-set pulls are served from rank 0's model (MODEL_KEYS), not by the shards"),
        ("server.optimizer", one_of(*BUILTIN_OPTIMIZERS),
         "a user function may read the whole model; the built-in optimizers are "
         "elementwise and run on each range"),
    )
)  # fmt: skip


def requirements(cfg: dict) -> list[tuple[str, Requirement]]:
    """(owner, requirement) of everything declared: the core axes, the sharded server
    group, then every plugin (:func:`edgefl.algorithms.plugin_requirements`)."""
    return [
        *(("core", r) for r in CORE_NEEDS),
        *(("ps.servers", r) for r in SHARD_NEEDS),
        *plugin_requirements(cfg),
    ]


def check_policies(cfg: dict) -> None:
    """Check every declared requirement (:func:`requirements`), construct every configured
    core policy once and run every plugin's config check, so bad parameters and refused
    combinations fail with a one-line ConfigError naming the keys before any MPI rank
    starts."""
    from ..algorithms import check_config
    from ..algorithms.ps.plugin import check_ps
    from ..policies.consistency import make_consistency

    check_requirements(cfg, requirements(cfg))
    n = cfg["fleet"]["devices"]
    make_update_aggregator(cfg, n)
    check_ps(cfg)
    check_shards(cfg)
    make_consistency(cfg, {d: 1 for d in range(n)})
    check_config(cfg)


def check_shards(cfg: dict, ranks: int | None = None) -> None:
    """``ps.servers = S > 0`` (a sharded server group): :data:`SHARD_NEEDS` (BSP, an
    elementwise aggregation and server optimizer, nothing that needs whole updates at rank
    0); ``ranks`` (MPI ranks of the job, None = not known yet) must leave at least one
    worker rank after rank 0 and the S shards. ``ps.replicas = k`` must be 1 <= k <= S
    (k = 1 without shards)."""
    from ..errors import ConfigError

    servers = cfg["ps"]["servers"]
    k = cfg["ps"].get("replicas", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > max(servers, 1):
        most = f"<= ps.servers = {servers}" if servers > 0 else "1 with ps.servers = 0"
        raise ConfigError(f"config key 'ps.replicas' = {k!r}: must be an integer >= 1 and {most}")
    if servers <= 0:
        return
    check_requirements(cfg, [("ps.servers", r) for r in SHARD_NEEDS])
    if ranks is not None and ranks < servers + 2:
        raise ConfigError(
            f"config key 'ps.servers' = {servers}: needs at least {servers + 2} MPI ranks "
            f"(coordinator + {servers} shards + 1 worker), got {ranks}"
        )
