"""What ``edgefl simulate`` finds before mpiexec starts (edgefl.data.checks,
edgefl.preflight): bad labels, shapes, dtypes, NaN/inf, empty devices, a fleet too big for
memory; ranks that a folder named ``edgefl`` cannot shadow; quiet broken pipes. In-process
or cheap subprocesses (``--version``, ``--dry-run``); no MPI start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from edgefl.config import load_config
from edgefl.data.base import DataInfo, FederatedDataset
from edgefl.data.checks import (
    DEVICE_RECORD_BYTES,
    MemoryEstimate,
    available_memory,
    check_examples,
    check_memory,
    check_test,
    estimate_memory,
    sample_ids,
    scan_devices,
)
from edgefl.data.clicks import ClicksFederated
from edgefl.errors import ConfigError, DataError, EdgeflError
from edgefl.launcher import rank_python
from edgefl.launching import mpi_command
from edgefl.preflight import checked_test_set, preflight
from edgefl.runtime.state import build_task

ROOT = Path(__file__).resolve().parents[1]
N, DIM, CLASSES = 10, 4, 3  # examples per device, features, classes of Fleet


class Fleet(FederatedDataset):
    """A lazily built plug-in dataset (``FederatedDataset``) with one injected fault on
    device ``at`` (or the test set): see :meth:`_xy`."""

    def __init__(
        self, num_devices: int, fault: str = "", at: int = 1, task: str = "classification"
    ):
        info = DataInfo((DIM,), CLASSES, task, "int64" if task == "lm" else "float32")
        super().__init__(info, num_devices)
        self.fault, self.at = fault, at
        self.built: list[int] = []

    def _xy(self, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(k + 1)
        task = self.info.task
        if task == "lm":
            x = torch.randint(0, CLASSES, (n, DIM), generator=g)
            y = torch.randint(0, CLASSES, (n, DIM), generator=g)
        else:
            x = torch.randn(n, DIM, generator=g)
            y = {
                "classification": torch.arange(n) % CLASSES,
                "binary": (torch.arange(n) % 2).float(),
                "regression": torch.randn(n, CLASSES, generator=g),
            }[task]
        if k != self.at:
            return x, y
        f = self.fault
        if f == "label":
            y[5] = CLASSES + 2
        elif f == "negative":
            y[0] = -1
        elif f == "shape":
            x = torch.randn(n, DIM + 1, generator=g)
        elif f == "dtype":
            x = x.double()
        elif f == "nan":
            x[2, 1] = float("nan")
        elif f == "inf-target":
            y[3, 0] = float("inf")
        elif f == "int-target":
            y = y.long()
        elif f == "float-labels":
            y = y.float()
        elif f == "binary-2":
            y[4] = 2.0
        elif f == "token":
            x[6, 2] = CLASSES
        elif f == "lm-target":
            y[7, 0] = CLASSES + 1
        return x, y

    def num_samples(self, device: int) -> int:
        k = self.check_device(device)
        if self.fault == "empty" and k == self.at:
            return 0
        return N + 1 if self.fault == "count" and k == self.at else N

    def train(self, device: int) -> TensorDataset:
        k = self.check_device(device)
        self.built.append(k)
        n = 0 if self.fault == "empty" and k == self.at else N
        if self.fault == "raises" and k == self.at:
            raise OSError("disk on fire")
        return TensorDataset(*self._xy(k, n))

    def test(self) -> TensorDataset:
        x, y = self._xy(-1, 6)
        if self.fault == "test-nan":
            x[:] = float("nan")
        return TensorDataset(x, y)


def make_fleet(num_devices: int, seed: int, fault: str = "", at: int = 1) -> Fleet:
    """The data plug-in: ``data.source = "test_preflight:make_fleet"``."""
    return Fleet(num_devices, fault, at)


def make_eager(num_devices: int, seed: int) -> tuple:
    """The ``(train, test)`` plug-in form: labels 0..2 in the test set (so 3 classes are
    inferred) but label 7 on the last device."""
    train = []
    for k in range(num_devices):
        y = np.arange(N) % CLASSES
        if k == num_devices - 1:
            y[9] = 7
        train.append((np.ones((N, DIM), np.float32), y))
    return train, (np.zeros((6, DIM), np.float32), np.arange(6) % CLASSES)


SRC = "test_preflight:make_fleet"


def fleet_cfg(tmp_path: Path, *sets: str) -> dict:
    return load_config(
        overrides=[
            f'data.source="{SRC}"',
            "fleet.devices=4",
            "fleet.ranks=3",
            f'run.out="{tmp_path / "run"}"',
            *sets,
        ]
    )


# -- device and test set checks -------------------------------------------------------------
C = "classification"


@pytest.mark.parametrize(
    "task, fault, message",
    [
        (C, "label", "device 1: label 5 at example 5 is outside [0, 3)"),
        (C, "negative", "device 1: label -1 at example 0 is outside [0, 3)"),
        (C, "float-labels", "device 1: labels are torch.float32, expected int64"),
        (C, "shape", "device 1: feature shape (5,) per example, the data's input_shape is (4,)"),
        (C, "dtype", "device 1: features are torch.float64, the data's input_dtype is float32"),
        (C, "nan", "device 1: feature value nan at example 2 is not finite"),
        (C, "empty", "device 1: no training examples (num_samples() = 0, 0 in train())"),
        (C, "count", "device 1: num_samples() = 11 but train() holds 10 examples"),
        (C, "raises", "device 1: train() raised OSError: disk on fire"),
        ("binary", "binary-2", "device 1: label 2.0 at example 4 is not 0 or 1"),
        ("regression", "inf-target", "device 1: target inf at example 3 is not finite"),
        ("regression", "int-target", "device 1: targets are torch.int64, expected floats"),
        ("lm", "token", "device 1: token id 3 at example 6 is outside [0, 3)"),
        ("lm", "lm-target", "device 1: target token id 4 at example 7 is outside [0, 3)"),
    ],
)  # fmt: skip
def test_a_bad_device_is_one_line_naming_it(task, fault, message):
    data = Fleet(5, fault, at=1, task=task)
    with pytest.raises(DataError) as e:
        scan_devices(data, "full", "mine:make")
    text = str(e.value)
    assert text.startswith(message), text
    assert text.endswith("(data.source = 'mine:make')") and "\n" not in text


@pytest.mark.parametrize("task", ["classification", "binary", "regression", "lm"])
def test_good_data_of_every_task_passes(task):
    data = Fleet(5, task=task)
    report = scan_devices(data, "full", "mine:make")
    assert (report.checked, report.devices) == (5, 5)
    x_bytes = 6 * DIM * (8 if task == "lm" else 4)  # the test set: 6 examples
    y_bytes = {"classification": 6 * 8, "binary": 6 * 4, "regression": 6 * CLASSES * 4}
    test, nbytes = check_test(data, "mine:make")
    assert nbytes == x_bytes + y_bytes.get(task, x_bytes) and len(test) == 6


def test_a_nan_test_set_is_refused():
    with pytest.raises(DataError, match=r"^test set: feature value nan at example 0 "):
        check_test(Fleet(3, "test-nan"), "mine:make")


class Pairs(Dataset):
    """A map-style dataset (not a TensorDataset) whose example 3 has 5 features."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return torch.zeros(5 if i == 3 else DIM), torch.tensor(i % CLASSES)


