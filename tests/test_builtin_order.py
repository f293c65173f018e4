"""Where a built-in is listed in ``edgefl.algorithms.BUILTIN`` means nothing: hooks run in
each class's declared ``order`` (issue 26). Shuffled, BUILTIN loads the same plugins in the
same order, and the golden configs that combine several plugins train their recorded model,
bit for bit (in-process loopback runs); so does a FedBN + Hermes + federated-evaluation +
client-metrics job, which has no golden hash (compared with the same job unshuffled)."""

from __future__ import annotations

import random

import pytest
from golden.configs import load_models, run_loopback

import edgefl.algorithms as algorithms
from edgefl.config import load_config

MODELS = load_models()
# golden configs where several plugins meet in one hook (chains, notifications)
MIXED = ("hermes_gddr", "norm_bound_filters", "scaffold_small", "cdgrab_step", "ps_sparse_keycache")
SHUFFLES = [tuple(random.Random(seed).sample(algorithms.BUILTIN, len(algorithms.BUILTIN)))
            for seed in (1, 2)] + [tuple(reversed(algorithms.BUILTIN))]  # fmt: skip

# FedBN (a model with BatchNorm buffers kept per device), Hermes' gate and hold-out,
# federated evaluation on that hold-out and the client's metrics, all in one job
FEDBN_MIX = [
    'data.source="test_buffers:make_images"',
    'model.name="cnn"',
    "model.args={channels=[4, 4], batchnorm=true}",
    'model.buffers="local"',
    "fleet.devices=3",
    "fleet.ranks=3",
    "run.rounds=3",
    "run.checkpoint_every=0",
    "train.batch_size=8",
    'sim.clock="virtual"',
    "sim.reference_s_per_sample=0.0001",
    'fleet.device="cpu"',
    'output.progress="quiet"',
    'algorithm.gate="hermes"',
    "hermes.max_local_iterations=2",
    "evaluation.every=1",
]


def test_shuffled_builtin_loads_the_same_plugins_in_the_same_order(monkeypatch):
    cfgs = [load_config(overrides=MODELS[n]["set"]) for n in MIXED]
    want = [[c.name for c in algorithms.load(cfg)] for cfg in cfgs]
    every = [c.name for c in algorithms.builtin_classes()]
    for order in SHUFFLES:
        monkeypatch.setattr(algorithms, "BUILTIN", order)
        assert [c.name for c in algorithms.builtin_classes()] == every
        assert [[c.name for c in algorithms.load(cfg)] for cfg in cfgs] == want


@pytest.mark.parametrize("name", MIXED)
def test_a_shuffled_builtin_trains_the_golden_model(name, monkeypatch):
    monkeypatch.setattr(algorithms, "BUILTIN", SHUFFLES[0])
    summary, _ = run_loopback(MODELS[name]["set"])
    assert summary["model_sha256"] == MODELS[name]["model_sha256"], name


def test_fedbn_with_hermes_and_federated_evaluation_does_not_depend_on_builtin(monkeypatch):
    first, _ = run_loopback(FEDBN_MIX)
    assert first["fed_eval"]["versions_landed"] and first["quarantined"] == {}
    monkeypatch.setattr(algorithms, "BUILTIN", SHUFFLES[2])
    again, _ = run_loopback(FEDBN_MIX)
    assert again["model_sha256"] == first["model_sha256"]
    assert again["fed_eval"] == first["fed_eval"]
