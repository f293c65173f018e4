"""A run directory's identity and owner (issue 25, F4 and F9).

F4: run A's checkpoint copied over run B's newest, then ``edgefl simulate --resume RUN_B``
rewrote B's config and metrics from A's. Now every run directory has a ``run_id`` that its
checkpoints and summary.json carry; a resume into a directory holding another run is
refused in one line naming both ids, touching nothing, and ``--out NEWDIR`` continues the
checkpoint as a new run directory. A checkpoint without an id (an older edgefl's) resumes
as before.

F9: two ``edgefl simulate --out SAME`` both ran to completion in the same directory. Now
the directory is claimed with ``flock`` for the job's life: a second job is refused in one
line, touching nothing, and the lock ends with its holder (also a SIGKILLed one).
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
from conftest import assert_one_line_error, launch_flaked, run_edgefl, set_args

from edgefl.ckpt import load_checkpoint, save_checkpoint
from edgefl.config import load_config
from edgefl.errors import EdgeflError
from edgefl.runtime import rundir
from edgefl.runtime.rundir import (
    LOCK_FILE,
    RUN_ID_FILE,
    check_run_dir,
    check_run_identity,
    claim_run_dir,
    prepare_run_dir,
    read_run_id,
    release_run_dir,
)

TINY = [
    "fleet.devices=4",
    "data.args.dim=10",
    "data.args.classes=4",
    "model.args.hidden=[8]",
    "fleet.device=cpu",
    "sim.reference_s_per_sample=0.0001",
    "output.progress=quiet",
]


def sets(*extra: str) -> list[str]:
    return set_args(*TINY, *extra)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# -------------------------------------------------------------------- F4, from outside
# (the edgefl simulate command in one process, run.backend = "inline": the run directory,
# its id and the resume checks are the same under either backend, and MPI's start-up is
# not what these test; the F9 lock tests below run over mpiexec)
INLINE = "run.backend=inline"


def test_a_foreign_checkpoint_does_not_overwrite_a_run(tmp_path):
    a, b, new = tmp_path / "A", tmp_path / "B", tmp_path / "NEW"
    for run, policy in ((a, "asp"), (b, "bsp")):
        proc = run_edgefl(
            "simulate", "--out", str(run), "--rounds", "2",
            *sets(INLINE, "run.checkpoint_every=1", f"algorithm.consistency={policy}"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    id_a, id_b = read_run_id(a), read_run_id(b)
    assert id_a and id_b and id_a != id_b
    assert summary(a)["run_id"] == id_a and summary(b)["run_id"] == id_b
    for r in (1, 2):  # every checkpoint carries its run directory's id
        assert load_checkpoint(b / "checkpoints" / f"ckpt-00000{r}.h5")["run_id"] == id_b
    # A's checkpoint copied over B's newest, then B resumed (F4: rc 0, B rewritten from A)
    newest = b / "checkpoints" / "ckpt-000002.h5"
    newest.write_bytes((a / "checkpoints" / "ckpt-000002.h5").read_bytes())
    before = snapshot(b)
    proc = run_edgefl("simulate", "--resume", str(b), "--rounds", "4")
    assert_one_line_error(proc, str(newest), id_a, id_b, "--out NEWDIR")
    assert snapshot(b) == before  # config.toml still bsp, metrics B's own
    assert 'consistency = "bsp"' in (b / "config.toml").read_text()
    # ... and with --dry-run too (refused before anything starts)
    proc = run_edgefl("simulate", "--resume", str(b), "--rounds", "4", "--dry-run")
    assert_one_line_error(proc, id_a, id_b)
    # the suggested way: continue A's checkpoint as a new run directory
    proc = run_edgefl("simulate", "--resume", str(b), "--rounds", "4", "--out", str(new))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert snapshot(b) == before
    id_new = read_run_id(new)
    assert id_new not in (None, id_a, id_b)
    assert summary(new)["run_id"] == id_new and summary(new)["rounds_done"] == 4
    assert load_checkpoint(new / "checkpoints" / "ckpt-000004.h5")["run_id"] == id_new
    assert 'consistency = "asp"' in (new / "config.toml").read_text()
    assert [r["round"] for r in rows(new)] == [1, 2, 3, 4]
    # and NEW resumes from its own checkpoints (same id) with a config file given, too
    proc = run_edgefl("simulate", str(new / "config.toml"), "--resume", str(new), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_checkpoint_without_an_id_still_resumes(tmp_path):
    """An older edgefl's run: no run_id file, checkpoints without one. The resume works
    and gives the directory an id, which the new checkpoints carry."""
    run = tmp_path / "old"
    proc = run_edgefl("simulate", "--out", str(run), "--rounds", "2", *sets(INLINE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = run / "checkpoints" / "ckpt-000002.h5"
    state = load_checkpoint(ckpt)
    del state["run_id"]
    save_checkpoint(ckpt, state)
    (run / RUN_ID_FILE).unlink()
    proc = run_edgefl("simulate", "--resume", str(run), "--rounds", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rid = read_run_id(run)
    assert rid is not None and summary(run)["run_id"] == rid
    assert summary(run)["rounds_done"] == 4
    assert load_checkpoint(run / "checkpoints" / "ckpt-000004.h5")["run_id"] == rid
    assert [r["round"] for r in rows(run)] == [1, 2, 3, 4]


# -------------------------------------------------------------------- F4, the rule


def test_check_run_identity(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    own, other = "a" * 32, "b" * 32
    check_run_identity(d, other, "c.h5")  # no run here yet (a new directory, --out)
    (d / "metrics.jsonl").write_text("{}\n")
    check_run_identity(d, None, "c.h5")  # an older edgefl's checkpoint: not checked
    with pytest.raises(EdgeflError, match="holds a run without a run id"):
        check_run_identity(d, other, "c.h5")
    (d / RUN_ID_FILE).write_text(own + "\n")
    check_run_identity(d, own, "c.h5")
    with pytest.raises(EdgeflError) as e:
        check_run_identity(d, other, "c.h5")
    msg = str(e.value)
    assert other in msg and own in msg and "--out NEWDIR" in msg and "\n" not in msg


def test_prepare_run_dir_keeps_or_makes_the_id(tmp_path):
    cfg = load_config()
    d = tmp_path / "d"
    try:
        prepare_run_dir(d, cfg, resuming=False)
        rid = read_run_id(d)
        assert rid is not None and len(rid) == 32
        prepare_run_dir(d, cfg, resuming=False)  # (the launcher, then rank 0)
        assert read_run_id(d) == rid
        assert (d / "config.toml").is_file() and (d / LOCK_FILE).is_file()
        assert "run_id" not in (d / "config.toml").read_text()  # not a config key
    finally:
        release_run_dir(d)
    (d / RUN_ID_FILE).write_text("not an id\n")
    assert read_run_id(d) is None


# -------------------------------------------------------------------- F9, the lock

HOLD = """
import sys, time
from pathlib import Path
from edgefl.runtime.rundir import claim_run_dir
claim_run_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def _holder(d: Path) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_the_lock_is_exclusive_and_dies_with_its_holder(tmp_path, monkeypatch):
    d = tmp_path / "run"
    monkeypatch.delenv("EDGEFL_LAUNCHER", raising=False)
    p = _holder(d)
    try:
        before = snapshot(tmp_path)
        for attempt in (
            lambda: prepare_run_dir(d, load_config(), resuming=False),
            lambda: prepare_run_dir(d, load_config(), resuming=True),
            lambda: check_run_dir(d, None),
            lambda: claim_run_dir(d),
        ):
            with pytest.raises(EdgeflError) as e:
                attempt()
            assert f"is in use by another job (pid {p.pid} holds" in str(e.value)
        assert snapshot(tmp_path) == before  # nothing written
        # a rank of a job whose launcher holds the lock goes ahead without claiming it
        monkeypatch.setenv("EDGEFL_LAUNCHER", f"{p.pid}:abc")
        assert claim_run_dir(d) is False
        check_run_dir(d, None)
        monkeypatch.delenv("EDGEFL_LAUNCHER")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # SIGKILLed: the kernel dropped its lock; the directory is free at once
    assert claim_run_dir(d) is True
    assert claim_run_dir(d) is True  # (held already: a no-op)
    assert (d / LOCK_FILE).read_text().strip() == str(os.getpid())
    release_run_dir(d)
    assert str(d.resolve()) not in rundir._held