def test_a_generic_dataset_names_the_bad_example():
    info = DataInfo((DIM,), CLASSES)
    with pytest.raises(DataError, match=r"^device 2: example 3 has feature shape \(5,\), the data"):
        check_examples(Pairs(), info, "device 2", "mine:make")


def test_sparse_devices_are_checked_too():
    data = ClicksFederated({"features": 50, "samples_per_device": 6, "nnz_per_example": 3}, 2, 0)
    scan_devices(data, "full", "clicks")  # good data passes
    bad = data.train(1)
    row = 4
    bad.csr.data[bad.csr.indptr[row]] = float("inf")
    with pytest.raises(DataError, match=rf"^device 1: feature value inf at example {row} "):
        scan_devices(data, "full", "clicks")


def test_sample_mode_checks_a_spread_of_devices_and_auto_projects_the_time():
    assert sample_ids(8) == list(range(8))
    ids = sample_ids(1000)
    assert len(ids) == 16 and ids == sorted(set(ids))
    assert ids[:8] == list(range(8)) and ids[-1] == 999 and 400 < ids[12] < 800
    data = Fleet(1000, "nan", at=500)  # 500 is not in the sample
    assert 500 not in ids
    assert scan_devices(data, "sample", "x").checked == 16
    ticks = iter(range(10**6))  # a clock that advances 1 s per reading: 1 s per device
    slow = scan_devices(data, "auto", "x", budget_s=100.0, clock=lambda: float(next(ticks)))
    assert (slow.checked, slow.projected_s) == (16, 1000.0)
    with pytest.raises(DataError, match="^device 500: feature value nan"):
        scan_devices(data, "auto", "x", budget_s=10**9)  # projected under budget: all
    with pytest.raises(DataError, match="^device 500: "):
        scan_devices(data, "full", "x")


