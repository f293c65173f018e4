"""edgefl.algorithms.gddr.coordinator: tau on every task, RESIDUAL decoding, adaptive tau,
replay of a dead or moved device's residual checkpoint, the flush, the summary and state."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.gddr.coordinator import GDDRCoordinator
from edgefl.algorithms.gddr.kinds import RESIDUAL
from edgefl.algorithms.gddr.store import load_residual, residual_checkpoint_name
from edgefl.algorithms.gddr.tau import AdaptiveTau, FixedTau
from edgefl.algorithms.gddr.worker import GDDRWorker
from edgefl.comm import Kind
from edgefl.errors import ConfigError
from edgefl.policies.consistency import Apply

from ..fakes import (
    FakeCoordinatorContext,
    FakeWorkerContext,
    config,
    flush_upload,
    message,
    received,
    upload,
)

N = 48
ON = 'algorithm.residual="gddr"'


class Pair:
    """A worker half and a coordinator half of one run (same config, model size, run dir)."""

    def __init__(self, *sets: str, out_dir=None) -> None:
        cfg = config(None, ON, *sets)
        self.cctx = FakeCoordinatorContext(cfg, {0: 6, 1: 6, 3: 6}, numel=N, out_dir=out_dir)
        data = {d: list(range(6)) for d in (0, 1, 3)}
        self.wctx = FakeWorkerContext(cfg, data, numel=N, out_dir=out_dir)
        self.c = GDDRCoordinator(self.cctx, "gddr")
        self.w = GDDRWorker(self.wctx, "gddr")
        self.tasks: dict[int, int] = {}
        self.sent: list = []  # the Uploads the worker half encoded

    def send(self, d: int, delta: np.ndarray, arg: int | None = None):
        """The worker sends ``delta`` of ``d`` with the tau the coordinator gives its task;
        returns the message as rank 0 receives it."""
        spec = TaskSpec()
        self.c.shape_task(d, spec)
        if arg is not None:
            spec.arg = arg
        task = self.tasks.get(d, 0)
        self.tasks[d] = task + 1
        job = LocalJob(d, task, 0, spec, aux=(6.0, 0.5, 1.0, 0.0))
        up = upload(self.w, job, delta.copy())
        assert up.by == "gddr" and up.kind == int(RESIDUAL) and self.wctx.sent == []
        self.sent.append(up)
        return received(up)

    def decode(self, d: int, delta: np.ndarray, arg: int | None = None) -> np.ndarray:
        msg = self.send(d, delta, arg)
        dense, why, used = self.c.decode(d, msg.round, msg)
        assert why == "" and used is msg
        return dense


def _delta(seed: int, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(N)).astype(np.float32)


def _step() -> Apply:
    return Apply("aggregate", [])


def test_every_task_carries_the_current_tau():
    p = Pair("gddr.tau=6")
    spec = TaskSpec(samples=3, arg=0)
    p.c.shape_task(0, spec)
    assert spec.arg == 6 and spec.samples == 3
    assert isinstance(p.c.tauc, FixedTau)


def test_decoding_rebuilds_the_dense_update_and_nothing_is_lost_over_a_flush():
    p = Pair()
    produced = np.zeros(N, np.float64)
    decoded = np.zeros(N, np.float64)
    for k in range(5):
        d = _delta(k)
        produced += d
        dense = p.decode(0, d)
        assert dense.dtype == np.float32 and dense.shape == (N,)
        assert 0 < np.count_nonzero(dense) < N  # only the released coordinates
        decoded += dense
    assert p.c.flush_devices() == [0]
    up = flush_upload(p.w, 0, 5)
    assert up.by == "gddr" and up.kind == int(Kind.UPDATE)
    decoded += up.payload
    np.testing.assert_allclose(decoded, produced, rtol=1e-5, atol=1e-5)


def test_the_released_values_land_on_the_released_coordinates():
    p = Pair()
    d = _delta(3)
    dense = p.decode(0, d)
    # at the first step nothing is held yet, so a released coordinate carries its own value
    nz = np.flatnonzero(dense)
    np.testing.assert_array_equal(dense[nz], d[nz])
    assert p.w.residuals[0].held()[nz].tolist() == [0.0] * nz.size


def test_a_message_with_the_wrong_count_is_rejected_and_the_mirror_stays_in_step():
    p = Pair()
    good = p.send(0, _delta(1))
    bad = message(RESIDUAL, src=1, device=0, round=0, aux=good.aux,
                  payload=good.payload[1:])  # one value short  # fmt: skip
    dense, why, used = p.c.decode(0, 0, bad)
    assert dense is None and used is bad
    assert why.startswith("GDDR message of device 0:") and "releases" in why
    assert p.c.stats["messages"] == 0 and p.c.norms == []
    dense, why, _ = p.c.decode(0, 0, good)  # the real one still decodes
    assert why == "" and dense is not None and p.c.stats["messages"] == 1


def test_the_decoder_follows_the_tau_each_message_reports():
    p = Pair()
    for k in range(6):
        p.decode(1, _delta(k), arg=2 if k % 2 else 7)  # the worker's tau differs per task
    assert p.c.decoders[1].last_step == 5
    np.testing.assert_array_equal(p.c.decoders[1].due, p.w.residuals[1].due)


def test_fixed_tau_ignores_the_norms_but_a_step_consumes_them():
    p = Pair()
    p.decode(0, _delta(1))
    p.decode(1, _delta(2, scale=50.0))
    assert len(p.c.norms) == 2
    p.c.after_apply(_step(), 0.0)
    assert p.c.norms == [] and p.c.tauc.tau == 4


def test_adaptive_tau_shortens_when_the_update_scale_jumps_and_tasks_carry_it():
    p = Pair("gddr.adaptive=true")
    assert isinstance(p.c.tauc, AdaptiveTau) and p.c.tauc.tau == 4
    p.decode(0, _delta(1))
    p.c.after_apply(_step(), 0.0)  # first step: the EMA starts
    assert p.c.tauc.tau == 4
    p.decode(0, _delta(2, scale=10.0))
    p.c.after_apply(_step(), 0.0)  # a 10x jump: fast drift, tau drops to tau_min
    assert p.c.tauc.tau == 2
    spec = TaskSpec()
    p.c.shape_task(0, spec)
    assert spec.arg == 2
    p.decode(0, _delta(3))  # the worker picks it up
    assert p.sent[-1].aux[3] == 2.0 and p.w.residuals[0].tau == 2


def test_a_bad_replay_setting_is_a_config_error_when_the_half_is_built():
    with pytest.raises(ConfigError, match="gddr.replay_decay"):
        GDDRCoordinator(FakeCoordinatorContext(config(None, ON, "gddr.replay_decay=1.0"),
                                               {0: 4}), "gddr")  # fmt: skip


# -- replay of a dead device -----------------------------------------------------------------


def _ckpt(out_dir, d: int):
    return out_dir / "checkpoints" / "gddr" / residual_checkpoint_name(d)


def test_a_dead_device_s_checkpointed_residual_is_folded_in_weighted_over_replay_steps(tmp_path):
    p = Pair("gddr.checkpoint_every=1", "gddr.replay_steps=3", "server.lr=2.0",
             out_dir=tmp_path)  # fmt: skip
    p.cctx.weights[0] = 0.25
    for k in range(3):
        p.decode(0, _delta(k))
    held = p.w.residuals[0].held().copy()  # the checkpoint of the last step holds it all
    assert np.count_nonzero(held) > 0
    p.c.on_device_dead(0, 7.5)
    [rep] = p.c.stats["replays"]
    assert rep["device"] == 0 and rep["time_s"] == 7.5 and rep["checkpoint_step"] == 2
    assert rep["coordinates"] == np.count_nonzero(held)
    assert rep["total"] == pytest.approx(held.sum())
    assert p.cctx.events == [("replay", 7.5, 0, -1)]
    before = p.cctx.global_model.copy()
    moves = []
    for _ in range(3):
        prev = p.cctx.global_model.copy()
        p.c.after_apply(_step(), 0.0)
        moves.append(np.abs(p.cctx.global_model - prev).sum())
    assert moves[0] > moves[1] > moves[2] > 0  # decaying amounts
    np.testing.assert_allclose(p.cctx.global_model - before, 2.0 * 0.25 * held, atol=1e-6)
    p.c.after_apply(_step(), 0.0)  # the replay is over
    np.testing.assert_allclose(p.cctx.global_model - before, 2.0 * 0.25 * held, atol=1e-6)


def test_messages_after_the_checkpoint_are_not_replayed_twice(tmp_path):
    p = Pair("gddr.checkpoint_every=2", "gddr.replay_steps=1", out_dir=tmp_path)
    for k in range(3):  # the checkpoint is of step 1; step 2 was received after it
        p.decode(0, _delta(k))
    p.c.on_device_dead(0, 1.0)
    [rep] = p.c.stats["replays"]
    assert rep["checkpoint_step"] == 1
    before = p.cctx.global_model.copy()
    p.c.after_apply(_step(), 0.0)
    replayed = p.cctx.global_model - before
    # the replay adds the checkpoint's residual where the device still holds it; what step 2
    # released carried its checkpointed part already (it is in the model)
    ckpt = load_residual(_ckpt(tmp_path, 0))
    assert ckpt["last_step"] == 1
    still_held = p.w.residuals[0].due >= 0
    expected = np.where(still_held, ckpt["residual"], 0.0)
    assert np.count_nonzero(expected) and np.count_nonzero(~still_held & (ckpt["residual"] != 0))
    np.testing.assert_allclose(replayed, expected, atol=1e-6)


def test_a_second_death_report_does_not_replay_again(tmp_path):
    p = Pair("gddr.checkpoint_every=1", out_dir=tmp_path)
    p.decode(0, _delta(1))
    p.c.on_device_dead(0, 1.0)
    p.c.on_device_dead(0, 2.0)
    assert len(p.c.stats["replays"]) == 1 and len(p.cctx.events) == 1


def test_nothing_to_replay_without_a_run_directory_or_a_message_of_the_device(tmp_path):
    p = Pair("gddr.checkpoint_every=1")
    p.decode(0, _delta(1))
    p.c.on_device_dead(0, 1.0)  # no run directory
    q = Pair("gddr.checkpoint_every=1", out_dir=tmp_path)
    q.c.on_device_dead(3, 1.0)  # device 3 never sent a RESIDUAL
    for x in (p, q):
        assert x.c.stats["replays"] == [] and x.c.stats["replay_errors"] == []
        assert x.c.replay.replaying == []


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_checkpoint_is_logged_and_skipped(tmp_path, caplog, damage):
    p = Pair("gddr.checkpoint_every=1", out_dir=tmp_path)
    p.decode(0, _delta(1))
    path = _ckpt(tmp_path, 0)
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(b"not an hdf5 file")
    with caplog.at_level(logging.ERROR, logger="edgefl.coordinator"):
        p.c.on_device_dead(0, 3.0)
    [err] = p.c.stats["replay_errors"]
    assert err["device"] == 0 and err["time_s"] == 3.0 and err["error"]
    assert "GDDR replay of dead device 0 skipped" in caplog.text
    assert p.c.stats["replays"] == [] and p.cctx.events == []


def test_a_moved_device_is_replayed_and_starts_over_on_its_new_rank(tmp_path):
    p = Pair("gddr.checkpoint_every=1", out_dir=tmp_path)
    p.decode(0, _delta(1))
    p.decode(1, _delta(2))
    state = {"gddr": p.w.device_state(0), "other": {"x": 1}}
    p.c.on_device_moved(0, 2, 4.0, state)
    assert [r["device"] for r in p.c.stats["replays"]] == [0]
    assert state == {"other": {"x": 1}}  # the new rank restores no residual
    assert 0 not in p.c.decoders and 1 in p.c.decoders
    assert not _ckpt(tmp_path, 0).exists() and _ckpt(tmp_path, 1).exists()
    assert p.c.flush_devices() == [1]
    # the new rank's empty residual starts at step 0 again, and the new decoder follows it
    fresh = GDDRWorker(p.wctx, "gddr")
    job = LocalJob(0, 1, 0, TaskSpec(arg=4), aux=(6.0, 0.0, 0.0))
    msg = received(upload(fresh, job, _delta(3)))
    assert (msg.kind, msg.device, msg.round) == (RESIDUAL, 0, 1)
    dense, why, _ = p.c.decode(0, 1, msg)
    assert why == "" and dense is not None


def test_moving_a_device_without_a_run_directory_only_drops_its_decoder():
    p = Pair()
    p.decode(0, _delta(1))
    state = {"gddr": {"anything": 1}}
    p.c.on_device_moved(0, 2, 1.0, state)
    assert state == {} and p.c.decoders == {}


# -- summary and state -----------------------------------------------------------------------


def test_the_summary_counts_messages_and_their_density():
    p = Pair()
    s = p.c.summary()["gddr"]
    assert s["messages"] == 0 and s["payload_density"] is None and s["tau"] == 4
    for d, k in ((0, 0), (0, 1), (3, 7)):
        p.decode(d, _delta(k))
    values = sum(up.payload.size - 1 for up in p.sent)  # (the last one is the norm)
    s = p.c.summary()["gddr"]
    assert s["messages"] == 3
    assert s["payload_density"] == pytest.approx(values / (3 * N))
    assert 0.3 < s["payload_density"] < 1.0
    assert s["replays"] == [] and s["replay_errors"] == []


def test_the_state_dict_round_trips_so_a_resumed_coordinator_decodes_the_same(tmp_path):
    p = Pair("gddr.adaptive=true", "gddr.checkpoint_every=1", out_dir=tmp_path)
    for k in range(3):
        p.decode(0, _delta(k, scale=1.0 + 3 * k))
        p.c.after_apply(_step(), 0.0)
    p.decode(1, _delta(5))
    p.c.on_device_dead(1, 2.0)  # a replay in progress
    p.decode(0, _delta(8))  # a norm not yet consumed
    st = p.c.state_dict()
    assert sorted(st["decoders"]) == ["0", "1"] and st["norms"].shape == (2,)
    q = GDDRCoordinator(FakeCoordinatorContext(p.cctx.cfg, {0: 6, 1: 6}, numel=N), "gddr")
    q.load_state_dict(st)
    assert q.summary() == p.c.summary()
    assert q.tauc.state_dict() == p.c.tauc.state_dict() and q.norms == p.c.norms
    assert q.replay.replaying == p.c.replay.replaying == [1]
    msg = p.send(0, _delta(9))
    a, _, _ = p.c.decode(0, msg.round, msg)
    b, why, _ = q.decode(0, msg.round, msg)
    assert why == ""
    np.testing.assert_array_equal(a, b)
    before_p, before_q = p.cctx.global_model.copy(), q.ctx.global_model.copy()
    p.c.after_apply(_step(), 0.0)
    q.after_apply(_step(), 0.0)
    np.testing.assert_array_equal(p.cctx.global_model - before_p, q.ctx.global_model - before_q)
    assert q.tauc.tau == p.c.tauc.tau
