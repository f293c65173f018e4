"""GDDR residual buffers: semantics, sum invariant, decoder, installments, density."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgefl.algorithms.gddr.residual as residual
from edgefl.algorithms.gddr.residual import (
    GDDRResidual,
    ReleaseDecoder,
    expected_release_mask,
    geometric_weight,
    issue_density,
    split_exact,
    stationary_density,
    withhold_mask,
)
from edgefl.errors import ConfigError


def scripted(monkeypatch, masks: dict[int, list[bool]]) -> None:
    """Replace the random withhold masks by a script: step -> mask (True = withhold)."""

    def fake(run_seed, device, step, size, alpha):
        return np.array(masks[step], dtype=bool)

    monkeypatch.setattr(residual, "withhold_mask", fake)


class Reference:
    """Independent per-coordinate implementation of the semantics (slow, for small models).

    Each held coordinate remembers the step its entry opened and the tau then in force; it is
    force-released once it has been withheld at ``tau_at_open`` consecutive steps.
    """

    def __init__(self, size, device, seed, alpha):
        self.size, self.device, self.seed, self.alpha = size, device, seed, alpha
        self.opened = [None] * size
        self.entry_tau = [0] * size
        self.acc = [0.0] * size

    def step(self, g, t, tau):
        w = withhold_mask(self.seed, self.device, t, self.size, self.alpha)
        sent_idx, sent_val, waited = [], [], []
        for i in range(self.size):
            forced = self.opened[i] is not None and t - self.opened[i] >= self.entry_tau[i]
            if w[i] and not forced:
                if self.opened[i] is None:
                    self.opened[i], self.entry_tau[i] = t, tau
                self.acc[i] += float(g[i])
            else:
                if self.opened[i] is not None:
                    waited.append(t - self.opened[i])
                sent_idx.append(i)
                sent_val.append(self.acc[i] + float(g[i]))
                self.opened[i], self.acc[i] = None, 0.0
        return sent_idx, sent_val, waited


# ----------------------------------------------------------------------------- semantics


def test_hand_computed_release_sequence(monkeypatch):
    W, R = True, False
    scripted(monkeypatch, {0: [W], 1: [W], 2: [W], 3: [W], 4: [R], 5: [W], 6: [W], 7: [R]})
    r = GDDRResidual(1, device=0, run_seed=0, alpha=0.5, tau=2)
    g = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
    sent = {}
    for t in range(8):
        if t == 5:
            r.set_tau(1)  # entries opened from step 5 on wait at most 1 step
        rel = r.step(np.array([g[t]], np.float32), t)
        assert rel.tau == (2 if t < 5 else 1)
        if rel.indices.size:
            sent[t] = float(rel.values[0])
        if t in (0, 3, 5):
            assert r.due[0] == t + rel.tau
    # 0,1 withheld; 2 forced (due 0 + 2); 3 withheld (due 5); 4 released by the mask;
    # 5 withheld with tau 1 (due 6); 6 forced; 7 released by the mask
    assert sent == {2: 1 + 2 + 4, 4: 8 + 16, 6: 32 + 64, 7: 128}
    assert r.held_count == 0 and r.held()[0] == 0.0


def test_tau_change_keeps_due_steps(monkeypatch):
    W = True
    scripted(monkeypatch, {t: [W, W] for t in range(12)})
    r = GDDRResidual(2, device=0, run_seed=0, alpha=0.9, tau=8)
    r.step(np.ones(2, np.float32), 0)  # both coordinates open with due 8
    r.set_tau(2)
    for t in range(1, 8):
        rel = r.step(np.ones(2, np.float32), t)
        assert rel.indices.size == 0, "a shorter tau must not cut an open entry short"
    rel = r.step(np.ones(2, np.float32), 8)
    assert rel.indices.tolist() == [0, 1] and rel.values.tolist() == [9.0, 9.0]
    r.step(np.ones(2, np.float32), 9)  # reopened with the new tau 2: due 11
    assert r.due.tolist() == [11, 11]


def test_skipped_steps_release_overdue_entries(monkeypatch):
    scripted(monkeypatch, {0: [True], 50: [True]})
    r = GDDRResidual(1, device=0, run_seed=0, alpha=0.5, tau=4)
    r.step(np.array([3.0], np.float32), 0)
    rel = r.step(np.array([5.0], np.float32), 50)  # due 4 <= 50: forced despite the mask
    assert rel.values.tolist() == [8.0] and r.held_count == 0


@pytest.mark.parametrize("alpha,tau", [(0.4, 4), (0.9, 3), (0.7, 1)])
def test_matches_reference_with_tau_changes(alpha, tau):
    size, seed, device = 37, 11, 5
    rng = np.random.default_rng(1)
    r = GDDRResidual(size, device, seed, alpha=alpha, tau=tau)
    ref = Reference(size, device, seed, alpha)
    taus = [tau, 1, 6, 2, tau]
    for t in range(60):
        if t % 12 == 0:
            r.set_tau(taus[t // 12])
        g = rng.standard_normal(size).astype(np.float32)
        rel = r.step(g, t)
        idx, val, waited = ref.step(g, t, r.tau)
        assert rel.indices.tolist() == idx
        np.testing.assert_allclose(rel.values, val, rtol=1e-6, atol=1e-6)
        assert all(w <= 6 for w in waited)


def test_mask_is_bernoulli_and_seeded():
    m = withhold_mask(3, 7, 100, 200_000, 0.4)
    assert abs(m.mean() - 0.4) < 0.005
    assert np.array_equal(m, withhold_mask(3, 7, 100, 200_000, 0.4))
    assert not np.array_equal(m, withhold_mask(3, 7, 101, 200_000, 0.4))
    assert not np.array_equal(m, withhold_mask(3, 8, 100, 200_000, 0.4))
    assert not withhold_mask(3, 7, 100, 1000, 0.0).any()


def test_alpha_zero_is_dense():
    r = GDDRResidual(50, 0, 0, alpha=0.0, tau=3)
    g = np.arange(50, dtype=np.float32)
    rel = r.step(g, 0)
    assert rel.indices.tolist() == list(range(50)) and np.array_equal(rel.values, g)
    assert rel.density == 1.0 and rel.norm == pytest.approx(float(np.linalg.norm(g)))


# ----------------------------------------------------------------------------- invariant


def _held_ok(sent, held, produced, scale):
    np.testing.assert_allclose(sent + held, produced, rtol=0, atol=1e-10 * scale + 1e-300)


@settings(max_examples=40, deadline=None)
@given(
    alpha=st.floats(0.0, 0.95),
    tau=st.integers(1, 10),
    size=st.integers(1, 300),
    steps=st.integers(1, 40),
    installments=st.integers(1, 4),
    ratio=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**31),
    events=st.lists(st.tuples(st.integers(0, 39), st.sampled_from(["ckpt", "tau"])), max_size=6),
)
def test_sum_invariant_property(alpha, tau, size, steps, installments, ratio, seed, events):
    rng = np.random.default_rng(seed)
    kw = {"alpha": alpha, "tau": tau, "installments": installments, "installment_ratio": ratio}
    r = GDDRResidual(size, 3, seed, **kw)
    twin = GDDRResidual(size, 3, seed, **kw)  # never checkpointed
    dec = ReleaseDecoder(size, 3, seed, alpha=alpha)
    produced = np.zeros(size)
    sent = np.zeros(size)
    scale = 1.0
    t = 0
    for k in range(steps):
        for when, what in events:
            if when != k:
                continue
            if what == "ckpt":  # restore into a fresh object (what a restart does)
                r = GDDRResidual.from_state_dict(r.state_dict())
                dec2 = ReleaseDecoder.from_residual_state(r.state_dict())
                assert np.array_equal(dec2.due, dec.due) and dec2.last_step == dec.last_step
            else:
                new = int(rng.integers(1, 11))
                r.set_tau(new)
                twin.set_tau(new)
        g = (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        produced += g
        scale += float(np.abs(g).sum())
        rel = r.step(g, t)
        rel_twin = twin.step(g, t)
        assert np.array_equal(rel.indices, rel_twin.indices)  # restore changes nothing
        assert np.array_equal(rel.values, rel_twin.values)
        assert np.array_equal(dec.advance(t, rel.tau), rel.indices)
        sent[rel.indices] += rel.values
        _held_ok(sent, r.held(), produced, scale)
        t += int(rng.integers(1, 3))  # steps may skip
    assert np.all(r.due <= t + 10)
    sent += r.flush()
    _held_ok(sent, 0.0, produced, scale)
    assert r.held_count == 0 and not r.held().any()


def test_no_value_waits_longer_than_its_tau():
    size, seed = 2000, 4
    r = GDDRResidual(size, 0, seed, alpha=0.9, tau=3)
    last_sent = np.full(size, -1)
    worst = 0
    for t in range(200):
        rel = r.step(np.ones(size, np.float32), t)
        # a value produced at step s was sent by step s + 3 at the latest
        gap = t - last_sent[rel.indices] - 1  # steps since the coordinate was last sent
        worst = max(worst, int(gap.max()))
        last_sent[rel.indices] = t
    assert worst == 3  # reached (alpha 0.9) and never exceeded


def test_float32_rounding_stays_in_residual():
    r = GDDRResidual(1, 0, 0, alpha=0.0, tau=1)
    total_sent = 0.0
    x = np.array([0.1], np.float32)
    for t in range(1000):
        rel = r.step(x, t)
        total_sent += float(rel.values[0])
    # sends are float32, yet sent + held equals the exact float64 sum of what was produced
    assert total_sent + r.held()[0] == pytest.approx(1000 * float(x[0]), rel=1e-15)


def test_non_finite_update_rejected_without_change():
    r = GDDRResidual(4, 0, 0, alpha=0.5, tau=2)
    r.step(np.ones(4, np.float32), 0)
    before = r.state_dict()
    with pytest.raises(ValueError, match="not finite"):
        r.step(np.array([1, np.nan, 1, 1], np.float32), 1)
    after = r.state_dict()
    assert after["last_step"] == before["last_step"]
    assert np.array_equal(after["residual"], before["residual"])
    with pytest.raises(ValueError, match=r"float32\[5\], expected a float\[4\]"):
        r.step(np.ones(5, np.float32), 1)
    with pytest.raises(ValueError, match="expected a float"):
        r.step(np.ones(4, np.int64), 1)
    with pytest.raises(ValueError, match="not after the last step 0"):
        r.step(np.ones(4, np.float32), 0)


# ----------------------------------------------------------------------------- installments


def test_installments_hand_computed(monkeypatch):
    W, R = True, False
    scripted(monkeypatch, {0: [W], 1: [R], 2: [R], 3: [R], 4: [R]})
    r = GDDRResidual(1, 0, 0, alpha=0.5, tau=4, installments=3, installment_ratio=0.5)
    assert r.step(np.array([7.0], np.float32), 0).indices.size == 0
    got = [float(r.step(np.zeros(1, np.float32), t).values[0]) for t in (1, 2, 3, 4)]
    # 7 paid as 4/7, 2/7, 1/7 of it at the coordinate's next three releases
    assert got == [4.0, 2.0, 1.0, 0.0]
    assert r.held()[0] == 0.0


def test_installments_keep_total_and_delay_mass():
    size, seed = 500, 9
    rng = np.random.default_rng(0)
    plain = GDDRResidual(size, 1, seed, alpha=0.6, tau=3)
    split = GDDRResidual(size, 1, seed, alpha=0.6, tau=3, installments=4, installment_ratio=0.6)
    dec = ReleaseDecoder(size, 1, seed, alpha=0.6)
    produced = np.zeros(size)
    s_plain, s_split = np.zeros(size), np.zeros(size)
    for t in range(80):
        g = rng.standard_normal(size).astype(np.float32)
        produced += g
        a, b = plain.step(g, t), split.step(g, t)
        assert np.array_equal(a.indices, b.indices)  # installments never change the index set
        assert np.array_equal(dec.advance(t, b.tau), b.indices)
        s_plain[a.indices] += a.values
        s_split[b.indices] += b.values
    assert np.abs(split.held()).sum() > np.abs(plain.held()).sum()  # some still in buckets
    s_plain += plain.flush()
    s_split += split.flush()
    np.testing.assert_allclose(s_plain, produced, atol=1e-9)
    np.testing.assert_allclose(s_split, produced, atol=1e-9)


def test_geometric_split_is_exact():
    from fractions import Fraction

    rem = np.random.default_rng(3).standard_normal(200) * 1e3
    parts = []
    r = rem.copy()
    for k in (5, 4, 3, 2, 1):
        a, r = split_exact(r, geometric_weight(np.full(rem.size, k), 0.7))
        parts.append(a)
    assert not r.any()
    for i in range(rem.size):
        assert sum(Fraction(float(p[i])) for p in parts) == Fraction(float(rem[i]))
    # the amounts are geometric: ratio 0.7 between consecutive installments
    np.testing.assert_allclose(parts[1] / parts[0], 0.7, rtol=1e-12)
    np.testing.assert_allclose(parts[4] / parts[3], 0.7, rtol=1e-12)
    assert geometric_weight(4, 1.0) == pytest.approx(0.25)


# ----------------------------------------------------------------------------- decoder


def test_decoder_reconstructs_indices_across_tau_changes_and_restore():
    size, seed, device = 5000, 21, 2
    rng = np.random.default_rng(5)
    r = GDDRResidual(size, device, seed, alpha=0.7, tau=4)
    dec = ReleaseDecoder(size, device, seed, alpha=0.7)
    for t in range(0, 120, 2):
        if t % 30 == 0:
            r.set_tau(int(rng.integers(1, 9)))
        if t == 60:  # coordinator restarts from its own checkpoint
            state = dec.state_dict()
            dec = ReleaseDecoder(size, device, seed, alpha=0.7)
            dec.load_state_dict(state)
        g = rng.standard_normal(size).astype(np.float32)
        rel = r.step(g, t)
        dense = dec.decode(t, rel.tau, rel.values)
        expect = np.zeros(size, np.float32)
        expect[rel.indices] = rel.values
        assert np.array_equal(dense, expect)
        assert np.array_equal(dec.due, r.due)
    assert [s for s, _ in dec.steps_after(100)] == [102, 104, 106, 108, 110, 112, 114, 116, 118]


def test_decoder_without_tau_change_info_goes_wrong():
    # the decoder needs the tau the device used: a wrong tau desynchronises the mirror
    size, seed = 3000, 1
    r = GDDRResidual(size, 0, seed, alpha=0.8, tau=2)
    dec = ReleaseDecoder(size, 0, seed, alpha=0.8)
    for t in range(3):
        dec.advance(t, 2)
        r.step(np.ones(size, np.float32), t)
    r.set_tau(6)
    mismatched = 0
    for t in range(3, 12):
        rel = r.step(np.ones(size, np.float32), t)
        mismatched += not np.array_equal(dec.advance(t, 2), rel.indices)
    assert mismatched > 0


def test_decoder_rejects_wrong_count_and_order():
    dec = ReleaseDecoder(100, 0, 0, alpha=0.5)
    with pytest.raises(ValueError, match="values, the mask releases"):
        dec.decode(0, 4, np.ones(101, np.float32))
    assert dec.last_step == -1  # unchanged
    n = dec.advance(0, 4).size
    assert 0 < n < 100
    with pytest.raises(ValueError, match="not after the last decoded step 0"):
        dec.advance(0, 4)


def test_expected_release_mask_is_pure():
    due = np.full(10, -1, np.int32)
    due[3] = 5
    rel, new_due = expected_release_mask(0, 0, 5, 0.99, due, 4)
    assert due[3] == 5  # input untouched
    assert rel[3]  # due at step 5: forced
    assert new_due[3] == -1


def test_flush_empties_and_decoder_follows():
    r = GDDRResidual(300, 0, 0, alpha=0.8, tau=5)
    dec = ReleaseDecoder(300, 0, 0, alpha=0.8)
    for t in range(5):
        rel = r.step(np.ones(300, np.float32), t)
        dec.advance(t, rel.tau)
    held = r.held().copy()
    assert r.held_count > 0
    out = r.flush()
    dec.flush()
    assert np.array_equal(out, held) and r.held_count == 0 and not r.held().any()
    assert np.array_equal(dec.due, r.due)
    rel = r.step(np.ones(300, np.float32), 5)
    assert np.array_equal(dec.advance(5, rel.tau), rel.indices)


# ----------------------------------------------------------------------------- config, state


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"alpha": 1.0}, r"'gddr.alpha' = 1.0: must be >= 0 and < 1"),
        ({"alpha": -0.1}, r"'gddr.alpha' = -0.1"),
        ({"tau": 0}, r"'gddr.tau' = 0: must be an integer >= 1"),
        ({"tau": 2.5}, r"'gddr.tau' = 2.5"),
        ({"installments": 0}, r"'gddr.installments' = 0"),
        ({"installment_ratio": 0.0}, r"'gddr.installment_ratio' = 0.0"),
        ({"installment_ratio": 1.5}, r"'gddr.installment_ratio' = 1.5"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        GDDRResidual(10, 0, 0, **kw)


def test_state_dict_mismatch_and_malformed():
    a = GDDRResidual(10, 0, 0)
    with pytest.raises(ValueError, match="device = 0"):
        GDDRResidual(10, 1, 0).load_state_dict(a.state_dict())
    bad = a.state_dict()
    bad["due"] = bad["due"].astype(np.int64)
    with pytest.raises(ValueError, match="'due' is int64"):
        GDDRResidual.from_state_dict(bad)
    bad = a.state_dict()
    del bad["residual"]
    with pytest.raises(ValueError, match="lacks residual"):
        GDDRResidual.from_state_dict(bad)


# ----------------------------------------------------------------------------- density


def test_density_formulas():
    assert stationary_density(0.4, 4) == pytest.approx(0.6 / (1 - 0.4**5))
    assert stationary_density(0.4, 4) == pytest.approx(0.60621, abs=1e-5)
    assert issue_density(0.4, 4) == pytest.approx(0.6256)
    assert stationary_density(0.0, 3) == 1.0
    assert stationary_density(0.5, 1) == pytest.approx(1 / 1.5)


@pytest.mark.parametrize("alpha,tau", [(0.4, 4), (0.8, 2), (0.6, 8), (0.9, 1)])
def test_density_matches_stationary_formula_small(alpha, tau):
    size, steps, burn = 20_000, 150, 30
    dec = ReleaseDecoder(size, 0, 123, alpha=alpha)
    count = 0
    for t in range(steps):
        n = dec.advance(t, tau).size
        count += n if t >= burn else 0
    measured = count / (size * (steps - burn))
    assert measured == pytest.approx(stationary_density(alpha, tau), rel=0.01)


@pytest.mark.slow
def test_payload_density_large_model():
    """10^6 coordinates, 120 steps, alpha 0.4, tau 4, through the worker.

    Asserts the exact stationary density (1-a)/(1-a^(tau+1)) = 0.6062 within +-2%. The issue's
    (1-a) + a^tau = 0.6256 is 3.1% above the measurement and is therefore *not* met at +-2%;
    the assertion on it documents that the two differ.
    """
    size, steps, burn = 1_000_000, 120, 20
    r = GDDRResidual(size, 0, 2024, alpha=0.4, tau=4)
    g = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    sent = 0
    for t in range(steps):
        rel = r.step(g, t)
        if t >= burn:
            sent += rel.values.size
    measured = sent / (size * (steps - burn))
    exact = stationary_density(0.4, 4)
    assert abs(measured / exact - 1) < 0.02
    assert abs(measured / exact - 1) < 0.001  # in fact far tighter
    assert abs(measured / issue_density(0.4, 4) - 1) > 0.02