def test_the_scan_keeps_no_device_built_and_forgetting_changes_no_data():
    """rank 0 checks every device before the job starts: it holds one device's data at a
    time (at 10,000 devices it kept all of them, 180 MB it never used again), and a
    forgotten device is built again bit for bit."""
    from edgefl.data.synthetic import SyntheticFederated

    data = SyntheticFederated({"dim": 5, "min_samples": 7, "samples_sigma": 0.0}, 40, 3)
    before = [tuple(t.clone() for t in data.train(k).tensors) for k in (0, 17, 39)]
    data.forget(0), data.forget(17), data.forget(39)
    assert data._train == {}
    report = scan_devices(data, "full", "synthetic")
    assert report.checked == 40 and data._train == {}  # every device checked, none kept
    for k, (x, y) in zip((0, 17, 39), before, strict=True):
        x2, y2 = data.train(k).tensors
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_forget_keeps_what_a_plug_in_source_cannot_build_again():
    """The default :meth:`FederatedDataset.forget` keeps everything: a user's source may
    hold data it cannot build again (here, under the built-in sources' attribute name)."""

    class Held(Fleet):
        def __init__(self) -> None:
            super().__init__(3)
            self._train = {k: TensorDataset(*self._xy(k, N)) for k in range(3)}

        def train(self, device: int):
            return self._train[device]

    data = Held()
    scan_devices(data, "full", "mine:make")
    assert sorted(data._train) == [0, 1, 2]


# -- through preflight -----------------------------------------------------------------------
def test_preflight_refuses_a_lazy_device_with_out_of_range_labels(tmp_path):
    cfg = fleet_cfg(tmp_path, 'data.args={fault = "label", at = 3}')
    with pytest.raises(DataError, match=rf"^device 3: label 5 at example 5 .*'{SRC}'\)$"):
        preflight(cfg)
    off = fleet_cfg(tmp_path, 'data.args={fault = "label", at = 3}', 'run.preflight="off"')
    assert preflight(off) == ""  # off: only the older checks (device 0's forward pass)


def test_preflight_refuses_eager_labels_beyond_the_inferred_classes(tmp_path):
    cfg = fleet_cfg(tmp_path, 'data.source="test_preflight:make_eager"')
    with pytest.raises(DataError, match=r"^device 3: label 7 at example 9 is outside \[0, 3\)"):
        preflight(cfg)


def test_preflight_refuses_zero_sample_devices_and_nan_test_sets(tmp_path):
    with pytest.raises(DataError, match=r"^device 1: no training examples"):
        preflight(fleet_cfg(tmp_path, 'data.args={fault = "empty"}'))
    with pytest.raises(DataError, match=r"^test set: feature value nan"):
        preflight(fleet_cfg(tmp_path, 'data.args={fault = "test-nan"}'))


def test_preflight_reports_what_it_checked(tmp_path):
    line = preflight(fleet_cfg(tmp_path))
    assert line.startswith("edgefl simulate: checked the data of all 4 devices and the test set")
    assert "memory estimate" in line and "\n" not in line


def test_rank_0_takes_the_test_set_its_preflight_built_once(tmp_path):
    """edgefl simulate's rank 0 checks the job, then runs it: the coordinator takes the
    test set the check built (a large fleet's is built once), only for the same data, and
    only once; a check that failed or did not keep it hands over nothing."""
    cfg = fleet_cfg(tmp_path, "seed=3")
    preflight(cfg)
    assert checked_test_set(cfg) is None  # (not kept unless asked: a notebook's process)
    preflight(cfg, keep_test=True)
    other = fleet_cfg(tmp_path, "seed=4")  # (another seed: another test set)
    assert checked_test_set(other) is None and checked_test_set(cfg) is None  # handed once
    preflight(cfg, keep_test=True)
    kept = checked_test_set(cfg)
    x, y = kept.tensors
    fresh_x, fresh_y = build_task(cfg).data.test().tensors
    assert torch.equal(x, fresh_x) and torch.equal(y, fresh_y)
    assert checked_test_set(cfg) is None
    bad = fleet_cfg(tmp_path, 'data.args={fault = "test-nan"}')
    with pytest.raises(DataError):
        preflight(bad, keep_test=True)
    assert checked_test_set(bad) is None


