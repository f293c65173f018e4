"""Stop and resume over real mpiexec: the per-device worker state crosses processes (the
STATE exchange), the resumed job ends with the golden model of the uninterrupted run.

A representative half of the resume matrix of tests/test_resume_exact.py (which runs every
golden config in one process): one config per algorithm family, incl. asynchronous
policies with tasks in flight at the checkpoint and gated devices with local models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_edgefl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden.configs import effective_config, job, load_models, simulate_argv  # noqa: E402

MODELS = load_models()
SAMPLE = (
    "hermes_gddr",  # ASP, gated devices, allocation, residual buffers (per-device state)
    "ps_servers_3_replicas_2",  # a sharded server group with replicas
    "scaffold_small",  # server and client control variates
)


@pytest.mark.mpi
@pytest.mark.parametrize("name", SAMPLE)
def test_stop_and_resume_over_mpiexec(name, tmp_path, launcher):
    entry = MODELS[name]
    cfg, _ = effective_config(entry["set"])
    k = max(1, cfg["run"]["rounds"] // 2)
    part = tmp_path / "part"
    proc = run_edgefl(*simulate_argv(job(entry["set"], f"debug.stop_after_round={k}"), part))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = part / "checkpoints" / f"ckpt-{k:06d}.h5"
    assert ckpt.is_file()
    resumed = tmp_path / "resumed"
    argv = [*simulate_argv(entry["set"], resumed), "--resume", str(ckpt)]
    proc = run_edgefl(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["model_sha256"] == entry["model_sha256"], (
        f"{name}: stopped at round {k} and resumed over mpiexec, the final model differs"
    )
