"""Parameter-server pushes through edgefl simulate: filtered, compressed updates with key
caching; a lost cached key list is resolved by a resend, never by applying values to wrong
keys. The jobs run in one process (``--backend inline``: the same messages over the
in-process transport); sparse, filtered pushes with lost key lists over real mpiexec are
in tests/test_ps_pull.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_edgefl

# a sparse workload: each device's update touches only its working set (the features its
# data references), the same keys every round, so key caching pays off
CLICKS = [
    "--set", "data.source=clicks", "--set", "model.name=logreg", "--rounds", "8",
    "--set", "data.args={features=2000, samples_per_device=200, nnz_per_example=10}",
    "--set", "output.progress=quiet",
]  # fmt: skip
SPARSE = [*CLICKS, "--set", "ps.sparse=true", "--set", "ps.key_cache=true"]


def _run(out, *extra):
    proc = run_edgefl("simulate", "--out", str(out), "--backend", "inline", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    """The dense-push run both tests compare with (made once)."""
    return _run(tmp_path_factory.mktemp("ps") / "dense", *CLICKS)


def test_sparse_pushes_cut_bytes_and_cache_misses_are_resent(tmp_path, dense):
    sparse = _run(tmp_path / "sparse", *SPARSE)
    forgetful = _run(tmp_path / "forget", *SPARSE, "--set", "debug.forget_key_cache_every=2")
    up = {k: sum(d["bytes_up"] for d in s["devices"].values())
          for k, s in (("dense", dense), ("sparse", sparse))}  # fmt: skip
    assert up["sparse"] < 0.5 * up["dense"]
    assert sparse["sparse_resends"] == 0
    # the coordinator lost its key lists: devices resent full index lists; same model
    assert forgetful["sparse_resends"] > 0
    assert forgetful["model_sha256"] == sparse["model_sha256"]
    assert forgetful["rejected"] == 0
    # lossless encoding (float32 values, no filter): the same model as dense pushes, bit
    # for bit (nothing is held back, so the end-of-training flush applies nothing)
    assert sparse["final_accuracy"] == dense["final_accuracy"]
    assert sparse["model_sha256"] == dense["model_sha256"]
    assert sparse["rounds_done"] == dense["rounds_done"] == 8


def test_significance_filter_holds_back_and_flushes(tmp_path, dense):
    s = _run(tmp_path / "sig", *SPARSE, "--set", 'ps.filters=["significant"]',
             "--set", "ps.sig_threshold=0.001", "--set", "ps.value_dtype=float16")  # fmt: skip
    up = sum(d["bytes_up"] for d in s["devices"].values())
    assert up < sum(d["bytes_up"] for d in dense["devices"].values())
    # what the filter held back is flushed at the end: accuracy close to dense
    assert abs(s["final_accuracy"] - dense["final_accuracy"]) <= 0.02
