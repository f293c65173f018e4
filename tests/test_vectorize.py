"""``train.vectorize = "auto"``: a worker trains its queued tasks of one model version as
one stacked computation (edgefl/runtime/stacking.py), within float32 rounding of the
one-by-one path; where it cannot, every task trains alone and the rank says why."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_a_rank_that_cannot_stack_trains_the_reference_model(tmp_path):
    """With a gate the rank says why once and trains every task alone: the one-by-one
    model, bit for bit."""
    sets = ['output.progress="quiet"', "run.rounds=3", "run.checkpoint_every=0",
            'algorithm.gate="hermes"', 'algorithm.consistency="asp"']  # fmt: skip
    over = dict(parse_override(s) for s in sets)
    off = edgefl.simulate(overrides=over, out=tmp_path / "off", backend="inline")
    over["train.vectorize"] = "auto"
    auto = edgefl.simulate(overrides=over, out=tmp_path / "auto", backend="inline")
    assert auto.model_sha256 == off.model_sha256


def _worker(**cfg_over):
    cfg = {"algorithm": {"gate": "always"}, "train": {"client": "", "optimizer": "sgd"},
           "debug": {"kill_ranks": [], "inject": [], "delay_s": 0.0}}  # fmt: skip
    for k, v in cfg_over.items():
        sec, key = k.split("__")
        cfg[sec][key] = v
    flat = SimpleNamespace(param_numel=10, numel=10)
    gated = cfg["algorithm"]["gate"] != "always"
    return SimpleNamespace(cfg=cfg, gated=gated, task=SimpleNamespace(flat=flat), plugins=[])


def test_why_not_names_what_keeps_a_rank_on_the_one_by_one_path():
    from edgefl.algorithms.fedprox import FedProxWorker
    from edgefl.algorithms.hermes.worker import HermesWorker

    assert stacking.why_not(_worker()) is None
    assert "algorithm.gate" in stacking.why_not(_worker(algorithm__gate="hermes"))
    assert "train.client" in stacking.why_not(_worker(train__client="m:f"))
    assert "train.optimizer" in stacking.why_not(_worker(train__optimizer="adam"))
    w = _worker()
    w.task.flat.numel = 12
    assert "buffers" in stacking.why_not(w)
    w = _worker()
    half = FedProxWorker.__new__(FedProxWorker)  # (no context needed: only its class counts)
    half.name = "fedprox"
    w.plugins = [half]
    assert "plugin 'fedprox'" in stacking.why_not(w)
    assert HermesWorker.stackable  # (its hooks do nothing without a gate)


def test_take_group_stops_at_the_first_task_that_differs():
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
    q = deque([(0, 1, 3, TaskSpec())])
    assert stacking.take_group(q, lambda item: True, {0: None}.get, dev) == []  # not tensors
    flush = deque([(0, 1, 3, TaskSpec(flags=4)), (1, 1, 3, TaskSpec(flags=4))])
    assert stacking.take_group(flush, lambda item: True, sizes.get, dev) == []


@pytest.mark.mpi
def test_over_mpiexec_auto_trains_the_inline_model(tmp_path, launcher):
    """Over real mpiexec (3 ranks) the stacked groups are the inline run's, so the model is
    the same, bit for bit."""
    inline = _run(tmp_path / "inline", 'train.vectorize="auto"')
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(tmp_path / "mpi")]
    for s in [*IID, 'train.vectorize="auto"']:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert s["model_sha256"] == inline.model_sha256
