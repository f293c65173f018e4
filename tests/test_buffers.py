"""Model buffers (BatchNorm running statistics): federated like the parameters
(``model.buffers = "federate"``) or kept per device (``"local"``, FedBN).

FlatParams' layout with and without buffers (no MPI), the up-front refusals, the server
optimizers on zero-delta entries, and whole jobs over the loopback transport: under BSP
FedAvg the global statistics are the sample-weighted mean of the devices' (recorded by a
test plugin reading the torch modules, not the flat vector); with ``local`` they stay at
their initial values while each device keeps its own, and a resume is bit-exact.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import run_loopback_job
from torch import nn

from edgefl.algorithms import check_config
from edgefl.algorithms.base import Plugin, WorkerPlugin
from edgefl.algorithms.fedbn import check_buffers
from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.models import FlatParams, build_model, layout_signature

IMG = SimpleNamespace(
    input_shape=(1, 6, 6), num_classes=3, task="classification", input_dtype="float32"
)
BN_ARGS = {"channels": [4, 4], "batchnorm": True}
SAMPLES = (16, 24, 40)  # per device: different, so sample weighting shows


# --------------------------------------------------------------- data and a recorder


def make_images(num_devices: int, seed: int, side: int = 6, classes: int = 3):
    """Per-device 1 x side x side images whose pixel mean and scale depend on the device
    (feature shift: the devices' BatchNorm statistics differ); labels from a fixed rule."""
    g = torch.Generator().manual_seed(seed)

    def part(n: int, shift: float, scale: float):
        x = torch.randn(n, 1, side, side, generator=g) * scale + shift
        y = (x.mean(dim=(1, 2, 3)) > shift).long() + (x[:, 0, 0, 0] > shift).long()
        return torch.utils.data.TensorDataset(x, y.clamp(max=classes - 1))

    train = [part(SAMPLES[k % 3], 0.5 * k, 1.0 + k) for k in range(num_devices)]
    return train, part(30, 0.0, 1.0)


REC: dict[str, list] = {"start": [], "end": [], "delta": []}
_LOCK = threading.Lock()


def _bufs(model: nn.Module) -> np.ndarray:
    """The float buffers as the torch modules hold them (not through FlatParams)."""
    got = [b.detach().reshape(-1) for _, b in model.named_buffers() if b.is_floating_point()]
    return torch.cat(got).numpy().copy()


class _RecorderWorker(WorkerPlugin):
    def before_train(self, d, job):
        with _LOCK:
            REC["start"].append((d, job.task, _bufs(job.model)))

    def encode(self, up, job):
        if up.flush:
            return
        flat = job.flat
        with _LOCK:
            REC["end"].append((up.device, job.task, _bufs(job.model), up.aux[0]))
            REC["delta"].append(((up.device, job.task), up.delta[flat.buffer_slice].copy()))


class Recorder(Plugin):
    """Records every device's buffers at the start and end of each task (a user plugin:
    its hooks run after the built-in ones)."""

    name = "recorder"
    worker = _RecorderWorker


def _reset() -> None:
    for v in REC.values():
        v.clear()


def _sets(*more: str) -> list[str]:
    return [
        'data.source="test_buffers:make_images"',
        'model.name="cnn"',
        "model.args={channels=[4, 4], batchnorm=true}",
        "fleet.devices=3",
        "fleet.ranks=3",
        "run.rounds=1",
        "run.checkpoint_every=0",
        "train.batch_size=8",
        'sim.clock="virtual"',
        "sim.reference_s_per_sample=0.0001",
        'fleet.device="cpu"',
        'output.progress="quiet"',
        'algorithm.plugins=["test_buffers:Recorder"]',
        *more,
    ]


def _info():
    from edgefl.data import load_federated

    return load_federated("test_buffers:make_images", {}, 3, 0).info


# ------------------------------------------------------------------ FlatParams layout


def test_layout_with_buffers_puts_float_buffers_after_the_parameters():
    model = build_model("cnn", IMG, BN_ARGS, seed=0)
    params = [n for n, _ in model.named_parameters()]
    floats = [n for n, b in model.named_buffers() if b.is_floating_point()]
    assert floats == [
        "features.1.running_mean", "features.1.running_var",
        "features.5.running_mean", "features.5.running_var",
    ]  # fmt: skip
    ints = {n: b.clone() for n, b in model.named_buffers() if not b.is_floating_point()}
    fp = FlatParams(model)
    assert fp.names == params + floats and fp.buffer_names == floats
    n_par = sum(p.numel() for p in model.parameters())
    assert fp.param_numel == n_par and fp.numel == n_par + 16
    assert fp.buffer_slice == slice(n_par, n_par + 16)
    assert fp.signature == layout_signature(fp.names, fp.shapes)
    assert fp.signature != layout_signature(params, [tuple(p.shape) for p in model.parameters()])
    bufs = dict(model.named_buffers())
    for name, off in zip(fp.names, fp.offsets, strict=True):
        t = bufs.get(name, dict(model.named_parameters()).get(name))
        assert t.data_ptr() == fp.flat.data_ptr() + 4 * off  # a view into the flat buffer
    # initial statistics: mean 0, variance 1
    assert np.array_equal(fp.buffer_values(), np.repeat([0, 1, 0, 1], 4).astype("f4"))
    # training-mode forwards update the statistics in place: the flat vector sees them
    before = fp.snapshot()
    model.train()
    model(torch.randn(8, 1, 6, 6) + 3.0)
    after = fp.to_host()
    assert np.array_equal(after[: fp.param_numel], before[: fp.param_numel])
    assert not np.array_equal(after[fp.buffer_slice], before[fp.buffer_slice])
    assert bufs["features.1.running_mean"].data_ptr() == fp.flat.data_ptr() + 4 * n_par
    assert np.array_equal(_bufs(model), after[fp.buffer_slice])
    # the integer counters stay in the model, outside the flat vector, and still count
    for name, b in model.named_buffers():
        if name in ints:
            assert int(b) == int(ints[name]) + 1


def test_from_host_and_load_buffers_set_the_statistics():
    model = build_model("cnn", IMG, BN_ARGS, seed=0).eval()
    fp = FlatParams(model)
    x = torch.randn(4, 1, 6, 6)
    y0 = model(x).detach().clone()
    vals = fp.snapshot()
    vals[fp.buffer_slice] = np.linspace(0.5, 2.0, 16, dtype=np.float32)
    fp.from_host(vals)
    assert np.array_equal(_bufs(model), vals[fp.buffer_slice])
    assert not torch.equal(model(x).detach(), y0)  # eval mode uses the running statistics
    fp.load_buffers(np.repeat([0, 1, 0, 1], 4).astype(np.float32))
    assert torch.equal(model(x).detach(), y0)
    assert np.array_equal(fp.host[: fp.param_numel], vals[: fp.param_numel])  # untouched
    with pytest.raises(ValueError, match="15 values.*16 buffer elements"):
        fp.load_buffers(np.zeros(15, np.float32))


class _Odd(nn.Module):
    def __init__(self, dtype=torch.float32, persistent=True) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(5, dtype=dtype), persistent=persistent)


