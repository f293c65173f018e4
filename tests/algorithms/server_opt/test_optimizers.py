"""Server optimizers (edgefl.algorithms.server_opt): the steps, the L1 prox, checkpoint
state and the config errors of ``[server]``."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import edgefl.algorithms.server_opt as server_opt
from edgefl.algorithms.server_opt.optimizers import (
    BUILTIN,
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
    UserFunction,
    load_function,
    make_server_optimizer,
)
from edgefl.errors import ConfigError
from edgefl.policies.keyrange import KeyRange


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, np.float32)


def test_the_package_documents_its_optimizers_module():
    # the package is a namespace for .optimizers: its docstring points there and names
    # every built-in optimizer a config may choose
    assert ":mod:`.optimizers`" in server_opt.__doc__
    for name in ("SGD", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad"):
        assert name in server_opt.__doc__
    assert BUILTIN == ("sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad")


def test_sgd_adds_lr_times_delta_in_place_and_counts_steps():
    opt = ServerOptimizer(lr=0.5)
    x = f32(1.0, 2.0, 3.0)
    out = opt.step(x, f32(2.0, -2.0, 0.0))
    assert out is x
    assert x.tolist() == [2.0, 1.0, 3.0]
    opt.step(x, f32(0.0, 0.0, 4.0))
    assert x.tolist() == [2.0, 1.0, 5.0] and opt.t == 2


def test_step_refuses_params_that_are_not_1d_float32_or_a_delta_of_another_size():
    opt = ServerOptimizer()
    with pytest.raises(ValueError, match="1-D float32"):
        opt.step(np.zeros(3, np.float64), np.zeros(3))
    with pytest.raises(ValueError, match="1-D float32"):
        opt.step(np.zeros((2, 2), np.float32), np.zeros(4))
    with pytest.raises(ValueError, match="delta has 2 elements, params 3"):
        opt.step(np.zeros(3, np.float32), np.zeros(2))
    assert opt.t == 0  # a refused step does not count


def test_fedavgm_accumulates_momentum():
    opt = FedAvgM(lr=1.0, beta1=0.5)
    x = np.zeros(2, np.float32)
    opt.step(x, f32(1.0, 2.0))  # b = d
    assert x.tolist() == [1.0, 2.0]
    opt.step(x, f32(1.0, 0.0))  # b = 0.5 * (1, 2) + (1, 0) = (1.5, 1)
    assert x.tolist() == [2.5, 3.0]
    assert opt.state_dict()["momentum"].tolist() == [1.5, 1.0]


def _adaptive_reference(kind, d, lr, b1, b2, tau):
    d = np.asarray(d, np.float64)
    m = (1 - b1) * d
    v0 = np.full_like(d, tau**2)
    if kind == "fedadam":
        v = b2 * v0 + (1 - b2) * d * d
    elif kind == "fedyogi":
        v = v0 - (1 - b2) * d * d * np.sign(v0 - d * d)
    else:
        v = v0 + d * d
    return lr * m / (np.sqrt(v) + tau), v


@pytest.mark.parametrize(
    "cls,kind", [(FedAdam, "fedadam"), (FedYogi, "fedyogi"), (FedAdagrad, "fedadagrad")]
)
def test_adaptive_first_step_matches_the_paper(cls, kind):
    d = [0.5, -2.0, 0.0, 1e-4]
    opt = cls(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    x = np.zeros(4, np.float32)
    opt.step(x, np.array(d, np.float32))
    want, v = _adaptive_reference(kind, d, 0.1, 0.9, 0.99, 1e-3)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.state_dict()["v"], v, rtol=1e-5)


def test_yogi_moves_v_towards_delta_squared_by_its_sign():
    # v starts at tau^2 = 1: below d^2 = 4 yogi adds (1 - b2) d^2, above d^2 = 0.25 it
    # subtracts it (adam always decays v towards d^2, adagrad always adds d^2)
    d = f32(2.0, 0.5)
    vs = {}
    for cls in (FedAdam, FedYogi, FedAdagrad):
        opt = cls(lr=1.0, beta2=0.9, tau=1.0)
        opt.step(np.zeros(2, np.float32), d)
        vs[cls.name] = opt.state_dict()["v"].astype(np.float64)
    np.testing.assert_allclose(vs["fedyogi"], [1.0 + 0.1 * 4.0, 1.0 - 0.1 * 0.25], rtol=1e-6)
    np.testing.assert_allclose(vs["fedadam"], [0.9 + 0.1 * 4.0, 0.9 + 0.1 * 0.25], rtol=1e-6)
    np.testing.assert_allclose(vs["fedadagrad"], [5.0, 1.25], rtol=1e-6)


def test_l1_prox_soft_thresholds_every_key_by_lr_times_l1():
    opt = ServerOptimizer(lr=2.0, l1=0.25)  # threshold 0.5
    x = f32(1.0, -1.0, 0.2, -0.4, 0.0)
    opt.step(x, np.zeros(5, np.float32))
    np.testing.assert_allclose(x, [0.5, -0.5, 0.0, 0.0, 0.0])


def test_l1_prox_only_touches_the_penalised_keys():
    x1 = f32(1.0, 1.0, 1.0, 1.0)
    ServerOptimizer(l1=0.5, l1_keys=KeyRange(1, 3)).step(x1, np.zeros(4, np.float32))
    assert x1.tolist() == [1.0, 0.5, 0.5, 1.0]
    x2 = f32(1.0, 1.0, 1.0, 1.0)
    ServerOptimizer(l1=0.5, l1_keys=np.array([0, 3])).step(x2, np.zeros(4, np.float32))
    assert x2.tolist() == [0.5, 1.0, 1.0, 0.5]


def test_adaptive_prox_threshold_uses_the_steps_own_scale():
    opt = FedAdagrad(lr=1.0, tau=0.5, l1=0.1)
    x = f32(5.0, 5.0)
    d = f32(0.0, 3.0)
    opt.step(x, d)
    v = 0.25 + d.astype(np.float64) ** 2
    m = 0.1 * d.astype(np.float64)
    before = 5.0 + m / (np.sqrt(v) + 0.5)
    want = before - 0.1 / (np.sqrt(v) + 0.5)
    np.testing.assert_allclose(x, want, rtol=1e-5)
    # a different threshold per key (sgd's would be the same 0.1 for both)
    assert not np.isclose(before[0] - x[0], before[1] - x[1])


@pytest.mark.parametrize(
    "make",
    [
        lambda: ServerOptimizer(lr=0.5, l1=0.01),
        lambda: FedAvgM(lr=0.5, beta1=0.8),
        lambda: FedAdam(lr=0.1),
        lambda: FedYogi(lr=0.1),
        lambda: FedAdagrad(lr=0.1, l1=0.001),
    ],
)
def test_state_dict_round_trip_continues_the_same_trajectory(make):
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=6).astype(np.float32) for _ in range(4)]
    a = make()
    xa = np.ones(6, np.float32)
    for d in deltas[:2]:
        a.step(xa, d)
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.t == 2
    xb = xa.copy()
    for d in deltas[2:]:
        a.step(xa, d)
        b.step(xb, d)
    np.testing.assert_array_equal(xa, xb)


def test_loaded_state_is_a_copy():
    a = FedAvgM()
    a.step(np.zeros(2, np.float32), f32(1.0, 1.0))
    st = a.state_dict()
    b = FedAvgM()
    b.load_state_dict(st)
    st["momentum"][:] = 99.0
    assert b.state_dict()["momentum"].tolist() == [1.0, 1.0]


def test_state_of_another_optimizer_is_refused():
    a = FedAdam()
    a.step(np.zeros(2, np.float32), f32(1.0, 1.0))
    with pytest.raises(ValueError, match="sgd: unexpected state"):
        ServerOptimizer().load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="unexpected state"):
        FedAdam().load_state_dict({"step": np.array(1), "momentum": np.zeros(2)})


@pytest.mark.parametrize(
    "name,cls",
    [
        ("sgd", ServerOptimizer),
        ("fedavgm", FedAvgM),
        ("fedadam", FedAdam),
        ("fedyogi", FedYogi),
        ("fedadagrad", FedAdagrad),
    ],
)
def test_make_server_optimizer_picks_the_named_class(name, cls):
    opt = make_server_optimizer({"optimizer": name, "lr": 0.3, "beta1": 0.5, "l1": 0.2})
    assert type(opt) is cls
    assert opt.lr == 0.3 and opt.l1 == 0.2
    if name != "sgd":
        assert opt.beta1 == 0.5


def test_make_server_optimizer_uses_defaults_and_ignores_other_keys():
    opt = make_server_optimizer({"min_devices": 3, "deadline_s": 1.0})
    assert type(opt) is ServerOptimizer and opt.lr == 1.0 and opt.l1 == 0.0


@pytest.mark.parametrize(
    "server,match",
    [
        ({"optimizer": "adam"}, "'server.optimizer' = 'adam': must be one of sgd"),
        ({"optimizer": 3}, "'server.optimizer' = 3"),
        ({"lr": 0.0}, "server.lr"),
        ({"lr": -1.0}, "server.lr"),
        ({"l1": -0.1}, "server.l1"),
        ({"optimizer": "fedavgm", "beta1": 1.0}, r"'server.beta1' = 1.0: must be in \[0, 1\)"),
        ({"optimizer": "fedadam", "beta2": -0.1}, "server.beta2"),
        ({"optimizer": "fedyogi", "tau": 0.0}, "server.tau"),
    ],
)
def test_bad_server_settings_are_config_errors_naming_the_key(server, match):
    with pytest.raises(ConfigError, match=match):
        make_server_optimizer(server)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user optimizer module on sys.path: ``<name>:<function>`` specs."""
    src = textwrap.dedent(
        """
        import numpy as np

        def momentum(params, delta, state, step, cfg):
            b = state.get("b")
            state["b"] = delta.copy() if b is None else 0.5 * b + delta
            state["steps"] = np.array(step)
            params += cfg["lr"] * state["b"]

        def replace(params, delta, state, step, cfg):
            return params - delta

        def wrong_shape(params, delta, state, step, cfg):
            return np.zeros(params.size + 1, np.float32)

        def not_finite(params, delta, state, step, cfg):
            return np.full_like(params, np.nan)

        not_callable = 3
        """
    )
    (tmp_path / "edgefl_test_user_opt.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "edgefl_test_user_opt"


def test_a_user_function_updates_in_place_and_keeps_its_state(user_module):
    spec = f"{user_module}:momentum"
    opt = make_server_optimizer({"optimizer": spec, "lr": 2.0})
    assert isinstance(opt, UserFunction)
    x = np.zeros(2, np.float32)
    opt.step(x, f32(1.0, 0.0))
    opt.step(x, f32(0.0, 1.0))  # b = (0.5, 1)
    assert x.tolist() == [3.0, 2.0]
    st = opt.state_dict()
    assert st["user.b"].tolist() == [0.5, 1.0] and int(st["user.steps"]) == 2
    again = make_server_optimizer({"optimizer": spec, "lr": 2.0})
    again.load_state_dict(st)
    y = x.copy()
    opt.step(x, f32(1.0, 1.0))
    again.step(y, f32(1.0, 1.0))
    np.testing.assert_array_equal(x, y)


def test_a_user_function_may_return_the_new_model_and_l1_follows(user_module):
    opt = UserFunction(f"{user_module}:replace", l1=0.5)
    x = f32(2.0, 0.25)
    out = opt.step(x, f32(0.0, -1.0))
    assert out is x
    assert x.tolist() == [1.5, 0.75]  # (2, 1.25) then soft threshold 0.5


@pytest.mark.parametrize(
    "fn,match", [("wrong_shape", "returned shape"), ("not_finite", "non-finite values")]
)
def test_a_bad_user_result_is_a_config_error(user_module, fn, match):
    opt = UserFunction(f"{user_module}:{fn}")
    x = f32(1.0, 1.0)
    with pytest.raises(ConfigError, match=match):
        opt.step(x, f32(0.0, 0.0))
    assert x.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nocolon", "expected 'package.module:function'"),
        (":fn", "expected 'package.module:function'"),
        ("edgefl_no_such_module_xyz:fn", "cannot import module"),
        ("{mod}:missing", "has no function 'missing'"),
        ("{mod}:not_callable", "has no function 'not_callable'"),
    ],
)
def test_load_function_errors_name_server_optimizer(user_module, spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_function(spec.format(mod=user_module))
    assert "server.optimizer" in str(e.value)


def test_user_state_of_unknown_keys_is_refused(user_module):
    opt = UserFunction(f"{user_module}:momentum", cfg={"lr": 1.0})
    with pytest.raises(ValueError, match="unexpected state"):
        opt.load_state_dict({"step": np.array(0), "momentum": np.zeros(2)})
