"""Every early stop leaves a checkpoint to resume from (issue 25, F3), and a rank that dies
in the last moments of a run is recorded (F8).

Real ``edgefl simulate`` jobs (the default job, 2 worker ranks), one per way a run stops
early; each checks the checkpoint written at the stop and that ``--resume`` of it works:

- every device quarantined (a NaN loss everywhere from model version 5, and no periodic
  checkpoint: before, the run left none at all): the divergence guard stops it once half
  are, rc 4; resumed, the devices get another chance and the run completes;
- divergence (the global model overflows at version 7): rc 4, the final checkpoint holds
  the non-finite model, and resuming it says which earlier checkpoint to resume instead;
  that one completes;
- a worker killed with ``fleet.on_failure = "stop"``: rc 3; the resume completes;
- SIGINT of ``edgefl simulate``: rc 130, checkpointed at the next model version; the
  resumed run ends on the uninterrupted run's model, bit for bit;
- every worker killed at once: one line says no worker rank is left (not one "going on"
  per rank), rc 3, both in ``failed_ranks``; the resume completes;
- a worker killed as the last round is written: it is in ``failed_ranks`` and events.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_launch, start_launch, when_rows

MPI = pytest.mark.mpi
TESTS = Path(__file__).parent.parent  # (tests/hang_client.py)
PATH = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])


def _cmd(out: Path, sets: tuple[str, ...]) -> list[str]:
    cmd = [sys.executable, "-m", "edgefl", "simulate", "--out", str(out)]
    for s in ("output.progress=quiet", "fleet.ranks=3", *sets):  # (2 worker ranks)
        cmd += ["--set", s]
    return cmd


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": PATH, **extra}


def _run(out: Path, *sets: str, **env: str) -> tuple[int, str]:
    proc = run_launch(_cmd(out, sets), timeout=240, env=_env(**env))
    return proc.returncode, proc.stdout + proc.stderr


def _start(out: Path, *sets: str) -> subprocess.Popen:
    """The run, started (its ranks.json written; an Open MPI launch failure repeated)."""
    return start_launch(_cmd(out, sets), out / "ranks.json", env=_env())


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def _resume(out: Path, ckpt: Path, **env: str) -> tuple[int, str, dict]:
    """``edgefl simulate RUN/config.toml --resume CKPT``; (status, output, summary)."""
    cmd = [sys.executable, "-m", "edgefl", "simulate", str(out / "config.toml"),
           "--resume", str(ckpt)]  # fmt: skip
    proc = run_launch(cmd, timeout=240, env=_env(**env))
    text = proc.stdout + proc.stderr
    return proc.returncode, text, _summary(out) if proc.returncode in (0, 3) else {}


def _completed(status: int, text: str, s: dict) -> None:
    assert status == 0, text[-3000:]
    assert s["rounds_done"] == 20 and s["stopped"] == "", s["stopped"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """The default job without faults, in one process (the same model as under MPI)."""
    import edgefl

    out = tmp_path_factory.mktemp("clean") / "run"
    return edgefl.simulate(
        overrides={"output.progress": "quiet"}, out=out, backend="inline"
    ).summary


@MPI
def test_all_devices_quarantined_leaves_a_checkpoint_to_resume(tmp_path, launcher):
    out = tmp_path / "run"
    client = 'train.client="hang_client:nan_everywhere"'
    status, text = _run(out, client, "run.checkpoint_every=0", EDGEFL_TEST_BREAK="1")
    assert status == 4, text[-3000:]  # the divergence guard: half the fleet quarantined
    s = _summary(out)
    why = "4 of 8 devices were quarantined for non-finite updates (run.divergence_share = 0.5)"
    assert s["stopped"] == f"diverged: {why}", s["stopped"]
    assert f"edgefl: the run diverged: {why}; likely cause: the client hook" in text
    out_now = [q for q in s["quarantined"].values() if q["excluded_at"] is not None]
    assert len(out_now) == 4 and all(q["excluded_at"] == 5 for q in out_now)
    ckpt = out / "checkpoints" / "ckpt-000005.h5"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [ckpt.name]
    status, text, s = _resume(out, ckpt)  # (fixed: EDGEFL_TEST_BREAK unset)
    _completed(status, text, s)
    assert "devices were quarantined when the run stopped; the resumed run gives them" in text


@MPI
def test_a_diverged_run_checkpoints_and_says_where_to_resume(tmp_path, launcher):
    out = tmp_path / "run"
    # (not evaluated on the way: the guard would stop at version 6's NaN test loss, before
    # the model itself overflows)
    sets = ('train.client="hang_client:diverge"', "server.optimizer=fedavgm", "run.eval_every=50")
    status, text = _run(out, *sets, EDGEFL_TEST_BREAK="1")
    assert status == 4, text[-3000:]
    s = _summary(out)
    assert s["stopped"] == "diverged: the global model became non-finite at version 7"
    assert (
        s["diverged"]["version"] == 7 and "server.optimizer = 'fedavgm'" in s["diverged"]["cause"]
    )
    final, before = (out / "checkpoints" / f"ckpt-00000{r}.h5" for r in (7, 5))
    assert final.is_file() and before.is_file()
    status, text, _ = _resume(out, final)
    assert status == 2 and "holds a non-finite model" in text and str(before) in text, text
    status, text, s = _resume(out, before)
    _completed(status, text, s)


@MPI
def test_on_failure_stop_leaves_a_checkpoint_to_resume(tmp_path, launcher):
    out = tmp_path / "run"
    p = _start(out, "fleet.on_failure=stop", "debug.delay_s=0.05")
    os.kill(when_rows(p, out, 5)[2], signal.SIGKILL)
    o, e = p.communicate(timeout=120)
    assert p.returncode == 3, (o + e)[-3000:]
    s = _summary(out)
    assert s["stopped"] == "rank 2 failed (fleet.on_failure = stop)" and list(
        s["failed_ranks"]
    ) == ["2"]
    ckpt = out / "checkpoints" / f"ckpt-{s['rounds_done']:06d}.h5"
    assert ckpt.is_file()
    _completed(*_resume(out, ckpt))


@MPI
def test_sigint_checkpoints_and_the_resume_is_exact(tmp_path, launcher, clean):
    out = tmp_path / "run"
    p = _start(out, "debug.delay_s=0.05", "run.checkpoint_every=0")
    when_rows(p, out, 5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    o, e = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 130, (o + e)[-3000:]
    assert took < 5.0, took
    s = _summary(out)
    assert s["stopped"].startswith("interrupted (received SIGINT)"), s["stopped"]
    assert "its checkpoint is written for --resume" in o + e
    ckpt = out / "checkpoints" / f"ckpt-{s['rounds_done']:06d}.h5"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [ckpt.name]
    status, text, s = _resume(out, ckpt)
    _completed(status, text, s)
    assert s["model_sha256"] == clean["model_sha256"]
    print(f"SIGINT -> edgefl simulate exited in {took:.2f} s (checkpointed)")


@MPI
def test_every_worker_killed_says_so_once_and_checkpoints(tmp_path, launcher):
    out = tmp_path / "run"
    p = _start(out, "debug.delay_s=0.05")
    pids = when_rows(p, out, 5)
    for r in (1, 2):
        os.kill(pids[r], signal.SIGKILL)
    o, e = p.communicate(timeout=120)
    text = o + e
    assert p.returncode == 3, text[-3000:]
    assert text.count("no worker rank is left: the run stops") == 1, text[-3000:]
    # (the ranks' deaths reach rank 0 one by one: the first may be re-hosted onto ranks
    # not yet known dead, but not one "going on" per rank)
    assert text.count("going on") <= 1, text[-3000:]
    s = _summary(out)
    assert sorted(s["failed_ranks"]) == ["1", "2"]
    assert s["stopped"].startswith("no worker rank is left")
    ckpt = out / "checkpoints" / f"ckpt-{s['rounds_done']:06d}.h5"
    assert ckpt.is_file()
    _completed(*_resume(out, ckpt))


@MPI
def test_a_rank_killed_at_the_very_end_is_recorded(tmp_path, launcher):
    out = tmp_path / "run"
    p = _start(out)
    os.kill(when_rows(p, out, 20)[2], signal.SIGKILL)  # as the last round is written
    o, e = p.communicate(timeout=120)
    assert p.returncode == 0, (o + e)[-3000:]
    s = _summary(out)
    assert list(s["failed_ranks"]) == ["2"], (o + e)[-3000:]
    assert [e["rank"] for e in _events(out) if e["event"] == "failed"] == [2]
    assert s["rounds_done"] == 20
