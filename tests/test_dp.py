"""Client-level DP: the DP-FedAvg aggregator, the sampling the coordinator does for it
(``dp.sampling``) and the epsilon it reports, checked against Google's dp-accounting (called
here through its public API, independently of edgefl's accounting module) and against the
exact epsilon of the Gaussian mechanism."""

from __future__ import annotations

import functools
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import NeighboringRelation, dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy import optimize
from scipy.stats import norm

from edgefl.algorithms.dp.accounting import Accountant, Sampling
from edgefl.algorithms.dp.dpfedavg import DPFedAvg
from edgefl.errors import ConfigError
from edgefl.policies.aggregation import Update
from edgefl.policies.consistency import BSP, Arrival, make_consistency

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden.configs import SMALL, job, run_loopback_dir, simulate_argv  # noqa: E402

DELTA = 1e-5


# -- the reference: dp-accounting's public API, with the event edgefl's draw corresponds to --
def reference_fixed(devices: int, m: int, z: float, steps: int, delta: float = DELTA) -> float:
    """m of N without replacement, replace-one: a clipped sum moves by up to 2C when one
    device's update is replaced, so the Gaussian's multiplier per unit sensitivity is z/2
    (dp-accounting 0.6.0 reads it that way, google/differential-privacy#378)."""
    acc = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    one = dp_event.SampledWithoutReplacementDpEvent(devices, m, dp_event.GaussianDpEvent(z / 2))
    acc.compose(dp_event.SelfComposedDpEvent(one, steps))
    return acc.get_epsilon(delta)


def reference_poisson(q: float, z: float, steps: int, delta: float = DELTA) -> float:
    acc = RdpAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    one = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z))
    acc.compose(dp_event.SelfComposedDpEvent(one, steps))
    return acc.get_epsilon(delta)


