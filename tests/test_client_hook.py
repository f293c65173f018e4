"""Bring your own training: the client hook (train.client), losses (train.loss), optimizers
(train.optimizer), the per-round learning rate (train.lr_schedule); FedProx and SCAFFOLD.

User code lives in tests/client_helpers.py (MPI ranks import it: PYTHONPATH=tests).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from golden.configs import SMALL, job, run_loopback

import edgefl
from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.training import FitContext, FitResult, check_result, lr_at, resolve_loss
from edgefl.training.optim import check_optimizer, optimizer_factory

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

BASE = {
    "fleet.devices": 4,
    "fleet.ranks": 3,
    "fleet.device": "cpu",
    "run.rounds": 8,
    "run.checkpoint_every": 0,
    "model.name": "logreg",
    "model.args": {},
    "sim.reference_s_per_sample": 0.0001,
    "output.progress": "quiet",
}
# a user client with MSE and Adam on a regression task (y = x.w + 0.5 + noise)
REGRESSION = {
    **BASE,
    "data.source": "client_helpers:regression",
    "train.client": "client_helpers:RegressionClient",
    "train.loss": "mse",
    "train.optimizer": "adam",
    "train.lr": 0.05,
    "train.local_epochs": 2,
}
# the test loss of predicting 0 is about 4.7 (round 1 of the run below); the bound is
# what learning the linear map gets to in 8 rounds with a margin (measured: 0.0046)
REGRESSION_BOUND = 0.05


@pytest.fixture(scope="module")
def regression_inline(tmp_path_factory) -> edgefl.Result:
    return edgefl.simulate(
        overrides=REGRESSION, out=tmp_path_factory.mktemp("reg") / "inline", backend="inline"
    )


# -- losses, optimizers, schedules (no job) ----------------------------------------------
def test_auto_loss_follows_the_task():
    assert resolve_loss("auto", "classification").name == "cross-entropy"
    assert resolve_loss("auto", "lm").name == "cross-entropy"
    assert resolve_loss("auto", "regression").name == "mse"
    assert resolve_loss("auto", "binary").name == "bce-with-logits"


def test_builtin_losses_match_torch():
    out = torch.randn(6, 1)
    y = torch.randint(0, 2, (6,)).float()
    bce = resolve_loss("bce-with-logits", "binary")
    want = torch.nn.functional.binary_cross_entropy_with_logits(out[:, 0], y)
    torch.testing.assert_close(bce(out, y), want)
    total, n = bce.total(out, y)
    torch.testing.assert_close(total / n, want)
    right, m = bce.correct(out, y)
    assert m == 6 and int(right) == int(((out[:, 0] > 0).float() == y).sum())
    mse = resolve_loss("mse", "regression")
    t = torch.randn(6, 1)
    torch.testing.assert_close(mse(out, t), ((out - t) ** 2).mean())
    assert mse.correct(out, t)[1] == 0  # regression: no accuracy


def test_bad_loss_specs_are_one_line_errors():
    with pytest.raises(ConfigError, match="train.loss.*needs class labels"):
        resolve_loss("cross-entropy", "regression")
    with pytest.raises(ConfigError, match="'train.loss': 'hinge' is not auto"):
        resolve_loss("hinge", "classification")
    with pytest.raises(ConfigError, match="'train.loss' = 'no_such_mod:f': cannot import"):
        resolve_loss("no_such_mod:f", "classification")
    with pytest.raises(ConfigError, match="module 'client_helpers' has no 'nope'"):
        resolve_loss("client_helpers:nope", "regression")


def test_optimizers():
    cfg = load_config(None, ["train.optimizer='adamw'", "train.weight_decay=0.1"])["train"]
    p = [torch.nn.Parameter(torch.ones(3))]
    opt = optimizer_factory(cfg)(p, 0.01)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["weight_decay"] == 0.1
    assert opt.defaults["betas"] == (0.9, 0.999)
    cfg = load_config(None, ["train.optimizer='client_helpers:plain_sgd'", "train.momentum=0.9"])
    opt = optimizer_factory(cfg["train"])(p, 0.1)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0
    for bad, msg in (("rmsprop", "is not sgd, adam, adamw"), ("nomod:f", "cannot import")):
        cfg = load_config(None, [f"train.optimizer='{bad}'"])
        with pytest.raises(ConfigError, match=msg):
            check_optimizer(cfg["train"])
    cfg = load_config(None, ["train.optimizer='adam'", "train.beta2=1.0"])
    with pytest.raises(ConfigError, match="'train.beta2' = 1.0: must be in"):
        check_optimizer(cfg["train"])


@pytest.mark.parametrize(
    "schedule, want",
    [
        ("constant", [0.1] * 6),
        ("step", [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]),
        ("exponential", [0.1 * 0.5**r for r in range(6)]),
        ("cosine", [0.1 * 0.5 * (1 + math.cos(math.pi * r / 6)) for r in range(6)]),
    ],
)
def test_lr_schedules(schedule, want):
    cfg = load_config(
        None, ["train.lr=0.1", f"train.lr_schedule='{schedule}'", "train.lr_step_rounds=2"]
    )
    got = [lr_at(cfg["train"], 6, r) for r in range(6)]
    assert got == pytest.approx(want)


def test_client_results_are_checked():
    assert check_result({"samples": 3, "loss": 0.5, "acc": 1}, "", 0) == FitResult(
        3, 0.5, {"acc": 1.0}
    )
    with pytest.raises(ConfigError, match="device 2: fit returned int"):
        check_result(42, "m:f", 2)
    with pytest.raises(ConfigError, match="samples = -1"):
        check_result(FitResult(-1, 0.1), "m:f", 0)
    with pytest.raises(ConfigError, match="metric.*mae.*not finite"):
        check_result(FitResult(1, 0.1, {"mae": float("nan")}), "m:f", 0)


def test_objective_adds_penalties_and_hooks_run_before_each_step():
    model = torch.nn.Linear(2, 1)
    seen = []
    ctx = FitContext(0, 0, 0, torch.Generator(), "cpu", resolve_loss("mse", "regression"),
                     torch.optim.SGD)  # fmt: skip
    ctx.penalties.append(lambda m: torch.tensor(2.0))
    ctx.grad_hooks.append(lambda m: seen.append(1))
    x, y = torch.zeros(4, 2), torch.zeros(4, 1)
    base = ctx.loss(model(x), y)
    got = ctx.objective(model, model(x), y).detach()
    assert float(got) == pytest.approx(float(base.detach()) + 2.0)
    ctx.before_step(model)
    assert seen == [1] and ctx.steps == 1


# -- whole jobs ----------------------------------------------------------------------------
def test_user_client_with_mse_and_adam_learns_a_regression(regression_inline):
    losses = [m["test_loss"] for m in regression_inline.metrics]
    assert losses[0] > 1.0 and losses[-1] < REGRESSION_BOUND, losses
    assert regression_inline.final_accuracy is None  # regression has no accuracy
    assert regression_inline.summary["final_test_loss"] == losses[-1]


def test_client_metrics_reach_the_rows(regression_inline):
    """RegressionClient returns {"mae": ...}: per device, and the sample-weighted mean."""
    for row in regression_inline.metrics:
        per = {d: v["client"]["mae"] for d, v in row["devices"].items()}
        assert len(per) == 4 and all(v > 0 for v in per.values())
        # every device reports the same samples here (64 x 2 epochs): the plain mean
        assert row["client"]["mae"] == pytest.approx(sum(per.values()) / 4)
    first, last = regression_inline.metrics[0], regression_inline.metrics[-1]
    assert last["client"]["mae"] < first["client"]["mae"]


def test_client_metrics_decoding_refuses_bad_payloads():
    from edgefl.algorithms.clientmetrics import decode_metrics as decode

    ok = np.frombuffer(b'{"samples": 3, "mae": 0.5}', np.uint8)
    assert decode(ok) == {"samples": 3.0, "mae": 0.5}
    for bad in (b"\xff", b"[1]", b'{"mae": "x"}', b'{"mae": NaN}', b'{"a": true}'):
        with pytest.raises(ValueError):
            decode(np.frombuffer(bad, np.uint8))


def _mpi_simulate(overrides: dict, out: Path) -> str:
    """``edgefl.simulate(overrides, out)`` over real mpiexec, in a fresh process whose ranks
    can import tests/client_helpers.py; returns the model's sha256."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    code = (
        "import json, sys, edgefl\n"
        "r = edgefl.simulate(overrides=json.loads(sys.argv[1]), out=sys.argv[2])\n"
        "print(r.model_sha256)\n"
    )
    for attempt in range(3):  # Open MPI sometimes fails to start at all (conftest.py)
        run_dir = out.with_name(f"{out.name}-{attempt}")
        p = subprocess.run(
            [sys.executable, "-c", code, json.dumps(overrides), str(run_dir)],
            capture_output=True, text=True, env=env, timeout=300, cwd=out.parent,
        )  # fmt: skip
        if p.returncode == 0 or "PMIx server's listener" not in p.stderr or attempt == 2:
            break
    assert p.returncode == 0, p.stderr[-2000:]
    out.symlink_to(run_dir)
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.mpi
def test_user_client_over_mpi_trains_the_inline_model(regression_inline, tmp_path, launcher):
    sha = _mpi_simulate(REGRESSION, tmp_path / "mpi")
    assert sha == regression_inline.model_sha256
    rows = [json.loads(line) for line in (tmp_path / "mpi" / "metrics.jsonl").open()]
    assert rows[-1]["test_loss"] < REGRESSION_BOUND
    assert [r["test_loss"] for r in rows] == [m["test_loss"] for m in regression_inline.metrics]


