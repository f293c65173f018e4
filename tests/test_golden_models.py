"""Golden final models: named job configs (tests/golden/configs.py) must train the model
recorded in tests/golden/models.json, bit for bit.

The hashes were recorded (tests/golden/record.py) with portable kernels (``run.kernels``,
the default; edgefl/kernels.py), where the real ``edgefl simulate`` over mpiexec and the
in-process loopback run gave the same model for every config (those marked ``"backend":
"mpi"`` are recorded over MPI only, see their ``why``). They hold on any x86-64 CPU with
AVX2, whatever kernels it would pick by itself (tests/test_portable_kernels.py runs the set
under both capabilities). Every config runs here in one process over the loopback
transport; a few, and the MPI-only ones, also run through the real CLI. A mismatch means
the change altered what training computes: re-record only if that is an intentional
behaviour change.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_edgefl
from golden.configs import (
    CONFIGS,
    MPI_ONLY,
    MPI_SAMPLE,
    check_deterministic,
    effective_config,
    load_models,
    mismatch_message,
    run_loopback,
    simulate_argv,
)

MODELS = load_models()
LOOPBACK = sorted(n for n, e in MODELS.items() if e.get("backend") != "mpi")
MPI = sorted({*MPI_SAMPLE, *(n for n, e in MODELS.items() if e.get("backend") == "mpi")})


def test_recorded_configs_are_the_defined_ones():
    """models.json holds exactly configs.CONFIGS with the same overrides (edit both through
    tests/golden/record.py), and every config is deterministic."""
    assert sorted(MODELS) == sorted(CONFIGS)
    for name, entry in MODELS.items():
        assert entry["set"] == CONFIGS[name], f"{name}: overrides changed since recording"
        assert (entry.get("backend") == "mpi") == (name in MPI_ONLY), name
        cfg, ranks = effective_config(entry["set"])
        check_deterministic(name, cfg)
        assert entry["ranks"] == recorded_ranks(cfg, ranks), f"{name}: {ranks} ranks now"


def recorded_ranks(cfg: dict, ranks: int) -> int | str:
    """What models.json records as a config's ranks: "auto" where fleet.ranks is (the count
    follows the machine's cores, the model does not), else the count edgefl simulate runs."""
    return "auto" if cfg["fleet"]["ranks"] == "auto" else ranks


@pytest.mark.parametrize("name", LOOPBACK)
def test_golden_model_loopback(name):
    entry = MODELS[name]
    summary, ranks = run_loopback(entry["set"])
    assert entry["ranks"] in ("auto", ranks)
    got = summary["model_sha256"]
    assert got == entry["model_sha256"], mismatch_message(name, entry, got, "loopback")


@pytest.mark.mpi
@pytest.mark.parametrize("name", MPI)
def test_golden_model_mpi(name, launcher, tmp_path):
    """The real CLI (mpiexec), started outside the repository so that the ranks import the
    installed edgefl, as a user's run does."""
    entry = MODELS[name]
    out = tmp_path / "run"
    proc = run_edgefl(*simulate_argv(entry["set"], out), cwd=tmp_path)
    assert proc.returncode == 0, f"{name}: edgefl simulate failed\n{proc.stderr[-3000:]}"
    got = json.loads((out / "summary.json").read_text())["model_sha256"]
    assert got == entry["model_sha256"], mismatch_message(name, entry, got, "mpiexec")
