"""The GDDR stability trade-off (step size x tau x alpha) on a quadratic.

Gradient descent on f(x) = 1/2 sum_i lambda_i x_i^2 (``dim`` coordinates, curvatures spread
evenly over [``mu``, 1]) where the gradient goes through a :class:`GDDRResidual` first: the
model moves by -step_size times the *released* values only. A withheld coordinate's gradients
accumulate and land at once up to tau steps later, computed at stale iterates. Plain gradient
descent is stable for step_size * lambda_max < 2; with delay the safe step shrinks roughly like
1 / tau (a coordinate held k steps applies about (k + 1) stale gradients at once), so
long delays combined with large steps diverge while small steps still converge.

Run ``python -m edgefl.algorithms.gddr.demo`` for a table of final losses.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from edgefl.algorithms.gddr.residual import GDDRResidual


def quadratic_stability(
    step_size: float,
    tau: int,
    alpha: float,
    steps: int,
    seed: int,
    dim: int = 200,
    mu: float = 0.05,
) -> list[float]:
    """Losses f(x_t), t = 0..steps, of GDDR gradient descent on a quadratic.

    Args:
        step_size: gradient step (dimensionless; lambda_max = 1).
        tau: ``gddr.tau``, most steps a gradient value may be withheld.
        alpha: ``gddr.alpha``, withhold probability.
        steps: gradient steps.
        seed: run seed (initial point and masks).
        dim: coordinates (default 200).
        mu: smallest curvature (default 0.05; condition number 1/mu).

    Returns ``steps + 1`` losses; once the loss is no longer finite or exceeds 1e30 the rest
    are ``inf``. Deterministic in its arguments.
    """
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    a = (q * np.linspace(mu, 1.0, dim)) @ q.T  # Q diag(lambda) Q^T: coordinates interact
    x = rng.standard_normal(dim)
    gddr = GDDRResidual(dim, device=0, run_seed=seed, alpha=alpha, tau=tau)
    losses = [0.5 * float(x @ a @ x)]
    for t in range(steps):
        g = (a @ x).astype(np.float32)
        rel = gddr.step(g, t)
        x[rel.indices] -= step_size * rel.values.astype(np.float64)
        loss = 0.5 * float(x @ a @ x)
        if not math.isfinite(loss) or loss > 1e30:
            losses.extend([math.inf] * (steps - t))
            break
        losses.append(loss)
    return losses


def main(argv: list[str] | None = None) -> int:
    """Print the final loss (relative to the initial one) for a grid of step size x tau."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--alpha", type=float, default=0.4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--taus", type=int, nargs="+", default=[1, 2, 4, 8, 20])
    p.add_argument("--step-sizes", type=float, nargs="+", default=[0.05, 0.2, 0.5, 1.0, 1.5])
    a = p.parse_args(argv)
    print(f"alpha={a.alpha} steps={a.steps} seed={a.seed}: final loss / initial loss")
    print("step \\ tau " + "".join(f"{t:>11d}" for t in a.taus))
    for eta in a.step_sizes:
        row = []
        for tau in a.taus:
            ls = quadratic_stability(eta, tau, a.alpha, a.steps, a.seed)
            row.append(ls[-1] / ls[0])
        print(f"{eta:>10.3g} " + "".join(f"{r:>11.2e}" for r in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