BINARY = {**BASE, "data.source": "client_helpers:binary", "train.lr": 0.5}


def test_single_logit_binary_model_without_the_two_logit_trick(tmp_path):
    r = edgefl.simulate(overrides=BINARY, out=tmp_path / "run", backend="inline")
    assert r.model().linear.weight.shape == (1, 6)  # one logit
    accs = [m["test_accuracy"] for m in r.metrics]
    assert accs[-1] > 0.9 and accs[-1] > accs[0], accs
    assert r.config["train"]["loss"] == "auto"  # bce-with-logits for a binary task


@pytest.mark.mpi
def test_single_logit_binary_model_over_mpi(tmp_path, launcher):
    inline = edgefl.simulate(overrides=BINARY, out=tmp_path / "inline", backend="inline")
    assert _mpi_simulate(BINARY, tmp_path / "mpi") == inline.model_sha256


def test_user_loss_function_is_used(tmp_path):
    # the built-in trainer with SGD (Adam would not see a loss scaled by 0.5)
    sets = {**REGRESSION, "run.rounds": 2, "train.client": "", "train.optimizer": "sgd",
            "train.lr": 0.02}  # fmt: skip
    mse = edgefl.simulate(overrides=sets, out=tmp_path / "a", backend="inline")
    half = edgefl.simulate(
        overrides={**sets, "train.loss": "client_helpers:half_mse"},
        out=tmp_path / "b", backend="inline",
    )  # fmt: skip
    assert half.model_sha256 != mse.model_sha256
    # half the gradient is the same as half the learning rate with mse
    same = edgefl.simulate(
        overrides={**sets, "train.lr": 0.01}, out=tmp_path / "c", backend="inline"
    )
    assert [m["test_loss"] for m in half.metrics] == pytest.approx(
        [0.5 * m["test_loss"] for m in same.metrics], rel=1e-5
    )


