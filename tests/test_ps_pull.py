"""Working-set pulls over real mpiexec (``ps.pull = "working-set"``): rank 0 sends each worker
only the model values its devices' data can touch. The final model is bit-identical to full
pulls, fewer bytes go down, a malformed working set is rejected (that rank gets full models),
and a resumed run (whose workers send their working sets again) is bit-exact."""

from __future__ import annotations

import json

import pytest
from conftest import run_edgefl

pytestmark = pytest.mark.mpi

ROUNDS = 6
NUMEL = 2 * 2000 + 2  # logreg on 2000 features, 2 classes: weight (2, 2000) + bias (2,)
CLICKS = [
    "--set", "data.source=clicks", "--set", "model.name=logreg", "--rounds", str(ROUNDS),
    "--set", "data.args={features=2000, samples_per_device=200, nnz_per_example=10}",
    "--set", "output.progress=quiet", "--set", "seed=5",
    "--ranks", "3",  # (2 workers of 4 devices each: each device's working set is well
    # under half the model)
]  # fmt: skip
WS = ["--set", "ps.pull=working-set"]


class _Runs:
    """Runs shared by the tests of this module, each made once, on first use."""

    def __init__(self, root) -> None:
        self.root = root
        self.done: dict[str, tuple[dict, str]] = {}

    def get(self, name: str, *extra: str) -> tuple[dict, str]:
        if name not in self.done:
            out = self.root / name
            proc = run_edgefl("simulate", "--out", str(out), *CLICKS, *extra)
            assert proc.returncode == 0, proc.stderr[-3000:]
            summary = json.loads((out / "summary.json").read_text())
            self.done[name] = (summary, proc.stdout + proc.stderr)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launcher):
    return _Runs(tmp_path_factory.mktemp("pull"))


def test_working_set_pull_is_bit_identical_with_fewer_bytes_down(runs):
    full, _ = runs.get("full")
    ws, _ = runs.get("ws", *WS)
    assert ws["model_sha256"] == full["model_sha256"]
    assert ws["rounds_done"] == full["rounds_done"] == ROUNDS
    # (a rank is sent its devices' union: about 0.7 of full pulls here, 2 ranks of 4 devices)
    assert ws["wire"]["bytes_sent"] < 0.75 * full["wire"]["bytes_sent"]
    info = ws["ps"]["working_set"]
    assert info["rejected_devices"] == [] and len(info["rank_keys"]) == ws["workers"]
    assert 0.0 < info["fraction_mean"] < 0.5
    for d, dev in ws["devices"].items():
        keys = round(info["fraction"][d] * NUMEL)
        # per round: MODEL_KEYS + TRAIN headers and the device's own working-set values
        assert dev["bytes_down"] == ROUNDS * (2 * 80 + 4 * keys)
        assert full["devices"][d]["bytes_down"] == ROUNDS * (2 * 80 + 4 * NUMEL)
        # up: the same updates plus one WORKSET message (int32 keys)
        assert dev["bytes_up"] == full["devices"][d]["bytes_up"] + 80 + 4 * keys
        assert dev["msgs_up"] == full["devices"][d]["msgs_up"] + 1
    rows = [json.loads(x) for x in (runs.root / "ws" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["bytes_down"] for r in rows) == sum(
        d["bytes_down"] for d in ws["devices"].values()
    )


def test_malformed_working_set_is_rejected_and_the_run_goes_on(runs):
    full, _ = runs.get("full")
    bad, log = runs.get("bad", *WS, "--set", "ps.debug_bad_working_set=unsorted")
    assert "rejected message from rank 1: WORKSET of rank 1, device 0" in log
    assert "must be sorted" in log
    assert bad["rejected"] == 1 and bad["rounds_done"] == ROUNDS
    info = bad["ps"]["working_set"]
    assert info["rejected_devices"] == [0]
    assert "1" not in info["rank_keys"] and len(info["rank_keys"]) == bad["workers"] - 1
    # rank 1 got full models: still the same final model
    assert bad["model_sha256"] == full["model_sha256"]
    assert bad["devices"]["0"]["bytes_down"] == full["devices"]["0"]["bytes_down"]


def test_resume_with_working_set_pulls_is_bit_exact(runs, tmp_path):
    ws, _ = runs.get("ws", *WS)
    part = tmp_path / "part"
    p = run_edgefl("simulate", "--out", str(part), *CLICKS, *WS, "--set",
                   "debug.stop_after_round=3")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = part / "checkpoints" / "ckpt-000003.h5"
    p = run_edgefl("simulate", "--resume", str(ckpt), *CLICKS, *WS)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["rounds_done"] == ROUNDS
    assert resumed["model_sha256"] == ws["model_sha256"]
    # the resumed workers sent their working sets again and were pulled by them
    assert resumed["ps"]["working_set"]["fraction"] == ws["ps"]["working_set"]["fraction"]


def test_working_set_pull_with_filtered_sparse_pushes_and_lost_key_lists(runs):
    """Sparse pushes through the KKT and significance filters: the accepted working set is
    each device's first cached key list (pushes are bitmaps over it from the start); when
    rank 0 forgets its key lists, the misses are resent. Same model as full pulls."""
    sparse = ["--set", "ps.sparse=true", "--set", "ps.key_cache=true", "--set",
              'ps.filters=["kkt", "significant"]', "--set", "ps.sig_threshold=0.01",
              "--set", "server.l1=0.01", "--set", "train.lr=0.5"]  # fmt: skip
    full, _ = runs.get("sparse-full", *sparse)
    ws, _ = runs.get("sparse-ws", *sparse, *WS, "--set", "debug.forget_key_cache_every=3")
    assert ws["model_sha256"] == full["model_sha256"]
    assert full["sparse_resends"] == 0 and ws["sparse_resends"] > 0 and ws["rejected"] == 0
    assert ws["ps"]["kkt_skipped"] == full["ps"]["kkt_skipped"] > 0
    for s in (full, ws):
        for m in s["ps"]["mass"].values():
            assert abs(m["produced"] - m["received"]) <= 1e-6 * m["received_abs"]
    assert ws["wire"]["bytes_sent"] < full["wire"]["bytes_sent"]
