"""The worked example plugin docs/examples/update_stats.py (docs/write-your-own-algorithm.md).

Its two halves without MPI (fake cores), a whole job over the loopback transport, and over
real mpiexec: its summary in summary.json, an unchanged model (``model_sha256`` equals the
run without it), its counters and per-device state coming back from a checkpoint on
``--resume``, and bad plugin specs failing with one line before MPI starts.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, SMALL_JOB, run_edgefl, run_loopback_job

from edgefl.algorithms import check_config
from edgefl.ckpt import load_checkpoint, save_checkpoint
from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.policies.consistency import Apply, Arrival
from edgefl.runtime import devstate

EXAMPLES = ROOT / "docs" / "examples"
PLUGIN = 'algorithm.plugins=["update_stats:UpdateStats"]'
WARN = "algorithm.plugin_args.update_stats.warn_norm=0.5"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def us(monkeypatch):
    """The example module, imported from docs/examples."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("update_stats")


def _arrival(d: int, delta: np.ndarray) -> Arrival:
    return Arrival(d, 0, 0, 10, 0.5, delta.astype(np.float32))


# ------------------------------------------------------------------- the halves, no MPI


def test_coordinator_half_counts_norms_and_checkpoints(us, tmp_path):
    cfg = load_config(overrides=[PLUGIN, WARN])
    core = SimpleNamespace(cfg=cfg, devices={0: {}, 1: {}}, version=0)
    p = us.UpdateStats.coordinator(core, "update_stats")
    deltas = {0: np.array([0.0, 0.5]), 1: np.array([3.0, 4.0])}  # norms 0.5 and 5
    ap = Apply("aggregate", [_arrival(d, x) for d, x in deltas.items()])
    before = [a.delta.copy() for a in ap.arrivals]
    p.after_apply(ap, 0.0)
    p.after_apply(Apply("mix", [_arrival(1, np.array([0.0, 1.0]))], [0.5]), 1.0)
    assert all(np.array_equal(a.delta, b) for a, b in zip(ap.arrivals, before))  # read only
    s = p.summary()["update_stats"]
    assert s["updates"] == 3 and s["over_warn_norm"] == 2  # 5 and 1; 0.5 is not above 0.5
    assert s["min_norm"] == pytest.approx(0.5) and s["max_norm"] == pytest.approx(5.0)
    assert s["mean_norm"] == pytest.approx(6.5 / 3)
    assert s["devices"]["1"] == {"updates": 2, "over": 2, "last_norm": 1.0, "max_norm": 5.0}
    # the state survives a real checkpoint file (str keys, plain leaves)
    path = tmp_path / "ckpt.h5"
    save_checkpoint(path, {"plugins": {"update_stats": {"state": p.state_dict()}}})
    q = us.UpdateStats.coordinator(core, "update_stats")
    assert q.summary()["update_stats"]["min_norm"] is None  # nothing seen yet
    q.load_state_dict(load_checkpoint(path)["plugins"]["update_stats"]["state"])
    assert q.summary() == p.summary()
    # an empty state (no update before the checkpoint) loads too
    save_checkpoint(path, {"s": us.UpdateStats.coordinator(core, "update_stats").state_dict()})
    q.load_state_dict(load_checkpoint(path)["s"])
    assert q.summary()["update_stats"]["updates"] == 0


def test_worker_half_counts_tasks_per_device(us):
    cfg = load_config(overrides=[PLUGIN])
    core = SimpleNamespace(cfg=cfg, devices=[1, 3])
    w = us.UpdateStats.worker(core, "update_stats")
    info: dict = {"rank": 1}
    w.on_register(info)
    json.dumps(info)  # REGISTER is JSON
    assert info["update_stats"] == {"devices": 2, "format": 1}
    for d in (1, 1, 3):
        w.before_train(d, None)
    assert [w.device_state(d) for d in (1, 3)] == [{"tasks": 2}, {"tasks": 1}]
    # what the STATE exchange carries, and back on another rank's fresh half
    wire = devstate.decode(devstate.encode({"update_stats": {"1": w.device_state(1)}}))
    fresh = us.UpdateStats.worker(core, "update_stats")
    fresh.load_device_state(1, wire["update_stats"]["1"])
    assert fresh.device_state(1) == {"tasks": 2} and fresh.device_state(3) == {"tasks": 0}


@pytest.mark.parametrize(
    "sets, key",
    [
        (["algorithm.plugin_args.update_stats.warn_norm=0"], "update_stats.warn_norm' = 0"),
        (['algorithm.plugin_args.update_stats.warn_norm="x"'], "update_stats.warn_norm'"),
        (
            ["algorithm.plugin_args.update_stats.warn=1"],
            "'algorithm.plugin_args.update_stats.warn'",
        ),
        (["ps.servers=1", "fleet.ranks=4"], "'ps.servers' = 1"),
    ],
)
def test_check_config_names_the_key(us, sets, key):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(overrides=[PLUGIN, *sets]))
    assert key in str(e.value)


def test_loopback_job_same_model_and_plausible_stats(us):
    plain, _ = run_loopback_job(load_config(overrides=SMALL_JOB), ranks=3)
    coord, statuses = run_loopback_job(load_config(overrides=[*SMALL_JOB, PLUGIN]), ranks=3)
    assert statuses == [0, 0, 0]
    assert np.array_equal(coord.global_model, plain.global_model)
    s = coord.plugin("update_stats").summary()["update_stats"]
    assert s["updates"] == 5 * 3 and sorted(s["devices"], key=int) == ["0", "1", "2", "3", "4"]
    assert all(v["updates"] == 3 for v in s["devices"].values())
    assert 0 < s["min_norm"] <= s["mean_norm"] <= s["max_norm"] < 100