# -------------------------------------------------------------------- F9, from outside


def _start(run: Path, rounds: int, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "edgefl", "simulate", "--out", str(run), "--rounds",
            str(rounds), *sets(*extra)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _held_by_other(lock: Path) -> bool:
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.mpi
def test_a_second_job_on_a_running_run_directory_is_refused(tmp_path, launcher):
    run = tmp_path / "X"
    for _attempt in range(3):  # (Open MPI's own launch flake: see conftest.run_launch)
        first = _start(run, 40, "debug.delay_s=0.1")
        deadline = time.monotonic() + 120
        # claimed, and its config written (the claim comes first: a moment apart)
        while first.poll() is None and not (
            _held_by_other(run / LOCK_FILE) and (run / "config.toml").exists()
        ):
            assert time.monotonic() < deadline, "the first job never claimed its directory"
            time.sleep(0.05)
        if first.poll() is None:
            break
        out, err = first.communicate()
        if not launch_flaked(out + err):
            pytest.fail(f"the first job ended early: {first.returncode}\n{out}\n{err}")
    rid, config = read_run_id(run), (run / "config.toml").read_bytes()
    try:
        second = run_edgefl("simulate", "--out", str(run), "--rounds", "2", *sets())
        assert first.poll() is None, "the first job ended before the second was refused"
        assert_one_line_error(second, f"run directory '{run}' is in use by another job")
        dry = run_edgefl("simulate", "--out", str(run), "--dry-run", *sets())
        assert_one_line_error(dry, "is in use by another job")
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out + err
    assert summary(run)["rounds_done"] == 40 and summary(run)["run_id"] == rid
    assert [r["round"] for r in rows(run)] == list(range(1, 41))
    assert (run / "config.toml").read_bytes() == config and b"rounds = 40" in config
    assert (run / "exit_status").read_text() == "0\n"


@pytest.mark.mpi
def test_two_jobs_started_together_on_one_run_directory(tmp_path, launcher):
    """F9 as reported: both started at once. One runs; the other is refused, either by the
    lock or (if the first was already done) by the finished run's metrics."""
    run = tmp_path / "X"
    procs = [_start(run, 10, "debug.delay_s=0.05"), _start(run, 10, "debug.delay_s=0.05")]
    # (no Open MPI start-up failure to allow for: each launch has its own session base,
    # tests/fault/test_session_dirs.py)
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [p.returncode for p in procs] + [o + e for o, e in outs]
    loser = next(e for p, (_, e) in zip(procs, outs) if p.returncode == 2)
    lines = loser.splitlines()
    assert len(lines) == 1 and "Traceback" not in loser, loser
    assert "is in use by another job" in lines[0] or "already holds a run" in lines[0]
    assert summary(run)["rounds_done"] == 10
    assert [r["round"] for r in rows(run)] == list(range(1, 11))


@pytest.mark.mpi
def test_rank_0_of_a_hand_started_job_claims_the_directory(tmp_path, launcher, monkeypatch):
    """``mpiexec ... edgefl run`` without ``edgefl simulate``: rank 0 owns the run and
    claims its directory; another job holding it is named in one line, status 2."""
    from conftest import run_launch

    from edgefl.config import dump_config

    monkeypatch.delenv("EDGEFL_LAUNCHER", raising=False)
    cfg = tmp_path / "job.toml"
    cfg.write_text(dump_config(load_config(overrides=[*TINY, "run.rounds=2"])))
    run = tmp_path / "X"
    p = _holder(run)
    try:
        cmd = launcher.command(
            3, [sys.executable, "-m", "edgefl", "run", str(cfg), "--out", str(run)], ulfm=False
        )
        proc = run_launch(cmd, timeout=300)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"is in use by another job (pid {p.pid} holds" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (run / "config.toml").exists() and not (run / "metrics.jsonl").exists()
