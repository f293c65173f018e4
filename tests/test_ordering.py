"""Ordering policies: D-RR, ID-GraB(PairBal), ID-GraB(Bal), CD-GraB
(edgefl.algorithms.ordering.orderers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.ordering import orderers as om
from edgefl.algorithms.ordering.orderers import (
    BalanceWalk,
    RandomSketch,
    balance,
    count_units,
    expand_units,
    herding_bound,
    make_orderer,
    pair_item_signs,
    reorder,
    replay_epoch_debug,
    save_epoch_debug,
)
from edgefl.errors import CheckpointError, ConfigError

GRAB = ("id-grab", "id-grab-bal", "cd-grab")
PAIRED = ("id-grab", "cd-grab")


def is_perm(o: np.ndarray, n: int) -> bool:
    return o.dtype == np.int32 and np.array_equal(np.sort(o), np.arange(n))


def int_grads(rng: np.random.Generator, sizes: list[int], d: int) -> list[np.ndarray]:
    """Small integer-valued float32 gradients: all arithmetic on them is exact."""
    return [rng.integers(-4, 5, size=(n, d)).astype(np.float32) for n in sizes]


def run_epoch(name: str, sizes: list[int], grads_by_id: list[np.ndarray], **kw) -> tuple:
    """initial orders, then one next_orders with rows of grads_by_id in visit order."""
    o = make_orderer(name, **kw)
    used = o.initial_orders(sizes)
    rows = [g[u] for g, u in zip(grads_by_id, used)]
    return o, used, o.next_orders(rows)


# ----------------------------------------------------------------------------- primitives


def test_balance_rule_and_ties():
    s = np.zeros(2)
    assert balance(s, np.array([1.0, 0.0])) == 1  # tie at s = 0 gives +1
    np.testing.assert_array_equal(s, [1.0, 0.0])
    assert balance(s, np.array([0.0, 3.0])) == 1  # orthogonal: tie again
    np.testing.assert_array_equal(s, [1.0, 3.0])
    assert balance(s, np.array([2.0, 0.0])) == -1  # <s,v> = 2 > 0
    np.testing.assert_array_equal(s, [-1.0, 3.0])
    assert balance(s, np.array([1.0, 0.0])) == 1  # <s,v> = -1 <= 0
    np.testing.assert_array_equal(s, [0.0, 3.0])
    assert balance(s, np.zeros(2)) == 1  # zero vector: tie


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_greedy_walk_bound(d, steps, seed):
    rng = np.random.default_rng(seed)
    walk = BalanceWalk(d)
    total = 0.0
    for _ in range(steps):
        v = rng.standard_normal(d) * rng.uniform(0.01, 10)
        walk.step(v)
        total += float(v @ v)
        assert walk.s @ walk.s <= total * (1 + 1e-12) + 1e-12
    walk.reset()
    assert not walk.s.any()


def test_reorder_hand_worked():
    # pairs (7,3), (5,1), (0,2) with pair signs +1, -1, +1
    visit = np.array([7, 3, 5, 1, 0, 2])
    signs = pair_item_signs(np.array([1, -1, 1]), 6)
    np.testing.assert_array_equal(signs, [1, -1, -1, 1, 1, -1])
    np.testing.assert_array_equal(reorder(visit, signs), [7, 1, 0, 2, 5, 3])
    # odd n: the unpaired last visit (3) keeps the middle
    visit = np.array([4, 2, 0, 1, 3])
    out = reorder(visit, pair_item_signs(np.array([1, 1]), 5))
    np.testing.assert_array_equal(out, [4, 0, 3, 1, 2])
    assert out.dtype == np.int32
    # alternating per-item signs (ID-GraB(Bal)): +1 in visit order, -1 reversed
    np.testing.assert_array_equal(reorder(np.arange(4), np.array([1, -1, 1, -1])), [0, 2, 3, 1])
    with pytest.raises(ValueError):
        reorder(np.arange(3), np.array([1, -1]))


def test_cd_grab_hand_worked_vs_id_grab():
    # worker 0 visits [2,0,3,1], worker 1 visits [1,3,0,2]; rows below are in visit order
    used = [np.array([2, 0, 3, 1]), np.array([1, 3, 0, 2])]
    rows = [
        np.array([[1, 0], [0, 0], [0, 1], [0, 0]], np.float32),  # diffs [1,0], [0,1]
        np.array([[2, 0], [0, 0], [0, 0], [0, 1]], np.float32),  # diffs [2,0], [0,-1]
    ]
    # shared sum, pair outer / worker inner:
    # (k0,w0) s=0 tie +1 -> s=[1,0]; (k0,w1) <s,[2,0]>=2 -> -1, s=[-1,0];
    # (k1,w0) <s,[0,1]>=0 -> +1, s=[-1,1]; (k1,w1) <s,[0,-1]>=-1 -> +1
    cd = make_orderer("cd-grab")
    cd.initial_orders([4, 4])
    out = cd.next_orders(rows, used)
    np.testing.assert_array_equal(out[0], [2, 3, 1, 0])
    np.testing.assert_array_equal(out[1], [3, 0, 2, 1])
    np.testing.assert_array_equal(cd.last_signs[1], [-1, 1, 1, -1])
    assert cd.epoch == 1
    # separate sums: worker 1's first pair is a tie (+1), then <[2,0],[0,-1]> = 0 -> +1
    idg = make_orderer("id-grab")
    idg.initial_orders([4, 4])
    out = idg.next_orders(rows, used)
    np.testing.assert_array_equal(out[0], [2, 3, 1, 0])
    np.testing.assert_array_equal(out[1], [1, 0, 2, 3])


def test_id_grab_bal_hand_worked_uses_stale_mean():
    g = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)  # gradient of example id i
    o = make_orderer("id-grab-bal")
    o.initial_orders([4])
    # epoch 0, mean 0: s=0 +1 (s=1); 1*2>0 -1 (s=-1); -3 +1 (s=2); 8>0 -1
    out = o.next_orders([g[[0, 1, 2, 3]]], [np.arange(4)])
    np.testing.assert_array_equal(out[0], [0, 2, 3, 1])
    # epoch 1 visits [0,2,3,1]: rows [1,3,4,2], v = rows - 2.5 = [-1.5,.5,1.5,-.5]:
    # every dot is <= 0 -> all +1 -> order unchanged (without the mean it would be [0,3,1,2])
    out = o.next_orders([g[out[0]]])
    np.testing.assert_array_equal(out[0], [0, 2, 3, 1])
    np.testing.assert_allclose(o.state_dict()["means"], [[2.5]])


def test_all_zero_gradients_are_ties():
    o, used, out = run_epoch("cd-grab", [6, 5], [np.zeros((6, 3)), np.zeros((5, 3))])
    for u, nxt in zip(used, out):
        n = u.size
        p = n // 2
        evens, odds = u[0 : 2 * p : 2], u[1 : 2 * p : 2]
        middle = u[n - 1 :] if n % 2 else u[:0]
        np.testing.assert_array_equal(nxt, np.concatenate([evens, middle, odds[::-1]]))


# ----------------------------------------------------------------------------- properties


sizes_st = st.lists(st.integers(0, 13), min_size=1, max_size=5)


@settings(max_examples=30, deadline=None)
@given(sizes_st, st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(om.ORDERINGS))
def test_outputs_are_permutations(sizes, d, seed, name):
    rng = np.random.default_rng(seed)
    o = make_orderer(name, seed=seed % 1000)
    orders = o.initial_orders(sizes)
    for _ in range(3):
        assert all(is_perm(x, n) for x, n in zip(orders, sizes))
        orders = o.next_orders([rng.standard_normal((n, d)) for n in sizes])
    assert all(is_perm(x, n) for x, n in zip(orders, sizes))


@settings(max_examples=30, deadline=None)
@given(sizes_st, st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from(PAIRED))
def test_pair_placement(sizes, d, seed, name):
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal((n, d)) for n in sizes]
    _, used, out = run_epoch(name, sizes, grads)
    for u, nxt in zip(used, out):
        n = u.size
        for k in range(n // 2):
            assert {int(nxt[k]), int(nxt[n - 1 - k])} == {int(u[2 * k]), int(u[2 * k + 1])}
        if n % 2:
            assert nxt[n // 2] == u[-1]  # unpaired item in the middle


@settings(max_examples=30, deadline=None)
@given(sizes_st, st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_cd_grab_decisions_follow_rule_and_bound(sizes, d, seed):
    """Replay the decisions (pair outer, worker inner, skipping workers without pair k)."""
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal((n, d)) for n in sizes]
    o, used, _ = run_epoch("cd-grab", sizes, grads)
    s = np.zeros(d)
    total = 0.0
    for k in range(max(n // 2 for n in sizes)):
        for w, n in enumerate(sizes):
            if k >= n // 2:
                continue
            rows = grads[w][used[w]]
            v = rows[2 * k].astype(np.float64) - rows[2 * k + 1]
            eps = 1 if s @ v <= 0 else -1
            assert o.last_signs[w][2 * k] == eps and o.last_signs[w][2 * k + 1] == -eps
            s += eps * v
            total += v @ v
            assert s @ s <= total * (1 + 1e-12) + 1e-12


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 10), min_size=1, max_size=4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.sampled_from(GRAB),
    st.sampled_from([2.0, 3.0, 0.5, 7.0]),
)
def test_invariances(sizes, d, seed, name, scale):
    """Per-worker offsets (pair methods; Bal after its first epoch), positive scaling and
    global negation leave the orders unchanged (integer data: exact arithmetic). Bal's
    stale mean divides by the item count: each worker's columns are made to sum to a
    multiple of its size, so that the mean is an integer too (otherwise 7a/9 and 7(a/9)
    round apart, and an exact tie s.v = 0 may become a tiny nonzero value: sizes [9],
    seed 11, scale 7)."""
    rng = np.random.default_rng(seed)
    base = int_grads(rng, sizes, d)
    if name == "id-grab-bal":
        for g in base:
            if len(g):
                g[-1] -= np.mod(g.sum(axis=0), len(g))
    offsets = [rng.integers(-3, 4, size=d).astype(np.float32) for _ in sizes]
    variants = {
        "scaled": [g * np.float32(scale) for g in base],
        "negated": [-g for g in base],
        "offset": [g + c for g, c in zip(base, offsets)],
    }

    def two_epochs(grads, visit=None):
        o = make_orderer(name, seed=3)
        used = o.initial_orders(sizes)
        first = o.next_orders([g[u] for g, u in zip(grads, used)])
        visit = first if visit is None else visit  # epoch 1 visits the reference's order
        second = o.next_orders([g[u] for g, u in zip(grads, visit)], visit)
        return first, second

    ref = two_epochs(base)
    for kind, grads in variants.items():
        got = two_epochs(grads, ref[0])
        epochs = (1,) if (kind == "offset" and name == "id-grab-bal") else (0, 1)
        for e in epochs:
            for a, b in zip(ref[e], got[e]):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {kind} epoch {e}")


def test_cd_grab_lowers_parallel_herding_vs_rr():
    rng = np.random.default_rng(0)
    m, n, d = 8, 64, 16
    grads = [rng.standard_normal((n, d)) + rng.standard_normal(d) for _ in range(m)]
    results = {}
    for name in ("rr", "id-grab", "cd-grab"):
        o = make_orderer(name, seed=1)
        used = o.initial_orders([n] * m)
        nxt = o.next_orders([g[u] for g, u in zip(grads, used)])
        results[name] = herding_bound([g[x] for g, x in zip(grads, nxt)])
    assert results["cd-grab"] < results["id-grab"] < results["rr"]


# ----------------------------------------------------------------------------- D-RR, units


def test_drr_seeds_differ_and_are_deterministic():
    o = make_orderer("rr", seed=5)
    seeds = {o.worker_seed(w, e) for w in range(64) for e in range(4)}
    assert len(seeds) == 64 * 4
    a = o.initial_orders([50] * 4)
    assert len({tuple(x) for x in a}) == 4  # workers shuffle differently
    b = make_orderer("rr", seed=5).initial_orders([50] * 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    nxt = o.next_orders(None)
    assert o.epoch == 1
    assert not np.array_equal(nxt[0], a[0])
    np.testing.assert_array_equal(nxt[2], o.shuffled(2, 50, 1))
    c = make_orderer("rr", seed=6).initial_orders([50])
    assert not np.array_equal(c[0], a[0])


def test_missing_worker_gets_drr_order():
    rng = np.random.default_rng(1)
    o = make_orderer("cd-grab", seed=2)
    o.initial_orders([6, 6, 6])
    out = o.next_orders([rng.standard_normal((6, 2)), None, rng.standard_normal((6, 2))])
    np.testing.assert_array_equal(out[1], o.shuffled(1, 6, 1))
    assert o.last_signs[1].size == 0 and o.last_signs[0].size == 6


def test_resize_keeps_unchanged_workers():
    o = make_orderer("id-grab", seed=2)
    first = o.initial_orders([4, 6])
    out = o.resize([4, 9, 3])
    np.testing.assert_array_equal(out[0], first[0])
    assert is_perm(out[1], 9) and is_perm(out[2], 3)


def test_units():
    assert count_units(10, 1) == 10 and count_units(10, 4) == 3 and count_units(0, 4) == 0
    np.testing.assert_array_equal(
        expand_units(np.array([2, 0, 1]), 10, 4), [8, 9, 0, 1, 2, 3, 4, 5, 6, 7]
    )
    o = make_orderer("cd-grab", unit="microbatch", microbatch=4)
    assert o.num_units(10) == 3
    np.testing.assert_array_equal(
        o.example_order(np.array([1, 2, 0]), 10), [4, 5, 6, 7, 8, 9, 0, 1, 2, 3]
    )
    assert make_orderer("cd-grab").num_units(10) == 10


# ----------------------------------------------------------------------------- sketch


@pytest.mark.parametrize("kind", om.SKETCH_KINDS)
def test_sketch_shapes_and_determinism(kind):
    rng = np.random.default_rng(0)
    g = rng.standard_normal((5, 50)).astype(np.float32)
    a = RandomSketch(8, seed=3, kind=kind)(g)
    assert a.shape == (5, 8) and a.dtype == np.float32
    np.testing.assert_array_equal(a, RandomSketch(8, seed=3, kind=kind)(g))
    assert not np.allclose(a, RandomSketch(8, seed=4, kind=kind)(g))
    # the projection is x @ R with the documented R
    r = RandomSketch(8, seed=3, kind=kind).matrix(50)
    np.testing.assert_allclose(a, g @ r, rtol=1e-5, atol=1e-5)
    t = RandomSketch(8, seed=3, kind=kind)(torch.from_numpy(g))
    assert isinstance(t, torch.Tensor) and t.shape == (5, 8)
    np.testing.assert_allclose(t.numpy(), a, rtol=1e-5, atol=1e-5)
    assert RandomSketch(8, seed=3, kind=kind)(g[0]).shape == (8,)
    assert RandomSketch(8, seed=3, kind=kind)(torch.from_numpy(g).view(5, 1, 50)).shape == (5, 1, 8)


def test_countsketch_structure():
    r = RandomSketch(4, seed=1).matrix(30)
    assert np.array_equal(np.abs(r).sum(axis=1), np.ones(30))  # one +-1 per coordinate
    assert set(np.unique(r)) <= {-1.0, 0.0, 1.0}


def test_gaussian_blocks_match_cached(monkeypatch):
    g = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    monkeypatch.setattr(om, "SKETCH_BLOCK_ROWS", 7)
    cached = RandomSketch(8, seed=3, kind="gaussian")(g)
    monkeypatch.setattr(om, "SKETCH_CACHE_BYTES", 0)
    np.testing.assert_allclose(RandomSketch(8, 3, "gaussian")(g), cached, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        RandomSketch(8, kind="fft")
    with pytest.raises(ValueError):
        RandomSketch(0)


@pytest.mark.parametrize("kind", om.SKETCH_KINDS)
def test_sketch_preserves_inner_products_on_average(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2000))
    ratios = [
        float((RandomSketch(64, seed=s, kind=kind)(x) ** 2).sum() / (x**2).sum()) for s in range(40)
    ]
    assert abs(np.mean(ratios) - 1) < 0.08


@pytest.mark.parametrize("kind", om.SKETCH_KINDS)
def test_sketch_mode_orders(kind):
    rng = np.random.default_rng(0)
    sizes = [8, 7]
    grads = [rng.standard_normal((n, 40)).astype(np.float32) for n in sizes]
    a = make_orderer("cd-grab", seed=1, sketch_dim=6, sketch_kind=kind)
    used = a.initial_orders(sizes)
    rows = [g[u] for g, u in zip(grads, used)]
    out_a = a.next_orders(rows)  # the orderer projects
    b = make_orderer("cd-grab", seed=1, sketch_dim=6, sketch_kind=kind)
    b.initial_orders(sizes)
    out_b = b.next_orders([b.project(r) for r in rows], sketched=True)  # workers project
    assert all(np.array_equal(x, y) for x, y in zip(out_a, out_b))
    # the decisions are the exact rules applied to the projections
    c = make_orderer("cd-grab", seed=1)
    c.initial_orders(sizes)
    out_c = c.next_orders([a.sketch(r) for r in rows])
    assert all(np.array_equal(x, y) for x, y in zip(out_a, out_c))
    assert all(is_perm(x, n) for x, n in zip(out_a, sizes))


# ----------------------------------------------------------------------------- state, config


@pytest.mark.parametrize("name", om.ORDERINGS)
def test_state_dict_round_trip(name):
    rng = np.random.default_rng(0)
    sizes = [9, 4, 6]
    o = make_orderer(name, seed=7, sketch_dim=3)
    orders = o.initial_orders(sizes)
    for _ in range(2):
        orders = o.next_orders([rng.standard_normal((n, 5)) for n in sizes])
    state = o.state_dict()
    assert state["orders"].dtype == np.int32 and state["epoch"] == 2
    p = make_orderer(name, seed=7, sketch_dim=3)
    p.load_state_dict(state)
    assert p.epoch == 2 and all(np.array_equal(x, y) for x, y in zip(p.orders, orders))
    grads = [rng.standard_normal((n, 5)) for n in sizes]
    for x, y in zip(o.next_orders(grads), p.next_orders(grads)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(CheckpointError):
        make_orderer("cd-grab" if name != "cd-grab" else "rr", 7, 3).load_state_dict(state)
    with pytest.raises(CheckpointError):
        make_orderer(name, seed=8, sketch_dim=3).load_state_dict(state)
    with pytest.raises(CheckpointError):
        make_orderer(name, seed=7, sketch_dim=3, sketch_kind="gaussian").load_state_dict(state)
    bad = dict(state, orders=np.zeros_like(state["orders"]))
    with pytest.raises(CheckpointError):
        make_orderer(name, seed=7, sketch_dim=3).load_state_dict(bad)


def test_bal_state_keeps_stale_means():
    o = make_orderer("id-grab-bal")
    o.initial_orders([3, 2])
    o.next_orders([np.ones((3, 2)), None])
    st_ = o.state_dict()
    np.testing.assert_array_equal(st_["means_set"], [True, False])
    np.testing.assert_allclose(st_["means"][0], [1.0, 1.0])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "grab"}, "algorithm.ordering"),
        ({"name": None}, "algorithm.ordering"),
        ({"name": "rr", "sketch_dim": -1}, "ordering.sketch_dim"),
        ({"name": "rr", "sketch_dim": True}, "ordering.sketch_dim"),
        ({"name": "rr", "unit": "batch"}, "ordering.unit"),
        ({"name": "rr", "microbatch": 0}, "ordering.microbatch"),
        ({"name": "rr", "seed": -1}, "seed"),
        ({"name": "rr", "sketch_kind": "fft"}, "ordering.sketch_kind"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        make_orderer(**kwargs)


def test_bad_inputs_raise():
    o = make_orderer("cd-grab")
    with pytest.raises(ValueError, match="initial_orders"):
        o.next_orders([np.zeros((2, 1))])
    o.initial_orders([3, 2])
    with pytest.raises(ValueError, match="2 workers|workers"):
        o.next_orders([np.zeros((3, 1))])
    with pytest.raises(ValueError, match="sent 2 gradients"):
        o.next_orders([np.zeros((2, 1)), np.zeros((2, 1))])
    with pytest.raises(ValueError, match="non-finite"):
        o.next_orders([np.full((3, 1), np.nan), np.zeros((2, 1))])
    with pytest.raises(ValueError, match="permutation"):
        o.next_orders([np.zeros((3, 1)), np.zeros((2, 1))], [np.array([0, 0, 1]), np.arange(2)])
    with pytest.raises(ValueError, match="width"):
        o.next_orders([np.zeros((3, 1)), np.zeros((2, 2))])
    sk = make_orderer("cd-grab", sketch_dim=4)
    sk.initial_orders([3])
    with pytest.raises(ValueError, match="sketch_dim is 4"):
        sk.next_orders([np.zeros((3, 5))], sketched=True)
    # 1-D rows (d = 1) and rows with extra axes are accepted
    assert is_perm(o.next_orders([np.arange(3.0), np.zeros((2, 1, 1))])[0], 3)


# ----------------------------------------------------------------------------- herding, debug


def test_herding_bound_hand_worked():
    assert herding_bound([np.array([[1.0], [-1.0], [1.0], [-1.0]])]) == 1.0
    assert herding_bound([np.array([[1.0], [1.0], [-1.0], [-1.0]])]) == 2.0
    # centring: a constant offset does not matter
    assert herding_bound([np.array([[5.0], [5.0], [3.0], [3.0]])]) == 2.0
    # two workers: position sums [2, 0, -2] (mean 0) -> prefix [2, 2, 0]
    two = [np.array([[1.0], [1.0], [-1.0]]), np.array([[1.0], [-1.0], [-1.0]])]
    assert herding_bound(two) == 2.0
    assert herding_bound([two[0] + two[1]]) == 2.0
    # unequal n: positions [2, 1]-> counts [2, 1], mean of all rows 1 -> centred [0, 0]
    assert herding_bound([np.array([[1.0], [1.0]]), np.array([[1.0]])]) == 0.0
    # 2-norm vs inf-norm
    g = [np.array([[3.0, 4.0], [-3.0, -4.0]])]
    assert herding_bound(g) == 4.0 and herding_bound(g, norm="2") == 5.0
    assert herding_bound([np.zeros((0, 3))]) == 0.0
    with pytest.raises(ValueError):
        herding_bound(g, norm="1")


@pytest.mark.parametrize("name", ["cd-grab", "id-grab-bal"])
def test_debug_dump_replays(tmp_path, name):
    rng = np.random.default_rng(0)
    sizes = [5, 6]
    o = make_orderer(name, seed=4)
    used = o.initial_orders(sizes)
    o.next_orders([rng.standard_normal((n, 3)) for n in sizes])  # stale means for Bal
    used = o.orders
    state = o.state_dict()
    grads = [rng.standard_normal((n, 3)).astype(np.float32) for n in sizes]
    sent = o.next_orders(grads)
    path = tmp_path / "epoch.npz"
    save_epoch_debug(path, state, grads, used, sent)
    again, saved = replay_epoch_debug(path)
    for a, b, c in zip(again, saved, sent):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, c)


# ----------------------------------------------------------------------------- benchmark


def test_bench_cdgrab_smoke(tmp_path, capsys):
    import argparse
    import json

    from edgefl.bench import cdgrab

    p = argparse.ArgumentParser()
    p.add_argument("--json")
    cdgrab.add_args(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(
        ["--tasks", "logreg", "--workers", "2", "--seeds", "1", "--epochs", "2", "--json", str(out)]
    )
    assert cdgrab.main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["ordering"] for r in rows] == ["rr", "id-grab", "cd-grab"]
    fields = {
        "task",
        "workers",
        "ordering",
        "seed",
        "train_loss_by_epoch",
        "epochs_to_rr_final_loss",
        "herding_bound_by_epoch",
        "ordering_overhead_fraction",
        "ordering_cpu_fraction",
    }
    for r in rows:
        assert set(r) == fields
        assert len(r["train_loss_by_epoch"]) == 2 and len(r["herding_bound_by_epoch"]) == 2
        assert 0.0 <= r["ordering_overhead_fraction"] < 1.0
        # what the epoch waits for is part of all the ordering work
        assert r["ordering_overhead_fraction"] <= r["ordering_cpu_fraction"] + 1e-12
    assert rows[0]["epochs_to_rr_final_loss"] is not None  # D-RR reaches its own final loss
    # every ordering starts from the same model and D-RR order: identical first epoch
    assert len({r["train_loss_by_epoch"][0] for r in rows}) == 1
    assert "target 1" in capsys.readouterr().out