@pytest.fixture(scope="module")
def memo_rdp():
    """Memoises dp-accounting's per-order RDP functions (pure functions of q, sigma and the
    order) for this module, so a grid of step counts pays each order once: it changes no
    value, only the time (the fixed-size RDP costs ~0.4 s per event otherwise)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    with pytest.MonkeyPatch.context() as mp:
        for name in ("_compute_rdp_sample_wor_gaussian_scalar", "_compute_log_a"):
            if hasattr(rdp, name):  # (a later release may rename them: then only slower)
                mp.setattr(rdp, name, functools.lru_cache(maxsize=None)(getattr(rdp, name)))
        yield


def _cfg(devices: int, q: float, z: float, sampling: str = "fixed", **extra) -> dict:
    cfg = {
        "seed": 3,
        "fleet": {"devices": devices},
        "server": {"participation": q, "min_devices": 1},
        "algorithm": {"aggregation": "mean"},
        "dp": {"clip": 0.5, "noise_multiplier": z, "delta": DELTA, "sampling": sampling},
        "robust": {"norm_bound": 0.0, "norm_bound_relative": 0.0},
    }
    for key, value in extra.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


def _ups(rows, ids=None):
    ids = range(len(rows)) if ids is None else ids
    return [Update(i, np.asarray(r, np.float32), 10, 0.1) for i, r in zip(ids, rows)]


# -- (a) reported epsilon == dp-accounting's, on a grid --------------------------------------
GRID_N = 40
GRID_Z = (0.7, 1.3, 3.0)
GRID_Q = (0.05, 0.25, 0.6)  # m = 2, 10, 24 of 40 (q N exact: no rounding question)
GRID_T = (1, 15, 200)


@pytest.mark.parametrize("mode", ["fixed", "poisson"])
def test_reported_epsilon_is_dp_accountings_on_a_grid(mode, memo_rdp):
    ups = _ups([[0.3, -0.2, 0.9], [1.5, 0.0, -0.4]])
    out = np.empty(3, np.float32)
    for z in GRID_Z:
        for q in GRID_Q:
            agg = DPFedAvg.from_config(_cfg(GRID_N, q, z, mode))
            done = 0
            for t in GRID_T:
                for _ in range(t - done):
                    agg.aggregate(ups, out=out)
                done = t
                if mode == "fixed":
                    want = reference_fixed(GRID_N, round(q * GRID_N), z, t)
                else:
                    want = reference_poisson(q, z, t)
                got = agg.epsilon()
                assert agg.steps == t
                assert got == pytest.approx(want, rel=0.01), (mode, z, q, t)


def test_the_example_figures_of_the_docs(memo_rdp):
    """docs/robustness.md's before/after table: z = 1, q = 0.1, 20 rounds of 100 devices.
    The defect of issue 15: these fixed-size draws were accounted as Poisson ones (4.26 by
    the old hand-written accountant)."""
    fixed = DPFedAvg.from_config(_cfg(100, 0.1, 1.0))
    fixed.accountant.step(fixed.sampling, 1.0, 20)
    poisson = DPFedAvg.from_config(_cfg(100, 0.1, 1.0, "poisson"))
    poisson.accountant.step(poisson.sampling, 1.0, 20)
    assert fixed.epsilon() == pytest.approx(24.89, abs=0.01)
    assert poisson.epsilon() == pytest.approx(4.22, abs=0.01)
    assert fixed.epsilon() > 1.4 * reference_poisson(0.1, 1.0, 20)


# -- soundness, independent of dp-accounting's conventions -----------------------------------
def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon of the Gaussian mechanism with sensitivity/std ratio mu (Balle & Wang,
    ICML 2018, Thm. 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""

    def gap(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps + norm.logcdf(-mu / 2 - eps / mu)) - delta

    return optimize.brentq(gap, 0.0, 1000.0, xtol=1e-12)


@pytest.mark.parametrize("z, steps", [(1.0, 1), (2.0, 10), (4.0, 100)])
def test_full_participation_is_never_below_the_exact_gaussian(z, steps):
    """Every device in every step: T Gaussian steps with noise std z C on the clipped sum are
    one Gaussian mechanism, of sensitivity 2C under replace-one (mu = 2 sqrt(T) / z) and C
    under add/remove (mu = sqrt(T) / z). Its exact epsilon bounds any valid accountant from
    below; charging only C for replace-one (the library's z unhalved) falls below it."""
    n = 8
    fixed = DPFedAvg(0.5, z, DELTA, Sampling.fixed(n, n))
    fixed.accountant.step(fixed.sampling, z, steps)
    exact = _exact_gaussian_epsilon(2 * math.sqrt(steps) / z, DELTA)
    assert exact <= fixed.epsilon() <= 1.25 * exact
    poisson = DPFedAvg(0.5, z, DELTA, Sampling.poisson(n, 1.0))
    poisson.accountant.step(poisson.sampling, z, steps)
    exact_ar = _exact_gaussian_epsilon(math.sqrt(steps) / z, DELTA)
    assert exact_ar <= poisson.epsilon() <= 1.6 * exact_ar


def test_poisson_epsilon_is_close_above_the_pld_accountants(memo_rdp):
    """The PLD accountant (a different, tighter method) on the same Poisson event."""
    agg = DPFedAvg.from_config(_cfg(100, 0.1, 1.0, "poisson"))
    agg.accountant.step(agg.sampling, 1.0, 20)
    pld = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-3)  # (pessimistic)
    pld.compose(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0)), 20
        )
    )
    tight = pld.get_epsilon(DELTA)
    assert tight <= agg.epsilon() <= 1.3 * tight


# -- the aggregator ---------------------------------------------------------------------------
def test_without_noise_it_is_the_mean_of_clipped_updates():
    agg = DPFedAvg(clip=1.0, noise_multiplier=0.0)
    got = agg.aggregate(_ups([[3, 4], [0.3, 0.4], [0, -2]]))  # norms 5, 0.5, 2
    np.testing.assert_allclose(got, [(0.6 + 0.3 + 0) / 3, (0.8 + 0.4 - 1) / 3], rtol=1e-6)
    assert agg.last_clipped == [0, 2] and agg.last_noise_std == 0.0
    assert agg.steps == 1 and agg.epsilon() == math.inf


