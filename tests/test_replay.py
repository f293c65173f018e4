"""Replay of a dead device's residual: exact decay, outstanding-part bookkeeping, dedup."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from edgefl.algorithms.gddr.replay import ResidualReplay, decay_fractions
from edgefl.algorithms.gddr.residual import GDDRResidual, ReleaseDecoder
from edgefl.errors import ConfigError


def residual_state(values, device=4):
    r = GDDRResidual(len(values), device, 0, alpha=0.5, tau=3)
    s = r.state_dict()
    s["residual"] = np.asarray(values, np.float64)
    return s


def test_decay_fractions_hand_computed():
    np.testing.assert_allclose(decay_fractions(0.5, 3), [4 / 7, 2 / 7, 1 / 7])
    assert decay_fractions(0.9, 1).tolist() == [1.0]


def test_amounts_decay_and_sum_exactly():
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(300) * 10.0 ** rng.integers(-6, 6, 300)
    vals[::7] = 0.0
    rp = ResidualReplay(decay=0.6, steps=6)
    info = rp.start(residual_state(vals))
    assert info.coordinates == np.count_nonzero(vals) and info.checkpoint_step == -1
    assert info.total == pytest.approx(vals.sum())
    got = []
    while rp.replaying:
        (a,) = rp.next_amounts()
        assert np.array_equal(a.indices, np.flatnonzero(vals))
        got.append(a.values)
    assert len(got) == 6 and rp.next_amounts() == []
    nz = vals[vals != 0]
    for j in range(6):  # shares follow the decay fractions
        np.testing.assert_allclose(got[j] / nz, decay_fractions(0.6, 6)[j], rtol=1e-12)
    for i in range(nz.size):  # and add up to the residual exactly (no rounding loss)
        assert sum(Fraction(float(g[i])) for g in got) == Fraction(float(nz[i]))


def test_hand_computed_amounts():
    rp = ResidualReplay(decay=0.5, steps=3)
    rp.start(residual_state([7.0, 0.0, -14.0]))
    steps = [rp.next_amounts()[0] for _ in range(3)]
    assert [s.indices.tolist() for s in steps] == [[0, 2]] * 3
    assert [s.step_index for s in steps] == [0, 1, 2]
    np.testing.assert_allclose([s.values for s in steps], [[4, -8], [2, -4], [1, -2]])
    assert not rp.replaying


def test_start_twice_is_a_noop():
    rp = ResidualReplay(decay=0.5, steps=2)
    s = residual_state([1.0, 2.0])
    assert rp.start(s) is not None
    assert rp.start(s) is None  # ULFM and a time-out both report the same death
    total = sum(a.values.sum() for _ in range(2) for a in rp.next_amounts())
    assert total == pytest.approx(3.0)
    rp.forget(4)
    assert not rp.started(4) and rp.start(s) is not None


def simulate(c, k, last, installments, zero_after_c=False, naive=False):
    """A device runs ``last + 3`` steps and dies; returns (applied, expected, replay, info).

    Its residual checkpoint is taken after step c. The coordinator decodes steps 0..k, learns
    of the death and starts the replay; messages k+1..last arrive late, one per coordinator
    step, interleaved with replay amounts; later messages are lost.
    """
    size, seed, device = 400, 17, 2
    rng = np.random.default_rng(c * 100 + k * 10 + last + installments)
    kw = {"alpha": 0.6, "tau": 3, "installments": installments, "installment_ratio": 0.5}
    w = GDDRResidual(size, device, seed, **kw)
    msgs, gs, ckpt = {}, {}, None
    for t in range(last + 3):
        if t in (4, 9, 12):
            w.set_tau({4: 5, 9: 1, 12: 3}[t])
        g = rng.standard_normal(size).astype(np.float32)
        if zero_after_c and t > c:
            g[:] = 0
        gs[t] = g
        msgs[t] = w.step(g, t)
        if t == c:
            ckpt = w.state_dict()

    # expected: everything produced up to c, minus messages up to c that never arrived, plus
    # the part of messages after c that came from production after c (a twin that starts at c
    # with empty values and the same schedule sends exactly that part)
    expected = sum(gs[t].astype(np.float64) for t in range(c + 1))
    for t in range(last + 1, c + 1):
        expected[msgs[t].indices] -= msgs[t].values
    twin_state = dict(ckpt)
    twin_state["residual"] = np.zeros(size)
    twin_state["bucket"] = np.zeros(size)
    twin = GDDRResidual.from_state_dict(twin_state)
    for t in range(c + 1, last + 1):
        twin.set_tau(msgs[t].tau)
        q = twin.step(gs[t], t)
        expected[q.indices] += q.values

    dec = ReleaseDecoder(size, device, seed, alpha=0.6)
    applied = np.zeros(size)
    for t in range(k + 1):
        applied += dec.decode(t, msgs[t].tau, msgs[t].values)
    rp = ResidualReplay(decay=0.5, steps=4)
    info = rp.start(ckpt, dec.steps_after(c))
    late = list(range(k + 1, last + 1))
    changed = 0
    while late or rp.replaying:
        if late:
            t = late.pop(0)
            idx = dec.advance(t, msgs[t].tau)
            assert np.array_equal(idx, msgs[t].indices)
            vals = rp.reconcile(device, t, msgs[t].tau, msgs[t].values)
            changed += int(np.any(vals != msgs[t].values.astype(np.float64)))
            applied[idx] += msgs[t].values if naive else vals
        for a in rp.next_amounts():
            applied[a.indices] += a.values
    return applied, expected, info, changed


@pytest.mark.parametrize("installments", [1, 3])
@pytest.mark.parametrize(
    "c,k,last",
    [
        (10, 10, 14),  # checkpoint = last received step; late messages after it
        (10, 13, 16),  # received past the checkpoint, then late messages
        (10, 11, 16),
        (10, 7, 12),  # checkpoint newer than the last received step; late ones span it
        (10, 7, 8),  # steps 9, 10 lost for good
        (10, 15, 15),  # no late messages
    ],
)
def test_each_value_applied_once(c, k, last, installments):
    applied, expected, info, changed = simulate(c, k, last, installments)
    np.testing.assert_allclose(applied, expected, rtol=0, atol=2e-5)
    assert info.skipped_steps == max(0, k - c)
    if last > max(c, k) and info.coordinates:  # late messages carried checkpointed residual
        assert changed > 0
    if last <= c:  # late messages older than the checkpoint are applied unchanged
        assert changed == 0


def test_naive_late_messages_double_count():
    # without reconcile, entries in the replay are applied twice: the test above can fail
    applied, expected, _, _ = simulate(10, 10, 14, 1, naive=True)
    assert np.abs(applied - expected).max() > 0.1


def test_zero_production_after_checkpoint_gives_the_checkpoint_sum():
    applied, expected, _, _ = simulate(8, 11, 14, 3, zero_after_c=True)
    np.testing.assert_allclose(applied, expected, atol=2e-5)


def test_reconcile_before_checkpoint_and_errors():
    rp = ResidualReplay()
    s = residual_state([1.0, 2.0, 3.0])
    s["last_step"] = 9
    rp.start(s)
    v = np.array([5.0, 6.0], np.float32)
    assert rp.reconcile(4, 7, 3, v).tolist() == [5.0, 6.0]  # predates the checkpoint
    with pytest.raises(ValueError, match="device 5 was not started"):
        rp.reconcile(5, 11, 3, v)
    with pytest.raises(ValueError, match="has 2 values, the schedule releases"):
        rp.reconcile(4, 12, 3, v)
    with pytest.raises(ValueError, match="still replaying"):
        rp.forget(4)
    with pytest.raises(ValueError, match="residual replay: GDDR state lacks"):
        rp.start({"format": "gddr-residual/1"})


def test_reconcile_flush():
    rp = ResidualReplay(decay=0.5, steps=2)
    rp.start(residual_state([1.0, 2.0, 3.0]))
    got = rp.reconcile_flush(4, np.array([1.5, 2.0, 3.0]))
    assert got.tolist() == [0.5, 0.0, 0.0]  # only what was not in the checkpoint


def test_state_dict_mid_replay():
    vals = np.random.default_rng(2).standard_normal(50)
    a = ResidualReplay(decay=0.7, steps=5)
    a.start(residual_state(vals, device=1))
    a.start(residual_state(vals * 2, device=3))
    a.next_amounts()
    b = ResidualReplay()
    b.load_state_dict(a.state_dict())
    assert b.replaying == [1, 3] and (b.decay, b.steps) == (0.7, 5)
    while a.replaying:
        xa, xb = a.next_amounts(), b.next_amounts()
        assert [x.device for x in xa] == [x.device for x in xb]
        for p, q in zip(xa, xb):
            assert np.array_equal(p.values, q.values) and p.step_index == q.step_index
    assert not b.replaying and b.started(1)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"decay": 1.0}, r"'gddr.replay_decay' = 1.0: must be > 0 and < 1"),
        ({"decay": 0}, r"'gddr.replay_decay' = 0"),
        ({"steps": 0}, r"'gddr.replay_steps' = 0: must be an integer >= 1"),
        ({"steps": 2.0}, r"'gddr.replay_steps' = 2.0"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ResidualReplay(**kw)
