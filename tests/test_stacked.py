"""edgefl.training.stacked: many devices' local SGD as one stacked computation, against
the sequential trainer (fit_loop) run device by device: the same examples in the same
orders (each device's own generator), the same result within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from edgefl.training.client import FitContext
from edgefl.training.stacked import fit_stacked, full_batch_width, groups
from edgefl.training.trainer import fit_loop

K, N, D, C = 6, 23, 5, 3


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(K, N, D, generator=g)
    Y = torch.randint(0, C, (K, N), generator=g)
    return X, Y


def _model(kind: str) -> nn.Module:
    torch.manual_seed(1)
    if kind == "logreg":
        return nn.Linear(D, C)
    return nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, C))


def _gens(task: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 * d + task) for d in range(K)]


def _sequential(model, X, Y, *, lr, epochs, steps, batch_size, momentum, weight_decay,
                gens=None):  # fmt: skip
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, losses = [], []
    for d, g in enumerate(gens or _gens()):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                              weight_decay=weight_decay)  # fmt: skip
        ctx = FitContext(d, 0, 0, g, "cpu", nn.functional.cross_entropy, None)
        loss, _ = fit_loop(model, TensorDataset(X[d], Y[d]), epochs=epochs, steps=steps,
                           batch_size=batch_size, generator=g, optimizer=opt, ctx=ctx)  # fmt: skip
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(loss)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    return start, out, losses


CASES = [
    ("logreg", dict(lr=0.1, epochs=0, steps=5, batch_size=0, momentum=0.0, weight_decay=0.0)),
    ("logreg", dict(lr=0.05, epochs=2, steps=0, batch_size=4, momentum=0.9, weight_decay=0.0)),
    ("mlp", dict(lr=0.05, epochs=1, steps=0, batch_size=5, momentum=0.0, weight_decay=1e-3)),
    ("mlp", dict(lr=0.05, epochs=0, steps=7, batch_size=8, momentum=0.5, weight_decay=1e-4)),
]


@pytest.mark.parametrize("kind, opts", CASES)
def test_the_stack_trains_each_device_as_the_sequential_trainer_does(kind, opts):
    X, Y = _data()
    model = _model(kind)
    start, want, want_loss = _sequential(model, X, Y, **opts)
    got, got_loss = fit_stacked(model, start, X, Y, generators=_gens(),
                                loss=nn.functional.cross_entropy, **opts)  # fmt: skip
    worst = 0.0
    for d in range(K):
        for n in start:
            ref = want[d][n]
            diff = (got[n][d] - ref).abs().max().item()
            worst = max(worst, diff / max(ref.abs().max().item(), 1e-6))
            assert not torch.equal(ref, start[n])  # (the device trained)
    assert worst < 1e-5, f"max relative difference {worst:.2e}"
    np.testing.assert_allclose(got_loss.numpy(), np.array(want_loss), rtol=1e-5, atol=1e-6)


def test_one_call_is_deterministic_and_leaves_the_model_alone():
    X, Y = _data(3)
    model = _model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = [
        fit_stacked(
            model,
            start,
            X,
            Y,
            generators=_gens(),
            loss=nn.functional.cross_entropy,
            lr=0.05,
            epochs=2,
            batch_size=4,
            momentum=0.9,
        )[0]  # fmt: skip
        for _ in range(2)
    ]
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in start)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_shapes_and_buffers_are_refused_and_no_step_returns_the_start():
    X, Y = _data()
    model = _model("logreg")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    with pytest.raises(ValueError, match="6 generators"):
        fit_stacked(model, start, X, Y, generators=_gens()[:2], loss=ce, lr=0.1)
    bn = nn.Sequential(nn.Linear(D, C), nn.BatchNorm1d(C))
    with pytest.raises(ValueError, match="float buffers are"):  # (their stacked values)
        fit_stacked(bn, dict(bn.named_parameters()), X, Y, generators=_gens(), loss=ce, lr=0.1)
    got, losses = fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, lr=0.1,
                              epochs=0, steps=0)  # fmt: skip
    assert all(torch.equal(got[n][d], start[n]) for n in start for d in range(K))
    assert torch.equal(losses, torch.zeros(K))


def _bn_model() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, C))


def _stacked_bufs(model: nn.Module, k: int = K) -> dict[str, torch.Tensor]:
    return {n: b.detach().expand(k, *b.shape).clone()
            for n, b in model.named_buffers() if b.is_floating_point()}  # fmt: skip


@pytest.mark.parametrize(
    "opts",
    [dict(lr=0.1, epochs=2, steps=0, batch_size=6, momentum=0.9, weight_decay=1e-4),
     dict(lr=0.05, epochs=0, steps=3, batch_size=0, momentum=0.0, weight_decay=0.0)],
)  # fmt: skip
def test_batchnorm_statistics_train_per_device_as_one_by_one(opts):
    """Each device's running statistics are updated by its own batches only, and its
    parameters and statistics end within rounding of the sequential trainer's."""
    X, Y = _data(5)
    X = X * torch.arange(1, K + 1).view(K, 1, 1)  # (devices of different scales)
    model = _bn_model()
    ref = {n: b.clone() for n, b in model.named_buffers()}
    bufs = _stacked_bufs(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, got_loss = fit_stacked(model, start, X, Y, generators=_gens(), buffers=bufs,
                                loss=nn.functional.cross_entropy, **opts)  # fmt: skip
    assert all(torch.equal(b, ref[n]) for n, b in model.named_buffers())  # (left alone)
    assert model.training
    for d in range(K):
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(ref[n])
        _, want, want_loss = _sequential(model, X[d : d + 1], Y[d : d + 1],
                                         gens=[_gens()[d]], **opts)  # fmt: skip
        for n, b in model.named_buffers():
            if b.is_floating_point():
                torch.testing.assert_close(bufs[n][d], b, rtol=1e-5, atol=1e-6)
                assert not torch.equal(b, ref[n])
        for n in start:
            torch.testing.assert_close(got[n][d], want[0][n], rtol=1e-5, atol=1e-6)
        assert abs(got_loss[d].item() - want_loss[0]) < 1e-5
    means = bufs["1.running_mean"]
    assert all(not torch.allclose(means[0], means[d], atol=1e-3) for d in range(1, K))


def test_buffers_other_than_batchnorms_keep_a_model_off_the_stack():
    from edgefl.training.stacked import buffers_why_not

    assert buffers_why_not(_bn_model()) is None and buffers_why_not(_model("mlp")) is None
    cumulative = nn.Sequential(nn.Linear(D, C), nn.BatchNorm1d(C, momentum=None))
    assert "momentum=None" in buffers_why_not(cumulative)
    other = nn.Linear(D, C)
    other.register_buffer("scale", torch.ones(C))
    assert "outside BatchNorm (Linear)" in buffers_why_not(other)
    X, Y = _data()
    bn = _bn_model()
    with pytest.raises(ValueError, match="cannot take padded counts"):
        fit_stacked(bn, dict(bn.named_parameters()), X, Y, generators=_gens(),
                    loss=nn.functional.cross_entropy, lr=0.1, batch_size=4, counts=[N] * K,
                    buffers=_stacked_bufs(bn))  # fmt: skip


def test_groups_gathers_devices_of_one_size():
    assert groups([5, 3, 5, 7, 3]) == {5: [0, 2], 3: [1, 4], 7: [3]}


def test_fedprox_and_scaffold_terms_match_their_gradient_hooks():
    """The per-device terms of FedProx (mu (w - w_start)) and SCAFFOLD (c - c_i) in the
    stack equal the plugins' own gradient hooks on the sequential path."""
    from edgefl.algorithms.fedprox import proximal_hook
    from edgefl.algorithms.scaffold import correction_hook
    from edgefl.models.flat import FlatParams

    X, Y = _data(5)
    model = _model("mlp")
    flat = FlatParams(model)
    params = [p for _, p in model.named_parameters()]
    offsets = flat.offsets[: len(params)]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    anchor = flat.snapshot()
    rng = np.random.default_rng(0)
    corr = [rng.normal(0, 0.1, flat.param_numel).astype(np.float32) for _ in range(K)]
    opts = dict(lr=0.05, epochs=1, steps=0, batch_size=6, momentum=0.0, weight_decay=0.0)
    for mu, use_corr in ((0.3, False), (0.0, True)):
        want = []
        for d, g in enumerate(_gens()):
            flat.from_host(anchor)
            opt = torch.optim.SGD(model.parameters(), lr=opts["lr"])
            ctx = FitContext(d, 0, 0, g, "cpu", nn.functional.cross_entropy, None)
            if mu:
                ctx.grad_hooks.append(proximal_hook(params, offsets, anchor, mu))
            if use_corr:
                ctx.grad_hooks.append(correction_hook(params, offsets, corr[d]))
            fit_loop(model, TensorDataset(X[d], Y[d]), epochs=1, steps=0, batch_size=6,
                     generator=g, optimizer=opt, ctx=ctx)  # fmt: skip
            want.append(flat.snapshot())
        flat.from_host(anchor)
        stacked_corr = None
        if use_corr:
            stacked_corr = {}
            for (n, p), off in zip(model.named_parameters(), offsets):
                part = [torch.from_numpy(c[off : off + p.numel()]).view_as(p) for c in corr]
                stacked_corr[n] = torch.stack(part)
        got, _ = fit_stacked(model, start, X, Y, generators=_gens(),
                             loss=nn.functional.cross_entropy, prox_mu=mu,
                             corrections=stacked_corr, **opts)  # fmt: skip
        for d in range(K):
            vec = torch.cat([got[n][d].reshape(-1) for n, _ in model.named_parameters()])
            ref = torch.from_numpy(want[d][: flat.param_numel])
            assert (vec - ref).abs().max() <= 1e-5 * ref.abs().max(), (mu, use_corr, d)
            assert not torch.allclose(vec, torch.from_numpy(anchor[: flat.param_numel]))


def test_a_devices_result_does_not_depend_on_the_others_in_its_stack():
    X, Y = _data(7)
    model = _model("mlp")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    opts = dict(loss=ce, lr=0.1, epochs=1, batch_size=4, momentum=0.5)
    full, _ = fit_stacked(model, start, X, Y, generators=_gens(), **opts)
    for sub in ([3], [2, 3], [0, 1, 3, 5]):
        gens = [_gens()[i] for i in sub]
        part, _ = fit_stacked(model, start, X[sub], Y[sub], generators=gens, **opts)
        assert all(torch.equal(full[n][3], part[n][sub.index(3)]) for n in start), sub


def test_plan_steps_is_the_one_step_count_of_both_paths():
    from edgefl.training.trainer import plan_steps

    assert plan_steps(2, 0, 4, 10)[1] == 6 and plan_steps(1, 5, 0, 10)[1] == 5
    assert plan_steps(1, 0, 0, 10) == (10, 1) and plan_steps(1, 0, 4, 0) == (0, 0)


def _each_as_one_by_one(model, start, X, Y, counts, got, losses, opts) -> None:
    """Each device of a stack (its first ``counts[d]`` examples its own) within 1e-5 of the
    sequential trainer run on its examples alone: parameters and mean loss."""
    for d, n in enumerate(counts):
        _, want, want_loss = _sequential(model, X[d : d + 1, :n], Y[d : d + 1, :n],
                                         gens=[_gens()[d]], **opts)  # fmt: skip
        for name in start:
            scale = want[0][name].abs().max()
            assert (got[name][d] - want[0][name]).abs().max() <= 1e-5 * scale, (d, name)
        assert abs(float(losses[d]) - want_loss[0]) <= 1e-5 * abs(want_loss[0])


RAGGED = [
    ("logreg", dict(lr=0.1, epochs=2, steps=0, batch_size=4, momentum=0.0, weight_decay=0.0)),
    ("mlp", dict(lr=0.05, epochs=1, steps=0, batch_size=5, momentum=0.9, weight_decay=1e-3)),
    ("mlp", dict(lr=0.05, epochs=0, steps=7, batch_size=6, momentum=0.5, weight_decay=0.0)),
]
COUNTS = [23, 9, 17, 12, 23, 7]  # (each device's own examples: the first COUNTS[d] of X[d])


@pytest.mark.parametrize("kind, opts", RAGGED)
def test_devices_of_different_sizes_train_in_one_stack_as_one_by_one(kind, opts):
    """Padded to the largest with masks: each device as the sequential trainer trains it on
    its own examples (its own batches, its short last batch, its own number of steps)."""
    X, Y = _data(3)
    model = _model(kind)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, losses = fit_stacked(model, start, X, Y, generators=_gens(),
                              loss=nn.functional.cross_entropy, counts=COUNTS, **opts)  # fmt: skip
    _each_as_one_by_one(model, start, X, Y, COUNTS, got, losses, opts)


def test_a_padded_devices_result_does_not_depend_on_its_stack_or_its_padding():
    """The same device alone, with others, and padded wider: bit for bit the same."""
    X, Y = _data(5)
    model = _model("mlp")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opts = dict(loss=nn.functional.cross_entropy, lr=0.1, epochs=2, batch_size=4, momentum=0.5)
    full, _ = fit_stacked(model, start, X, Y, generators=_gens(), counts=COUNTS, **opts)
    for sub in ([1], [1, 5], [0, 1, 3]):
        gens = [_gens()[i] for i in sub]
        width = max(COUNTS[i] for i in sub)  # (the padding: only as wide as this stack needs)
        part, _ = fit_stacked(model, start, X[sub, :width], Y[sub, :width], generators=gens,
                              counts=[COUNTS[i] for i in sub], **opts)  # fmt: skip
        assert all(torch.equal(full[n][1], part[n][sub.index(1)]) for n in start), sub


@pytest.mark.parametrize("kind", ["logreg", "mlp", "opaque"])
def test_a_stack_longest_first_trains_only_its_devices_still_going_bit_for_bit(kind):
    """Devices stacked by their steps, most first (the worker's order), are a prefix of
    the stack at every step: only they compute (views of the stack's first rows, updated
    in place). Each device's result, with momentum, weight decay, FedProx's and
    SCAFFOLD's terms, is bit for bit the one of the stack in any other order, where every
    device computes and the devices done are masked."""
    from edgefl.runtime.stacking import longest_first

    X, Y = _data(7)
    model = _model("logreg" if kind == "logreg" else "mlp")
    if kind == "opaque":  # (a forward the written-out step does not know: autograd's path)
        model = nn.Sequential(nn.Sequential(*model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    corr = {n: 0.01 * torch.randn(K, *p.shape, generator=torch.Generator().manual_seed(2))
            for n, p in start.items()}  # fmt: skip
    opts = dict(loss=nn.functional.cross_entropy, lr=0.1, epochs=2, batch_size=4, momentum=0.5,
                weight_decay=1e-3, prox_mu=0.1)  # fmt: skip
    order = longest_first(COUNTS, 2, 0, 4)
    assert order != sorted(order)  # (the test's counts are not in that order already)
    ref, ref_loss = fit_stacked(model, start, X, Y, generators=_gens(), counts=COUNTS,
                                corrections=corr, **opts)  # fmt: skip
    got, loss = fit_stacked(
        model, start, X[order], Y[order], generators=[_gens()[i] for i in order],
        counts=[COUNTS[i] for i in order], corrections={n: c[order] for n, c in corr.items()},
        **opts,
    )  # fmt: skip
    for j, i in enumerate(order):
        assert all(torch.equal(got[n][j], ref[n][i]) for n in start), (i, j)
        assert torch.equal(loss[j], ref_loss[i])


@pytest.mark.parametrize("kind", ["logreg", "mlp", "opaque"])
def test_packed_examples_train_each_device_as_the_padded_stack_bit_for_bit(kind):
    """Mini-batches of devices of different sizes from their examples back to back
    (``offsets``, what a worker passes: nothing padded) give each device the padded
    stack's parameters and loss, bit for bit; packed input that does not fit is refused."""
    from edgefl.runtime.stacking import packed

    X, Y = _data(9)
    model = _model("logreg" if kind == "logreg" else "mlp")
    if kind == "opaque":  # (a forward the written-out step does not know: autograd's path)
        model = nn.Sequential(nn.Sequential(*model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opts = dict(loss=nn.functional.cross_entropy, lr=0.1, epochs=2, batch_size=4, momentum=0.5,
                weight_decay=1e-3, counts=COUNTS)  # fmt: skip
    ref, ref_loss = fit_stacked(model, start, X, Y, generators=_gens(), **opts)
    Xp, Yp, offsets = packed([(X[d, :c], Y[d, :c]) for d, c in enumerate(COUNTS)], "cpu")
    assert Xp.shape[0] == sum(COUNTS) and offsets[:2] == [0, COUNTS[0]]
    got, loss = fit_stacked(model, start, Xp, Yp, generators=_gens(), offsets=offsets, **opts)
    assert all(torch.equal(got[n], ref[n]) for n in start)
    assert torch.equal(loss, ref_loss)
    with pytest.raises(ValueError, match="reach row"):
        fit_stacked(model, start, Xp[:-1], Yp[:-1], generators=_gens(), offsets=offsets, **opts)
    with pytest.raises(ValueError, match="mini-batches only"):
        fit_stacked(model, start, Xp, Yp, generators=_gens(), offsets=offsets,
                    **{**opts, "batch_size": 0})  # fmt: skip


def test_counts_need_mini_batches_and_the_cross_entropy():
    X, Y = _data(0)
    model = _model("logreg")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    with pytest.raises(ValueError, match="full_batch_width"):  # (23 wide: 24 needed)
        fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, lr=0.1, epochs=1,
                    counts=COUNTS)  # fmt: skip
    with pytest.raises(ValueError, match="batch_size"):  # batches of 10: mini and full
        fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, lr=0.1, epochs=1,
                    batch_size=10, counts=COUNTS)  # fmt: skip
    with pytest.raises(ValueError, match="cross-entropy"):
        fit_stacked(model, start, X, Y.float(), generators=_gens(), lr=0.1, epochs=1,
                    batch_size=4, counts=COUNTS, loss=nn.functional.mse_loss)  # fmt: skip


@pytest.mark.parametrize("kind, opts", [
    ("logreg", dict(lr=0.1, epochs=0, steps=5, batch_size=0, momentum=0.0, weight_decay=0.0)),
    ("mlp", dict(lr=0.05, epochs=3, steps=0, batch_size=0, momentum=0.9, weight_decay=1e-3)),
])  # fmt: skip
def test_full_batch_devices_of_different_sizes_stack_padded_to_their_width(kind, opts):
    """Full batches of 7 to 23 examples: padded to 24 (full_batch_width of 17 to 24) with
    masks, each device as the sequential trainer trains it on its own examples, and bit for
    bit as alone in a stack of its width."""
    X, Y = _data(4)
    counts = [23, 17, 21, 24, 18, 20]
    width = full_batch_width(max(counts))
    assert {full_batch_width(c) for c in counts} == {width} == {24}
    X = torch.cat([X, torch.randn(K, width - N, D)], 1)
    Y = torch.cat([Y, torch.zeros(K, width - N, dtype=Y.dtype)], 1)
    model = _model(kind)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ce = nn.functional.cross_entropy
    got, losses = fit_stacked(model, start, X, Y, generators=_gens(), loss=ce, counts=counts,
                              **opts)  # fmt: skip
    _each_as_one_by_one(model, start, X, Y, counts, got, losses, opts)
    for d, n in enumerate(counts):
        alone, _ = fit_stacked(model, start, X[d : d + 1], Y[d : d + 1], generators=[_gens()[d]],
                               loss=ce, counts=[n], **opts)  # fmt: skip
        assert all(torch.equal(alone[name][0], got[name][d]) for name in start), d


def test_an_lstm_trains_stacked_unrolled_as_the_sequential_trainer_does():
    """vmap has no batching rule for the fused LSTM kernel: the stack runs a plain
    ``nn.LSTM`` step by step (models.per_example.functional_twin); each device ends within
    rounding of the sequential trainer's model and loss, and the model is left alone."""
    from types import SimpleNamespace

    from edgefl.models import build_model
    from edgefl.training.losses import CrossEntropy

    info = SimpleNamespace(input_shape=(6,), num_classes=12, task="lm", input_dtype="int64")
    model = build_model("lstm", info, {"embed": 4, "hidden": 8}, 3)
    assert type(model.lstm) is nn.LSTM
    g = torch.Generator().manual_seed(4)
    X = torch.randint(0, 12, (K, 10, 6), generator=g)
    Y = torch.randint(0, 12, (K, 10, 6), generator=g)
    lm = CrossEntropy("lm")
    opts = dict(lr=0.5, epochs=1, steps=0, batch_size=4, momentum=0.5, weight_decay=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, got_loss = fit_stacked(model, start, X, Y, generators=_gens(), loss=lm, **opts)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert type(model.lstm).forward is nn.LSTM.forward and "forward" not in vars(model.lstm)
    for d in range(K):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
        g = _gens()[d]
        ctx = FitContext(d, 0, 0, g, "cpu", lm, None)
        loss, _ = fit_loop(model, TensorDataset(X[d], Y[d]), epochs=1, steps=0, batch_size=4,
                           generator=g, optimizer=opt, ctx=ctx)  # fmt: skip
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n][d], p.detach(), rtol=1e-5, atol=1e-6)
            assert not torch.equal(p, start[n])
        assert abs(got_loss[d].item() - loss) < 1e-5


class _Unbatchable(nn.Module):
    """A forward that reads a value out of its input (``.item()``): vmap cannot batch it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1.0 if x.sum().item() > 0 else 1.0)


def test_probe_says_why_a_model_cannot_train_stacked():
    from edgefl.training.stacked import probe

    X, Y = _data()
    ce = nn.functional.cross_entropy
    assert probe(_model("mlp"), X[0], Y[0], ce) is None
    bn = nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.Linear(8, C))
    assert probe(bn, X[0], Y[0], ce) is None
    why = probe(_Unbatchable(), X[0], Y[0], ce)
    assert why.startswith("the model cannot train stacked under torch.func.vmap (")
    assert "\n" not in why


def test_held_out_losses_are_each_devices_evaluate_whatever_its_stack():
    """A gate's held-out losses, measured for a stack at once: each device's within 1e-6 of
    ``evaluate`` on its own model, bit for bit the same alone or with devices of other
    sizes, nan for a device without held-out examples."""
    from edgefl.models.train import evaluate
    from edgefl.training.stacked import held_out_losses

    X, Y = _data(9)
    model = _bn_model()
    sizes = [5, 13, 0, 9, 23, 1]
    data = [(X[d, :n], Y[d, :n]) for d, n in enumerate(sizes)]
    g = torch.Generator().manual_seed(3)
    params = {n: p.detach() + 0.1 * torch.randn(K, *p.shape, generator=g)
              for n, p in model.named_parameters()}  # fmt: skip
    bufs = {n: b.detach() + 0.1 * torch.rand(K, *b.shape, generator=g)
            for n, b in model.named_buffers() if b.is_floating_point()}  # fmt: skip
    got = held_out_losses(model, params, data, buffers=bufs)
    assert torch.isnan(got[2]) and not torch.isnan(got[[0, 1, 3, 4, 5]]).any()
    for d, (x, y) in enumerate(data):
        if not len(y):
            continue
        one = {n: v[d : d + 1] for n, v in params.items()}
        alone = held_out_losses(model, one, [(x, y)], {n: v[d : d + 1] for n, v in bufs.items()})
        assert torch.equal(alone[0], got[d])  # (its stack does not matter)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n][d])
            for n, b in model.named_buffers():
                if b.is_floating_point():
                    b.copy_(bufs[n][d])
        want = evaluate(model, TensorDataset(x, y), "classification")[0]
        assert abs(got[d].item() - want) < 1e-6 * max(1.0, abs(want))
