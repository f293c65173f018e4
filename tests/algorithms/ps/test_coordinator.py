"""Rank 0's ps half (edgefl.algorithms.ps.coordinator) over a fake context: collecting
working sets, MODEL_KEYS pulls, decoding SPARSE pushes (with RESEND on a key-cache miss),
the final flush accounting, summary and checkpoint state."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.base import Download
from edgefl.algorithms.ps.compress import FORMATS, Encoder, key_hash
from edgefl.algorithms.ps.coordinator import PSCoordinator
from edgefl.algorithms.ps.filters import mass_checksum
from edgefl.algorithms.ps.kinds import MODEL_KEYS, RESEND, SPARSE, WORKSET
from edgefl.comm import Kind
from edgefl.comm.wire import HEADER_BYTES
from edgefl.policies.consistency import Arrival
from edgefl.policies.keyrange import key_digest

from ..fakes import FakeCoordinatorContext, config, message

NUMEL = 12
WS_SETS = ("ps.pull=working-set", "model.name=logreg")


def _msg(kind, src=1, device=-1, round=0, aux=(), payload=None):
    m = message(kind, src=src, device=device, round=round, aux=aux, payload=payload)
    m.nbytes = 0 if payload is None else int(payload.nbytes)
    return m


def _ctx(*sets, samples=None, n_workers=2, **kw) -> FakeCoordinatorContext:
    samples = samples or {0: 10, 1: 20, 2: 30, 3: 40}
    return FakeCoordinatorContext(config(None, *sets), samples, n_workers, numel=NUMEL, **kw)


def _ws(*keys):
    return np.array(keys, np.int32)


def _registered(ctx, sets_per_device, heartbeats=None):
    """Queue one WORKSET per device (from its rank) and each rank's HEARTBEAT, then run
    on_registered."""
    for d, keys in sets_per_device.items():
        ctx.inbox.append(_msg(WORKSET, src=ctx.rank_of(d), device=d, payload=keys))
    for r in ctx.workers if heartbeats is None else heartbeats:
        ctx.inbox.append(_msg(Kind.HEARTBEAT, src=r))
    ps = PSCoordinator(ctx, "ps")
    ps.on_registered()
    return ps


def test_full_pulls_collect_nothing():
    ctx = _ctx()
    ps = PSCoordinator(ctx, "ps")
    ps.on_registered()
    assert ctx.sent == [] and ps.ws_rank == {}
    down = Download(1, 0)
    ps.send_model(down)
    assert (down.by, down.kind, down.payload) == ("", None, None)  # the core sends MODEL
    assert ctx.sent == [] and ps.down_bytes(0) is None


def test_working_sets_are_asked_for_and_a_rank_gets_the_union_of_its_devices():
    ctx = _ctx(*WS_SETS)
    # devices 0, 2 on rank 1; 1, 3 on rank 2
    ps = _registered(ctx, {0: _ws(0, 3, 5), 2: _ws(3, 7), 1: _ws(1), 3: _ws(2, 11)})
    assert [(s.rank, s.kind) for s in ctx.sent] == [(1, Kind.HEARTBEAT), (2, Kind.HEARTBEAT)]
    keys, digest = ps.ws_rank[1]
    assert keys.tolist() == [0, 3, 5, 7] and digest == key_digest(keys)
    assert ps.ws_rank[2][0].tolist() == [1, 2, 11]
    assert ps.ws_rejected == [] and ctx.rejected == []
    assert len(ctx.released) == 6  # every message polled is given back
    assert ps.ws_up[0] == HEADER_BYTES + 3 * 4


def test_a_malformed_working_set_is_rejected_and_its_rank_pulls_full_models():
    ctx = _ctx(*WS_SETS)
    ps = _registered(ctx, {0: _ws(0, 3), 2: _ws(3, 7), 1: _ws(5, 1), 3: _ws(2)})
    assert ps.ws_rejected == [1] and 1 not in ps.ws_dev
    (rank, why), = ctx.rejected  # fmt: skip
    assert rank == 2 and why.startswith("WORKSET of rank 2, device 1:")
    assert set(ps.ws_rank) == {1}
    down = Download(2, 0)
    ps.send_model(down)
    assert (down.by, down.kind, down.payload) == ("", None, None)
    assert ps.down_bytes(1) is None and ps.down_bytes(3) is None


@pytest.mark.parametrize("bad", [_ws(3, 3), _ws(0, NUMEL), np.array([0.5], np.float32)])
def test_every_kind_of_bad_key_list_is_rejected(bad):
    ctx = _ctx(*WS_SETS, samples={0: 5}, n_workers=1)
    ps = _registered(ctx, {0: bad})
    assert ps.ws_rejected == [0] and ps.ws_rank == {} and len(ctx.rejected) == 1


def test_a_rank_whose_devices_touch_every_key_pulls_the_full_model():
    ctx = _ctx(*WS_SETS, samples={0: 5, 1: 5}, n_workers=1)
    ps = _registered(ctx, {0: np.arange(0, 6, dtype=np.int32), 1: np.arange(6, NUMEL)})
    assert ps.ws_rank == {} and set(ps.ws_dev) == {0, 1}


def test_failed_ranks_are_not_waited_for():
    ctx = _ctx(*WS_SETS)
    ctx.failed = {2}
    ps = _registered(ctx, {0: _ws(1), 2: _ws(2)}, heartbeats=[1])
    assert set(ps.ws_rank) == {1}


def test_a_silent_rank_gets_full_models_after_the_register_timeout():
    ctx = _ctx(*WS_SETS, "comm.register_timeout_s=0.01")
    ps = _registered(ctx, {0: _ws(1), 2: _ws(2)}, heartbeats=[1])  # rank 2 never answers
    assert set(ps.ws_rank) == {1}


def test_other_messages_during_collection_are_released_and_ignored():
    ctx = _ctx(*WS_SETS, samples={0: 5}, n_workers=1)
    ctx.inbox.append(_msg(Kind.REPORT, src=1, device=0))
    ps = _registered(ctx, {0: _ws(4)})
    assert ps.ws_rank[1][0].tolist() == [4] and len(ctx.released) == 3


def test_send_model_encodes_the_global_values_at_the_ranks_keys():
    ctx = _ctx(*WS_SETS, model=np.arange(NUMEL, dtype=np.float32) * 10)
    ps = _registered(ctx, {0: _ws(2, 5), 2: _ws(9), 1: _ws(1), 3: _ws(0)})
    ctx.version_ = 7
    ctx.sent.clear()
    down = Download(1, 7)
    ps.send_model(down)
    assert ctx.sent == []  # the core sends the one message (round: the version)
    keys, digest = ps.ws_rank[1]
    assert (down.by, down.kind, down.rank, down.version) == ("ps", MODEL_KEYS, 1, 7)
    assert down.aux == (3.0, float(digest)) and int(down.aux[1]) == digest
    assert down.payload.dtype == np.float32 and down.payload.tolist() == [20.0, 50.0, 90.0]
    ctx.add_to_model(keys, np.ones(3, np.float32))  # a later step: the payload is a copy
    assert down.payload.tolist() == [20.0, 50.0, 90.0]


def test_down_bytes_counts_two_headers_and_the_devices_own_working_set():
    ctx = _ctx(*WS_SETS)
    ps = _registered(ctx, {0: _ws(2, 5), 2: _ws(9), 1: _ws(1), 3: _ws(0)})
    assert ps.down_bytes(0) == 2 * HEADER_BYTES + 4 * 2
    assert ps.down_bytes(2) == 2 * HEADER_BYTES + 4


def test_on_start_books_the_workset_uploads_except_on_resume():
    ctx = _ctx(*WS_SETS, samples={0: 5, 1: 5}, n_workers=1)
    ps = _registered(ctx, {0: _ws(2, 5), 1: _ws(1)})
    ps.on_start()
    assert ctx.booked == [(0, HEADER_BYTES + 8), (1, HEADER_BYTES + 4)]
    ctx.booked.clear()
    ctx.resuming_ = True
    ps.on_start()
    assert ctx.booked == []


# -- sparse pushes ---------------------------------------------------------------------------
SPARSE_SETS = ("ps.sparse=true",)


def _sparse(enc: Encoder, keys, vals, device=0, task=0, **kw):
    p = enc.encode(np.array(keys), np.array(vals, np.float32), **kw).payload
    return _msg(SPARSE, src=1 + device % 2, device=device, round=task, payload=p)


def test_decode_returns_the_dense_delta_and_books_its_mass():
    ctx = _ctx(*SPARSE_SETS)
    ps = PSCoordinator(ctx, "ps")
    msg = _sparse(Encoder(NUMEL), [1, 4], [0.5, -2.0], device=3)
    delta, why, used = ps.decode(3, 0, msg)
    assert why == "" and used is msg
    assert delta.dtype == np.float32 and delta.shape == (NUMEL,)
    assert np.flatnonzero(delta).tolist() == [1, 4] and delta[[1, 4]].tolist() == [0.5, -2.0]
    produced, received, received_abs = ps.mass[3]
    assert produced == 0.0 and received == pytest.approx(mass_checksum([1, 4], [0.5, -2.0]))
    assert received_abs == 2.5
    assert ps.flush_devices() == [3]


def test_a_dense_encoded_push_books_only_its_nonzero_keys():
    ctx = _ctx(*SPARSE_SETS)
    ps = PSCoordinator(ctx, "ps")
    keys = list(range(10))  # dense is smaller than indexed here
    vals = [0.0] * 9 + [3.0]
    msg = _sparse(Encoder(NUMEL), keys, vals)
    assert FORMATS[msg.payload[0]] == "dense"
    delta, why, _ = ps.decode(0, 0, msg)
    assert why == "" and ps.mass[0][1] == pytest.approx(mass_checksum([9], [3.0]))


def test_a_malformed_push_is_refused_with_a_reason():
    ctx = _ctx(*SPARSE_SETS)
    ps = PSCoordinator(ctx, "ps")
    good = _sparse(Encoder(NUMEL), [1], [1.0])
    bad = _msg(SPARSE, src=1, device=0, payload=good.payload[:-2].copy())
    delta, why, used = ps.decode(0, 0, bad)
    assert delta is None and used is bad
    assert why.startswith("sparse update of device 0: ")
    other_space = _sparse(Encoder(NUMEL + 1), [1], [1.0])
    delta, why, _ = ps.decode(0, 0, other_space)
    assert delta is None and "key space" in why


def test_a_key_cache_miss_asks_for_a_resend_and_decodes_it():
    ctx = _ctx(*SPARSE_SETS, "ps.key_cache=true")
    ps = PSCoordinator(ctx, "ps")
    enc = Encoder(NUMEL, key_cache=True)
    enc.encode(np.array([2, 6]), np.ones(2, np.float32))  # (rank 0 never got this one)
    missed = _sparse(enc, [2, 6], [1.5, -1.0], device=1, task=4)
    assert FORMATS[missed.payload[0]] == "cached"
    enc.reset_cache()
    resent = _sparse(enc, [2, 6], [1.5, -1.0], device=1, task=4)
    ctx.inbox.append(resent)
    delta, why, used = ps.decode(1, 4, missed)
    assert why == "" and used is resent
    assert delta[[2, 6]].tolist() == [1.5, -1.0]
    assert ps.resends == 1
    assert [(s.rank, s.kind, s.device, s.round) for s in ctx.sent] == [(2, RESEND, 1, 4)]
    assert ctx.booked == [(1, HEADER_BYTES + missed.nbytes)] and ctx.released == [missed]
    # the resent list is cached now: the next push naming it decodes at once
    again = _sparse(enc, [2, 6], [1.0, 1.0], device=1, task=5)
    assert FORMATS[again.payload[0]] == "cached"
    assert ps.decode(1, 5, again)[1] == ""


def test_a_resend_that_misses_again_is_refused():
    ctx = _ctx(*SPARSE_SETS, "ps.key_cache=true")
    ps = PSCoordinator(ctx, "ps")
    enc = Encoder(NUMEL, key_cache=True)
    enc.encode(np.array([3]), np.ones(1, np.float32))
    missed = _sparse(enc, [3], [1.0])
    # a reply that still names the hash only: refused, and no second RESEND is sent
    ctx.inbox += [_sparse(enc, [3], [2.0])]
    delta, why, _ = ps.decode(0, 0, missed)
    assert delta is None and "key list still unknown after a resend" in why
    assert ps.resends == 1 and ctx.sent_kinds() == [RESEND] and ctx.inbox == []


def test_an_accepted_working_set_is_the_devices_first_cached_key_list():
    ctx = _ctx(*WS_SETS, "ps.sparse=true", "ps.key_cache=true", samples={0: 5}, n_workers=1)
    ws = _ws(1, 4, 8)
    ps = _registered(ctx, {0: ws})
    enc = Encoder(NUMEL, key_cache=True)
    enc.cache.put(key_hash(ws, NUMEL), ws.astype(np.int64))
    msg = _sparse(enc, [4, 8], [1.0, 2.0], base=ws, remember=False)
    assert FORMATS[msg.payload[0]] == "mask"
    delta, why, _ = ps.decode(0, 0, msg)
    assert why == "" and delta[[4, 8]].tolist() == [1.0, 2.0] and ps.resends == 0


class _Ap:  # after_apply reads nothing of the Apply
    pass


def test_the_debug_hook_forgets_the_key_caches_every_n_versions():
    ctx = _ctx(*SPARSE_SETS, "ps.key_cache=true", "debug.forget_key_cache_every=2")
    ps = PSCoordinator(ctx, "ps")
    enc = Encoder(NUMEL, key_cache=True)
    ps.decode(0, 0, _sparse(enc, [1, 2], [1.0, 1.0]))
    assert len(ps.decoders[0].cache) == 1
    ctx.version_ = 1
    ps.after_apply(_Ap(), 0.0)
    assert len(ps.decoders[0].cache) == 1
    ctx.version_ = 2
    ps.after_apply(_Ap(), 0.0)
    assert len(ps.decoders[0].cache) == 0


def test_without_sparse_pushes_no_device_is_asked_to_flush():
    ctx = _ctx(*WS_SETS)
    ps = PSCoordinator(ctx, "ps")
    ps._decoder(0)
    assert ps.flush_devices() == []


def _arrival(d, delta, msg):
    return Arrival(d, 9, 0, 10, 0.0, np.asarray(delta, np.float32), msg=msg)


def test_a_final_update_flush_books_its_mass_kkt_counts_and_bytes():
    ctx = _ctx(*SPARSE_SETS)
    ps = PSCoordinator(ctx, "ps")
    delta = np.zeros(NUMEL, np.float32)
    delta[[0, 5]] = [1.0, -3.0]
    msg = _msg(Kind.UPDATE, src=1, device=2, round=9, aux=(10.0, 7.5, 3.0, 8.0), payload=delta)
    ps.on_flushed(2, _arrival(2, delta, msg))
    produced, received, received_abs = ps.mass[2]
    assert produced == 7.5 and received == pytest.approx(mass_checksum([0, 5], [1.0, -3.0]))
    assert received_abs == 4.0 and ps.flushed_abs == 4.0 and ps.kkt == [3, 8]
    assert ctx.booked == [(2, HEADER_BYTES + delta.nbytes)]


def test_a_sparse_final_flush_is_not_booked_twice():
    ctx = _ctx(*SPARSE_SETS)
    ps = PSCoordinator(ctx, "ps")
    msg = _sparse(Encoder(NUMEL), [3], [2.0], device=0, task=1)
    msg.aux = (5.0, 4.0, 0.0, 2.0)
    delta, _, _ = ps.decode(0, 1, msg)
    received = ps.mass[0][1]
    ps.on_flushed(0, _arrival(0, delta, msg))
    assert ps.mass[0] == [4.0, received, 2.0]  # (decode booked the received mass)
    assert ps.flushed_abs == 2.0 and ps.kkt == [0, 2]


def test_summary_of_sparse_pushes():
    ctx = _ctx(*SPARSE_SETS, 'ps.filters=["significant"]')
    ps = PSCoordinator(ctx, "ps")
    ps.decode(1, 0, _sparse(Encoder(NUMEL), [2], [-1.0], device=1))
    ps.kkt = [1, 4]
    out = ps.summary()
    assert out["sparse_resends"] == 0
    s = out["ps"]
    assert s["pull"] == "full" and s["filters"] == ["significant"]
    assert "working_set" not in s
    assert s["mass"] == {"1": {"produced": 0.0, "received": ps.mass[1][1], "received_abs": 1.0}}
    assert s["kkt_skipped"] == 1 and s["kkt_seen"] == 4 and s["flushed_abs"] == 0.0


def test_summary_of_working_set_pulls():
    ctx = _ctx(*WS_SETS)
    ps = _registered(ctx, {0: _ws(0, 3, 5), 2: _ws(3), 1: _ws(4, 4), 3: _ws(2)})
    s = ps.summary()["ps"]
    assert "mass" not in s and s["pull"] == "working-set"
    ws = s["working_set"]
    assert ws["fraction"] == {"0": 3 / NUMEL, "2": 1 / NUMEL, "3": 1 / NUMEL}
    assert ws["fraction_mean"] == pytest.approx(5 / (3 * NUMEL))
    assert ws["rank_keys"] == {"1": 3} and ws["rejected_devices"] == [1]


def test_state_dict_round_trip_restores_counters_and_key_caches():
    sets = (*SPARSE_SETS, "ps.key_cache=true")
    ctx = _ctx(*sets)
    ps = PSCoordinator(ctx, "ps")
    enc = Encoder(NUMEL, key_cache=True)
    ps.decode(2, 0, _sparse(enc, [1, 7], [1.0, 2.0], device=2))
    ps.resends, ps.kkt, ps.flushed_abs = 3, [2, 5], 1.25
    st = ps.state_dict()
    assert st["decoders"] == [2] and st["resends"] == 3
    back = PSCoordinator(_ctx(*sets), "ps")
    back.load_state_dict(st)
    assert back.resends == 3 and back.kkt == [2, 5] and back.flushed_abs == 1.25
    assert back.mass == {2: ps.mass[2]}
    assert back.flush_devices() == [2]
    # the restored cache decodes a push that names the list by hash
    cached = _sparse(enc, [1, 7], [3.0, 4.0], device=2, task=1)
    assert FORMATS[cached.payload[0]] == "cached"
    delta, why, _ = back.decode(2, 1, cached)
    assert why == "" and delta[[1, 7]].tolist() == [3.0, 4.0] and back.resends == 3


def test_loading_an_empty_state_starts_from_zero():
    ps = PSCoordinator(_ctx(*SPARSE_SETS), "ps")
    ps.load_state_dict({})
    assert (ps.resends, ps.mass, ps.kkt, ps.flushed_abs, ps.decoders) == (0, {}, [0, 0], 0.0, {})