def test_the_denominator_is_the_samplings_not_the_arrivals():
    """Fixed: the m drawn (a lost update counts as zero); Poisson: q N. Never the count
    that arrived, which is not public under add/remove adjacency."""
    rows = [[0.1, 0.2], [0.3, -0.1], [0.0, 0.4]]
    s = np.sum(rows, axis=0)
    fixed = DPFedAvg(1.0, 0.0, sampling=Sampling.fixed(10, 4))
    np.testing.assert_allclose(fixed.aggregate(_ups(rows)), s / 4, rtol=1e-6)
    poisson = DPFedAvg(1.0, 0.0, sampling=Sampling.poisson(10, 0.25))
    np.testing.assert_allclose(poisson.aggregate(_ups(rows)), s / 2.5, rtol=1e-6)
    # with every drawn device reporting, the fixed mode is the plain mean of clipped updates
    full = DPFedAvg(1.0, 0.0, sampling=Sampling.fixed(10, 3))
    np.testing.assert_allclose(full.aggregate(_ups(rows)), s / 3, rtol=1e-6)


def test_a_step_without_updates_releases_the_noise_alone_and_counts():
    n, z, clip = 50_000, 1.2, 0.5
    agg = DPFedAvg(clip, z, sampling=Sampling.poisson(20, 0.2), seed=9)
    out = agg.aggregate([], out=np.empty(n, np.float32))
    assert agg.steps == 1 and agg.epsilon() > 0
    assert agg.last_noise_std == pytest.approx(z * clip / 4.0)
    assert out.std() == pytest.approx(z * clip / 4.0, rel=0.02)
    with pytest.raises(ValueError, match="needs out"):
        DPFedAvg(clip, z, sampling=Sampling.poisson(20, 0.2)).aggregate([])


def test_noise_has_the_dp_fedavg_scale():
    n, d, clip, z = 8, 200_000, 0.5, 1.3
    rows = np.zeros((n, d), np.float32)
    agg = DPFedAvg(clip=clip, noise_multiplier=z, seed=11, sampling=Sampling.fixed(20, n))
    noise = agg.aggregate(_ups(rows)).astype(np.float64)
    assert agg.last_noise_std == pytest.approx(z * clip / n)
    assert noise.std() == pytest.approx(z * clip / n, rel=0.01)  # 200k samples: ~0.16% error
    assert abs(noise.mean()) < 4 * z * clip / n / math.sqrt(d)


def test_noise_is_seeded_per_step_and_independent_of_arrival_order():
    rng = np.random.default_rng(0)
    u = _ups(rng.standard_normal((6, 50)))
    s = Sampling.fixed(6, 6)
    a, b = DPFedAvg(1.0, 1.0, sampling=s, seed=3), DPFedAvg(1.0, 1.0, sampling=s, seed=3)
    first = a.aggregate(u)
    assert np.array_equal(b.aggregate(u[::-1]), first)  # bit-identical, any order
    second = a.aggregate(u)
    assert not np.array_equal(second, first)  # fresh noise every step
    assert not np.array_equal(DPFedAvg(1.0, 1.0, sampling=s, seed=4).aggregate(u), first)
    # a resumed aggregator continues the same noise stream and the same accounting
    c = DPFedAvg(1.0, 1.0, sampling=s, seed=3)
    c.load_state_dict(b.state_dict())
    assert np.array_equal(c.aggregate(u), b.aggregate(u))
    assert c.steps == b.steps == 2 and c.epsilon() == b.epsilon() > 0


