"""``edgefl simulate --backend inline|mpi`` (and ``run.backend``): the in-process backend from
the command line writes the run directory an MPI run writes and trains the same model; its
dry run, resume, exit statuses and one-line errors behave as the MPI path's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_edgefl

import edgefl

# a tiny job: 4 devices, 2 rounds, an 8-unit MLP (about a second in process)
TINY = [
    "--set", "fleet.devices=4", "--set", "run.rounds=2", "--set", "data.args.dim=10",
    "--set", "data.args.classes=4", "--set", "model.args.hidden=[8]",
    "--set", "fleet.device=cpu", "--set", "sim.reference_s_per_sample=0.0001",
    "--set", "output.progress=quiet",
]  # fmt: skip


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def inline_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "inline"
    p = run_edgefl("simulate", "--backend", "inline", *TINY, "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "in this process (threads, no MPI)" in p.stdout.splitlines()[0]
    assert "mpiexec" not in p.stdout + p.stderr
    return out


def test_inline_cli_writes_the_run_directory(inline_out):
    s = _summary(inline_out)
    assert len(s["model_sha256"]) == 64
    assert (inline_out / "exit_status").read_text().strip() == "0"
    for name in ("metrics.jsonl", "final_model.pt", "config.toml", "events.jsonl"):
        assert (inline_out / name).is_file(), name
    assert 'backend = "inline"' in (inline_out / "config.toml").read_text()
    assert len((inline_out / "metrics.jsonl").read_text().splitlines()) == 2


def test_inline_model_does_not_depend_on_the_rank_count(inline_out, tmp_path):
    # under the virtual clock the worker ranks (threads here) only share out the devices
    out = tmp_path / "two"
    p = run_edgefl("simulate", "--backend", "inline", *TINY, "--ranks", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "4 devices on 1 worker ranks" in p.stdout
    assert _summary(out)["model_sha256"] == _summary(inline_out)["model_sha256"]


@pytest.mark.mpi
def test_inline_and_mpi_backends_train_the_same_model(inline_out, tmp_path, launcher):
    out = tmp_path / "mpi"
    p = run_edgefl("simulate", "--backend", "mpi", *TINY, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "in this process" not in p.stdout
    assert _summary(out)["model_sha256"] == _summary(inline_out)["model_sha256"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ours = [json.loads(x) for x in (inline_out / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in ours]


def test_bad_backend_is_one_argparse_error():
    p = run_edgefl("simulate", "--backend", "foo", timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    errors = [x for x in p.stderr.splitlines() if "error:" in x]
    assert errors == [
        "edgefl simulate: error: argument --backend: invalid choice: 'foo' "
        "(choose from 'mpi', 'inline')"
    ]


def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path):
    out = tmp_path / "dry"
    p = run_edgefl("simulate", "--backend", "inline", *TINY, "--ranks", "3", "--out", str(out),
                   "--dry-run")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (
        "inline: 3 ranks in this process (threads, no MPI): 4 devices on 2 worker ranks + "
        f"coordinator, run directory {out}"
    )
    # run.backend chooses the backend
    p = run_edgefl("simulate", *TINY, "--set", "run.backend=inline", "--dry-run", "--out",
                   str(out))  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("inline: "), p.stderr
    assert not out.exists()


def test_backend_option_wins_over_run_backend(tmp_path, launcher):
    out = tmp_path / "dry"
    p = run_edgefl("simulate", *TINY, "--set", "run.backend=inline", "--backend", "mpi",
                   "--dry-run", "--out", str(out))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert " -m edgefl run " in p.stdout and "inline" not in p.stdout
    assert not out.exists()


def test_errors_are_one_line_with_status_2(inline_out, tmp_path):
    # a run directory that holds a run already: refused before anything starts
    p = run_edgefl("simulate", "--backend", "inline", *TINY, "--out", str(inline_out))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "already holds a run" in p.stderr
    # a bad value
    p = run_edgefl("simulate", "--backend", "inline", "--set", "run.rounds=0", "--out",
                   str(tmp_path / "x"))  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("edgefl: error: ")
    assert p.stderr.strip().count("\n") == 0 and not (tmp_path / "x").exists()


def test_inline_resume_continues_to_the_uninterrupted_model(tmp_path):
    job = [*TINY, "--set", "run.rounds=4", "--set", "run.checkpoint_every=2"]
    full, part = tmp_path / "full", tmp_path / "part"
    p = run_edgefl("simulate", "--backend", "inline", *job, "--out", str(full))
    assert p.returncode == 0, p.stderr
    p = run_edgefl("simulate", "--backend", "inline", *job, "--set", "debug.stop_after_round=2",
                   "--out", str(part))  # fmt: skip
    assert p.returncode in (0, 3), p.stderr
    assert len((part / "metrics.jsonl").read_text().splitlines()) == 2
    # no config given: the checkpoint's own (its run.backend is inline)
    p = run_edgefl("simulate", "--resume", str(part / "checkpoints"))
    assert p.returncode == 0, p.stderr
    assert "in this process (threads, no MPI)" in p.stdout
    assert len((part / "metrics.jsonl").read_text().splitlines()) == 4
    assert _summary(part)["model_sha256"] == _summary(full)["model_sha256"]


def test_simulate_defaults_to_run_backend(tmp_path, capsys):
    sets = {
        "fleet.devices": 2, "run.rounds": 1, "data.args.dim": 10, "data.args.classes": 4,
        "model.args.hidden": [8], "fleet.device": "cpu", "output.progress": "quiet",
        "run.backend": "inline",
    }  # fmt: skip
    r = edgefl.simulate(overrides=sets, out=tmp_path / "run")  # (no MPI launched)
    assert "in this process (threads, no MPI)" in capsys.readouterr().out
    assert r.config["run"]["backend"] == "inline" and len(r.metrics) == 1
