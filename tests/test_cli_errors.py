"""The ``edgefl`` command on user errors: status 2, one ``edgefl: error:`` line, no
traceback, nothing written. Plus ``config show`` and ``simulate --dry-run``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import run_edgefl

from edgefl.ckpt import save_checkpoint
from edgefl.cli import MPI_ENV
from edgefl.config import config_from_toml, load_config
from edgefl.config.ranks import usable_cores


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder (None) below ``root``."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def assert_user_error(proc, *needles: str) -> str:
    """Status 2, stderr is one ``edgefl: error:`` line naming every needle, no traceback."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 2, out
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.stderr
    line = lines[0]
    assert line.startswith("edgefl: error: "), line
    assert len(line) > len("edgefl: error: ") + 10, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def truncated_checkpoint(path: Path) -> Path:
    save_checkpoint(path, {"round": 3, "w": np.arange(1000, dtype=np.float32)})
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return path


# ------------------------------------------------------------------------- simulate

# (id, config file text or None, extra args, substrings the message must contain)
SIMULATE_CASES = [
    ("unknown-key", "[train]\nlrr = 0.1\n", [], ["'train.lrr'", "job.toml", "'train.lr'"]),
    ("wrong-type", '[run]\nrounds = "ten"\n', [], ["'run.rounds'", "'ten'", "an integer"]),
    ("missing-config", None, ["nope.toml"], ["nope.toml", "not found"]),
    ("config-is-a-directory", None, ["somedir"], ["'somedir' is a directory"]),
    (
        "plugin-raises",
        '[data]\nsource = "raising_source:make"\n',
        [],
        ["data.source 'raising_source:make'", "raised RuntimeError: cannot read my data"],
    ),
    (
        "plugin-module",
        '[data]\nsource = "no_such_pkg.mod:fn"\n',
        [],
        ["data.source", "no_such_pkg.mod"],
    ),
    ("model-module", '[model]\nname = "no_such_pkg:Net"\n', [], ["model.name", "no_such_pkg"]),
    (
        "fedh5-missing",
        '[data]\nsource = "fedh5"\nargs = {path = "missing.h5"}\n',
        [],
        ["missing.h5", "not found"],
    ),
    ("resume-truncated", None, ["--resume", "trunc.h5"], ["trunc.h5", "truncated or corrupt"]),
    ("resume-garbage", None, ["--resume", "garbage.h5"], ["garbage.h5", "not an HDF5 file"]),
    ("resume-missing", None, ["--resume", "gone.h5"], ["gone.h5", "no such file"]),
]


@pytest.mark.parametrize(
    "text, extra, needles", [c[1:] for c in SIMULATE_CASES], ids=[c[0] for c in SIMULATE_CASES]
)
def test_simulate_user_error(tmp_path, text, extra, needles):
    args = ["simulate"]
    if text is not None:
        (tmp_path / "job.toml").write_text(text, encoding="utf-8")
        args.append("job.toml")
    truncated_checkpoint(tmp_path / "trunc.h5")
    (tmp_path / "garbage.h5").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp_path / "somedir").mkdir()
    (tmp_path / "raising_source.py").write_text(
        "def make(num_devices, seed):\n    raise RuntimeError('cannot read my data')\n"
    )
    before = snapshot(tmp_path)
    proc = run_edgefl(*args, *extra, "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert_user_error(proc, *needles)
    assert not (tmp_path / "run").exists()
    assert snapshot(tmp_path) == before


def test_empty_config_file_warns_and_runs_the_defaults(tmp_path):
    (tmp_path / "empty.toml").write_text("# nothing yet\n")
    proc = run_edgefl("simulate", "empty.toml", "--dry-run", "--out", "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "edgefl: warning: config file 'empty.toml' sets nothing" in proc.stderr


def test_simulate_error_leaves_existing_run_dir_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("# my earlier run\nseed = 42\n", encoding="utf-8")
    (tmp_path / "job.toml").write_text('[model]\nname = "no_such_pkg:Net"\n', encoding="utf-8")
    before = snapshot(tmp_path)
    proc = run_edgefl("simulate", "job.toml", "--out", str(run), cwd=tmp_path)
    assert_user_error(proc, "no_such_pkg")
    assert (run / "config.toml").read_text(encoding="utf-8") == "# my earlier run\nseed = 42\n"
    assert snapshot(tmp_path) == before


def test_simulate_refuses_finished_run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1, "accuracy": 0.5}\n', encoding="utf-8")
    before = snapshot(tmp_path)
    proc = run_edgefl(
        "simulate", "--devices", "2", "--rounds", "1", "--out", str(run), cwd=tmp_path
    )
    assert_user_error(proc, "metrics.jsonl", "--resume")
    assert snapshot(tmp_path) == before  # no config.toml written either


def test_simulate_dry_run_prints_command(tmp_path):
    proc = run_edgefl("simulate", "--dry-run", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    cmd = shlex.split(lines[0])
    assert "mpiexec" in Path(cmd[0]).name
    i = cmd.index("-n")
    # default fleet.ranks = auto: the coordinator and a worker per core (8 devices)
    assert cmd[i + 1] == str(1 + min(8, usable_cores()))
    assert "edgefl run" in lines[0]
    assert str(tmp_path / "run" / "config.toml") in cmd
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- run, inspect


def test_run_outside_mpi(tmp_path, monkeypatch):
    listed = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")
    for var in {*listed, *MPI_ENV}:
        monkeypatch.delenv(var, raising=False)  # run_edgefl copies os.environ
    (tmp_path / "job.toml").write_text("seed = 1\n", encoding="utf-8")
    before = snapshot(tmp_path)
    proc = run_edgefl("run", "job.toml", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert_user_error(proc, "mpiexec -n", "job.toml")
    assert snapshot(tmp_path) == before


def test_inspect_corrupt_checkpoint(tmp_path):
    ckpt = truncated_checkpoint(tmp_path / "ckpt-000003.h5")
    before = snapshot(tmp_path)
    proc = run_edgefl("inspect", str(ckpt), cwd=tmp_path)
    assert_user_error(proc, "ckpt-000003.h5")
    assert proc.stdout == ""
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------- config show


def test_config_show_unknown_key(tmp_path):
    proc = run_edgefl("config", "show", "--set", "train.lrr=1", cwd=tmp_path)
    assert_user_error(proc, "'train.lrr'", "did you mean 'train.lr'")
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_config_show_prints_defaults(tmp_path):
    proc = run_edgefl("config", "show", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    tomllib.loads(proc.stdout)
    assert config_from_toml(proc.stdout) == load_config()
    assert list(tmp_path.iterdir()) == []


def test_config_show_set_below_scalar_in_free_table(tmp_path):
    proc = run_edgefl("config", "show", "--set", "data.args.alpha.x=1", cwd=tmp_path)
    assert_user_error(proc, "data.args")


def test_config_show_date_in_free_table(tmp_path):
    proc = run_edgefl("config", "show", "--set", "data.args.day=2020-01-01", cwd=tmp_path)
    assert_user_error(proc, "data.args")
