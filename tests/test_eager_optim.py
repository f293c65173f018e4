"""edgefl.training.eager: optimizer steps that do not load torch._dynamo compute exactly what
``optimizer.step()`` computes, and fall back to it wherever a difference could show."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from edgefl.training.eager import optimizer_step, zero_grad

CASES = [
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    (torch.optim.SGD, {"momentum": 0.5, "dampening": 0.3, "maximize": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"weight_decay": 0.1}),
]


def _train(make, use_eager: bool, steps: int = 6) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = make(net.parameters())
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        zero_grad(opt) if use_eager else opt.zero_grad(set_to_none=True)
        x = torch.randn(16, 7, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer_step(opt) if use_eager else opt.step()
    return [p.detach().clone() for p in net.parameters()], opt.state_dict()


@pytest.mark.parametrize("cls,kw", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_same_parameters_and_state_bit_for_bit(cls, kw):
    def make(params):
        return cls(params, lr=0.05, **kw)

    ref, ref_state = _train(make, use_eager=False)
    got, got_state = _train(make, use_eager=True)
    stateless = cls is torch.optim.SGD and not kw.get("momentum")
    assert stateless or ref_state["state"], "the optimizer kept no state: nothing compared"
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert ref_state["param_groups"] == got_state["param_groups"]
    for key, st in ref_state["state"].items():
        for name, value in st.items():
            other = got_state["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_hooks_subclasses_and_schedulers_take_the_real_step():
    net = torch.nn.Linear(3, 1)
    calls = []
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    handle = opt.register_step_pre_hook(lambda o, a, k: calls.append("hook"))
    net(torch.ones(2, 3)).sum().backward()
    optimizer_step(opt)
    assert calls == ["hook"]
    handle.remove()

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            calls.append("subclass")
            return super().step(closure)

    sub = Counting(net.parameters(), lr=0.1)
    optimizer_step(sub)
    assert calls == ["hook", "subclass"]

    sched_opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
    optimizer_step(sched_opt)  # the scheduler counts the optimizer's steps: no warning after
    with_warning = []
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
        with_warning = [w for w in caught if "before `optimizer.step()`" in str(w.message)]
    assert with_warning == []
    assert sched_opt.param_groups[0]["lr"] == pytest.approx(0.05)


def _python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_process_that_never_compiles_does_not_load_dynamo():
    out = _python(
        """
        import sys, torch
        from edgefl.training.eager import defer_dynamo, optimizer_step, zero_grad
        assert defer_dynamo() == 4 and defer_dynamo() == 0
        net = torch.nn.Linear(4, 2)
        for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
            opt = cls(net.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                net(torch.ones(5, 4)).sum().backward()
                optimizer_step(opt)
                zero_grad(opt)
                assert all(p.grad is None for p in net.parameters())
            opt.load_state_dict(opt.state_dict())
        print("torch._dynamo" in sys.modules)
        """
    )
    assert out == "False"


def test_once_dynamo_is_loaded_torch_wrappers_are_used_again():
    out = _python(
        """
        import torch
        from edgefl.training.eager import defer_dynamo
        defer_dynamo()
        raw = torch.optim.Optimizer.zero_grad.__wrapped__
        deferred = getattr(raw, "__dynamo_disable")
        import torch._dynamo
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        opt.zero_grad()
        print(getattr(raw, "__dynamo_disable") is not deferred)
        """
    )
    assert out == "True"