def test_model_without_float_buffers_keeps_the_parameter_layout():
    for model in (build_model("cnn", IMG, {"channels": [4, 4]}, 0), _Odd(persistent=False)):
        names = [n for n, _ in model.named_parameters()]
        shapes = [tuple(p.shape) for p in model.parameters()]
        fp = FlatParams(model)
        assert fp.names == names and fp.shapes == shapes and fp.buffer_names == []
        assert fp.numel == fp.param_numel == sum(p.numel() for p in model.parameters())
        assert fp.buffer_slice == slice(fp.numel, fp.numel)
        assert fp.signature == layout_signature(names, shapes)
        assert fp.buffer_values().size == 0
    # the cnn without batchnorm: the very layout of before (recorded value)
    assert FlatParams(build_model("cnn", IMG, {}, 0)).numel == 160 + 4640 + 3 * 128 + 3


def test_float_buffers_must_be_float32():
    with pytest.raises(ConfigError, match="model buffer 'mask': has dtype torch.float64"):
        FlatParams(_Odd(torch.float64))
    assert FlatParams(_Odd()).buffer_names == ["mask"]


# --------------------------------------------------------------------- refusals


def test_settings_that_float_buffers_cannot_run_with_are_refused():
    names = ["features.1.running_mean", "features.1.running_var", "x"]
    cases = [
        (["dp.enabled=true"], "config key 'dp.enabled' = true: cannot run"),
        (["server.l1=0.01"], "config key 'server.l1' = 0.01"),
        (['algorithm.ordering="cd-grab"'], "config key 'algorithm.ordering' = 'cd-grab'"),
        (['server.optimizer="fedadam"'], "config key 'server.optimizer' = 'fedadam'"),
    ]
    for sets, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            check_buffers(load_config(overrides=sets), names)
        assert "\n" not in str(e.value) and "(3 in all)" in str(e.value)
        check_buffers(load_config(overrides=sets), [])  # no float buffers: fine
    local = load_config(overrides=['server.optimizer="fedadam"', 'model.buffers="local"'])
    check_buffers(local, names)  # zero updates: any server step leaves them alone
    with pytest.raises(ConfigError, match="model.buffers = 'local'"):
        check_buffers(load_config(overrides=["dp.enabled=true", 'model.buffers="local"']), names)


