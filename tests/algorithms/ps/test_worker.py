"""A worker's ps half (edgefl.algorithms.ps.worker) over a fake context: working sets,
MODEL_KEYS installs, filtered and encoded SPARSE pushes, RESEND, the final flush, the KKT
filter's context and per-device checkpoint state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from edgefl.algorithms.base import LocalJob, TaskSpec
from edgefl.algorithms.ps.compress import FORMATS, Decoder, round_values
from edgefl.algorithms.ps.coordinator import PSCoordinator
from edgefl.algorithms.ps.filters import FilterContext, mass_checksum
from edgefl.algorithms.ps.kinds import MODEL_KEYS, RESEND, SPARSE, WORKSET
from edgefl.algorithms.ps.worker import PSWorker
from edgefl.algorithms.ps.workset import loss_gradient
from edgefl.comm import Kind
from edgefl.errors import EdgeflError
from edgefl.models.flat import FlatParams
from edgefl.models.logreg import LogReg
from edgefl.policies.keyrange import key_digest

from ..fakes import (
    FakeCoordinatorContext,
    FakeWorkerContext,
    config,
    flush_upload,
    message,
    received,
    upload,
)

# logreg over 6 features, 2 classes: linear.weight keys 0..11 (row o, feature j = 6 o + j),
# linear.bias keys 12, 13
N_IN, CLASSES = 6, 2
NUMEL = N_IN * CLASSES + CLASSES
WS_SETS = ("ps.pull=working-set", "model.name=logreg")


def _data(cols, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, N_IN)
    x[:, cols] = torch.randn(n, len(cols), generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def _flat():
    torch.manual_seed(0)
    model = LogReg(N_IN, CLASSES)
    return model, FlatParams(model)


def _worker(*sets, data=None, rank=1, logreg=True):
    data = data if data is not None else {0: _data([0, 3]), 2: _data([3, 5])}
    _, flat = _flat()
    model = ("model.name=logreg",) if logreg else ()
    ctx = FakeWorkerContext(config(None, *model, *sets), data, rank=rank, flat=flat)
    w = PSWorker(ctx, "ps")
    w.on_register({})
    return ctx, w


def _job(d, task=0, aux=(10.0, 0.5, 1.0, 1.0), **kw):
    return LocalJob(device=d, task=task, version=0, spec=TaskSpec(), aux=aux, **kw)


def _delta(**entries):
    v = np.zeros(NUMEL, np.float32)
    for k, x in entries.items():
        v[int(k[1:])] = x
    return v


def _decode(sent, dec=None):
    dec = dec or Decoder(NUMEL)
    return dec.decode(sent.payload).to_dense()


# -- working sets ------------------------------------------------------------------------
def test_working_sets_are_the_devices_feature_columns_and_the_bias():
    ctx, w = _worker(*WS_SETS)
    assert w.ws[0].tolist() == [0, 3, 6, 9, 12, 13]
    assert w.ws[2].tolist() == [3, 5, 9, 11, 12, 13]
    assert w.ws_union.tolist() == [0, 3, 5, 6, 9, 11, 12, 13]
    assert w.ws_digest == key_digest(w.ws_union)


def test_no_working_sets_without_logreg_or_any_ps_option():
    _, w = _worker("ps.pull=working-set", logreg=False)
    assert w.ws == {} and w.ws_union is None
    _, w = _worker()  # logreg, full pulls, no sparse pushes
    assert w.ws == {}
    _, w = _worker("ps.sparse=true")  # known (the key cache uses it) but not pulled
    assert set(w.ws) == {0, 2} and w.ws_union is None


def test_rank_0s_heartbeat_is_answered_with_one_workset_per_device_then_a_heartbeat():
    ctx, w = _worker(*WS_SETS)
    w.on_message(message(Kind.HEARTBEAT, src=0))
    assert ctx.sent_kinds() == [WORKSET, WORKSET, Kind.HEARTBEAT]
    a, b, hb = ctx.sent
    assert (a.rank, a.device, b.device, hb.rank) == (0, 0, 2, 0)
    assert a.payload.dtype == np.int32 and a.payload.tolist() == w.ws[0].tolist()
    w.on_message(message(Kind.HEARTBEAT, src=0))  # sent once
    assert len(ctx.sent) == 3


@pytest.mark.parametrize("rank,bad", [(1, True), (2, False)])
def test_the_debug_hook_corrupts_rank_1s_first_working_set_only(rank, bad):
    ctx, w = _worker(*WS_SETS, "ps.debug_bad_working_set=unsorted", rank=rank)
    w.on_message(message(Kind.HEARTBEAT, src=0))
    first, second = ctx.sent[0].payload, ctx.sent[1].payload
    assert (first.tolist() == w.ws[0][::-1].tolist()) is bad
    assert second.tolist() == w.ws[2].tolist()


def test_model_keys_install_a_version_at_the_working_set_keys():
    ctx, w = _worker(*WS_SETS)
    keys = w.ws_union
    vals = np.arange(1, keys.size + 1, dtype=np.float32)
    msg = message(MODEL_KEYS, src=0, round=5, aux=(keys.size, w.ws_digest), payload=vals)
    w.on_message(msg)
    got = ctx.versions[5]
    assert got[keys].tolist() == vals.tolist()
    assert not np.delete(got, keys).any()  # keys outside it: zeros at first
    assert ctx.released == [msg]


@pytest.mark.parametrize("bad", ["count", "digest", "payload"])
def test_model_keys_for_another_key_list_are_a_clear_error(bad):
    ctx, w = _worker(*WS_SETS)
    n, digest = w.ws_union.size, w.ws_digest
    vals = np.ones(n, np.float32)
    if bad == "count":
        n -= 1
    elif bad == "digest":
        digest ^= 1
    else:
        vals = np.ones(n + 1, np.float32)
    msg = message(MODEL_KEYS, src=0, round=3, aux=(n, digest), payload=vals)
    with pytest.raises(EdgeflError, match="MODEL_KEYS of model version 3"):
        w.on_message(msg)
    assert ctx.released == [msg] and ctx.versions == {}


def test_model_keys_on_a_rank_without_a_working_set_are_an_error():
    ctx, w = _worker()
    msg = message(MODEL_KEYS, src=0, round=1, aux=(2, 0), payload=np.ones(2, np.float32))
    with pytest.raises(EdgeflError, match="working set has 0 keys"):
        w.on_message(msg)


# -- pushes ------------------------------------------------------------------------------
def test_without_sparse_pushes_the_core_sends_the_update():
    ctx, w = _worker()
    up = upload(w, _job(0), _delta(k1=1.0))
    assert (up.by, up.kind, up.payload) == ("", None, None)  # left to the core: dense
    np.testing.assert_array_equal(up.delta, _delta(k1=1.0))
    assert up.aux == (10.0, 0.5, 1.0, 1.0)
    fl = flush_upload(w, 0, 1)
    assert (fl.by, fl.kind, fl.payload) == ("", None, None)
    assert w.device_state(0) == {} and ctx.sent == []


def test_a_push_is_an_encoded_sparse_message_with_the_tasks_aux():
    ctx, w = _worker("ps.sparse=true")
    delta = _delta(k1=0.5, k12=-1.0)
    s = upload(w, _job(0, task=3, aux=(4.0, 0.1, 2.0, 1.0)), delta)
    assert (s.by, s.kind, s.device, s.task, s.aux) == ("ps", SPARSE, 0, 3, (4.0, 0.1, 2.0, 1.0))
    assert ctx.sent == []  # the core sends the one message
    assert s.payload.dtype == np.uint8
    np.testing.assert_array_equal(_decode(s), delta)
    assert w.produced[0] == pytest.approx(mass_checksum([1, 12], [0.5, -1.0]))


def test_the_significant_filter_holds_small_entries_until_the_flush():
    ctx, w = _worker("ps.sparse=true", 'ps.filters=["significant"]', "ps.sig_threshold=0.5")
    up = upload(w, _job(0, task=0), _delta(k1=0.3, k2=2.0))
    np.testing.assert_array_equal(_decode(up), _delta(k2=2.0))
    up = upload(w, _job(0, task=1), _delta(k1=0.3, k4=0.1))  # k1 accumulates to 0.6
    np.testing.assert_allclose(_decode(up), _delta(k1=0.6))
    s = flush_upload(w, 0, 2)
    assert (s.by, s.kind, s.device, s.task) == ("ps", SPARSE, 0, 2)
    np.testing.assert_allclose(_decode(s), _delta(k4=0.1))
    samples, produced, skipped, seen = s.aux
    assert samples == 4.0 and skipped == 0.0 and seen == 0.0
    assert produced == pytest.approx(
        mass_checksum([1, 2], [0.3, 2.0]) + mass_checksum([1, 4], [0.3, 0.1])
    )
    assert flush_upload(w, 2, 0).by == ""  # device 2 never pushed
    assert ctx.sent == []


def test_low_precision_values_are_sent_as_the_receiver_decodes_them():
    ctx, w = _worker("ps.sparse=true", "ps.value_dtype=float16")
    delta = _delta(k0=1.0001, k5=-3.14159)
    got = _decode(upload(w, _job(0), delta))
    np.testing.assert_array_equal(got[[0, 5]], round_values(delta[[0, 5]], "float16"))
    assert got[0] != delta[0]  # (float16 cannot hold 1.0001)
    # the rounding error is held back and released by the flush
    fl = flush_upload(w, 0, 1)
    assert fl.by == "ps" and fl.kind == SPARSE
    np.testing.assert_allclose(got + _decode(fl), delta, rtol=1e-6)


def test_a_resend_carries_the_full_key_list_of_that_task_only():
    ctx, w = _worker("ps.sparse=true", "ps.key_cache=true")
    delta = _delta(k1=1.0, k7=2.0)
    first = upload(w, _job(0, task=2), delta)
    assert first.kind == SPARSE and ctx.sent == []
    w.on_message(message(RESEND, src=0, device=0, round=1))  # not the last task: ignored
    assert ctx.sent == []
    w.on_message(message(RESEND, src=0, device=0, round=2))
    (s,) = ctx.sent  # (the RESEND answer is the plugin's own message)
    assert (s.rank, s.kind, s.device, s.round, s.aux) == (0, SPARSE, 0, 2, first.aux)
    assert FORMATS[s.payload[0]] == "indexed"
    np.testing.assert_array_equal(_decode(s), delta)  # a fresh receiver decodes it
    w.on_message(message(RESEND, src=0, device=2, round=0))  # never pushed: nothing
    assert len(ctx.sent) == 1


def _ps_pair(*sets, data=None):
    """A worker half and rank 0's half with the working sets exchanged (one worker rank)."""
    sets = (*WS_SETS, *sets)
    wctx, w = _worker(*sets, data=data)
    w.on_message(message(Kind.HEARTBEAT, src=0))
    cctx = FakeCoordinatorContext(config(None, *sets), {0: 4, 2: 4}, n_workers=1, numel=NUMEL)
    for s in wctx.sent:
        m = message(s.kind, src=1, device=s.device, payload=s.payload)
        cctx.inbox.append(m)
    wctx.sent.clear()
    c = PSCoordinator(cctx, "ps")
    c.on_registered()
    assert set(c.ws_dev) == {0, 2}
    return wctx, w, cctx, c


