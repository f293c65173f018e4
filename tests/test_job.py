"""End-to-end jobs over real mpiexec (3-4 ranks): output, checkpoints, resume bit-exactness,
forged messages during a run, and `edgefl run` launched by hand."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_edgefl, run_launch

pytestmark = pytest.mark.mpi

SMALL = """
seed = 3
[run]
rounds = 6
checkpoint_every = 3
[fleet]
devices = 4
ranks = 3
[data]
source = "synthetic"
[data.args]
alpha = 0.5
beta = 0.5
dim = 20
classes = 5
[model]
name = "mlp"
[model.args]
hidden = [16]
[train]
batch_size = 16
lr = 0.1
[output]
progress = "lines"
"""


@pytest.fixture
def small_config(tmp_path: Path) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL)
    return p


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_simulate_writes_run_directory(small_config, tmp_path, launcher):
    out = tmp_path / "run"
    proc = run_edgefl("simulate", str(small_config), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final accuracy:" in proc.stdout
    assert "round    6/6" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        for key in (
            "wall_time_s",
            "train_loss",
            "test_loss",
            "test_accuracy",
            "bytes_up",
            "bytes_down",
            "msgs_up",
            "msgs_down",
            "devices",
        ):
            assert key in r
        assert sorted(r["devices"], key=int) == ["0", "1", "2", "3"]
        assert r["bytes_up"] > 0 and r["msgs_up"] == 4
    assert rows[-1]["test_accuracy"] > 0.3  # 5 classes: well above chance after 6 rounds
    assert (out / "checkpoints" / "ckpt-000003.h5").is_file()
    assert (out / "checkpoints" / "ckpt-000006.h5").is_file()
    assert (out / "final_model.pt").is_file()
    s = _summary(out)
    assert s["rounds_done"] == 6 and s["rejected"] == 0
    assert s["final_accuracy"] == rows[-1]["test_accuracy"]
    # inspect shows the checkpoint's round
    proc = run_edgefl("inspect", str(out / "checkpoints" / "ckpt-000006.h5"))
    assert proc.returncode == 0 and "round" in proc.stdout


def test_forged_messages_rejected_and_result_unchanged(small_config, tmp_path, launcher):
    clean, forged = tmp_path / "clean", tmp_path / "forged"
    p1 = run_edgefl("simulate", str(small_config), "--out", str(clean))
    p2 = run_edgefl(
        "simulate",
        str(small_config),
        "--out",
        str(forged),
        "--set",
        'debug.inject=["bad-kind","bad-length","bad-dtype","foreign-device","duplicate"]',
    )
    assert p1.returncode == 0, p1.stderr
    assert p2.returncode == 0, p2.stderr
    assert "rejected message from rank 1: unknown kind 99" in p2.stderr
    assert "rejected message from rank 1: UPDATE payload dtype float64" in p2.stderr
    s1, s2 = _summary(clean), _summary(forged)
    assert s2["rejected"] == 4 and s2["duplicates"] == 1
    assert s1["model_sha256"] == s2["model_sha256"]


def test_resume_is_bit_exact(small_config, tmp_path, launcher):
    full, part = tmp_path / "full", tmp_path / "part"
    p = run_edgefl("simulate", str(small_config), "--out", str(full))
    assert p.returncode == 0, p.stderr
    p = run_edgefl(
        "simulate", str(small_config), "--out", str(part), "--set", "debug.stop_after_round=3"
    )
    assert p.returncode == 0, p.stderr
    assert "stopped: debug.stop_after_round = 3" in p.stdout
    assert not (part / "checkpoints" / "ckpt-000006.h5").exists()
    ckpt = part / "checkpoints" / "ckpt-000003.h5"
    p = run_edgefl("simulate", str(small_config), "--resume", str(ckpt))
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = _summary(full), _summary(part)  # resumed into the checkpoint's run directory
    assert b["rounds_done"] == 6
    assert a["model_sha256"] == b["model_sha256"]
    ma = torch.load(full / "final_model.pt")
    mb = torch.load(part / "final_model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_mpiexec_by_hand(small_config, tmp_path, launcher):
    out = tmp_path / "byhand"
    cmd = launcher.command(
        4, [sys.executable, "-m", "edgefl", "run", str(small_config), "--out", str(out)], ulfm=False
    )
    proc = run_launch(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final accuracy:" in proc.stdout
    s = _summary(out)
    assert s["workers"] == 3 and s["rounds_done"] == 6


def _run_with_module_dir(launcher, tmp_path: Path, config: str):
    """`mpiexec -n 3 edgefl run` of ``config`` with ``tmp_path`` (plug-in modules) importable."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(config)
    cmd = launcher.command(
        3,
        [sys.executable, "-m", "edgefl", "run", str(cfg), "--out", str(tmp_path / "o")],
        ulfm=False,
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return run_launch(cmd, timeout=300, env=env)


def test_worker_side_error_stops_everyone_with_status_2(tmp_path, launcher):
    # a plug-in that fails only on worker ranks: the coordinator reports it and stops all
    mod = tmp_path / "flaky_plugin.py"
    mod.write_text(
        "import os\n"
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def make(num_devices, seed):\n"
        "    if os.environ.get('OMPI_COMM_WORLD_RANK', '0') != '0':\n"
        "        from edgefl.errors import DataError\n"
        "        raise DataError('disk full on this node')\n"
        "    x = torch.randn(20, 3); y = torch.arange(20) % 2\n"
        "    return [TensorDataset(x, y)] * num_devices, TensorDataset(x, y)\n"
    )
    proc = _run_with_module_dir(
        launcher,
        tmp_path,
        '[data]\nsource = "flaky_plugin:make"\n[model]\nname = "logreg"\n[fleet]\ndevices = 2\n',
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "disk full on this node" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_worker_exception_during_training_ends_job_with_status_2(tmp_path, launcher):
    # a custom model whose forward fails on worker ranks only: no hang, one clear report
    mod = tmp_path / "broken_model.py"
    mod.write_text(
        "import os\n"
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, info):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(info.input_shape[0], info.num_classes)\n"
        "    def forward(self, x):\n"
        "        if os.environ.get('OMPI_COMM_WORLD_RANK', '0') != '0':\n"
        "            raise RuntimeError('kaboom in forward')\n"
        "        return self.lin(x)\n"
    )
    proc = _run_with_module_dir(
        launcher, tmp_path, '[model]\nname = "broken_model:Net"\n[fleet]\ndevices = 2\n'
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "edgefl: error: rank 1: " in proc.stderr or "edgefl: error: rank 2: " in proc.stderr
    assert "RuntimeError: kaboom in forward" in proc.stderr
