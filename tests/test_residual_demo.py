"""The GDDR stability trade-off on a quadratic: long delay + large step diverges."""

from __future__ import annotations

import math

import pytest

from edgefl.algorithms.gddr.demo import main, quadratic_stability


@pytest.mark.parametrize("seed", [0, 1])
def test_large_step_with_tau_8_diverges_small_step_converges(seed):
    big = quadratic_stability(1.8, tau=8, alpha=0.4, steps=300, seed=seed)
    small = quadratic_stability(0.5, tau=8, alpha=0.4, steps=300, seed=seed)
    assert len(big) == len(small) == 301
    assert big[-1] > 1e6 * big[0]  # diverges
    assert small[-1] < 1e-8 * small[0]  # converges
    # the delay is the cause: the same large step converges without withholding (dense
    # gradient descent is stable for step < 2) and with tau = 1
    dense = quadratic_stability(1.8, tau=8, alpha=0.0, steps=300, seed=seed)
    assert dense[-1] < 1e-20 * dense[0]
    short = quadratic_stability(1.8, tau=1, alpha=0.4, steps=300, seed=seed)
    assert short[-1] < 1e-2 * short[0]


def test_deterministic_and_overflow_is_inf():
    a = quadratic_stability(1.9, tau=8, alpha=0.9, steps=200, seed=3)
    assert a == quadratic_stability(1.9, tau=8, alpha=0.9, steps=200, seed=3)
    assert len(a) == 201 and math.isinf(a[-1])
    assert all(math.isfinite(x) for x in a[: a.index(math.inf)])


def test_main_prints_table(capsys):
    assert main(["--steps", "50", "--taus", "1", "8", "--step-sizes", "0.5", "1.8"]) == 0
    out = capsys.readouterr().out
    assert "final loss / initial loss" in out and len(out.strip().splitlines()) == 4
