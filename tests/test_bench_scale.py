"""``edgefl bench scale`` without MPI: the /proc sampler of a process tree, the linear fits
and the per-device and extrapolation lines, and ``--systems pfl`` without pfl."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl.bench import scale

linux = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="Linux /proc")


@linux
def test_tree_rss_and_cpu_of_a_process_tree(tmp_path):
    watch = tmp_path / "rows.jsonl"
    code = (
        f"import time; open({str(watch)!r}, 'w').write('{{}}\\n'); t = time.time()\n"
        "while time.time() - t < 0.3: pass"
    )
    m = scale.run_measured([sys.executable, "-c", code], interval=0.02, watch=watch)
    assert m.rc == 0 and m.peak > 1_000_000 and len(m.marks) == 1 and m.wall >= 0.3
    name = os.path.basename(sys.executable)
    assert m.each[name] == m.peak  # one process: its own peak is the tree's
    assert 0.1 < m.cpu[name] <= m.wall + 0.1  # it spun for 0.3 s (seen at the last sample)


def test_a_process_whose_memory_no_sample_read_is_not_listed():
    """A short-lived child gone before a sample read its memory (peak 0, no label) is left
    out of the by-process breakdown, which printed it as "? 0"."""
    labels = {10: "rank 0", 11: "rank 0", 12: "prterun"}
    got = scale._peaks_by_label(labels, {10: 5, 11: 7, 12: 3, 13: 0})
    assert got == {"rank 0": 7, "prterun": 3}


def test_fit_and_per_device_lines(capsys):
    assert scale._fit([1, 3], [10.0, 14.0]) == pytest.approx((8.0, 2.0))
    rows = [
        {"system": "edgefl", "devices": 1000, "peak_rss_mb": 1000.0, "s_per_round": 1.0},
        {"system": "edgefl", "devices": 10000, "peak_rss_mb": 1450.0, "s_per_round": 10.0},
    ]
    cfg = scale.bench_config(type("A", (), {"seed": 0, "rounds": 3, "ranks": 3})(), 1000)
    assert scale.data_bytes_per_device(cfg) == 88 * 300
    scale._per_device(rows, [1000, 10000], cfg, 100_000)
    out = capsys.readouterr().out
    assert "edgefl memory per device: 50.0 KB" in out and "beyond its data 23.6 KB" in out
    assert "extrapolated to 100000 devices" in out and "peak RSS 5.95 GB" in out
    assert "100.0 s per round" in out


def test_the_100000_device_memory_target_line(capsys):
    """4 GB = 4,000 MB (peak_rss_mb's unit: 10^6 bytes), for the vectorized rows of the
    logreg job at 100,000 devices or more; none for other rows."""
    rows = [
        {"system": "edgefl-vec", "devices": 100_000, "peak_rss_mb": 3695.0},
        {"system": "edgefl-inline-vec", "devices": 100_000, "peak_rss_mb": 4000.4},
        {"system": "edgefl-vec", "devices": 10_000, "peak_rss_mb": 9999.0},
    ]
    scale._targets(rows)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "# 100000 devices, edgefl-vec: peak RSS 3695 MB (target <= 4000: met)",
        "# 100000 devices, edgefl-inline-vec: peak RSS 4000 MB (target <= 4000: NOT met)",
    ]
    scale._targets(rows, job="mlp")
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(importlib.util.find_spec("pfl") is not None, reason="pfl is installed here")
@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/python"])
def test_systems_pfl_without_pfl_is_one_clear_line(python):
    cmd = [sys.executable, "-m", "edgefl", "bench", "scale", "--sizes", "10", "--rounds", "2",
           "--systems", "pfl", "--pfl-python", python]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stdout == ""  # (before anything runs: not even the header)
    assert proc.stderr.strip() == (
        f"edgefl: error: --systems pfl: pfl is not importable by {python} "
        "(pip install 'pfl[pytorch]==0.6.0' there, or pass --pfl-python)"
    )


@pytest.mark.parametrize("job", ["mlp", "cnn"])
def test_other_jobs_are_valid_configs_and_their_plain_loop_runs(job):
    """``--job mlp|cnn``: the config loads, and the plain loop (fedavg_loop: SGD
    mini-batches as the config says) trains it, reporting its rate and accuracy."""
    from edgefl.config import load_config

    args = type("A", (), {"seed": 0, "rounds": 2, "ranks": 3, "job": job, "kernels": "native"})
    cfg = scale.bench_config(args(), 6)
    c = load_config(doc=cfg)
    assert c["fleet"]["devices"] == 6 and c["run"]["kernels"] == "native"
    assert c["model"]["name"] == job and c["train"]["batch_size"] == 32
    got = scale.plain_loop(cfg)
    assert got["rounds_per_s"] > 0 and got["cpu_s_per_round"] > 0
    assert 0.0 <= got["final_accuracy"] <= 1.0
    assert scale.data_bytes_per_device(cfg) > 0


def test_the_loop_runs_the_kernels_edgefl_runs():
    from edgefl import kernels

    portable = scale.loop_env("portable")
    native = scale.loop_env("native")
    for key, value in kernels.portable_env().items():
        assert portable[key] == value and key not in native