def test_non_finite_updates_are_refused():
    agg = DPFedAvg(1.0, 1.0)
    with pytest.raises(ValueError, match="device 1"):
        agg.aggregate(_ups([[1.0, 0.0], [np.nan, 0.0], [0.0, 1.0]]))


def test_summary_states_event_adjacency_and_library(memo_rdp):
    agg = DPFedAvg.from_config(_cfg(100, 0.1, 1.0))
    agg.aggregate(_ups([[0.1, 0.2]]))
    s = agg.summary()["dp"]
    assert s["adjacency"] == "replace-one" and s["sampling"] == "fixed" and s["steps"] == 1
    assert s["event"].startswith("SampledWithoutReplacementDpEvent(100, 10, GaussianDpEvent(0.5)")
    assert s["accountant"].startswith("dp-accounting 0.6") and s["epsilon"] == agg.epsilon()
    p = DPFedAvg.from_config(_cfg(100, 0.1, 1.0, "poisson")).summary()["dp"]
    assert p["adjacency"] == "add/remove-one"
    assert p["event"].startswith("PoissonSampledDpEvent(0.1, GaussianDpEvent(1)")


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"clip": 0.0, "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": -1.0, "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": "1", "noise_multiplier": 1.0}, "dp.clip"),
        ({"clip": 1.0, "noise_multiplier": -0.1}, "dp.noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": math.inf}, "dp.noise_multiplier"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 0.0}, "dp.delta"),
        ({"clip": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, "dp.delta"),
    ],
)
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DPFedAvg(**kwargs)


def test_bad_samplings_name_the_key():
    with pytest.raises(ConfigError, match="'server.participation' = 0.0"):
        Sampling.poisson(10, 0.0)
    with pytest.raises(ConfigError, match="'server.participation'"):
        Sampling.fixed(10, 11)
    with pytest.raises(ConfigError, match="'fleet.devices'"):
        Sampling.fixed(0, 0)
    with pytest.raises(ConfigError, match="'dp.sampling' = 'uniform'"):
        DPFedAvg.from_config(_cfg(10, 0.5, 1.0, "uniform"))


def test_from_config():
    agg = DPFedAvg.from_config(_cfg(9, 0.5, 1.1, dp__clip=0.7, dp__delta=1e-6))
    assert (agg.clip, agg.noise_multiplier, agg.delta, agg.seed) == (0.7, 1.1, 1e-6, 3)
    # m is the BSP round size: floor(q N + 0.5), at least server.min_devices
    assert agg.sampling == Sampling.fixed(9, 5)
    assert DPFedAvg.from_config(_cfg(9, 0.1, 1.0, server__min_devices=3)).sampling.sample_size == 3
    assert DPFedAvg.from_config(_cfg(9, 0.3, 1.0, "poisson")).sampling == Sampling.poisson(9, 0.3)
    with pytest.raises(ConfigError, match="'algorithm.aggregation' = 'krum'"):
        DPFedAvg.from_config(_cfg(9, 0.5, 1.0, algorithm__aggregation="krum"))
    with pytest.raises(ConfigError, match="'robust.norm_bound' = 2.0"):
        DPFedAvg.from_config(_cfg(9, 0.5, 1.0, "poisson", robust__norm_bound=2.0))


def test_poisson_needs_dp_enabled():
    cfg = _cfg(4, 0.5, 1.0, "poisson")
    cfg["algorithm"].update(consistency="bsp")
    cfg["server"]["deadline_s"] = 0.0
    cfg["dp"]["enabled"] = False
    with pytest.raises(ConfigError, match="'dp.sampling' = 'poisson'.*dp.enabled"):
        make_consistency(cfg, {d: 1 for d in range(4)})
    cfg["dp"]["enabled"] = True
    assert make_consistency(cfg, {d: 1 for d in range(4)}).dp_sampling == "poisson"


# -- (c) the participation draws -------------------------------------------------------------------
def _arrival(d: int) -> Arrival:
    return Arrival(d, 0, 0, 1, 0.0, np.zeros(1, np.float32))


