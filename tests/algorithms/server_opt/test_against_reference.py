"""Server optimizers: update rules against hand-computed values, L1 prox, state, config."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

from edgefl.algorithms.server_opt.optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
    make_server_optimizer,
)
from edgefl.errors import ConfigError
from edgefl.policies.keyrange import KeyRange


def _f32(*x: float) -> np.ndarray:
    return np.array(x, np.float32)


def test_sgd_is_fedavg_with_server_lr() -> None:
    x = _f32(1.0, 2.0)
    ServerOptimizer(lr=0.5).step(x, _f32(0.5, -1.0))
    assert x.tolist() == [1.25, 1.5]


def test_l1_prox_soft_thresholds_penalised_keys_only() -> None:
    x = _f32(0.1, -1.0, 2.0, 0.05)
    ServerOptimizer(lr=0.5, l1=0.6, l1_keys=KeyRange(0, 3)).step(x, np.zeros(4))
    # threshold lr * l1 = 0.3 on keys 0..2; key 3 (a bias) untouched
    np.testing.assert_allclose(x, [0.0, -0.7, 1.7, 0.05], rtol=1e-6)
    y = _f32(0.5, -0.5, 0.2)
    ServerOptimizer(lr=1.0, l1=0.3, l1_keys=np.array([1])).step(y, _f32(0.0, 0.0, 0.0))
    np.testing.assert_allclose(y, [0.5, -0.2, 0.2], rtol=1e-6)


def test_fedavgm_two_steps() -> None:
    opt = FedAvgM(lr=1.0, beta1=0.9)
    x = _f32(0.0)
    opt.step(x, _f32(1.0))  # b = 1, x = 1
    opt.step(x, _f32(1.0))  # b = 0.9 + 1 = 1.9, x = 2.9
    assert x[0] == pytest.approx(2.9, rel=1e-6)
    assert opt.state_dict()["momentum"][0] == pytest.approx(1.9, rel=1e-6)


def _adaptive_reference(kind: str, deltas, lr, b1, b2, tau, l1=0.0):
    """The Reddi et al. (2021) rules written out in float64 for one coordinate."""
    x, m, v = 0.0, 0.0, tau * tau
    for d in deltas:
        m = b1 * m + (1 - b1) * d
        if kind == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        elif kind == "fedyogi":
            v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d)
        else:
            v = v + d * d
        x = x + lr * m / (math.sqrt(v) + tau)
        thr = lr * l1 / (math.sqrt(v) + tau)
        x = math.copysign(max(abs(x) - thr, 0.0), x)
    return x, m, v


def test_adaptive_first_step_by_hand() -> None:
    # delta 0.5, beta1 0.9, beta2 0.99, tau 1e-3, lr 0.1, v starts at tau^2 = 1e-6
    m = 0.1 * 0.5  # 0.05
    for cls, v in [
        (FedAdam, 0.99 * 1e-6 + 0.01 * 0.25),
        (FedYogi, 1e-6 + 0.01 * 0.25),  # sign(1e-6 - 0.25) = -1
        (FedAdagrad, 1e-6 + 0.25),
    ]:
        opt = cls(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
        x = _f32(0.0)
        opt.step(x, _f32(0.5))
        assert x[0] == pytest.approx(0.1 * m / (math.sqrt(v) + 1e-3), rel=1e-5), cls.name
        st = opt.state_dict()
        assert st["m"][0] == pytest.approx(m, rel=1e-6) and st["v"][0] == pytest.approx(v, rel=1e-5)
        assert int(st["step"]) == 1


@pytest.mark.parametrize("kind", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_rules_match_reference_over_steps(kind: str) -> None:
    deltas = [0.5, -0.2, 0.05, 0.3, -0.4, 0.0, 0.1]
    opt = make_server_optimizer(
        {"optimizer": kind, "lr": 0.05, "beta1": 0.8, "beta2": 0.9, "tau": 0.01, "l1": 0.002}
    )
    x = _f32(0.0)
    for d in deltas:
        opt.step(x, _f32(d))
    want, m, v = _adaptive_reference(kind, deltas, 0.05, 0.8, 0.9, 0.01, l1=0.002)
    assert x[0] == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert opt.state_dict()["v"][0] == pytest.approx(v, rel=1e-4)


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(0)
    deltas = [rng.normal(0, 0.1, 50).astype(np.float32) for _ in range(6)]
    for name in ("sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        cfg = {"optimizer": name, "lr": 0.1, "l1": 0.01}
        a, xa = make_server_optimizer(cfg), np.zeros(50, np.float32)
        for d in deltas[:3]:
            a.step(xa, d)
        b, xb = make_server_optimizer(cfg), xa.copy()
        b.load_state_dict({k: np.array(v) for k, v in a.state_dict().items()})
        for d in deltas[3:]:
            a.step(xa, d)
            b.step(xb, d)
        assert np.array_equal(xa, xb), name
        assert b.t == 6


def test_config_errors_name_the_key() -> None:
    cases = [
        ({"lr": 0.0}, "'server.lr' = 0.0: must be > 0"),
        ({"optimizer": "fedadam", "beta1": 1.0}, "'server.beta1' = 1.0"),
        ({"optimizer": "fedyogi", "beta2": -0.1}, "'server.beta2'"),
        ({"optimizer": "fedadam", "tau": 0}, "'server.tau'"),
        ({"l1": -1}, "'server.l1' = -1: must be >= 0"),
        ({"optimizer": "adamw"}, "'server.optimizer' = 'adamw'"),
        ({"optimizer": "no_such_mod_xyz:f"}, "cannot import module 'no_such_mod_xyz'"),
        ({"optimizer": "math:no_such_fn"}, "has no function 'no_such_fn'"),
        ({"optimizer": "fedavgm", "beta1": True}, "'server.beta1' = True"),
    ]
    for cfg, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            make_server_optimizer(cfg)
    assert make_server_optimizer({"participation": 0.5}).name == "sgd"  # other keys ignored


def test_user_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_server_upd.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def clipped(params, delta, state, step, cfg):
                state.setdefault("count", np.zeros(1))
                state["count"] += 1
                params += cfg["lr"] * np.clip(delta, -1, 1)

            def doubled(params, delta, state, step, cfg):
                return params + 2 * delta

            def bad_shape(params, delta, state, step, cfg):
                return params[:1]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    opt = make_server_optimizer({"optimizer": "my_server_upd:clipped", "lr": 0.5, "l1": 0.25})
    x = _f32(0.0, 0.0, 3.0)
    opt.step(x, _f32(4.0, 0.2, 0.0))
    # 0.5 * clip -> [0.5, 0.1, 3.0]; then the prox subtracts lr * l1 = 0.125
    np.testing.assert_allclose(x, [0.375, 0.0, 2.875], rtol=1e-6)
    st = opt.state_dict()
    assert st["user.count"].tolist() == [1.0]
    again = make_server_optimizer({"optimizer": "my_server_upd:clipped", "lr": 0.5})
    again.load_state_dict(st)
    again.step(x, _f32(0, 0, 0))
    assert again.state_dict()["user.count"].tolist() == [2.0] and again.t == 2
    y = _f32(1.0)
    make_server_optimizer({"optimizer": "my_server_upd:doubled"}).step(y, _f32(0.25))
    assert y.tolist() == [1.5]
    with pytest.raises(ConfigError, match="returned shape"):
        make_server_optimizer({"optimizer": "my_server_upd:bad_shape"}).step(_f32(1, 2), _f32(0, 0))
