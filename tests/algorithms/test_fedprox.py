"""edgefl.algorithms.fedprox (one module: its config section, the proximal hook, the worker
half, the plugin class), each without MPI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import edgefl.algorithms.fedprox
from edgefl.algorithms import (
    BUILTIN,
    builtin_classes,
    check_config,
    coordinator_plugins,
    load,
    worker_plugins,
)
from edgefl.algorithms.base import LocalJob, Plugin, TaskSpec
from edgefl.algorithms.fedprox import SECTIONS, FedProx, FedProxWorker
from edgefl.config.fields import Field
from edgefl.errors import ConfigError
from edgefl.models.flat import FlatParams
from edgefl.training.client import FitContext

from .fakes import FakeCoordinatorContext, FakeWorkerContext, config


def test_one_module_documents_its_rule_and_holds_the_whole_algorithm():
    mod = edgefl.algorithms.fedprox
    assert "mu * (w - w_global)" in mod.__doc__ and "FitContext.grad_hooks" in mod.__doc__
    assert not hasattr(mod, "__path__")  # a module, not a package
    assert FedProx.sections is SECTIONS and FedProx.worker is FedProxWorker


def test_the_module_provides_a_built_in_plugin_and_imports_without_torch():
    assert "fedprox:FedProx" in BUILTIN
    cls = next(c for c in builtin_classes() if c.name == "fedprox")
    assert cls.__module__ == "edgefl.algorithms.fedprox"
    code = (
        "import sys; import edgefl.algorithms.fedprox as m; "
        "assert 'fedprox' in m.SECTIONS; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_section_is_fedprox_made_of_fields():
    assert set(SECTIONS) == {"fedprox"} and set(SECTIONS["fedprox"]) == {"enabled", "mu"}
    assert all(isinstance(f, Field) for f in SECTIONS["fedprox"].values())


def test_off_by_default_with_a_small_mu():
    cfg = config()
    assert cfg["fedprox"] == {"enabled": False, "mu": 0.01}
    f = SECTIONS["fedprox"]
    assert f["enabled"].type == "bool" and f["mu"].type == "float"
    assert f["mu"].min == 0.0 and not f["mu"].exclusive_min  # mu = 0 is FedAvg, allowed


@pytest.mark.parametrize(
    "setting, key",
    [
        ("fedprox.mu=-0.1", "fedprox.mu"),
        ('fedprox.mu="big"', "fedprox.mu"),
        ("fedprox.enabled=1", "fedprox.enabled"),
        ("fedprox.lam=1", "fedprox.lam"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(None, setting)


def test_good_values_are_taken():
    cfg = config(None, "fedprox.enabled=true", "fedprox.mu=0")
    assert cfg["fedprox"] == {"enabled": True, "mu": 0.0}
    assert config(None, "fedprox.mu=1")["fedprox"]["mu"] == 1.0


def test_the_plugin_has_a_worker_half_only():
    assert issubclass(FedProx, Plugin) and FedProx.name == "fedprox"
    assert FedProx.worker is FedProxWorker and FedProx.coordinator is None
    assert FedProx.requires == ()


def test_it_follows_fedprox_enabled():
    assert not FedProx.enabled(config()) and FedProx not in load(config())
    cfg = config(None, "fedprox.enabled=true")
    assert FedProx.enabled(cfg) and FedProx in load(cfg)
    check_config(cfg)


def test_the_runtime_builds_its_worker_half_and_no_coordinator_half():
    cfg = config(None, "fedprox.enabled=true")
    halves = [p for p in worker_plugins(FakeWorkerContext(cfg, {0: [1]})) if p.name == "fedprox"]
    assert len(halves) == 1 and isinstance(halves[0], FedProxWorker)
    ctx = FakeCoordinatorContext(cfg, {0: 1})
    assert all(p.name != "fedprox" for p in coordinator_plugins(ctx))


def _model() -> tuple[nn.Module, FlatParams]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, FlatParams(model)


def _worker(mu: float = 0.5) -> FedProxWorker:
    ctx = FakeWorkerContext(config(None, "fedprox.enabled=true", f"fedprox.mu={mu}"), {0: [1]})
    return FedProxWorker(ctx, "fedprox")


def _fit_ctx() -> FitContext:
    return FitContext(0, 0, 0, torch.Generator(), "cpu", nn.functional.mse_loss,
                      torch.optim.SGD)  # fmt: skip


def _job(model, flat, start=None, fit_ctx="new") -> LocalJob:
    job = LocalJob(0, 0, 0, TaskSpec(), model=model, start=start, flat=flat)
    job.fit_ctx = _fit_ctx() if fit_ctx == "new" else fit_ctx
    return job


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    x = torch.arange(15, dtype=torch.float32).reshape(5, 3) / 10
    nn.functional.mse_loss(model(x), torch.ones(5, 2)).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_without_a_fit_context_nothing_is_added():
    job = _job(None, None, fit_ctx=None)
    _worker().before_train(0, job)  # (a plugin's own train: no client hook to extend)
    assert job.fit_ctx is None


def test_the_hook_adds_mu_times_the_distance_to_the_start_model():
    model, flat = _model()
    start = flat.snapshot() - 0.3  # the task's start model differs from the current one
    job = _job(model, flat, start=start)
    _worker(mu=0.5).before_train(0, job)
    assert len(job.fit_ctx.grad_hooks) == 1
    assert job.fit_ctx.penalties == []  # the reported loss stays the task loss
    plain = _grads(model)
    job.fit_ctx.before_step(model)  # what the trainer runs between backward and step
    for g0, p in zip(plain, model.parameters(), strict=True):
        np.testing.assert_allclose(p.grad.numpy(), (g0 + 0.5 * 0.3).numpy(), rtol=1e-6)
    assert job.fit_ctx.steps == 1


def test_the_anchor_is_the_model_at_the_start_of_the_task_when_none_is_given():
    model, flat = _model()
    at_start = flat.snapshot()
    job = _job(model, flat, start=None)
    _worker(mu=2.0).before_train(0, job)
    with torch.no_grad():  # a local step moves the model (in place, as an optimizer does)
        flat.flat.add_(0.1)
    plain = _grads(model)
    job.fit_ctx.before_step(model)
    moved = flat.snapshot() - at_start
    assert np.allclose(moved, 0.1)
    for g0, p in zip(plain, model.parameters(), strict=True):
        np.testing.assert_allclose(p.grad.numpy(), (g0 + 2.0 * 0.1).numpy(), rtol=1e-5)


def test_mu_0_leaves_the_gradients_alone():
    model, flat = _model()
    job = _job(model, flat, start=flat.snapshot() + 5.0)
    _worker(mu=0.0).before_train(0, job)
    plain = _grads(model)
    job.fit_ctx.before_step(model)
    for g0, p in zip(plain, model.parameters(), strict=True):
        assert torch.equal(p.grad, g0)


def test_a_parameter_without_a_gradient_is_skipped():
    model, flat = _model()
    job = _job(model, flat, start=flat.snapshot() - 1.0)
    _worker().before_train(0, job)
    model.zero_grad(set_to_none=True)
    job.fit_ctx.before_step(model)  # no backward yet: no gradient to correct
    assert all(p.grad is None for p in model.parameters())


def test_every_task_gets_its_own_hook_from_its_own_start():
    model, flat = _model()
    w = _worker(mu=1.0)
    a = _job(model, flat, start=flat.snapshot() - 1.0)
    b = _job(model, flat, start=flat.snapshot())
    w.before_train(0, a)
    w.before_train(0, b)
    assert len(a.fit_ctx.grad_hooks) == len(b.fit_ctx.grad_hooks) == 1
    plain = _grads(model)
    b.fit_ctx.before_step(model)  # anchored at the current model: no change
    for g0, p in zip(plain, model.parameters(), strict=True):
        assert p.grad.numpy() == pytest.approx(g0.numpy(), abs=1e-7)


def test_a_model_with_float_buffers_gets_the_term_on_its_parameters_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    flat = FlatParams(model)
    assert flat.buffer_names  # (running statistics follow the parameters in the layout)
    start = flat.snapshot() - 0.3
    job = _job(model, flat, start=start)
    _worker(mu=0.5).before_train(0, job)
    plain = _grads(model)
    job.fit_ctx.grad_hooks[0](model)
    got = [p.grad for p in model.parameters()]
    for g, p0, off, p in zip(got, plain, flat.offsets, model.parameters()):
        anchor = torch.from_numpy(start[off : off + p.numel()]).view_as(p)
        assert torch.allclose(g, p0 + 0.5 * (p.detach() - anchor), atol=1e-6)
