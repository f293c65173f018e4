"""``train.vectorize = "auto"``: a worker trains its queued tasks of one model version as
one stacked computation (edgefl/runtime/stacking.py), within float32 rounding of the
one-by-one path; where it cannot, every task trains alone and the rank says why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import edgefl
from edgefl.config.load import parse_override
from edgefl.runtime import stacking

IID = ['data.source="partition"', 'data.args={scheme="iid"}', 'output.progress="quiet"',
       "run.rounds=5", "run.checkpoint_every=0"]  # fmt: skip


def _run(out, *sets):
    over = dict(parse_override(s) for s in [*IID, *sets])
    return edgefl.simulate(overrides=over, out=out, backend="inline")


def _params(result) -> np.ndarray:
    sd = torch.load(result.run_dir / "final_model.pt", map_location="cpu", weights_only=True)
    return torch.cat([v.reshape(-1).float() for v in sd.values()]).numpy()


def test_auto_trains_within_rounding_of_one_by_one_and_is_deterministic(tmp_path):
    off = _run(tmp_path / "off")
    auto = _run(tmp_path / "auto", 'train.vectorize="auto"')
    again = _run(tmp_path / "again", 'train.vectorize="auto"')
    assert auto.model_sha256 == again.model_sha256  # deterministic on one machine
    assert auto.model_sha256 != off.model_sha256  # (the stacked path ran: not bit for bit)
    a, b = _params(auto), _params(off)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    assert abs(auto.final_accuracy - off.final_accuracy) <= 0.005
    # every task ran stacked (8 devices x 5 rounds), and summary.json says so
    assert auto.summary["stacked_tasks"] == 40 and off.summary["stacked_tasks"] == 0
    # a budget that fits one device per stack: the same model (K-independent results)
    tiny = _run(tmp_path / "tiny", 'train.vectorize="on"', "train.vectorize_mb=0.001")
    assert tiny.model_sha256 == auto.model_sha256 and tiny.summary["stacked_tasks"] == 40
    # another rank count (other devices share each worker's stacks): the same model
    two = _run(tmp_path / "two", 'train.vectorize="auto"', "fleet.ranks=2")
    assert two.model_sha256 == auto.model_sha256


def test_a_loss_weighted_model_does_not_depend_on_the_stacks(tmp_path):
    """Loss-weighted aggregation reads each device's training loss: a stacked device's
    mean loss, like its parameters, is the same in any stack (one device per stack, the
    default budget, another rank count), so the model is too."""
    agg = ('algorithm.aggregation="loss-weighted"', "fleet.devices=40")
    auto = _run(tmp_path / "auto", 'train.vectorize="auto"', *agg)
    tiny = _run(tmp_path / "tiny", 'train.vectorize="on"', "train.vectorize_mb=0.001", *agg)
    two = _run(tmp_path / "two", 'train.vectorize="auto"', "fleet.ranks=2", *agg)
    assert auto.summary["stacked_tasks"] == tiny.summary["stacked_tasks"] == 200
    assert tiny.model_sha256 == auto.model_sha256 == two.model_sha256


@pytest.mark.parametrize(
    "sets",
    [("fedprox.enabled=true", "fedprox.mu=0.5"), ("scaffold.enabled=true",)],
    ids=["fedprox", "scaffold"],
)
def test_fedprox_and_scaffold_terms_train_stacked_within_rounding(tmp_path, sets):
    """Their gradient terms are per-device terms of the stacked step (gradterms.py)."""
    common = ("run.rounds=3", "train.local_steps=4", *sets)
    off = _run(tmp_path / "off", *common)
    on = _run(tmp_path / "on", 'train.vectorize="on"', *common)
    assert on.summary["stacked_tasks"] == 24
    a, b = _params(on), _params(off)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_on_refuses_a_job_that_cannot_stack_before_it_starts(tmp_path):
    from edgefl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.vectorize' = 'on'.*OrderingWorker"):
        _run(tmp_path / "r", 'train.vectorize="on"', 'algorithm.ordering="rr"')


def test_a_stackable_plugin_with_an_opaque_hook_is_named():
    from edgefl.training.gradterms import ConstantTerm

    ok = SimpleNamespace(device=3, fit_ctx=SimpleNamespace(penalties=[], grad_hooks=[]))
    p = torch.zeros(2, 2, requires_grad=True)
    ok.fit_ctx.grad_hooks.append(ConstantTerm([p], [0], np.arange(4, dtype=np.float32)))
    mu, corr = stacking.gradient_terms([ok], np.zeros(4, np.float32), ["w"], [(2, 2)], [0])
    assert mu == 0.0 and corr["w"].shape == (1, 2, 2) and float(corr["w"][0, 1, 1]) == 3.0
    bad = SimpleNamespace(device=7, fit_ctx=SimpleNamespace(penalties=[], grad_hooks=[print]))
    with pytest.raises(RuntimeError, match="device 7.*gradient hook"):
        stacking.gradient_terms([ok, bad], np.zeros(4, np.float32), ["w"], [(2, 2)], [0])


class Unbatchable(torch.nn.Module):
    """A custom model whose forward vmap cannot batch (it reads ``.item()``)."""

    def __init__(self, info) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(int(np.prod(info.input_shape)), info.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.flatten(1)) * (1.0 if x.sum().item() > -1e30 else 2.0)


def test_a_model_vmap_cannot_batch_trains_alone_or_is_refused(tmp_path, caplog):
    """``auto``: the workers try the model once, say why in one line and train every task
    alone (the one-by-one model, bit for bit); ``on``: refused before the run starts."""
    from edgefl.errors import ConfigError

    custom = ('model.name="test_vectorize:Unbatchable"',)
    off = _run(tmp_path / "off", *custom)
    auto = _run(tmp_path / "auto", 'train.vectorize="auto"', *custom)
    assert auto.model_sha256 == off.model_sha256 and auto.summary["stacked_tasks"] == 0
    said = [m for m in caplog.messages if "cannot train stacked under torch.func.vmap" in m]
    assert len(said) == 1 and said[0].startswith("train.vectorize = 'auto': every task trains")
    with pytest.raises(ConfigError, match=r"'on'.*cannot train stacked under torch.func.vmap"):
        _run(tmp_path / "on", 'train.vectorize="on"', *custom)


def test_an_lstm_trains_alone_under_auto_and_stacked_under_on(tmp_path, caplog):
    """Stacked, a plain nn.LSTM runs unrolled (slower than its fused kernel): ``auto``
    keeps it one by one and says so; ``on`` stacks it, within rounding of one by one."""
    lm = ('data.source="text"', 'model.name="lstm"', "model.args={embed=4, hidden=8}",
          "data.args={seq_len=6}", "run.rounds=2")  # fmt: skip
    off = _run(tmp_path / "off", *lm)
    auto = _run(tmp_path / "auto", 'train.vectorize="auto"', *lm)
    assert auto.model_sha256 == off.model_sha256 and auto.summary["stacked_tasks"] == 0
    assert any("has an nn.LSTM" in m for m in caplog.messages)
    on = _run(tmp_path / "on", 'train.vectorize="on"', *lm)
    assert on.summary["stacked_tasks"] == 16 and on.model_sha256 != off.model_sha256
    a, b = _params(on), _params(off)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_a_proximal_term_anchored_away_from_a_devices_start_becomes_a_constant():
    """A gated device starts from its own local model while FedProx anchors it at the
    global one: mu * (w - anchor) = mu * (w - start) + mu * (start - anchor)."""
    from edgefl.training.gradterms import ProximalTerm

    p = torch.zeros(4, requires_grad=True)
    starts = np.array([[1, 2, 3, 4], [0, 0, 0, 0]], np.float32)  # (one row per device)
    anchor = np.array([1, 1, 1, 1], np.float32)
    jobs = [SimpleNamespace(device=d, fit_ctx=SimpleNamespace(
                penalties=[], grad_hooks=[ProximalTerm([p], [0], anchor, 0.5)]))
            for d in range(2)]  # fmt: skip
    mu, corr = stacking.gradient_terms(jobs, starts, ["w"], [(4,)], [0])
    assert mu == 0.5
    np.testing.assert_array_equal(corr["w"].numpy(), 0.5 * (starts - anchor))
    mu, corr = stacking.gradient_terms(jobs, anchor, ["w"], [(4,)], [0])  # (anchored there)
    assert mu == 0.5 and corr is None


def test_a_rank_that_cannot_stack_trains_the_reference_model(tmp_path):
    """With Adam the rank says why once and trains every task alone: the one-by-one
    model, bit for bit."""
    sets = ['output.progress="quiet"', "run.rounds=3", "run.checkpoint_every=0",
            'train.optimizer="adam"']  # fmt: skip
    over = dict(parse_override(s) for s in sets)
    off = edgefl.simulate(overrides=over, out=tmp_path / "off", backend="inline")
    over["train.vectorize"] = "auto"
    auto = edgefl.simulate(overrides=over, out=tmp_path / "auto", backend="inline")
    assert auto.model_sha256 == off.model_sha256


@pytest.mark.parametrize("allocation", ["fixed", "hermes"])
def test_gated_devices_train_stacked_from_their_own_local_models(
    tmp_path, monkeypatch, caplog, allocation
):
    """Hermes: each gated device's row of a stack starts from its own local model, and the
    gate reads the held-out losses the stack measured at once: the same pushes and
    reports as one by one, the model within rounding; with Hermes' work allocation too
    (tasks on seeded subsets of their devices' examples)."""
    common = (
        'algorithm.gate="hermes"',
        'algorithm.consistency="asp"',
        "run.rounds=6",
        "hermes.max_local_iterations=3",
        f'algorithm.allocation="{allocation}"',
    )
    off = _run(tmp_path / "off", *common)

    def alone(*args, **kwargs):
        raise AssertionError("a gate of a stacked device evaluated its model alone")

    monkeypatch.setattr("edgefl.algorithms.hermes.worker.evaluate", alone)
    caplog.set_level("DEBUG", logger="edgefl.worker")
    on = _run(tmp_path / "on", 'train.vectorize="on"', *common)
    stacked = on.summary["stacked_tasks"]
    assert off.summary["stacked_tasks"] == 0 and stacked > 0
    sizes = [int(m.split()[3]) for m in caplog.messages if m.endswith("tasks stacked")]
    assert sum(sizes) == stacked and max(sizes) > 1
    assert _decisions(on) == _decisions(off)  # (every push and report, in virtual time)
    a, b = _params(on), _params(off)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def _decisions(result) -> list[tuple]:
    """(event, device, task) of every iteration, push and dispatch of a run, in order."""
    lines = (result.run_dir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [(e["event"], e["device"], e["task"]) for e in events if "device" in e]


def _why(model=None, halves=(), **cfg_over):
    cfg = {"algorithm": {"gate": "always"},
           "train": {"client": "", "optimizer": "sgd", "vectorize": "auto"},
           "debug": {"kill_ranks": [], "inject": [], "delay_s": 0.0}}  # fmt: skip
    for k, v in cfg_over.items():
        sec, key = k.split("__")
        cfg[sec][key] = v
    return stacking.why_not(cfg, model or torch.nn.Linear(3, 2), list(halves))


def test_why_not_names_what_keeps_a_rank_on_the_one_by_one_path():
    from edgefl.algorithms.fedprox import FedProxWorker
    from edgefl.algorithms.hermes.worker import HermesWorker
    from edgefl.algorithms.ordering.worker import OrderingWorker

    assert _why() is None
    assert _why(algorithm__gate="hermes") is None  # (each device from its own model)
    assert "train.client" in _why(train__client="m:f")
    assert "train.optimizer" in _why(train__optimizer="adam")
    other = torch.nn.Linear(3, 2)
    other.register_buffer("scale", torch.ones(2))
    assert "float buffers outside BatchNorm" in _why(other)
    assert _why(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))) is None
    lstm = torch.nn.LSTM(3, 4)
    assert "nn.LSTM" in _why(lstm) and _why(lstm, train__vectorize="on") is None
    assert _why(halves=[FedProxWorker, HermesWorker]) is None  # (declared stackable)
    assert "plugin OrderingWorker hooks into local training (train)" in _why(
        halves=[OrderingWorker]
    )