def test_bad_client_is_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="train.client.*no 'missing'"):
        edgefl.simulate(
            overrides={**BASE, "train.client": "client_helpers:missing"},
            out=tmp_path / "a", backend="inline",
        )  # fmt: skip
    with pytest.raises(edgefl.RunFailed):
        edgefl.simulate(
            overrides={**BASE, "train.client": "client_helpers:bad_client"},
            out=tmp_path / "b", backend="inline",
        )  # fmt: skip


# -- FedProx and SCAFFOLD -------------------------------------------------------------------
def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit():
    fedavg, _ = run_loopback(job(SMALL))
    prox0, _ = run_loopback(job(SMALL, "fedprox.enabled=true", "fedprox.mu=0.0"))
    prox, _ = run_loopback(job(SMALL, "fedprox.enabled=true", "fedprox.mu=0.5"))
    assert prox0["model_sha256"] == fedavg["model_sha256"]
    assert prox["model_sha256"] != fedavg["model_sha256"]


def test_proximal_hook_is_the_gradient_of_the_proximal_term():
    from edgefl.algorithms.fedprox import proximal_hook

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    anchor = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    hook = proximal_hook(params, [0, 6], anchor, mu=0.3)
    for p in params:
        p.grad = torch.zeros_like(p)
    hook(model)
    w = torch.cat([p.detach().reshape(-1) for p in params])
    w.requires_grad_(True)
    (0.15 * ((w - torch.from_numpy(anchor)) ** 2).sum()).backward()
    got = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(got, w.grad)