def test_survives_a_rehost_before_its_first_checkpoint(us, tmp_path):
    # worker rank 2 dies at its 2nd task, before any checkpoint: its devices move to rank 1,
    # whose plugin half never saw them (in one process: the inline backend)
    import edgefl

    sets = {"fleet.devices": 4, "fleet.ranks": 3, "run.rounds": 3, "run.checkpoint_every": 0,
            "algorithm.plugins": ["update_stats:UpdateStats"],
            "debug.kill_ranks": [2], "debug.kill_after_tasks": 2}  # fmt: skip
    r = edgefl.simulate(overrides=sets, out=tmp_path / "run", backend="inline")
    s = r.summary
    assert s["stopped"] == "" and list(s["failed_ranks"]) == ["2"]
    assert sorted(m["device"] for m in s["rehosted"]) == [1, 3]
    stats = s["update_stats"]
    assert sorted(stats["devices"], key=int) == ["0", "1", "2", "3"]
    counts = _task_counts(tmp_path / "run" / "checkpoints" / "ckpt-000003.h5")
    assert sorted(counts, key=int) == ["0", "1", "2", "3"] and all(counts.values())


# -------------------------------------------------------------------- over real mpiexec

JOB = ["--devices", "4", "--ranks", "3", "--rounds", "3"]


def _simulate(out: Path, *sets: str, config: Path | None = None, resume: Path | None = None):
    args = ["simulate", *([str(config)] if config else []), "--out", str(out)]
    if resume is None:
        args += JOB
    else:
        args += ["--resume", str(resume)]
    for s in sets:
        args += ["--set", s]
    p = run_edgefl(*args, env=ENV)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "summary.json").read_text())


def _task_counts(ckpt: Path) -> dict[str, int]:
    devs = load_checkpoint(ckpt)["plugins"]["update_stats"]["devices"]
    return {d: v["tasks"] for d, v in devs.items()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The 3-round job with the plugin, uninterrupted (shared by the MPI tests)."""
    out = tmp_path_factory.mktemp("plugin") / "run"
    return out, _simulate(out, PLUGIN, WARN)


@pytest.mark.mpi
def test_simulate_with_plugin_reports_and_keeps_the_model(full_run, tmp_path, launcher):
    out, s = full_run
    plain = _simulate(tmp_path / "plain")
    assert "update_stats" not in plain
    assert s["model_sha256"] == plain["model_sha256"]
    u = s["update_stats"]
    assert u["warn_norm"] == 0.5 and u["updates"] == 4 * 3
    assert sorted(u["devices"], key=int) == ["0", "1", "2", "3"]
    assert all(v["updates"] == 3 and v["max_norm"] >= v["last_norm"] > 0
               for v in u["devices"].values())  # fmt: skip
    assert u["over_warn_norm"] == sum(v["over"] for v in u["devices"].values())
    assert 0 < u["min_norm"] <= u["mean_norm"] <= u["max_norm"] < 100
    # over_warn_norm is consistent with the norms seen
    if u["max_norm"] <= 0.5:
        assert u["over_warn_norm"] == 0
    elif u["min_norm"] > 0.5:
        assert u["over_warn_norm"] == 12
    else:
        assert 0 < u["over_warn_norm"] < 12
    # the worker half's per-device state is in the final checkpoint
    assert _task_counts(out / "checkpoints" / "ckpt-000003.h5") == {str(d): 3 for d in range(4)}


@pytest.mark.mpi
def test_resume_continues_the_plugin_counters(full_run, tmp_path, launcher):
    _, full = full_run
    part = tmp_path / "part"
    s = _simulate(part, PLUGIN, WARN, "debug.stop_after_round=2")
    assert s["stopped"] == "debug.stop_after_round = 2"
    assert s["update_stats"]["updates"] == 8
    ckpt = part / "checkpoints" / "ckpt-000002.h5"
    saved = load_checkpoint(ckpt)["plugins"]["update_stats"]
    assert saved["state"]["updates"] == 8
    assert _task_counts(ckpt) == {str(d): 2 for d in range(4)}
    # resume as docs/quickstart.md does: the run's own config.toml and the checkpoint
    s = _simulate(part, config=part / "config.toml", resume=ckpt)
    assert s["rounds_done"] == 3 and s["model_sha256"] == full["model_sha256"]
    assert s["update_stats"] == full["update_stats"]  # 8 from the checkpoint + 4 new
    assert _task_counts(part / "checkpoints" / "ckpt-000003.h5") == {str(d): 3 for d in range(4)}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ('["nope:X"]', "cannot import 'nope'"),
        (
            '["update_stats:UpdateStatsCoordinator"]',
            "is not a subclass of edgefl.algorithms.Plugin",
        ),
        ('["update_stats:Missing"]', "has no 'Missing'"),
        ('["update_stats"]', "is not 'module:Class'"),
    ],
)
def test_bad_plugin_spec_fails_before_mpi(spec, needle, tmp_path, launcher):
    out = tmp_path / "run"
    p = run_edgefl("simulate", "--out", str(out), *JOB, "--set", f"algorithm.plugins={spec}",
                   env=ENV)  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "edgefl: error: config key 'algorithm.plugins[0]'"
    )
    assert needle in lines[0]
    assert "edgefl simulate:" not in p.stdout  # the launch banner: nothing was started
    assert not out.exists()