def test_take_group_takes_the_queued_tasks_that_train_with_the_first():
    from collections import deque

    from edgefl.algorithms.base import TaskSpec

    q = deque([(0, 1, 3, TaskSpec()), (1, 1, 3, TaskSpec()), (2, 1, 3, TaskSpec()),
               (3, 1, 4, TaskSpec())])  # fmt: skip
    sizes = {0: 10, 1: 10, 2: 10, 3: 10}
    dev = dict.fromkeys(range(4), "cpu")
    got = stacking.take_group(q, lambda item: True, sizes.get, dev)
    assert [d for d, *_ in got] == [0, 1, 2] and [d for d, *_ in q] == [3]
    q = deque([(0, 1, 3, TaskSpec()), (1, 1, 3, TaskSpec())])
    got = stacking.take_group(q, lambda item: True, {0: 10, 1: 9}.get, dev)
    assert [d for d, *_ in got] == [0] and len(q) == 1  # (a stack of one)
    # not only at the head: the queue's later tasks of the first one's kind, the others
    # left in their order; a device passed over keeps its later task behind it
    q = deque([(0, 1, 3, TaskSpec()), (1, 1, 3, TaskSpec()), (2, 1, 3, TaskSpec()),
               (1, 2, 3, TaskSpec()), (3, 1, 3, TaskSpec())])  # fmt: skip
    sizes = {0: 10, 1: 9, 2: 10, 3: 10}
    got = stacking.take_group(q, lambda item: True, sizes.get, dev)
    assert [(d, t) for d, t, *_ in got] == [(0, 1), (2, 1), (3, 1)]
    assert [(d, t) for d, t, *_ in q] == [(1, 1), (1, 2)]
    q = deque([(0, 1, 3, TaskSpec())])
    assert stacking.take_group(q, lambda item: True, {0: None}.get, dev) == []  # not tensors
    flush = deque([(0, 1, 3, TaskSpec(flags=4)), (1, 1, 3, TaskSpec(flags=4))])
    assert stacking.take_group(flush, lambda item: True, sizes.get, dev) == []
    # a stack that pads sizes: the same width (mini-batches of 32; a device of 20 is one
    # full batch, 24 wide), up to the budget of the largest
    mixed = {0: 40, 1: 33, 2: 90, 3: 20, 4: 18}
    dev = dict.fromkeys(range(5), "cpu")
    width = lambda n, spec: 32 if 32 < n else -(-n // 8) * 8  # noqa: E731
    q = deque([(d, 1, 3, TaskSpec()) for d in range(5)])
    got = stacking.take_group(q, lambda item: True, mixed.get, dev, width=width)
    assert [d for d, *_ in got] == [0, 1, 2] and [d for d, *_ in q] == [3, 4]
    got = stacking.take_group(q, lambda item: True, mixed.get, dev, width=width)
    assert [d for d, *_ in got] == [3, 4] and not q  # (20 and 18: both 24 wide)
    q = deque([(d, 1, 3, TaskSpec()) for d in range(3)])
    budget = lambda n: 2 if n > 80 else 8  # noqa: E731
    got = stacking.take_group(q, lambda item: True, mixed.get, dev, budget, width)
    assert [d for d, *_ in got] == [0, 1] and [d for d, *_ in q] == [2]
    # a subset's size is its task's samples (Hermes' allocation); gated tasks (CONTINUE,
    # REFRESH) of any version with any_version, never one with a plugin argument
    q = deque([(0, 1, 3, TaskSpec(samples=12, flags=1)), (1, 1, 5, TaskSpec(samples=12)),
               (2, 1, 3, TaskSpec(samples=50, flags=9)), (3, 1, 3, TaskSpec(arg=7)),
               (4, 1, 3, TaskSpec(samples=12, flags=16))])  # fmt: skip
    sizes = {0: 40, 1: 33, 2: 12, 3: 12, 4: 12}
    got = stacking.take_group(q, lambda item: True, sizes.get, dev, any_version=True)
    assert [d for d, *_ in got] == [0, 1, 2] and [d for d, *_ in q] == [3, 4]
    q = deque([(0, 1, 3, TaskSpec(samples=12)), (1, 1, 5, TaskSpec(samples=12))])
    got = stacking.take_group(q, lambda item: True, sizes.get, dev)
    assert [d for d, *_ in got] == [0] and len(q) == 1  # (another version)


GATED = ('algorithm.gate="hermes"', 'algorithm.consistency="asp"',
         "hermes.max_local_iterations=3")  # fmt: skip


def test_padded_stacks_devices_of_any_sizes_with_zeros_after_their_own():
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, 2, 3, generator=g), torch.randint(0, 5, (n,), generator=g))
            for n in (4, 1, 6, 0)]  # fmt: skip
    for width in (0, 6, 9):
        X, Y = stacking.padded(data, "cpu", width)
        assert X.shape == (4, max(width, 6), 2, 3) and Y.shape == (4, max(width, 6))
        assert X.dtype == torch.float32 and Y.dtype == torch.int64
        for i, (x, y) in enumerate(data):
            assert torch.equal(X[i, : len(x)], x) and torch.equal(Y[i, : len(y)], y)
            assert not X[i, len(x) :].any() and not Y[i, len(y) :].any()
    same = [(torch.randn(5, 3, generator=g), torch.arange(5)) for _ in range(3)]
    X, Y = stacking.padded(same, "cpu", 5)
    assert torch.equal(X, torch.stack([x for x, _ in same])) and Y.shape == (3, 5)
    assert stacking.padded(same, "cpu", 7)[0].shape == (3, 7, 3)


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [(), GATED], ids=["bsp", "hermes"])
def test_over_mpiexec_auto_trains_the_inline_model(tmp_path, launcher, extra):
    """Over real mpiexec (3 ranks) the model is the inline run's, bit for bit, whichever
    devices the queues' timing put in one stack (a device's result, and its gate's held-out
    loss, do not depend on the others in its stack)."""
    inline = _run(tmp_path / "inline", 'train.vectorize="auto"', *extra)
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(tmp_path / "mpi")]
    for s in [*IID, 'train.vectorize="auto"', *extra]:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert s["model_sha256"] == inline.model_sha256
    assert s["stacked_tasks"] > 0 and inline.summary["stacked_tasks"] > 0
    if not extra:
        assert s["stacked_tasks"] == inline.summary["stacked_tasks"] == 40