def test_scaffold_variates():
    from edgefl.algorithms.scaffold import client_delta, server_step

    c = np.array([1.0, -2.0], np.float32)
    delta = np.array([0.5, 0.25], np.float32)  # y - x after K = 5 steps at lr 0.1
    dc = client_delta(c, delta, steps=5, lr=0.1)
    # c_i+ = c_i - c + (x - y) / (K lr), so dc = -c - delta / (K lr)
    np.testing.assert_allclose(dc, [-1.0 - 1.0, 2.0 - 0.5], rtol=1e-6)
    assert not client_delta(c, delta, steps=0, lr=0.1).any()
    server_step(c, {3: np.ones(2, np.float32), 1: np.ones(2, np.float32)}, devices=4)
    np.testing.assert_allclose(c, [1.5, -1.5])


def test_scaffold_trains_deterministically_and_differs_from_fedavg():
    a, _ = run_loopback(job(SMALL, "scaffold.enabled=true"))
    b, _ = run_loopback(job(SMALL, "scaffold.enabled=true"))
    fedavg, _ = run_loopback(job(SMALL))
    assert a["model_sha256"] == b["model_sha256"] != fedavg["model_sha256"]
    assert a["scaffold"]["control_norm"] > 0


def test_scaffold_refuses_what_it_cannot_run_with():
    from edgefl.runtime.policies import check_policies

    for sets, key in (
        (["algorithm.consistency='asp'"], "algorithm.consistency"),
        (["algorithm.gate='hermes'"], "algorithm.gate"),
        (["algorithm.residual='gddr'"], "algorithm.residual"),
        (["fedprox.enabled=true"], "fedprox.enabled"),
    ):
        cfg = load_config(None, ["scaffold.enabled=true", *sets])
        with pytest.raises(ConfigError, match=f"'scaffold.enabled' = true: needs {key}"):
            check_policies(cfg)


def test_model_and_loss_that_do_not_fit_fail_before_launch(tmp_path):
    bad_model = {**REGRESSION, "model.name": "client_helpers:BrokenNet"}
    with pytest.raises(ConfigError, match="'model.name' = 'client_helpers:BrokenNet': forward"):
        edgefl.simulate(overrides=bad_model, out=tmp_path / "a", backend="inline")
    # a regression model's one output against cross-entropy's class labels
    bad_loss = {**BINARY, "train.loss": "mse", "data.source": "synthetic"}
    with pytest.raises(ConfigError, match="'train.loss' = 'mse' \\(mse\\): fails on"):
        edgefl.simulate(overrides=bad_loss, out=tmp_path / "b", backend="inline")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