def _drive(policy: BSP, rounds: int, available=lambda d: True) -> list[list[int]]:
    """Run ``rounds`` BSP rounds, every dispatched device reporting at once; the devices of
    each applied round (a round of nobody closes on its timer, at the same time)."""
    got: list[list[int]] = []
    dec = policy.start(0.0, available)
    while len(got) < rounds:
        if dec.dispatch:
            for d in dec.dispatch:
                nxt = policy.arrived(_arrival(d), 0, 0.0, available)
            dec = nxt
        elif dec.timer is not None and dec.timer[0] == 0.0:
            dec = policy.timer(dec.timer[1], 0.0, available)
        else:
            raise AssertionError(f"round {len(got) + 1}: the policy started nothing")
        assert dec.apply is not None and dec.apply.mode == "aggregate"
        got.append(sorted(a.device for a in dec.apply.arrivals))
    return got


def _samples(n: int) -> dict[int, int]:
    return {d: 10 + d for d in range(n)}


def test_poisson_draws_are_deterministic_and_at_rate_q():
    n, q, rounds = 50, 0.1, 400
    a = _drive(BSP(_samples(n), seed=7, participation=q, dp_sampling="poisson"), rounds)
    b = _drive(BSP(_samples(n), seed=7, participation=q, dp_sampling="poisson"), rounds)
    c = _drive(BSP(_samples(n), seed=8, participation=q, dp_sampling="poisson"), rounds)
    assert a == b and a != c  # the draws are a function of the seed
    sizes = np.array([len(r) for r in a])
    assert abs(sizes.mean() / n - q) < 0.01  # 20 000 Bernoulli(0.1): sd 0.002
    # independent inclusions: Binomial(N, q) round sizes (a fixed-size draw has variance 0)
    assert 0.7 < sizes.var() / (n * q * (1 - q)) < 1.3
    per_device = np.bincount(np.concatenate([r for r in a if r]), minlength=n) / rounds
    assert per_device.min() > 0.03 and per_device.max() < 0.2
    assert (sizes == 0).any()  # some rounds draw nobody: each was still applied (a step)


def test_fixed_dp_draws_are_todays_while_everyone_is_available():
    """Golden models unchanged: with every device idle and available, the DP fixed-size
    draw is the draw edgefl always made."""
    old = _drive(BSP(_samples(12), seed=5, participation=0.25), 30)
    new = _drive(BSP(_samples(12), seed=5, participation=0.25, dp_sampling="fixed"), 30)
    assert new == old and all(len(r) == 3 for r in new)


def test_fixed_dp_draws_are_over_all_devices_when_some_are_away():
    """m of all N: a device away sits the round out, so an available one is drawn with
    probability m/N, as accounted, not m/(devices available)."""
    n, q, rounds = 20, 0.25, 400

    def even(d):
        return d % 2 == 0

    got = _drive(BSP(_samples(n), seed=2, participation=q, dp_sampling="fixed"), rounds, even)
    assert all(all(even(d) for d in r) and len(r) <= 5 for r in got)
    rate = np.bincount(np.concatenate([r for r in got if r]), minlength=n)[::2] / rounds
    assert abs(rate.mean() - 0.25) < 0.03  # m/N; drawing among the 10 available gives 0.5
    # without DP the draw stays among the available devices, as before
    old = _drive(BSP(_samples(n), seed=2, participation=q), 50, even)
    assert all(len(r) == 5 for r in old)


# -- (d) the accountant in checkpoints, and a resumed run ----------------------------------------
def test_accountant_state_round_trips():
    acc = Accountant()
    s = Sampling.fixed(30, 30)  # (every device: the accountant's cheap case)
    acc.step(s, 1.0, 7)
    acc.step(s, 1.5, 3)
    other = Accountant()
    other.load_state_dict(json.loads(json.dumps(acc.state_dict())))  # plain values
    assert other.history == acc.history and other.steps == 10
    assert other.epsilon(DELTA) == acc.epsilon(DELTA) > 0
    with pytest.raises(ConfigError, match="'dp.sampling' = 'poisson'"):
        acc.step(Sampling.poisson(30, 0.2), 1.0)
    with pytest.raises(ConfigError, match="'dp.delta'"):
        acc.epsilon(0.0)


