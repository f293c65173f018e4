"""Build the configured core policy objects and check a config before any rank starts."""

from __future__ import annotations

from edgefl.algorithms.aggregators import make_aggregator

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


def check_policies(cfg: dict) -> None:
    """Construct every configured core policy once and run every plugin's config check, so
    bad parameters fail with a one-line ConfigError naming the key before any MPI rank
    starts."""
    from ..algorithms import check_config
    from ..algorithms.ps import check_ps
    from ..policies.consistency import make_consistency

    n = cfg["fleet"]["devices"]
    make_update_aggregator(cfg, n)
    check_ps(cfg)
    check_shards(cfg)
    make_consistency(cfg, {d: 1 for d in range(n)})
    check_config(cfg)


# What a sharded server group (``ps.servers > 0``) supports: config key -> (allowed values,
# what to say). Everything else is rank-0-only machinery (not built for shards yet).
SHARD_NEEDS: dict[str, tuple[tuple, str]] = {
    "algorithm.consistency": (("bsp",), "'bsp'"),
    "algorithm.aggregation": (("sample-weighted", "mean"), "'sample-weighted' or 'mean'"),
    "algorithm.gate": (("always",), "'always'"),
    "algorithm.residual": (("none",), "'none'"),
    "algorithm.ordering": (("none",), "'none'"),
    "robust.norm_bound": ((0.0, 0), "0"),
    "robust.norm_bound_relative": ((0.0, 0), "0"),
    "dp.enabled": ((False,), "false"),
    "ps.sparse": ((False,), "false"),
    "ps.pull": (("full",), "'full'"),
    "server.optimizer": (("sgd",), "'sgd'"),
    "server.l1": ((0.0, 0), "0"),
}


def check_shards(cfg: dict, ranks: int | None = None) -> None:
    """``ps.servers = S > 0`` (a sharded server group): only BSP with a weighted-mean
    aggregation and a plain SGD server step is supported (the shards aggregate their key
    ranges elementwise); ``ranks`` (MPI ranks of the job, None = not known yet) must leave
    at least one worker rank after rank 0 and the S shards. ``ps.replicas = k`` must be
    1 <= k <= S (k = 1 without shards)."""
    from ..errors import ConfigError

    servers = cfg["ps"]["servers"]
    k = cfg["ps"].get("replicas", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > max(servers, 1):
        most = f"<= ps.servers = {servers}" if servers > 0 else "1 with ps.servers = 0"
        raise ConfigError(f"config key 'ps.replicas' = {k!r}: must be an integer >= 1 and {most}")
    if servers <= 0:
        return
    bad = []
    for key, (allowed, say) in SHARD_NEEDS.items():
        a, b = key.split(".")
        got = cfg[a][b]
        if got not in allowed:
            bad.append(f"{key} = {got!r} (needs {say})")
    if bad:
        raise ConfigError(
            f"config key 'ps.servers' = {servers}: not supported yet with " + "; ".join(bad)
        )
    if ranks is not None and ranks < servers + 2:
        raise ConfigError(
            f"config key 'ps.servers' = {servers}: needs at least {servers + 2} MPI ranks "
            f"(coordinator + {servers} shards + 1 worker), got {ranks}"
        )
