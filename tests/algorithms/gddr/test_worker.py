"""edgefl.algorithms.gddr.worker: each device's residual, its RESIDUAL releases, its flush
and its residual checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.base import LocalJob, TaskSpec, Upload
from edgefl.algorithms.gddr.kinds import RESIDUAL
from edgefl.algorithms.gddr.residual import GDDRResidual
from edgefl.algorithms.gddr.store import load_residual, residual_checkpoint_name
from edgefl.algorithms.gddr.worker import GDDRWorker
from edgefl.comm import Kind

from ..fakes import FakeWorkerContext, config, flush_upload, upload

N = 64
ON = 'algorithm.residual="gddr"'


def _worker(*sets: str, out_dir=None, numel: int = N) -> GDDRWorker:
    ctx = FakeWorkerContext(config(None, ON, *sets), {0: list(range(7)), 3: list(range(5))},
                            numel=numel, out_dir=out_dir)  # fmt: skip
    return GDDRWorker(ctx, "gddr")


def _job(d: int = 0, task: int = 0, arg: int = 0) -> LocalJob:
    return LocalJob(d, task, 0, TaskSpec(arg=arg), aux=(7.0, 0.25, 1.5, 123.0))


def _delta(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_an_update_is_encoded_as_one_residual_message_with_the_released_values_and_norm():
    w = _worker()
    delta = _delta(1)
    up = upload(w, _job(task=5), delta)
    assert (up.by, up.kind, up.device, up.task) == ("gddr", int(RESIDUAL), 0, 5)
    assert w.ctx.sent == []  # the core sends the one message
    # aux: the first three of the job's (samples, loss, seconds), then the tau it used
    assert up.aux == (7.0, 0.25, 1.5, 4.0)
    ref = GDDRResidual(N, 0, 0, alpha=0.4, tau=4).step(delta, 0)  # the same rule, by hand
    assert 0 < ref.values.size < N
    np.testing.assert_array_equal(up.payload[:-1], ref.values)
    assert up.payload.dtype == np.float32
    assert up.payload[-1] == pytest.approx(float(np.linalg.norm(delta.astype(np.float64))))


def test_steps_count_up_per_device_and_devices_have_their_own_residuals():
    w = _worker()
    for task in range(3):
        upload(w, _job(0, task), _delta(task))
    upload(w, _job(3, 0), _delta(9))
    assert w.residuals[0].last_step == 2 and w.residuals[3].last_step == 0
    assert w.residuals[3].device == 3


def test_the_task_argument_sets_tau_and_0_keeps_it():
    w = _worker()
    assert upload(w, _job(arg=7), _delta(1)).aux[3] == 7.0 and w.residuals[0].tau == 7
    assert upload(w, _job(task=1, arg=0), _delta(2)).aux[3] == 7.0


def test_the_config_reaches_the_residual():
    w = _worker("gddr.alpha=0.0", "gddr.installments=3", "gddr.installment_ratio=0.25")
    up = upload(w, _job(), _delta(1))
    r = w.residuals[0]
    assert (r.alpha, r.installments, r.installment_ratio) == (0.0, 3, 0.25)
    assert up.payload.size == N + 1  # alpha 0: nothing is withheld


def test_sent_plus_held_is_what_was_produced_and_the_flush_sends_the_rest_dense():
    w = _worker()
    produced = np.zeros(N, np.float64)
    for task in range(4):
        d = _delta(10 + task)
        produced += d
        sent = upload(w, _job(task=task), d)
        assert sent.kind == int(RESIDUAL)
    held = w.residuals[0].held().copy()
    assert np.abs(held).sum() > 0
    up = flush_upload(w, 0, 9)
    assert (up.by, up.kind, up.device, up.task) == ("gddr", int(Kind.UPDATE), 0, 9)
    assert up.aux == (7.0, 0.0, 0.0, 0.0)  # the flush's own: the device's samples, 7
    assert up.payload.dtype == np.float32 and up.payload.shape == (N,)
    np.testing.assert_allclose(up.payload, held, rtol=1e-6, atol=1e-7)
    assert not up.delta.any() and w.ctx.sent == []
    assert not w.residuals[0].held().any()  # emptied
    # a second flush: the residual holds nothing more
    assert not flush_upload(w, 0, 10).payload.any()


def test_a_device_that_never_sent_has_nothing_to_flush():
    w = _worker()
    up = flush_upload(w, 3, 0)
    assert (up.by, up.kind, up.payload) == ("", None, None)  # the core's zero UPDATE
    assert up.aux == (5.0, 0.0, 0.0, 0.0) and not up.delta.any() and w.ctx.sent == []
    assert 3 not in w.residuals


def test_no_checkpoints_without_a_run_directory():
    w = _worker("gddr.checkpoint_every=1")
    assert w.ckpt_dir is None
    upload(w, _job(), _delta(1))  # nothing written, no error


def test_a_checkpoint_is_written_at_every_due_step_before_the_message(tmp_path):
    w = _worker("gddr.checkpoint_every=2", out_dir=tmp_path)
    path = tmp_path / "checkpoints" / "gddr" / residual_checkpoint_name(0)
    assert w.ckpt_dir == tmp_path / "checkpoints" / "gddr"
    upload(w, _job(task=0), _delta(1))  # step 0: 1 step done, not due
    assert not path.exists()
    upload(w, _job(task=1), _delta(2))  # step 1: 2 steps done, due
    st = load_residual(path)
    assert st["last_step"] == 1 and st["device"] == 0
    np.testing.assert_array_equal(st["residual"], w.residuals[0].state_dict()["residual"])
    upload(w, _job(task=2), _delta(3))  # step 2: not due, the file stays at step 1
    assert load_residual(path)["last_step"] == 1
    upload(w, _job(task=3), _delta(4))
    assert load_residual(path)["last_step"] == 3


def test_checkpoint_every_0_never_writes(tmp_path):
    w = _worker("gddr.checkpoint_every=0", out_dir=tmp_path)
    for task in range(3):
        upload(w, _job(task=task), _delta(task))
    assert not (tmp_path / "checkpoints").exists()


def test_device_state_round_trips_so_a_resumed_device_sends_the_same_message():
    a = _worker()
    for task in range(3):
        upload(a, _job(task=task, arg=5), _delta(task))
    assert a.device_state(3) == {}  # never trained here
    b = _worker()
    b.load_device_state(0, a.device_state(0))
    assert b.residuals[0].last_step == 2 and b.residuals[0].tau == 5
    nxt = _delta(99)
    ua = upload(a, _job(task=3), nxt.copy())
    ub = upload(b, _job(task=3), nxt.copy())
    np.testing.assert_array_equal(ua.payload, ub.payload)
    assert ua.aux == ub.aux and ua.kind == ub.kind == int(RESIDUAL)


def test_a_foreign_device_state_is_refused():
    a = _worker()
    upload(a, _job(), _delta(1))
    with pytest.raises(ValueError, match="device"):
        _worker().load_device_state(3, a.device_state(0))
    with pytest.raises(ValueError, match="size"):
        _worker(numel=N + 1).load_device_state(0, a.device_state(0))


def test_a_wrongly_sized_update_is_an_error_and_encodes_nothing():
    w = _worker()
    up = Upload(0, 0, np.zeros(N - 1, np.float32), (7.0, 0.25, 1.5, 123.0))
    with pytest.raises(ValueError, match="GDDR update"):
        w.encode(up, _job())
    assert up.by == "" and up.payload is None and w.ctx.sent == []