def test_checkpoint_of_the_other_sampling_is_refused_and_old_ones_reaccounted():
    fixed = DPFedAvg(1.0, 1.0, sampling=Sampling.fixed(30, 30))
    fixed.aggregate(_ups([[0.5, 0.5]]))
    poisson = DPFedAvg(1.0, 1.0, sampling=Sampling.poisson(30, 0.2))
    with pytest.raises(ConfigError, match="'dp.sampling' = 'poisson'.*replace-one"):
        poisson.load_state_dict(fixed.state_dict())
    # an accountant state of the hand-written RDP accountant (orders / rdp / steps)
    old = {"accountant": {"orders": [2, 3], "rdp": [0.1, 0.2], "steps": 12}}
    fixed.load_state_dict(old)
    assert fixed.steps == 12
    assert fixed.epsilon() == pytest.approx(reference_fixed(30, 30, 1.0, 12), rel=1e-9)


POISSON_JOB = job(
    SMALL,
    "fleet.devices=5",
    "run.rounds=6",
    "server.participation=0.4",
    "dp.enabled=true",
    "dp.sampling=poisson",
    "dp.clip=0.5",
    "dp.noise_multiplier=1.1",
)


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_poisson_run_resumed_reports_the_uninterrupted_epsilon():
    """Stop after round 3, resume from its checkpoint: same model, same epsilon, and that
    epsilon is dp-accounting's for 6 Poisson steps (rounds drawing nobody included)."""
    with tempfile.TemporaryDirectory(prefix="edgefl-dp-") as tmp:
        whole = run_loopback_dir(POISSON_JOB, Path(tmp) / "whole")
        part_dir = Path(tmp) / "part"
        part = run_loopback_dir(job(POISSON_JOB, "debug.stop_after_round=3"), part_dir)
        ckpt = part_dir / "checkpoints" / "ckpt-000003.h5"
        resumed = run_loopback_dir(POISSON_JOB, Path(tmp) / "resumed", resume=ckpt)
    assert part["rounds_done"] == 3 and whole["rounds_done"] == resumed["rounds_done"] == 6
    assert part["dp_epsilon"] == pytest.approx(reference_poisson(0.4, 1.1, 3), rel=1e-9)
    assert resumed["dp_epsilon"] == whole["dp_epsilon"]
    assert whole["dp_epsilon"] == pytest.approx(reference_poisson(0.4, 1.1, 6), rel=1e-9)
    assert resumed["model_sha256"] == whole["model_sha256"]


# -- (b) one real mpiexec run --------------------------------------------------------------------
@pytest.mark.mpi
def test_mpiexec_run_reports_dp_accountings_epsilon(launcher, tmp_path):
    """``edgefl simulate`` (fixed-size sampling, 3 of 6 devices a round): summary.json's
    epsilon is dp-accounting's for that event, replace-one, within 1%."""
    from conftest import run_edgefl

    sets = job(
        SMALL,
        "fleet.devices=6",
        "run.rounds=3",
        "server.participation=0.5",
        "dp.enabled=true",
        "dp.clip=0.5",
        "dp.noise_multiplier=1.1",
    )
    out = tmp_path / "run"
    proc = run_edgefl(*simulate_argv(sets, out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_done"] == 3
    want = reference_fixed(6, 3, 1.1, 3)
    assert summary["dp_epsilon"] == pytest.approx(want, rel=0.01)
    assert summary["dp_epsilon"] > 1.4 * reference_poisson(0.5, 1.1, 3)  # not the old figure
