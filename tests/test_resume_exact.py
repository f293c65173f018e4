"""Stop at round k, resume from the checkpoint, and end exactly where the uninterrupted run
ends: the golden configurations (tests/golden) in one process over the loopback transport.

Every plugin's state (``plugins/<name>/state``) and every worker half's per-device state
(``plugins/<name>/devices/<id>``, collected with the STATE exchange) is in the checkpoint;
the resumed run's final ``model_sha256`` must equal the recorded golden hash, and its
summary statistics (DP epsilon, lost tasks, staleness, the plugins' counters) must equal the
uninterrupted run's. The same is checked over real mpiexec in tests/test_resume_mpi.py.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden.configs import (  # noqa: E402
    SUMMARIES,
    effective_config,
    job,
    load_models,
    run_loopback_dir,
)

MODELS = load_models()
LOOPBACK = sorted(n for n, e in MODELS.items() if e.get("backend", "loopback") != "mpi")
# summary.json fields a resume must reproduce (timing fields excluded)
SAME = ("rounds_done", "dp_epsilon", "lost_tasks", "staleness_hist", "consistency",
        "failed_devices", "stopped")  # fmt: skip


@pytest.mark.parametrize("name", LOOPBACK)
def test_stop_and_resume_ends_with_the_golden_model(name):
    entry = MODELS[name]
    cfg, _ = effective_config(entry["set"])
    rounds = cfg["run"]["rounds"]
    k = max(1, rounds // 2)
    with tempfile.TemporaryDirectory(prefix="edgefl-resume-") as tmp:
        # the uninterrupted run: the golden test's, when it ran in this session
        whole = SUMMARIES.get(tuple(entry["set"]))
        whole = whole or run_loopback_dir(entry["set"], Path(tmp) / "whole")
        first = Path(tmp) / "part"
        part = run_loopback_dir(job(entry["set"], f"debug.stop_after_round={k}"), first)
        assert part["rounds_done"] == k
        ckpt = first / "checkpoints" / f"ckpt-{k:06d}.h5"
        assert ckpt.is_file()
        resumed = run_loopback_dir(entry["set"], Path(tmp) / "resumed", resume=ckpt)
    assert whole["model_sha256"] == entry["model_sha256"], f"{name}: the uninterrupted run"
    assert resumed["model_sha256"] == entry["model_sha256"], (
        f"{name}: stopped at round {k} of {rounds} and resumed, the final model differs"
    )
    for key in SAME:
        assert resumed[key] == whole[key], f"{name}: summary {key!r} after the resume"
    for key in ("hermes", "gddr", "ps", "ordering"):
        a, b = whole.get(key), resumed.get(key)
        if isinstance(a, dict):
            for sub in ("iterations", "pulls", "pushes", "messages", "tau", "epochs", "mass",
                        "kkt_skipped", "allocations", "wi"):  # fmt: skip
                if sub in a:
                    assert b[sub] == a[sub], f"{name}: summary {key}.{sub} after the resume"