def test_the_support_table_in_the_docs_is_current():
    from pathlib import Path

    from edgefl.algorithms import builtin_classes

    doc = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
    begin = "<!-- vectorize: generated by edgefl.runtime.stacking.support_markdown -->"
    got = doc.read_text().split(begin, 1)[1].split("<!-- /vectorize -->", 1)[0].strip()
    assert got == stacking.support_markdown(builtin_classes()).strip(), (
        "docs/performance.md: the vectorize support table is stale; paste "
        "stacking.support_markdown(builtin_classes())"
    )


sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden.configs import HERMES, PINNED, job, run_loopback_dir  # noqa: E402

FEDBN = ('model.name="cnn"', "model.args.batchnorm=true", 'data.source="partition"',
         'data.args={dataset="digits", scheme="iid"}', 'model.buffers="local"')  # fmt: skip


@pytest.mark.parametrize(
    "extra", [(), HERMES, FEDBN, (*FEDBN, *HERMES[-7:])], ids=["bsp", "hermes", "fedbn", "both"]
)
def test_a_stacked_run_stopped_and_resumed_ends_with_the_same_model(tmp_path, extra):
    """Stop a vectorized run at round 3, resume it from the checkpoint: the same final
    model as the uninterrupted vectorized run, bit for bit (a gate's local models, Hermes'
    allocation and FedBN's per-device statistics come back from the checkpoint)."""
    sets = job(PINNED, "fleet.devices=6", "fleet.ranks=3", *extra, "run.rounds=6",
               "run.checkpoint_every=1", 'train.vectorize="on"')  # fmt: skip
    whole = run_loopback_dir(sets, tmp_path / "whole")
    part = run_loopback_dir(job(sets, "debug.stop_after_round=3"), tmp_path / "part")
    assert part["rounds_done"] == 3 and whole["stacked_tasks"] > 0
    ckpt = tmp_path / "part" / "checkpoints" / "ckpt-000003.h5"
    resumed = run_loopback_dir(sets, tmp_path / "resumed", resume=ckpt)
    assert resumed["model_sha256"] == whole["model_sha256"]
    assert resumed["rounds_done"] == whole["rounds_done"] == 6
