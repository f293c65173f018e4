"""On an IID partition, FedAvg over real mpiexec ends within 3 points of centralized training
of the same model on the pooled data (same epochs over the data, same learning rate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_edgefl

from edgefl.config import config_from_toml
from edgefl.data import load_federated, pooled
from edgefl.models import build_model
from edgefl.models.train import evaluate, local_train

pytestmark = pytest.mark.mpi

CONFIG = """
seed = 1
[run]
rounds = 10
checkpoint_every = 0
[fleet]
devices = 6
ranks = 4
[data]
source = "partition"
[data.args]
dataset = "gaussian-mixture"
scheme = "iid"
dataset_args = {classes = 10, dim = 20, samples = 3000}
[model]
name = "mlp"
[model.args]
hidden = [32]
[train]
local_epochs = 1
batch_size = 20
lr = 0.05
[output]
progress = "quiet"
"""


def test_iid_fedavg_close_to_centralized(tmp_path: Path, launcher):
    conf = tmp_path / "iid.toml"
    conf.write_text(CONFIG)
    proc = run_edgefl("simulate", str(conf), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fed_acc = json.loads((tmp_path / "run" / "summary.json").read_text())["final_accuracy"]

    cfg = config_from_toml(CONFIG)
    data = load_federated(cfg["data"]["source"], cfg["data"]["args"], 6, cfg["seed"])
    model = build_model("mlp", data.info, {"hidden": [32]}, cfg["seed"])
    gen = torch.Generator().manual_seed(0)
    local_train(
        model,
        pooled(data),
        epochs=10,
        steps=0,
        batch_size=20,
        lr=0.05,
        momentum=0.0,
        weight_decay=0.0,
        generator=gen,
        task="classification",
    )
    _, central_acc = evaluate(model, data.test(), "classification")
    print(f"FedAvg {fed_acc:.4f} vs centralized {central_acc:.4f}")
    assert central_acc > 0.8  # the task is learnable, so the comparison means something
    assert abs(fed_acc - central_acc) <= 0.03