def test_check_config_builds_the_model_to_see_its_buffers():
    base = [s for s in _sets() if not s.startswith("algorithm.plugins")]
    with pytest.raises(ConfigError, match="'server.optimizer' = 'fedavgm'.*features.1"):
        check_config(load_config(overrides=[*base, 'server.optimizer="fedavgm"']))
    plain = [s.replace("batchnorm=true", "batchnorm=false") for s in base]
    check_config(load_config(overrides=[*plain, 'server.optimizer="fedavgm"']))


@pytest.mark.parametrize("name", ["sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_server_optimizers_leave_zero_delta_entries_alone(name):
    from edgefl.algorithms.server_opt.optimizers import make_server_optimizer

    cfg = load_config(overrides=[f'server.optimizer="{name}"', "server.lr=0.3"])
    opt = make_server_optimizer(cfg["server"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10).astype(np.float32)
    keep = x[6:].copy()
    for _ in range(5):
        d = rng.standard_normal(10).astype(np.float32)
        d[6:] = 0.0
        opt.step(x, d)
    assert np.array_equal(x[6:], keep)


# -------------------------------------------------------------- whole jobs (loopback)


def test_federated_statistics_are_the_sample_weighted_mean():
    _reset()
    cfg = load_config(overrides=_sets())
    coord, statuses = run_loopback_job(cfg, ranks=3)
    assert statuses == [0, 0, 0]
    ends = {d: (b, n) for d, _t, b, n in REC["end"]}
    assert sorted(ends) == [0, 1, 2] and [ends[d][1] for d in range(3)] == list(SAMPLES)
    init = REC["start"][0][2]
    assert all(np.array_equal(b, init) for _d, _t, b in REC["start"])  # all from the global
    vals = np.stack([ends[d][0] for d in range(3)]).astype(np.float64)
    w = np.array(SAMPLES, np.float64) / sum(SAMPLES)
    expected = (w[:, None] * vals).sum(axis=0)
    sl = coord.task.flat.buffer_slice
    got = coord.global_model[sl]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, vals.mean(axis=0), rtol=1e-3)  # weighted, not plain
    assert not np.allclose(got, init, atol=1e-3)  # they moved
    assert np.array_equal(_bufs(coord.task.model), got)  # rank 0 evaluates with them


def _local_run(rounds: int, *more: str):
    _reset()
    cfg = load_config(overrides=_sets('model.buffers="local"', f"run.rounds={rounds}", *more))
    coord, statuses = run_loopback_job(cfg, ranks=3)
    assert statuses == [0, 0, 0]
    return coord


def test_local_statistics_stay_on_the_devices():
    coord = _local_run(3)
    flat = coord.task.flat
    init = build_model("cnn", _info(), BN_ARGS, 0)
    init_vals = _bufs(init)
    assert np.array_equal(coord.global_model[flat.buffer_slice], init_vals)  # never moved
    assert all(not d.any() for _d, d in REC["delta"])  # zero updates there
    # the parameters did train
    assert not np.array_equal(
        coord.global_model[: flat.param_numel], FlatParams(init).host[: flat.param_numel]
    )
    ends: dict[int, list] = {}
    for d, t, b, _n in REC["end"]:
        ends.setdefault(d, []).append((t, b))
    assert sorted(ends) == [0, 1, 2] and all(len(v) == 3 for v in ends.values())
    last = [sorted(ends[d], key=lambda e: e[0])[-1][1] for d in range(3)]
    for i in range(3):
        assert not np.allclose(last[i], init_vals, atol=1e-3)
        for j in range(i):
            assert not np.allclose(last[i], last[j], atol=1e-3)  # each device its own
    # every task starts from the device's own values: its previous task's end (the first
    # from the initial ones)
    for d, t, b in REC["start"]:
        prev = [e for tt, e in ends[d] if tt < t]
        want = (
            max(((tt, e) for tt, e in ends[d] if tt < t), key=lambda x: x[0])[1]
            if prev
            else init_vals
        )
        assert np.array_equal(b, want), (d, t)


def _resumable(sets: list[str], run_dir: Path, resume: Path | None = None):
    """A loopback job writing ``run_dir`` (checkpoints), optionally resumed from ``resume``
    (as tests/test_resume_exact.py runs it)."""
    from edgefl.ckpt import load_checkpoint
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    _reset()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(overrides=sets)
    task0 = build_task(cfg)
    state = load_checkpoint(resume) if resume is not None else None

    def coordinator(cfg_, t, task, out_dir=None):
        return Coordinator(cfg_, t, task0, out_dir=run_dir, resume=state)

    coord, statuses = run_loopback_job(cfg, 3, coordinator_cls=coordinator)
    assert statuses == [0, 0, 0]
    last = {}
    for d, t, b, _n in REC["end"]:
        if t >= last.get(d, (-1, None))[0]:
            last[d] = (t, b)
    starts = {(d, t): b for d, t, b in REC["start"]}
    return hashlib.sha256(coord.global_model.tobytes()).hexdigest(), last, starts


def test_local_resume_is_bit_exact(tmp_path):
    sets = _sets('model.buffers="local"', "run.rounds=4")
    whole = _resumable(sets, tmp_path / "whole")
    _resumable([*sets, "debug.stop_after_round=2"], tmp_path / "part")
    ckpt = tmp_path / "part" / "checkpoints" / "ckpt-000002.h5"
    assert ckpt.is_file()
    resumed = _resumable(sets, tmp_path / "resumed", resume=ckpt)
    assert resumed[0] == whole[0]  # the global model
    for d in range(3):  # each device's own statistics at the end
        assert resumed[1][d][0] == whole[1][d][0]
        assert np.array_equal(resumed[1][d][1], whole[1][d][1]), d
    # the resumed tasks started from the devices' checkpointed statistics, not the initial
    assert resumed[2] and all(np.array_equal(b, whole[2][k]) for k, b in resumed[2].items())
    init = _bufs(build_model("cnn", _info(), BN_ARGS, 0))
    assert all(not np.array_equal(b, init) for b in resumed[2].values())


@pytest.mark.parametrize("vectorize", ["off", "on"])
def test_local_statistics_with_a_gate(vectorize):
    """Hermes-gated devices keep a local model between pushes: their statistics follow it
    (stored after every local iteration), and the global ones still never move; trained
    one by one or stacked (each row from the device's own local model)."""
    coord = _local_run(
        3, 'algorithm.consistency="asp"', 'algorithm.gate="hermes"',
        "hermes.max_local_iterations=2", f'train.vectorize="{vectorize}"',
        'algorithm.plugins=["test_buffers:StackedRecorder"]',
    )  # fmt: skip
    assert coord.stacked_tasks == (0 if vectorize == "off" else len(REC["start"]))
    init = _bufs(build_model("cnn", _info(), BN_ARGS, 0))
    assert np.array_equal(coord.global_model[coord.task.flat.buffer_slice], init)
    assert REC["delta"] and all(not d.any() for _d, d in REC["delta"])
    seen = {d for d, _t, _b in REC["start"]}
    assert seen == {0, 1, 2}
    for d, t, b in REC["start"]:
        firsts = min(tt for dd, tt, _ in REC["start"] if dd == d)
        assert np.array_equal(b, init) == (t == firsts), (d, t)


# ------------------------------------------------- stacked training (train.vectorize)


class _StackedRecorderWorker(_RecorderWorker):
    """The recorder, stackable (it reads only): ``end`` is ``job.model``'s statistics at
    ``encode``, the trained ones where a plugin's ``after_train`` put the device's trained
    model there (FedBN), else the start's (the stack's deltas are taken at once)."""

    stackable = True


class StackedRecorder(Plugin):
    name = "stacked_recorder"
    worker = _StackedRecorderWorker


def _recorded(mode: str, vectorize: str):
    _reset()
    sets = _sets(
        f'model.buffers="{mode}"', "run.rounds=2", "fleet.devices=12", "fleet.ranks=3",
        f'train.vectorize="{vectorize}"',
    )  # fmt: skip
    sets = [s for s in sets if not s.startswith("algorithm.plugins")]
    cfg = load_config(overrides=[*sets, 'algorithm.plugins=["test_buffers:StackedRecorder"]'])
    coord, statuses = run_loopback_job(cfg, ranks=3)
    assert statuses == [0, 0, 0]
    starts = {(d, t): b for d, t, b in REC["start"]}
    ends = {(d, t): b for d, t, b, _n in REC["end"]}
    return coord, starts, ends, dict(REC["delta"])


@pytest.mark.parametrize("mode", ["federate", "local"])
def test_stacked_statistics_follow_each_device_as_one_by_one(mode, caplog):
    """BatchNorm models train stacked (devices of one size together): each device's running
    statistics start from what it holds one by one (the global ones, or its own under FedBN)
    and end within float32 rounding of the one-by-one run's, and so does the model."""
    ref, ref_starts, ref_ends, ref_deltas = _recorded(mode, "off")
    caplog.set_level("DEBUG", logger="edgefl.worker")
    got, starts, ends, deltas = _recorded(mode, "on")
    assert ref.stacked_tasks == 0 and got.stacked_tasks == 24  # (12 devices x 2 rounds)
    sizes = [int(m.split()[3]) for m in caplog.messages if m.endswith("tasks stacked")]
    assert sum(sizes) == 24 and max(sizes) > 1  # (devices of one size: stacks of several)
    assert sorted(starts) == sorted(ref_starts) == sorted(deltas) == sorted(ref_deltas)
    close = dict(rtol=1e-4, atol=1e-5)
    for key, want in ref_starts.items():  # (round 2 starts from round 1's: rounded too)
        np.testing.assert_allclose(starts[key], want, **close, err_msg=str(key))
    a, b = got.global_model, ref.global_model
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    flat = got.task.flat
    if mode == "federate":  # the statistics travel: their updates moved them
        for key, want in ref_deltas.items():
            np.testing.assert_allclose(deltas[key], want, **close, err_msg=str(key))
            assert np.abs(want).max() > 1e-3
        assert not np.allclose(a[flat.buffer_slice], ref_starts[(0, 0)], atol=1e-4)
        return
    # FedBN: each device's own, never in the global model nor in an update
    init = _bufs(build_model("cnn", _info(), BN_ARGS, 0))
    assert np.array_equal(a[flat.buffer_slice], init)
    assert all(not d.any() for d in deltas.values())
    for key, want in ref_ends.items():
        np.testing.assert_allclose(ends[key], want, **close, err_msg=str(key))
        assert not np.allclose(ends[key], starts[key], atol=1e-4)  # (they moved)
    assert all(np.array_equal(starts[(d, 1)], ends[(d, 0)]) for d in range(12))
