"""Sharded server group (``ps.servers = S``): ranks 1..S each own an even key range of the
model; workers pull and push the ranges there; rank 0 keeps control (Li et al., OSDI 2014).
The model is bit-identical to an unsharded run, rank 0 moves far fewer model bytes, a resumed
sharded run is bit-exact, and unsupported combinations fail before any rank starts."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from conftest import SMALL_JOB, run_edgefl, run_loopback_job

from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import Validator
from edgefl.config import load_config
from edgefl.errors import ConfigError, EdgeflError
from edgefl.runtime.placement import devices_of_rank, is_shard, rank_of_device
from edgefl.runtime.policies import check_shards
from edgefl.server.kinds import SHARD_APPLY, SHARD_MODEL, SHARD_PUSH
from edgefl.server.shard import Shard

SMALL = SMALL_JOB


def test_placement_skips_shard_ranks():
    # 5 devices, 5 ranks, 2 shards: ranks 1-2 are shards, ranks 3-4 host the devices
    assert devices_of_rank(1, 5, 5, servers=2) == []
    assert devices_of_rank(2, 5, 5, servers=2) == []
    assert devices_of_rank(3, 5, 5, servers=2) == [0, 2, 4]
    assert devices_of_rank(4, 5, 5, servers=2) == [1, 3]
    assert [rank_of_device(d, 5, servers=2) for d in range(5)] == [3, 4, 3, 4, 3]
    assert [is_shard(r, 2) for r in range(5)] == [False, True, True, False, False]
    # unchanged without shards
    assert devices_of_rank(1, 5, 3) == [0, 2, 4] and rank_of_device(3, 3) == 2


@pytest.mark.parametrize(
    "key, value",
    [
        ("algorithm.consistency", '"ssp"'),
        ("algorithm.aggregation", '"krum"'),
        ("algorithm.aggregation", '"norm-clip"'),
        ("algorithm.aggregation", '"loss-weighted"'),
        ("algorithm.gate", '"hermes"'),
        ("algorithm.residual", '"gddr"'),
        ("robust.norm_bound", "5.0"),
        ("ps.sparse", "true"),
        ("ps.pull", '"working-set"'),
        ("server.optimizer", '"tests_user_opt:update"'),
        ("dp.enabled", "true"),
    ],
)
def test_unsupported_combinations_name_their_keys(key, value):
    cfg = load_config(overrides=["ps.servers=2", f"{key}={value}"])
    with pytest.raises(ConfigError) as e:
        check_shards(cfg)
    text = str(e.value)
    assert "'ps.servers' = 2" in text and key in text and "\n" not in text
    assert " because " in text  # the reason


# what the shards run since they apply every elementwise rule per key range (each choice is
# checked bit for bit against the unsharded run below)
ELEMENTWISE = {
    "median": ["algorithm.aggregation=median"],
    "trimmed-mean": ["algorithm.aggregation=trimmed-mean", "robust.trim_fraction=0.25"],
    "mean": ["algorithm.aggregation=mean"],
    "fedavgm": ["server.optimizer=fedavgm", "server.beta1=0.8"],
    "fedadam": ["server.optimizer=fedadam", "server.lr=0.05"],
    "fedyogi": ["server.optimizer=fedyogi", "server.lr=0.05"],
    "fedadagrad": ["server.optimizer=fedadagrad", "server.lr=0.05"],
    "l1-prox": ["server.l1=0.002"],
    "fedadam-l1": ["server.optimizer=fedadam", "server.lr=0.05", "server.l1=0.002"],
    "cd-grab": ["algorithm.ordering=cd-grab"],
    # (allowed before; its allocation follows the timings: the virtual clock's here)
    "hermes-allocation": ["algorithm.allocation=hermes", "allocation.trigger=always"],
}
# deterministic timings (the virtual clock, a fixed reference speed), as tests/golden pins
PINNED = ['sim.clock="virtual"', "sim.reference_s_per_sample=0.0001"]


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_newly_allowed_choices_are_bit_identical_to_the_unsharded_run(name):
    sets = [*SMALL, *PINNED, "data.args.dim=16", "model.args.hidden=[32]", *ELEMENTWISE[name]]
    check_shards(load_config(overrides=[*sets, "ps.servers=2"]), 5)  # (no longer refused)
    plain, st0 = run_loopback_job(load_config(overrides=sets), ranks=3)
    sharded, st2 = run_loopback_job(load_config(overrides=[*sets, "ps.servers=2"]), ranks=5)
    assert st0 == [0, 0, 0] and st2 == [0] * 5
    assert sharded.version == plain.version == 3
    assert np.isfinite(sharded.global_model).all()
    assert _sha(sharded.global_model) == _sha(plain.global_model)
    # a stateful optimizer's per-key state came back from the shards whole
    want, got = plain.server_opt.state_dict(), sharded.server_opt.state_dict()
    assert sorted(want) == sorted(got)
    for k in want:
        assert np.array_equal(want[k], got[k]), k


def test_stateful_optimizer_on_shards_resumes_bit_exact(tmp_path):
    """Rank 0's checkpoint holds the optimizer state the shards sent with every range, and
    a resume sends it back: stopped after round 2 and resumed, the run ends bit-identical."""
    from edgefl.ckpt import load_checkpoint
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    sets = [*SMALL, *PINNED, "run.rounds=4", "server.optimizer=fedadam", "server.lr=0.05",
            "ps.servers=2"]  # fmt: skip
    ref, _ = run_loopback_job(load_config(overrides=sets), ranks=5)

    def run(cfg, out, resume=None):
        task0 = build_task(cfg)

        def coordinator(cfg_, t, task, out_dir=None):
            return Coordinator(cfg_, t, task0, out_dir=out, resume=resume)

        return run_loopback_job(cfg, 5, coordinator_cls=coordinator)

    out = tmp_path / "run"
    out.mkdir()
    part, st = run(load_config(overrides=[*sets, "debug.stop_after_round=2"]), out)
    assert st[0] == 0 and part.version == 2
    state = load_checkpoint(out / "checkpoints" / "ckpt-000002.h5")
    assert state["server_optimizer"]["m"].shape == ref.global_model.shape
    resumed, st = run(load_config(overrides=sets), out, resume=state)
    assert st == [0] * 5 and resumed.version == 4
    assert _sha(resumed.global_model) == _sha(ref.global_model)


def test_ranks_must_leave_a_worker():
    cfg = load_config(overrides=["ps.servers=2"])
    check_shards(cfg, 4)  # coordinator + 2 shards + 1 worker
    with pytest.raises(ConfigError, match=r"'ps.servers' = 2: needs at least 4 MPI ranks"):
        check_shards(cfg, 3)
    check_shards(load_config(overrides=['algorithm.consistency="ssp"']), 2)  # S = 0: no check


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def test_sharded_loopback_job_is_bit_identical_and_moves_model_bytes_off_rank0():
    wide = [*SMALL, "data.args.dim=32", "model.args.hidden=[256]"]  # 37 KB of float32
    plain, st0 = run_loopback_job(load_config(overrides=wide), ranks=3)
    sharded, st2 = run_loopback_job(load_config(overrides=[*wide, "ps.servers=2"]), ranks=5)
    assert st0 == [0, 0, 0] and st2 == [0] * 5
    assert {v["rank"] for v in sharded.devices.values()} == {3, 4}
    assert all(v["rounds"] == 3 for v in sharded.devices.values())
    assert sharded.version == plain.version == 3
    assert _sha(sharded.global_model) == _sha(plain.global_model)
    model = plain.global_model.nbytes
    sent0 = sum(plain.t.stats.bytes_sent.values())
    sent2 = sum(sharded.t.stats.bytes_sent.values())
    # unsharded rank 0 sends the model to 2 worker ranks x 3 rounds; sharded rank 0 sends
    # only the initial ranges (one model) plus headers and apply lists
    assert sent0 >= 6 * model
    assert model <= sent2 < 1.3 * model
    ps = sharded.server.summary()["ps"]
    n = sharded.global_model.size
    assert ps["servers"] == 2 and ps["ranges"] == [[0, (n + 1) // 2], [(n + 1) // 2, n]]
    # each shard served 2 pulls x 3 versions and returned 3 new ranges: its half of the model
    for s in ("1", "2"):
        assert ps["shards"][s]["bytes_sent"] >= (6 + 3) * model // 2 - 8


def test_shard_rejects_a_piece_of_the_wrong_length():
    cfg = load_config(overrides=[*SMALL, "ps.servers=2"])
    fabric = Fabric(4)
    shard = Shard(cfg, LoopbackTransport(fabric, 2, Validator(2)), 100, "sig")
    assert (shard.range.start, shard.range.stop) == (50, 100)  # even_ranges(100, 2)[1]
    worker = LoopbackTransport(fabric, 3, Validator(3))
    worker.send(2, SHARD_PUSH, device=1, round=0, aux=(50.0, 100.0, 0.0, 0.0),
                payload=np.ones(50, np.float32))  # fmt: skip
    worker.send(2, SHARD_PUSH, device=1, round=1, aux=(50.0, 100.0, 0.0, 0.0),
                payload=np.ones(49, np.float32))  # fmt: skip
    msgs = []
    for _ in range(20):
        msgs += shard.t.poll(timeout=0.1)
        if len(msgs) == 2:
            break
    shard._handle(msgs[0])
    assert np.array_equal(shard.pieces[(1, 1, 0)], np.ones(50, np.float32))  # (range, dev, task)
    with pytest.raises(EdgeflError, match=r"carries 49 values for keys \[50, 100\)"):
        shard._handle(msgs[1])
    assert (1, 1, 1) not in shard.pieces


def test_shard_applies_pieces_that_arrive_after_the_apply_list():
    """The apply list may overtake the pieces: the shard waits, then aggregates exactly as
    the unsharded aggregator + SGD server step do on those keys."""
    from edgefl.policies.aggregation import SampleWeighted, Update

    cfg = load_config(overrides=[*SMALL, "ps.servers=2"])
    fabric = Fabric(4)
    shard = Shard(cfg, LoopbackTransport(fabric, 1, Validator(1)), 7, "sig")
    r0 = LoopbackTransport(fabric, 0, Validator(0))
    r0.validator.hosted[1] = frozenset({-1})  # (rank 0 does this at the shard's REGISTER)
    w = LoopbackTransport(fabric, 3, Validator(3))
    assert (shard.range.start, shard.range.stop) == (0, 4)
    rng = np.random.default_rng(3)
    start = rng.normal(size=7).astype(np.float32)
    d0, d1 = rng.normal(size=7).astype(np.float32), rng.normal(size=7).astype(np.float32)
    r0.send(1, SHARD_MODEL, round=5, aux=(0.0, 4.0), payload=start[:4].copy())
    rows = np.array([1, 9, 30, 0.5, 0, 9, 10, 0.7], np.float64)
    r0.send(1, SHARD_APPLY, round=6, payload=rows)

    def pump() -> None:
        for _ in range(10):
            for m in shard.t.poll(timeout=0.05):
                shard._handle(m)
        shard._progress()

    pump()
    assert shard.version == 5 and shard.todo  # pieces missing: waits
    w.send(1, SHARD_PUSH, device=0, round=9, aux=(0.0, 4.0, 5.0), payload=d0[:4].copy())
    pump()
    assert shard.version == 5
    w.send(1, SHARD_PUSH, device=1, round=9, aux=(0.0, 4.0, 5.0), payload=d1[:4].copy())
    pump()
    assert shard.version == 6 and not shard.todo and not shard.pieces
    full = SampleWeighted().aggregate([Update(0, d0, 10, 0.7), Update(1, d1, 30, 0.5)])
    want = start + np.float32(cfg["server"]["lr"]) * full
    got = [m for m in r0.poll(timeout=0.5) if m.kind == SHARD_MODEL]
    assert len(got) == 1 and got[0].round == 6
    assert np.array_equal(got[0].payload, want[:4])
    # hand-computed: (30 d1 + 10 d0) / 40 on the first key
    assert np.isclose(got[0].payload[0], start[0] + (30 * d1[0] + 10 * d0[0]) / 40, atol=1e-6)


def test_a_pull_is_served_before_the_apply_sent_after_it():
    """Rank 0 asks for version 5 for worker rank 3, then for version 6 whose pieces are
    already in (after a failover the workers hold the version the round re-runs from and
    report at once): both in one poll. The pull gets version 5's values, then the shard
    applies. (The shard once applied first and then failed: 'rank 3 pulls model version 5;
    this shard holds version 6 only', which hung the failover test now and then.)"""
    from edgefl.server.kinds import SHARD_PULL

    cfg = load_config(overrides=[*SMALL, "ps.servers=2"])
    fabric = Fabric(4)
    shard = Shard(cfg, LoopbackTransport(fabric, 1, Validator(1)), 7, "sig")
    r0 = LoopbackTransport(fabric, 0, Validator(0))
    r0.validator.hosted[1] = frozenset({-1})
    w = LoopbackTransport(fabric, 3, Validator(3))
    w.validator.hosted[1] = frozenset({-1})
    start = np.arange(4, dtype=np.float32)
    r0.send(1, SHARD_MODEL, round=5, aux=(0.0, 4.0), payload=start.copy())
    w.send(1, SHARD_PUSH, device=0, round=9, aux=(0.0, 4.0, 5.0), payload=np.ones(4, np.float32))
    r0.send(1, SHARD_PULL, round=5, aux=(3.0, 5.0))
    r0.send(1, SHARD_APPLY, round=6, payload=np.array([0, 9, 10, 0.5], np.float64))
    msgs = shard.t.poll(timeout=0.5)
    assert [m.kind for m in msgs].count(SHARD_APPLY) == 1 and len(msgs) == 4  # one poll
    for m in msgs:
        shard._handle(m)
    shard._progress()
    assert shard.version == 6 and not shard.todo
    got = [m for m in w.poll(timeout=0.5) if m.kind == SHARD_MODEL]
    assert [m.round for m in got] == [5]
    assert np.array_equal(got[0].payload, start)  # version 5's values, not version 6's
    # a pull of a version the shard no longer holds is an error naming both versions
    r0.send(1, SHARD_PULL, round=5, aux=(3.0, 5.0))
    for m in shard.t.poll(timeout=0.5):
        shard._handle(m)
    with pytest.raises(EdgeflError, match="rank 3 pulls model version 5; this shard holds "
                       "version 6 only"):  # fmt: skip
        shard._progress()


# -- over real mpiexec --------------------------------------------------------------------
RUN = ["--devices", "4", "--rounds", "4", "--set", "output.progress=quiet", "--set", "seed=3"]


def _simulate(out, *extra):
    p = run_edgefl("simulate", "--out", str(out), *RUN, *extra, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _plain_model(out, **sets) -> str:
    """The unsharded run's model, in one process (the inline backend trains the MPI run's
    model bit for bit: tests/test_golden_models.py)."""
    import edgefl

    over = {"fleet.devices": 4, "run.rounds": 4, "output.progress": "quiet", "seed": 3, **sets}
    return edgefl.simulate(overrides=over, out=out, backend="inline").model_sha256


@pytest.mark.mpi
@pytest.mark.slow
def test_sharded_mpi_run_matches_unsharded_and_resumes_bit_exact(tmp_path, launcher):
    plain = _simulate(tmp_path / "plain", "--ranks", "3")
    sharded = _simulate(tmp_path / "sharded", "--ranks", "5", "--set", "ps.servers=2")
    # the same 2 worker ranks host the same devices; the shards aggregate bit-identically
    assert sharded["model_sha256"] == plain["model_sha256"]
    assert sharded["rounds_done"] == plain["rounds_done"] == 4
    ps = sharded["ps"]
    assert ps["servers"] == 2 and set(ps["shards"]) == {"1", "2"}
    sent0 = sharded["wire"]["bytes_sent"]
    assert sent0 < 0.3 * plain["wire"]["bytes_sent"]
    assert all(s["bytes_sent"] > sent0 for s in ps["shards"].values())
    # checkpoint after round 2, resume: the same final model
    part = tmp_path / "part"
    _simulate(part, "--ranks", "5", "--set", "ps.servers=2", "--set", "debug.stop_after_round=2")
    ckpt = part / "checkpoints" / "ckpt-000002.h5"
    p = run_edgefl("simulate", "--resume", str(ckpt), *RUN, "--ranks", "5", "--set",
                   "ps.servers=2", timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["rounds_done"] == 4
    assert resumed["model_sha256"] == plain["model_sha256"]


@pytest.mark.mpi
@pytest.mark.slow
def test_sharded_mpi_run_with_median_and_fedadam_matches_unsharded(tmp_path, launcher):
    """Newly allowed on shards: a coordinate-wise robust rule and a stateful optimizer (its
    state comes back to rank 0 with every range) give the unsharded model over mpiexec."""
    extra = ["--set", "algorithm.aggregation=median", "--set", "server.optimizer=fedadam",
             "--set", "server.lr=0.05"]  # fmt: skip
    plain = _plain_model(tmp_path / "plain", **{"algorithm.aggregation": "median",
                         "server.optimizer": "fedadam", "server.lr": 0.05})  # fmt: skip
    sharded = _simulate(tmp_path / "sharded", "--ranks", "5", "--set", "ps.servers=2", *extra)
    assert sharded["rounds_done"] == 4
    assert sharded["model_sha256"] == plain


@pytest.mark.mpi
@pytest.mark.parametrize(
    "extra, words",
    [
        (["--ranks", "3", "--set", "ps.servers=2"], ["'ps.servers' = 2", "needs at least 4"]),
        (
            ["--ranks", "5", "--set", "ps.servers=2", "--set", "algorithm.consistency=asp"],
            ["'ps.servers' = 2", "algorithm.consistency = 'asp'"],
        ),
    ],
)
def test_bad_sharded_configs_fail_before_mpiexec(tmp_path, launcher, extra, words):
    p = run_edgefl("simulate", "--out", str(tmp_path / "x"), *RUN, *extra, timeout=60)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in p.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_a_dead_shard_stops_the_run_with_a_checkpoint_that_resumes(tmp_path, launcher):
    """No replication: a shard SIGKILLed at its 2nd apply ends the job with exit status 3;
    rank 0 checkpointed the last complete version (1), and resuming from it ends with the
    model of an uninterrupted run."""
    plain = _plain_model(tmp_path / "plain")
    out = tmp_path / "dead"
    p = run_edgefl("simulate", "--out", str(out), *RUN, "--ranks", "5", "--set", "ps.servers=2",
                   "--set", "debug.kill_ranks=[1]", "--set", "debug.kill_after_tasks=2",
                   timeout=120)  # fmt: skip
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-3000:]
    assert "server shard rank 1 failed" in p.stdout
    assert "Traceback" not in p.stderr
    ckpt = out / "checkpoints" / "ckpt-000001.h5"
    assert ckpt.exists()
    p = run_edgefl("simulate", "--resume", str(ckpt), timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["rounds_done"] == 4
    assert resumed["model_sha256"] == plain
