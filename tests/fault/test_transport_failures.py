"""Real ``mpiexec --with-ft ulfm -n 4``: ranks SIGKILLed mid-exchange are detected by the
transport within a second, the survivors carry on and exit 0 on their own.

Under ULFM Open MPI's launcher does not tear the job down when a rank dies, and its exit
status is that of the survivors (a killed rank does not make it non-zero; without
``--with-ft ulfm`` the whole job is killed instead, status 137).
"""

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import run_launch

from edgefl.launcher import child_env

pytestmark = pytest.mark.mpi
PROGRAM = Path(__file__).parent / "ranks_kill.py"
ROUNDS, KILL_ROUND = 40, 10  # as in ranks_kill.py


def run_job(launcher, victims: list[int], out: Path):
    assert launcher.supports_ulfm(), f"needs Open MPI >= 5, found {launcher}"
    arg = ",".join(map(str, victims))
    cmd = launcher.command(4, [sys.executable, str(PROGRAM), arg, str(out)], ulfm=True)
    t0 = time.monotonic()
    proc = run_launch(cmd, timeout=60, env=child_env(False))
    wall = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    for r in victims:
        assert json.loads((out / f"killed{r}.json").read_text())["rank"] == r, text
    docs = {}
    for r in sorted(set(range(4)) - set(victims)):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result\n{text}"
        docs[r] = json.loads(f.read_text())
        assert docs[r]["ok"], f"rank {r}: {docs[r]}\n{text}"
    for r in victims:
        assert not (out / f"rank{r}.json").exists()
    return proc, wall, docs, text


@pytest.mark.parametrize("victims", [[3], [2, 3]], ids=["one-worker", "two-workers"])
def test_coordinator_detects_killed_workers_and_serves_the_others(launcher, tmp_path, victims):
    proc, wall, docs, text = run_job(launcher, victims, tmp_path)
    assert proc.returncode == 0, text
    coord = docs[0]
    for r, s in coord["detect_latency_s"].items():
        print(f"rank {r} kill detected by rank 0 after {s * 1e3:.1f} ms (job {wall:.1f} s)")
        assert 0 < s < 2.0, text
        assert f"rank 0: rank {r} failed (" in proc.stderr
    assert coord["failed"] == victims
    survivors = [w for w in (1, 2, 3) if w not in victims]
    # every update of the survivors arrived and checked out; the victims' up to their death
    assert coord["rounds"] == {str(w): KILL_ROUND if w in victims else ROUNDS for w in (1, 2, 3)}
    # ... and the exchange with the survivors went on after the failure was found
    assert all(coord["after_detection"][str(w)] > 0 for w in survivors)
    assert all(coord["after_detection"][str(w)] == 0 for w in victims)
    assert coord["close_s"] < 1.0  # no wait on the sends to the dead ranks
    for w in survivors:  # workers listen to every rank: they saw it too, and finished
        assert docs[w]["rounds"] == ROUNDS
        assert docs[w]["detected"] == victims
    assert wall < 30.0


def test_workers_leave_on_their_own_when_the_coordinator_dies(launcher, tmp_path):
    proc, wall, docs, text = run_job(launcher, [0], tmp_path)
    assert proc.returncode == 0, text
    for w in (1, 2, 3):
        d = docs[w]
        print(f"rank {w}: coordinator kill detected after {d['detect_latency_s'] * 1e3:.1f} ms")
        # the other workers may be in it too: they leave without MPI_Finalize, which ULFM
        # reports like a death, and may have done so before this one looked
        assert 0 in d["detected"] and set(d["detected"]) <= {0, 1, 2, 3} - {w}
        assert 0 < d["detect_latency_s"] < 2.0, text
        assert d["closed_after_s"] < 5.0, text  # transport closed soon after the death
        assert 1 <= d["rounds"] < ROUNDS
        assert f"rank {w}: coordinator (rank 0) died; exiting" in proc.stdout
    assert wall < 30.0
