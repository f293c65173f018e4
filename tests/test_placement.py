"""Device-to-rank mapping and torch device resolution (GPU path included, skipped without)."""

import json
from pathlib import Path

import pytest
import torch

from edgefl.runtime.placement import devices_of_rank, rank_of_device, torch_device_for


def test_devices_cover_all_ranks_round_robin():
    got = [devices_of_rank(r, 10, 4) for r in range(4)]
    assert got == [[], [0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert all(rank_of_device(d, 4) == r for r in range(1, 4) for d in got[r])


def test_torch_device_resolution():
    assert torch_device_for(0, "auto", {}, 3, 0) == "cpu"
    assert torch_device_for(0, "auto", {}, 3, 2) == "cuda:1"
    assert torch_device_for(5, "auto", {"5": "cpu"}, 0, 2) == "cpu"
    assert torch_device_for(1, "cpu", {"1": "cuda:0"}, 0, 1) == "cuda:0"
    assert torch_device_for(0, "cuda", {}, 5, 4) == "cuda:1"


def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path, launcher):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from conftest import run_edgefl

    proc = run_edgefl(
        "simulate",
        "--devices",
        "2",
        "--ranks",
        "3",
        "--rounds",
        "1",
        "--set",
        'fleet.device_map={"0" = "cuda:0"}',
        "--out",
        str(tmp_path / "r"),
    )
    assert proc.returncode == 2
    assert "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_device_on_cuda_two_on_cpu(tmp_path: Path, launcher):
    from conftest import run_edgefl

    out = tmp_path / "gpu"
    proc = run_edgefl(
        "simulate",
        "--devices",
        "3",
        "--ranks",
        "4",
        "--rounds",
        "3",
        "--set",
        'fleet.device_map={"0" = "cuda:0", "1" = "cpu", "2" = "cpu"}',
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["devices"]["0"]["torch"] == "cuda:0"
    assert s["devices"]["1"]["torch"] == "cpu"
    print({d: v["time_s"] / max(v["rounds"], 1) for d, v in s["devices"].items()})