def test_with_key_caching_pushes_name_their_keys_as_a_bitmap_over_the_working_set():
    wctx, w, cctx, c = _ps_pair("ps.sparse=true", "ps.key_cache=true")
    pushes = [_delta(k0=1.0, k9=-2.0), _delta(k3=0.5), _delta(k13=4.0, k6=1.0)]
    for task, delta in enumerate(pushes):
        s = upload(w, _job(0, task=task), delta)
        assert s.kind == SPARSE and FORMATS[s.payload[0]] == "mask"
        got, why, _ = c.decode(0, task, received(s))
        assert why == "" and c.resends == 0
        np.testing.assert_array_equal(got, delta)


def test_without_an_accepted_working_set_the_first_push_misses_and_is_resent():
    wctx, w, cctx, c = _ps_pair("ps.sparse=true", "ps.key_cache=true")
    del c.ws_dev[0]  # (as if rank 0 had rejected device 0's WORKSET)
    delta = _delta(k0=1.0, k3=2.0)
    push = received(upload(w, _job(0, task=0), delta))
    assert (push.kind, push.device, push.round) == (SPARSE, 0, 0) and wctx.sent == []

    def answer(key):
        # the worker answers rank 0's RESEND: feed it to the worker, return its reply
        (r,) = [s for s in cctx.sent if s.kind == RESEND]
        w.on_message(message(RESEND, src=0, device=r.device, round=r.round))
        s = wctx.sent[-1]
        return message(SPARSE, src=1, device=s.device, round=s.round, payload=s.payload)

    cctx.wait_for = answer
    got, why, _ = c.decode(0, 0, push)
    assert why == "" and c.resends == 1
    np.testing.assert_array_equal(got, delta)