def test_the_in_process_backend_builds_the_test_set_once(tmp_path, monkeypatch):
    """backend="inline": the check and rank 0 share a process, so the coordinator takes the
    test set the check built (one build, the same accuracy as the MPI backend's rank 0
    gets); nothing is left kept in the process after the job, nor after a job that fails
    before rank 0 starts."""
    import edgefl
    import edgefl.preflight as preflight_module
    from edgefl.data.synthetic import SyntheticFederated

    built = []
    test = SyntheticFederated.test

    def counted(self):
        if self._test is None:
            built.append(self.num_devices)
        return test(self)

    monkeypatch.setattr(SyntheticFederated, "test", counted)
    over = {"fleet.devices": 6, "run.rounds": 1, "output.progress": "quiet", "seed": 3}
    res = edgefl.simulate(overrides=over, out=tmp_path / "a", backend="inline")
    assert built == [6]
    assert preflight_module._CHECKED_TEST is None
    assert 0.0 <= res.summary["final_accuracy"] <= 1.0
    # a run directory that refuses the job (it holds a run): the kept test set is dropped
    with pytest.raises(EdgeflError, match="already holds a run"):
        edgefl.simulate(overrides=over, out=tmp_path / "a", backend="inline")
    assert built == [6, 6]
    assert preflight_module._CHECKED_TEST is None


def test_a_fleet_too_big_for_memory_is_refused_before_it_is_built(monkeypatch, tmp_path):
    # nothing of the fleet's size may run first: these would take minutes and GBs
    import edgefl.data.synthetic as synthetic
    import edgefl.runtime.policies as policies

    def forbidden(*a, **k):
        raise AssertionError("built something of the fleet's size before the estimate")

    monkeypatch.setattr(policies, "check_policies", forbidden)
    monkeypatch.setattr(synthetic.SyntheticFederated, "test", forbidden)
    cfg = load_config(overrides=["fleet.devices=100000000", f'run.out="{tmp_path / "r"}"'])
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert time.perf_counter() - t0 < 30
    text = str(e.value)
    assert text.startswith("config key 'fleet.devices' = 100000000: the job needs about ")
    assert " TB of memory" in text and "run.preflight" in text and "\n" not in text


def test_memory_estimate_arithmetic():
    data = Fleet(100)
    est = estimate_memory(data, processes=3, model_bytes=1000)
    assert est.sampled == [0, 1, 50, 99] and sorted(set(data.built)) == est.sampled
    assert est.device_bytes == N * DIM * 4 + N * 8 + DEVICE_RECORD_BYTES
    check_memory(est, (est.total, "test"))  # exactly enough
    check_memory(est, None)  # unknown: no check
    with pytest.raises(
        ConfigError, match=r"^config key 'fleet.devices' = 100: .* is available \(test\)"
    ):
        check_memory(est, (est.total - 1, "test"))
    bigger = MemoryEstimate(100, 3, est.device_bytes, 1000, test_bytes=5)
    assert bigger.total == est.total + 5


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="Linux /proc/meminfo")
def test_available_memory_reads_this_machine():
    room = available_memory()
    assert room is not None and 10**7 < room[0] < 1 << 50 and room[1]


# -- ranks a folder named edgefl cannot shadow ---------------------------------------------
class EchoLauncher:
    def command(self, ranks: int, argv: list[str]) -> list[str]:
        return ["mpiexec", "-n", str(ranks), *argv]


def boot_code(monkeypatch, where: Path) -> str:
    """The ``-c`` program that starts a rank under Python < 3.11 (no ``-P``)."""
    with monkeypatch.context() as m:
        m.chdir(where)
        m.setattr(sys, "version_info", (3, 10, 14))
        argv = rank_python()
    assert argv[:2] == [sys.executable, "-c"]
    return argv[2]


