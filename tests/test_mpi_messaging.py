"""Real mpiexec, 3 ranks: every message kind round-trips (payloads chunked, then model-sized
ones on the model tags into receives posted in advance), malformed messages (also raw bytes
on the header tag) are rejected with a log line and the conversation continues, duplicates
ignored."""

import sys
from pathlib import Path

import pytest
from conftest import run_launch

pytestmark = pytest.mark.mpi
PROGRAM = Path(__file__).parent / "mpi" / "messaging.py"


def test_every_kind_round_trips_and_forgeries_are_rejected(launcher):
    cmd = launcher.command(3, [sys.executable, str(PROGRAM)], ulfm=False)
    proc = run_launch(cmd, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"rank {r} OK" in proc.stdout
    err = proc.stderr
    for src in (1, 2):
        assert f"rejected message from rank {src}: unknown kind 99" in err
        assert f"rejected message from rank {src}: UPDATE payload has 1003 elements" in err
        assert f"rejected message from rank {src}: UPDATE payload dtype float64" in err
        assert f"rejected message from rank {src}: rank {src} does not host device 99" in err
        # phase 2: a forged model-tag payload into a receive posted in advance, raw bytes
        assert f"rejected message from rank {src}: rank {src} does not host device 98" in err
        assert f"rejected message from rank {src}: header of 40 bytes, expected 80" in err
        assert f"rejected message from rank {src}: header receive failed: MPI error" in err
        assert f"rejected message from rank {src}: bad magic" in err
        assert f"rejected message from rank {src}: unknown kind 0" in err
    assert "rejected message from rank 0: MODEL payload has 1001 elements, model has 1000" in err
