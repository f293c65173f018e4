"""``edgefl bench stacked``: both paths on a small probe in a fresh process, in the kernels
asked for, the stacked path within float32 rounding of one by one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("kernels, model", [("portable", "logreg"), ("native", "mlp")])
def test_the_bench_prints_both_paths_and_their_difference(tmp_path, kernels, model):
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgefl",
            "bench",
            "stacked",
            "--devices",
            "12",
            "--samples",
            "20",
            "--features",
            "5",
            "--batch",
            "8",
            "--model",
            model,
            "--chunk",
            "5",
            "--kernels",
            kernels,
            "--json",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "# command: edgefl bench stacked" in run.stdout
    assert f'"kernels": "{kernels}"' in run.stdout
    rows = json.loads(out.read_text())
    assert [r["path"] for r in rows] == ["one by one", "stacked"]
    assert rows[1]["max_rel_diff"] < 1e-5 and rows[1]["ms_per_device"] > 0