def test_rank_command_keeps_the_working_directory_off_the_front(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cmd = mpi_command(EchoLauncher(), 3, tmp_path / "run")
    start = cmd.index(sys.executable)
    if sys.version_info >= (3, 11):
        assert cmd[start : start + 5] == [sys.executable, "-P", "-m", "edgefl", "run"]
    else:
        assert cmd[start : start + 5] == [sys.executable, "-c", cmd[start + 2], "-m", "edgefl"]
    monkeypatch.chdir(ROOT)  # a source tree run in place: its edgefl folder is the package
    assert mpi_command(EchoLauncher(), 3, tmp_path / "run")[start + 1] == "-m"


@pytest.fixture
def shadowed(tmp_path) -> Path:
    """A working directory with a bogus ``edgefl`` package and a user data module."""
    (tmp_path / "edgefl").mkdir()
    (tmp_path / "edgefl" / "__init__.py").write_text("raise ImportError('bogus edgefl')\n")
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n\n"
        "def make(num_devices, seed):\n"
        "    x, y = np.ones((6, 4), np.float32), np.arange(6) % 3\n"
        "    return [(x, y)] * num_devices, (x, y)\n"
    )
    return tmp_path


def _py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_a_folder_named_edgefl_cannot_shadow_the_ranks(shadowed, monkeypatch):
    assert "bogus edgefl" in _py("-m", "edgefl", "--version", cwd=shadowed).stderr  # the trap
    boot = ["-c", boot_code(monkeypatch, shadowed)]
    assert _py(*boot, "-m", "edgefl", "--version", cwd=shadowed).stdout.startswith("edgefl ")
    rank = ["-P"] if sys.version_info >= (3, 11) else boot
    # started as a rank is, the user's module in that folder still imports
    sets = ["--set", "data.source=mydata:make", "--set", "fleet.devices=2"]
    proc = _py(*rank, "-m", "edgefl", "simulate", "--dry-run", "--out", "r", *sets, cwd=shadowed)
    assert proc.returncode == 0, proc.stderr
    assert f" {' '.join(rank)} -m edgefl run r/config.toml --out r" in proc.stdout


# -- broken pipes ---------------------------------------------------------------------------
def test_a_closed_pipe_ends_quietly_with_status_141(tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte (`| head` that already quit)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "edgefl", "config", "docs"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


# -- bad data from a plug-in, through the real command (F5, F7 of the trust issue) ----------
BAD_DATA = """
import numpy as np


def make(num_devices, seed, fault):
    rng = np.random.default_rng(seed)
    def part(k, n=20):
        x = rng.normal(size=(n, 6)).astype(np.float32)
        y = rng.integers(0, 3, size=n).astype(np.float32)
        if fault == "float64" and k == 2:
            x = x.astype(np.float64)
        if fault == "inf-label" and k == 1:
            y[4] = np.inf
        return x, y
    return [part(k) for k in range(num_devices)], part(-1, 30)
"""


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            "float64",
            "train[2] (device 2) has float64 features, train[0] (device 0) float32: every "
            "device and the test set must give features of one dtype",
        ),
        ("inf-label", "train[1]: labels must be whole numbers, found inf"),
    ],
)
def test_a_plugin_with_bad_data_is_one_line_from_the_command(tmp_path, fault, message):
    """One device's float64 features among float32 ones, an inf label: the command says so
    in one line naming the device (exit status 2), writes nothing, and shows no
    traceback (previously: accepted silently, and 'found -9223372036854775808')."""
    (tmp_path / "bad_data_src.py").write_text(BAD_DATA)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "edgefl", "simulate", "--dry-run", "--out", str(out),
         "--set", "fleet.devices=4", "--set", "data.source=bad_data_src:make",
         "--set", f'data.args={{fault = "{fault}"}}'],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists()


def test_features_are_checked_for_nan_a_part_at_a_time(monkeypatch):
    """Issue 27: the NaN/inf check of a large set (rank 0's test set of the whole fleet)
    takes CHECK_ELEMENTS features at a time (isfinite of all at once made temporaries of
    1.7x the set, the peak of rank 0 at 10,000 devices), and still names the first bad
    example."""
    import edgefl.data.checks as checks

    seen: list[int] = []
    isfinite = torch.isfinite

    def spy(t):
        seen.append(t.numel())
        return isfinite(t)

    monkeypatch.setattr(checks, "CHECK_ELEMENTS", 1000)
    monkeypatch.setattr(torch, "isfinite", spy)
    info = DataInfo(input_shape=(7,), num_classes=3)
    x = torch.zeros(1000, 7)
    checks._check_features(x, info)
    assert max(seen) <= 1000 and sum(seen) == x.numel()
    x[713, 4] = float("-inf")
    x[900, 0] = float("nan")
    with pytest.raises(checks._Bad, match="feature value -inf at example 713 is not finite"):
        checks._check_features(x, info)
