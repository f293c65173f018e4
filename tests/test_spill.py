"""A test set over ``run.test_memory_mb`` lives in an unlinked temporary file
(:mod:`edgefl.data.spill`): the same rows, the same evaluation bit for bit, nothing left on
disk, bad parts refused with one line."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from edgefl.algorithms.fedeval.metrics import metric_means
from edgefl.data.base import DataInfo, FederatedDataset
from edgefl.data.checks import check_test
from edgefl.data.spill import SpilledTensors, load_test
from edgefl.data.synthetic import SyntheticFederated
from edgefl.errors import DataError
from edgefl.models.train import evaluate

ARGS = {"dim": 7, "classes": 4, "test_samples_per_device": 13}


def _cat(parts):
    xs, ys = zip(*(p.tensors for p in parts))
    return torch.cat(xs), torch.cat(ys)


def test_synthetic_parts_are_the_test_set_and_its_size_is_known():
    data = SyntheticFederated(ARGS, 9, 5)
    x, y = SyntheticFederated(ARGS, 9, 5).test().tensors
    for rows in (1, 13, 30, 1000):  # (whole devices a part: 1, 1, 2 and all 9)
        px, py = _cat(data.test_parts(rows))
        assert torch.equal(px, x) and torch.equal(py, y)
    assert data._test is None  # (no part kept)
    assert data.test_nbytes() == x.numel() * 4 + y.numel() * 8


def test_over_the_budget_the_test_set_is_on_disk_and_reads_back_the_same():
    data = SyntheticFederated(ARGS, 9, 5)
    size = data.test_nbytes()
    assert load_test(data, size) is data.test()  # within the budget: in memory
    assert load_test(data, 0) is data.test()  # 0: no limit
    spilled = load_test(SyntheticFederated(ARGS, 9, 5), size - 1)
    assert isinstance(spilled, SpilledTensors) and len(spilled) == 9 * 13
    assert spilled.nbytes == size
    for f in spilled._files:  # unlinked: nothing to clean up, whatever ends the process
        assert os.fstat(f.fileno()).st_nlink == 0
    x, y = data.test().tensors
    for i in (0, 1, 50, len(x) - 1, -1):
        xi, yi = spilled[i]
        assert torch.equal(xi, x[i]) and torch.equal(yi, y[i])
    with pytest.raises(IndexError, match="out of range for 117 examples"):
        spilled[117]
    for bs in (1, 10, 64, 117, 500):
        got = list(spilled.batches(bs))
        want = [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]
        assert len(got) == len(want)
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want))
    spilled.close()
    assert len(spilled) == 0


def test_evaluation_from_disk_equals_evaluation_in_memory_bit_for_bit(monkeypatch):
    import edgefl.data.spill as spill

    monkeypatch.setattr(spill, "BLOCK_BYTES", 1000)  # (many blocks: their seams are crossed)
    data = SyntheticFederated(ARGS, 40, 2)
    spilled = load_test(SyntheticFederated(ARGS, 40, 2), 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 4))
    for bs in (1024, 37, 0):
        assert evaluate(model, spilled, "classification", batch_size=bs) == evaluate(
            model, data.test(), "classification", batch_size=bs
        )
    metrics = {
        "right": lambda out, y: (out.argmax(1) == y).float(),
        "margin": lambda out, y: out.max(1).values,
    }
    assert metric_means(model, spilled, metrics, batch_size=33) == metric_means(
        model, data.test(), metrics, batch_size=33
    )


class _Parts(FederatedDataset):
    """A source that builds its test set in parts: ``bad`` spoils one part."""

    def __init__(self, bad: str = "") -> None:
        super().__init__(DataInfo(input_shape=(3,), num_classes=2), 2)
        self.bad = bad

    def train(self, device):
        return TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))

    def num_samples(self, device):
        return 4

    def test(self):
        return TensorDataset(*_cat(self.test_parts(5)))

    def test_nbytes(self):
        return 10 * (3 * 4 + 8)

    def test_parts(self, rows):
        for k in range(2):
            x, y = torch.ones(5, 3), torch.ones(5, dtype=torch.long)
            if k == 1 and self.bad == "nan":
                x[2, 1] = math.nan
            if k == 1 and self.bad == "dtype":
                x = x.double()
            if k == 1 and self.bad == "rows":
                y = y[:4]
            yield TensorDataset(x, y) if self.bad != "rows" else _Uneven(x, y)


class _Uneven:
    def __init__(self, x, y):
        self.tensors = (x, y)


def test_bad_parts_are_refused_with_one_line_and_nothing_kept(monkeypatch):
    made = []
    real = SpilledTensors.__init__

    def recorded(self, *a, **k):
        real(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(SpilledTensors, "__init__", recorded)
    test, nbytes = check_test(_Parts(), "mine:make", 1)
    assert isinstance(test, SpilledTensors) and len(test) == 10 and nbytes == 0
    with pytest.raises(DataError, match=r"^test set: feature value nan at example 2 "):
        check_test(_Parts("nan"), "mine:make", 1)  # (each part checked before it is written)
    with pytest.raises(
        DataError,
        match=r"^test set: a part of features float64 \(3,\) and targets int64 \(\) after "
        r"parts of features float32 ",
    ):
        load_test(_Parts("dtype"), 1)
    with pytest.raises(DataError, match="a part has 5 feature rows and 4 targets"):
        load_test(_Parts("rows"), 1)
    assert all(f.closed for s in made[1:] for f in s._files)  # the refused ones' files
    assert not any(f.closed for f in made[0]._files)


def test_a_job_with_its_test_set_on_disk_gives_the_same_run(tmp_path):
    import edgefl

    over = {"fleet.devices": 6, "run.rounds": 2, "output.progress": "quiet", "seed": 4}
    mem = edgefl.simulate(overrides=over, out=tmp_path / "mem", backend="inline").summary
    disk = edgefl.simulate(
        overrides={**over, "run.test_memory_mb": 0.001}, out=tmp_path / "disk", backend="inline"
    ).summary
    for key in ("model_sha256", "final_accuracy", "final_test_loss"):
        assert disk[key] == mem[key], key
    assert np.isfinite(disk["final_test_loss"])


@pytest.mark.mpi
def test_over_mpiexec_rank_0_evaluates_from_disk_with_the_same_results(tmp_path, launcher):
    """Rank 0's pre-launch check spills the test set, says so on one line, and hands the
    file to the coordinator; the run equals the in-memory one."""
    from conftest import run_edgefl

    run = ["--devices", "4", "--rounds", "2", "--set", "output.progress=quiet", "--set", "seed=5"]
    summaries = {}
    for name, budget in (("mem", "256"), ("disk", "0.001")):
        p = run_edgefl(
            "simulate", "--out", str(tmp_path / name), *run, "--set",
            f"run.test_memory_mb={budget}", timeout=180,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        said = [ln for ln in p.stderr.splitlines() if "kept in a temporary file" in ln]
        assert len(said) == (name == "disk"), p.stderr
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    for key in ("model_sha256", "final_accuracy", "final_test_loss"):
        assert summaries["disk"][key] == summaries["mem"][key], key


def test_no_room_for_the_file_is_one_line_naming_the_key(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # ($TMPDIR's folder)
    with pytest.raises(DataError) as e:
        check_test(_Parts(), "mine:make", 1)
    text = str(e.value)
    assert text.startswith("test set: its 0.0 MB (over run.test_memory_mb = 9.53674e-07) go ")
    assert f"in {tmp_path / 'gone'}, which failed: No such file or directory; set TMPDIR" in text
    assert "\n" not in text


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_a_killed_job_leaves_no_file_behind(tmp_path):
    """SIGKILL from outside while the job runs with its test set on disk: the file was
    unlinked from the start ($TMPDIR never lists it), and its space goes with the process."""
    import signal
    import subprocess
    import sys
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--backend", "inline", "--devices", "4",
           "--rounds", "100000", "--set", "run.test_memory_mb=0.001", "--set",
           "output.progress=quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        assert "kept in a temporary file in " + str(tmp) in line, line
        held = []
        for _ in range(100):  # (the coordinator's copy: the check's was handed over)
            held = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")]
            held = [h for h in held if h.startswith(str(tmp)) and h.endswith("(deleted)")]
            if held:
                break
            time.sleep(0.05)
        assert len(held) == 2, held  # features and targets
        assert list(tmp.iterdir()) == []
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert list(tmp.iterdir()) == []