def test_a_push_outside_the_working_set_is_sent_without_the_bitmap():
    wctx, w, cctx, c = _ps_pair("ps.sparse=true", "ps.key_cache=true")
    delta = _delta(k1=1.0)  # feature 1 is in no device's data
    s = upload(w, _job(0), delta)
    assert s.kind == SPARSE and FORMATS[s.payload[0]] != "mask"
    got, why, _ = c.decode(0, 0, received(s))
    assert why == "" and np.array_equal(got, delta)


# -- the KKT filter ----------------------------------------------------------------------
KKT_SETS = ("ps.sparse=true", 'ps.filters=["kkt"]', "server.l1=0.5", "train.lr=0.1")


def test_before_train_gives_the_kkt_filter_weights_and_scaled_gradients():
    ctx, w = _worker(*KKT_SETS)
    model, flat = _flat()
    ds = ctx.train_set(0)
    start = np.linspace(-1, 1, NUMEL).astype(np.float32)
    job = _job(0, model=model, dataset=ds, start=start)
    job.spec = TaskSpec(batch=3)  # 4 samples, batches of 3: 2 steps of one epoch
    w.before_train(0, job)
    fc = job.ctx["kkt"]
    assert isinstance(fc, FilterContext)
    keys = w.ws[0]  # (logreg: the device's working set)
    assert fc.keys.tolist() == keys.tolist()
    assert fc.weights.tolist() == start[keys].tolist()
    g = loss_gradient(model, ds, "classification")
    np.testing.assert_allclose(fc.grads, g[keys] * 0.1 * 2, rtol=1e-6)


