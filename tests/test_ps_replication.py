"""k-way replication of the sharded server group (``ps.replicas = k``) with
aggregate-then-replicate (Li et al., OSDI 2014, section 4.3) and failover: a dead shard's
ranges move to a live replica holder and the broken round re-runs from the last complete
version, so the final model is bit-identical to a run without the failure."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import SMALL_JOB, run_edgefl, run_loopback_job

from edgefl.comm.loopback import Fabric
from edgefl.comm.wire import HEADER_BYTES
from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.runtime.coordinator import Coordinator
from edgefl.runtime.policies import check_shards
from edgefl.server.kinds import SHARD_REPLICA
from edgefl.server.shard import Shard, fail_over, range_holders

SMALL = SMALL_JOB


def test_ring_holders_and_fail_over_by_hand():
    assert range_holders(0, 3, 2) == [1, 2]
    assert range_holders(2, 3, 2) == [3, 1]  # the ring wraps
    assert range_holders(1, 4, 3) == [2, 3, 4]
    assert range_holders(1, 3, 1) == [2]
    # shard rank 2 dies: range 1 goes to rank 3; rank 3 then dies too: range 2 -> rank 1,
    # range 1 has no live holder (ranks 2 and 3)
    assert fail_over([1, 2, 3], {2}, 3, 2) == [1, 3, 3]
    assert fail_over([1, 3, 3], {2, 3}, 3, 2) is None
    assert fail_over([1, 2, 3], {2, 3}, 3, 3) == [1, 1, 1]
    assert fail_over([1, 2, 3], {3}, 3, 1) is None  # k = 1: no copy


@pytest.mark.parametrize(
    "servers, replicas",
    [(3, 4), (3, 0), (3, -1), (0, 2), (2, "2"), (2, True)],
)
def test_bad_replicas_name_the_key(servers, replicas):
    cfg = load_config(overrides=[f"ps.servers={servers}"])
    cfg["ps"]["replicas"] = replicas
    with pytest.raises(ConfigError) as e:
        check_shards(cfg)
    text = str(e.value)
    assert "'ps.replicas'" in text and "\n" not in text


def test_replicas_bounds_accepted_and_schema_rejects_zero():
    for k in (1, 2, 3):
        check_shards(load_config(overrides=["ps.servers=3", f"ps.replicas={k}"]))
    check_shards(load_config())  # default: ps.servers = 0, ps.replicas = 1
    with pytest.raises(ConfigError, match="ps.replicas"):
        check_shards(load_config(overrides=["ps.servers=3", "ps.replicas=4"]))
    with pytest.raises(ConfigError, match="ps.replicas"):
        load_config(overrides=["ps.replicas=0"])


class _Died(Exception):
    pass


def _loopback(cfg: dict, ranks: int, kill: tuple[int, int] | None = None):
    """run_loopback_job recording every replica a shard receives and every model version
    rank 0 assembles; ``kill = (rank, n)``: that shard dies at its n-th apply."""
    fabric = Fabric(ranks)
    replicas_seen: dict[int, list] = {r: [] for r in range(1, 1 + cfg["ps"]["servers"])}
    versions: dict[int, np.ndarray] = {}

    class RecShard(Shard):
        def _handle(self, msg):
            if msg.kind == SHARD_REPLICA:
                i = self.by_bounds[(int(msg.aux[0]), int(msg.aux[1]))]
                replicas_seen[self.t.rank].append((i, int(msg.round), msg.payload.copy()))
            super()._handle(msg)

        def _apply(self, version, rows):
            if kill and self.t.rank == kill[0] and self.applied + 1 >= kill[1]:
                fabric.kill(self.t.rank)
                raise _Died
            super()._apply(version, rows)

    class RecCoordinator(Coordinator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            versions[0] = self.global_model.copy()
            inner = self.server._shard_apply

            def recorded(arr):
                ok = inner(arr)
                if ok:
                    versions[self.version + 1] = self.global_model.copy()
                return ok

            self.server._shard_apply = recorded

    coord, statuses = run_loopback_job(
        cfg, ranks, shard_cls=RecShard, coordinator_cls=RecCoordinator, fabric=fabric
    )
    statuses = ["killed" if s == "_Died" else s for s in statuses]
    return coord, statuses, replicas_seen, versions


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def test_replicas_hold_the_owners_range_after_every_apply():
    cfg = load_config(overrides=[*SMALL, "ps.servers=3", "ps.replicas=2"])
    coord, st, seen, versions = _loopback(cfg, ranks=6)
    assert st == [0] * 6 and coord.version == 3
    plain, st1, _, _ = _loopback(load_config(overrides=[*SMALL, "ps.servers=3"]), ranks=6)
    assert st1 == [0] * 6
    assert _sha(coord.global_model) == _sha(plain.global_model)  # replication changes nothing
    ranges = coord.server.ranges
    for i, r in enumerate(ranges):
        holder = range_holders(i, 3, 2)[1]
        got = {v: a for j, v, a in seen[holder] if j == i}
        # version 0 (from rank 0) and each of the 3 applies, exactly once each
        assert sorted(got) == [0, 1, 2, 3]
        assert len([1 for j, _, _ in seen[holder] if j == i]) == 4
        for v, a in got.items():
            assert np.array_equal(a, versions[v][r.start : r.stop]), (i, v)
    # nobody else got a copy of range i (k - 1 = 1 holder)
    for s, log in seen.items():
        assert {j for j, _, _ in log} == {(s - 2) % 3}
    ps = coord.server.summary()["ps"]
    numel = coord.global_model.size
    # 4 versions x (3 headers + every key once)
    assert ps["replica_bytes"] == 4 * (3 * HEADER_BYTES + 4 * numel)
    assert ps["replicas"] == 2 and ps["failovers"] == [] and ps["owners"] == [1, 2, 3]
    assert plain.server.summary()["ps"]["replica_bytes"] == 0


@pytest.mark.parametrize(
    "killed, optimizer",
    [
        (2, []),
        (3, []),
        (2, ["server.optimizer=fedadam", "server.lr=0.05"]),
        (3, ["server.optimizer=fedavgm"]),
    ],
)
def test_a_killed_shard_fails_over_and_the_run_is_bit_identical(killed, optimizer):
    """With a stateful server optimizer rank 0 sends the owners the optimizer state of the
    version the round re-runs from (the survivors may have stepped theirs already)."""
    over = [*SMALL, "ps.servers=3", "ps.replicas=2", *optimizer]
    ref, st0, _, _ = _loopback(load_config(overrides=over), ranks=6)
    coord, st, _, versions = _loopback(load_config(overrides=over), ranks=6, kill=(killed, 2))
    want = [0] * 6
    want[killed] = "killed"
    assert st == want
    assert coord.version == 3 and not coord.stopped
    assert _sha(coord.global_model) == _sha(ref.global_model)
    ps = coord.server.summary()["ps"]
    moved = killed - 1  # the killed shard's range index
    assert len(ps["failovers"]) == 1
    fo = ps["failovers"][0]
    assert fo["rank"] == killed and fo["version"] == 1 and fo["ranges"] == [moved]
    new_owner = killed % 3 + 1
    assert ps["owners"][moved] == new_owner
    assert str(killed) not in ps["shards"] and len(ps["shards"]) == 2
    assert all(v["rounds"] == 3 for v in coord.devices.values())


def test_k1_shard_death_still_stops_with_status_3():
    cfg = load_config(overrides=[*SMALL, "ps.servers=3"])
    coord, st, _, _ = _loopback(cfg, ranks=6, kill=(2, 2))
    assert st[0] == 3 and coord.version == 1
    assert "no live copy" in coord.stopped


# -- over real mpiexec --------------------------------------------------------------------
RUN = ["--devices", "4", "--rounds", "4", "--set", "output.progress=quiet", "--set", "seed=3"]


def _simulate(out, *extra, status=0):
    p = run_edgefl("simulate", "--out", str(out), *RUN, *extra, timeout=120)
    assert p.returncode == status, p.stdout[-2000:] + p.stderr[-3000:]
    return p, json.loads((out / "summary.json").read_text())


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_killed_shard_fails_over_and_finishes_bit_identical(tmp_path, launcher):
    rep = ["--ranks", "5", "--set", "ps.servers=2", "--set", "ps.replicas=2"]
    _, ref = _simulate(tmp_path / "ref", *rep)
    p, dead = _simulate(tmp_path / "dead", *rep, "--set", "debug.kill_ranks=[1]",
                        "--set", "debug.kill_after_tasks=2")  # fmt: skip
    assert "fail over to ranks [2]" in p.stdout
    assert "Traceback" not in p.stderr
    assert dead["rounds_done"] == ref["rounds_done"] == 4
    # the round re-runs deterministically: the same model as the unkilled run
    assert dead["model_sha256"] == ref["model_sha256"]
    assert dead["final_accuracy"] == ref["final_accuracy"]
    assert np.isfinite(dead["final_test_loss"])
    ps = dead["ps"]
    assert ps["owners"] == [2, 2] and len(ps["failovers"]) == 1
    assert ps["failovers"][0]["rank"] == 1 and ps["failovers"][0]["ranges"] == [0]
    assert ref["ps"]["replica_bytes"] > 0 and ref["ps"]["failovers"] == []
