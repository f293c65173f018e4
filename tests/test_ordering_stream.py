"""Streaming ordering (EpochStream): rows fed as they arrive give next_orders' exact orders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.ordering.orderers import make_orderer

GRAB = ("id-grab", "id-grab-bal", "cd-grab")


def _grads(rng: np.random.Generator, sizes: list[int], width: int) -> list[np.ndarray]:
    # integer-valued rows make exact ties (<s, v> == 0) likely, the hardest case for order
    return [rng.integers(-2, 3, size=(n, width)).astype(np.float32) for n in sizes]


def _batch(name: str, sizes, epochs_grads, seed=3, sketch_dim=0):
    o = make_orderer(name, seed=seed, sketch_dim=sketch_dim)
    o.initial_orders(sizes)
    out = []
    for grads in epochs_grads:
        out.append((o.next_orders(grads), [s.copy() for s in o.last_signs]))
    return out, o


def _streamed(name: str, sizes, epochs_grads, rng, seed=3, sketch_dim=0):
    """Feed every epoch in random chunks, interleaving the workers at random."""
    o = make_orderer(name, seed=seed, sketch_dim=sketch_dim)
    o.initial_orders(sizes)
    out = []
    for grads in epochs_grads:
        stream = o.begin_epoch()
        cursors = [0] * len(sizes)
        while True:
            open_ = [w for w, g in enumerate(grads) if cursors[w] < g.shape[0]]
            if not open_:
                break
            w = int(rng.choice(open_))
            take = int(rng.integers(1, 4))
            stream.add(w, grads[w][cursors[w] : cursors[w] + take])
            cursors[w] += take
        out.append((stream.finish(), [s.copy() for s in o.last_signs]))
    return out, o


@pytest.mark.parametrize("name", GRAB)
@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    width=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_stream_equals_batch_any_interleaving(name, sizes, width, seed):
    rng = np.random.default_rng(seed)
    epochs = [_grads(rng, sizes, width) for _ in range(3)]
    want, ob = _batch(name, sizes, epochs)
    got, os_ = _streamed(name, sizes, epochs, rng)
    for (wo, ws), (go, gs) in zip(want, got, strict=True):
        for a, b in zip(wo, go, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(ws, gs, strict=True):
            np.testing.assert_array_equal(a, b)
    # the resumable state (epoch, orders, ID-GraB(Bal)'s means) is the same too
    sa, sb = ob.state_dict(), os_.state_dict()
    for key in sa:
        np.testing.assert_array_equal(np.asarray(sa[key]), np.asarray(sb[key]))


def test_stream_sketched_rows_equal_batch():
    rng = np.random.default_rng(0)
    sizes = [8, 7, 8]
    epochs = [[rng.standard_normal((n, 50)).astype(np.float32) for n in sizes] for _ in range(2)]
    want, _ = _batch("cd-grab", sizes, epochs, sketch_dim=6)
    got, _ = _streamed("cd-grab", sizes, epochs, rng, sketch_dim=6)
    for (wo, _), (go, _) in zip(want, got, strict=True):
        for a, b in zip(wo, go, strict=True):
            np.testing.assert_array_equal(a, b)


def test_cd_grab_decides_while_the_epoch_runs():
    """With every worker shipping one pair per step, all pairs so far are decided at once;
    a worker that lags holds back exactly the decisions that come after its pair."""
    m, n, d = 4, 10, 3
    rng = np.random.default_rng(1)
    grads = _grads(rng, [n] * m, d)
    o = make_orderer("cd-grab", seed=0)
    o.initial_orders([n] * m)
    stream = o.begin_epoch()
    for k in range(n // 2):
        for w in range(m):
            stream.add(w, grads[w][2 * k : 2 * k + 2])
            assert stream.decisions == k * m + w + 1
    stream.finish()

    stream = make_orderer("cd-grab", seed=0)
    stream.initial_orders([n] * m)
    st_ = stream.begin_epoch()
    for w in (0, 2, 3):  # worker 1 has not sent its first pair: only (pair 0, worker 0)
        st_.add(w, grads[w][:4])
    assert st_.decisions == 1
    st_.add(1, grads[1][:4])  # now pairs 0 and 1 of everyone
    assert st_.decisions == 2 * m


def test_incomplete_worker_gets_rr_and_the_rest_still_balance():
    sizes = [6, 6, 6]
    rng = np.random.default_rng(2)
    grads = _grads(rng, sizes, 3)
    o = make_orderer("cd-grab", seed=5)
    o.initial_orders(sizes)
    stream = o.begin_epoch()
    stream.add(0, grads[0])
    stream.add(2, grads[2])  # worker 1 never reports: like next_orders with None for it
    got = stream.finish()
    ref = make_orderer("cd-grab", seed=5)
    ref.initial_orders(sizes)
    want = ref.next_orders([grads[0], None, grads[2]])
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[1], o.shuffled(1, 6, 1))

    o2 = make_orderer("cd-grab", seed=5)
    o2.initial_orders(sizes)
    s2 = o2.begin_epoch()
    s2.add(1, grads[1][:3])  # a partial worker (died mid-epoch) also gets D-RR
    s2.add(0, grads[0])
    s2.add(2, grads[2])
    s2.drop(1)
    with pytest.raises(ValueError, match="dropped"):
        s2.add(1, grads[1][3:])
    out = s2.finish()
    np.testing.assert_array_equal(out[1], o2.shuffled(1, 6, 1))
    assert o2.last_signs[1].size == 0
    for w in (0, 2):
        assert sorted(out[w].tolist()) == list(range(6))


def test_bad_adds_are_refused_and_keep_nothing():
    sizes = [4, 4]
    rng = np.random.default_rng(3)
    grads = _grads(rng, sizes, 2)
    o = make_orderer("id-grab", seed=1)
    o.initial_orders(sizes)
    stream = o.begin_epoch()
    stream.add(0, grads[0][:2])
    with pytest.raises(ValueError, match="sent 5 gradients for 4 units"):
        stream.add(0, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="width 3"):
        stream.add(1, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        stream.add(1, np.array([[np.nan, 0.0]], np.float32))
    with pytest.raises(ValueError, match="no worker 2"):
        stream.add(2, grads[1])
    assert stream.count == [2, 0]
    stream.add(0, grads[0][2:])
    stream.add(1, grads[1])
    got = stream.finish()
    ref = make_orderer("id-grab", seed=1)
    ref.initial_orders(sizes)
    for a, b in zip(ref.next_orders(grads), got, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="already finished"):
        stream.add(0, grads[0])
    with pytest.raises(ValueError, match="already finished"):
        stream.finish()


def test_stale_stream_cannot_finish():
    o = make_orderer("cd-grab", seed=0)
    o.initial_orders([4, 4])
    old = o.begin_epoch()
    o.next_orders([np.ones((4, 2)), np.ones((4, 2))])
    with pytest.raises(ValueError, match="stream is for epoch 0, the orderer is at 1"):
        old.finish()


def test_rr_stream_needs_no_gradients():
    o = make_orderer("rr", seed=4)
    o.initial_orders([5, 3])
    stream = o.begin_epoch()
    assert stream.add(0, np.ones((5, 2))) == 0
    got = stream.finish()
    np.testing.assert_array_equal(got[0], o.shuffled(0, 5, 1))
    np.testing.assert_array_equal(got[1], o.shuffled(1, 3, 1))