def test_before_train_uses_local_steps_and_every_key_without_a_working_set():
    ctx, w = _worker(*KKT_SETS, "train.local_steps=5")
    w.ws.clear()
    model, _ = _flat()
    job = _job(0, model=model, dataset=ctx.train_set(0), start=np.zeros(NUMEL, np.float32))
    w.before_train(0, job)
    fc = job.ctx["kkt"]
    assert fc.keys.tolist() == list(range(NUMEL))
    g = loss_gradient(model, ctx.train_set(0), "classification")
    np.testing.assert_allclose(fc.grads, g * 0.1 * 5, rtol=1e-6)


def test_no_kkt_context_without_the_kkt_filter():
    ctx, w = _worker("ps.sparse=true")
    model, _ = _flat()
    job = _job(0, model=model, dataset=ctx.train_set(0), start=np.zeros(NUMEL, np.float32))
    w.before_train(0, job)
    assert "kkt" not in job.ctx


def test_the_kkt_filter_skips_zero_weights_with_small_gradients_but_never_biases():
    ctx, w = _worker(*KKT_SETS)
    assert w._exempt_keys().tolist() == [12, 13]
    keys = np.arange(NUMEL)
    weights = np.zeros(NUMEL)
    weights[3] = 1.0  # a nonzero weight is always sent
    job = _job(0)
    job.ctx["kkt"] = FilterContext(keys, weights, np.full(NUMEL, 0.1))  # |g| <= l1
    delta = _delta(k0=0.2, k3=0.2, k12=0.2)
    np.testing.assert_array_equal(_decode(upload(w, job, delta)), _delta(k3=0.2, k12=0.2))
    s = flush_upload(w, 0, 1)
    assert s.by == "ps" and s.kind == SPARSE
    np.testing.assert_allclose(_decode(s), _delta(k0=0.2))
    assert s.aux[2:] == (1.0, 3.0)  # KKT entries skipped, seen


# -- checkpoint state --------------------------------------------------------------------
def test_device_state_round_trip_keeps_held_mass_counts_and_key_cache():
    sets = ("ps.sparse=true", "ps.key_cache=true", 'ps.filters=["significant", "kkt"]',
            "ps.sig_threshold=1.0", "server.l1=0.5")  # fmt: skip
    ctx, w = _worker(*sets)
    job = _job(0, task=0)
    job.ctx["kkt"] = FilterContext(np.arange(NUMEL), np.zeros(NUMEL), np.zeros(NUMEL))
    upload(w, job, _delta(k1=0.4, k2=3.0, k5=5.0))
    st = w.device_state(0)
    assert set(st) == {"filters", "produced", "cache", "kkt"}
    assert st["kkt"] == [[2, 2]]  # k1 held by significant; kkt saw and skipped k2, k5

    ctx2, w2 = _worker(*sets)
    w2.load_device_state(0, st)
    assert w2.produced[0] == w.produced[0]
    a, b = flush_upload(w, 0, 1), flush_upload(w2, 0, 1)
    assert a.by == b.by == "ps" and a.kind == b.kind == SPARSE
    assert a.aux == b.aux
    np.testing.assert_allclose(_decode(a), _decode(b))
    np.testing.assert_allclose(_decode(b), _delta(k1=0.4, k2=3.0, k5=5.0))


def test_loading_an_empty_device_state_sets_nothing_up():
    ctx, w = _worker("ps.sparse=true")
    w.load_device_state(0, {})
    assert w.filters == {} and flush_upload(w, 0, 0).by == ""
