"""Stop at round k, resume from the checkpoint, and end exactly where the uninterrupted run
ends: the golden configurations (tests/golden) in one process over the loopback transport.

Every plugin's state (``plugins/<name>/state``) and every worker half's per-device state
(``plugins/<name>/devices/<id>``, collected with the STATE exchange) is in the checkpoint;
the resumed run's final ``model_sha256`` must equal the recorded golden hash, and its
summary statistics (DP epsilon, lost tasks, staleness, the plugins' counters) must equal the
uninterrupted run's. The same is checked over real mpiexec in tests/test_resume_mpi.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden.configs import (  # noqa: E402
    SUMMARIES,
    effective_config,
    job,
    load_models,
    sha256_of,
)

MODELS = load_models()
LOOPBACK = sorted(n for n, e in MODELS.items() if e.get("backend", "loopback") != "mpi")
# summary.json fields a resume must reproduce (timing fields excluded)
SAME = ("rounds_done", "dp_epsilon", "lost_tasks", "staleness_hist", "consistency",
        "failed_devices", "stopped")  # fmt: skip


def _run(sets: list[str], run_dir: Path, resume: Path | None = None) -> dict:
    from conftest import run_loopback_job

    from edgefl.ckpt import load_checkpoint
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg, ranks = effective_config(sets)
    task0 = build_task(cfg)  # before the worker threads (see golden/configs.run_loopback)
    state = load_checkpoint(resume) if resume is not None else None

    def coordinator(cfg_, t, task, out_dir=None):
        return Coordinator(cfg_, t, task0, out_dir=run_dir, resume=state)

    out: dict = {}

    def go() -> None:
        try:
            out["r"] = run_loopback_job(cfg, ranks, coordinator_cls=coordinator)
        except BaseException as e:  # noqa: BLE001
            out["e"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(240)
    assert not th.is_alive(), "loopback job hung"
    if "e" in out:
        raise out["e"]
    coord, statuses = out["r"]
    assert statuses == [0] * ranks, statuses
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model_sha256"] == sha256_of(coord.global_model)
    return summary


@pytest.mark.parametrize("name", LOOPBACK)
def test_stop_and_resume_ends_with_the_golden_model(name):
    entry = MODELS[name]
    cfg, _ = effective_config(entry["set"])
    rounds = cfg["run"]["rounds"]
    k = max(1, rounds // 2)
    with tempfile.TemporaryDirectory(prefix="edgefl-resume-") as tmp:
        # the uninterrupted run: the golden test's, when it ran in this session
        whole = SUMMARIES.get(tuple(entry["set"])) or _run(entry["set"], Path(tmp) / "whole")
        first = Path(tmp) / "part"
        part = _run(job(entry["set"], f"debug.stop_after_round={k}"), first)
        assert part["rounds_done"] == k
        ckpt = first / "checkpoints" / f"ckpt-{k:06d}.h5"
        assert ckpt.is_file()
        resumed = _run(entry["set"], Path(tmp) / "resumed", resume=ckpt)
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
