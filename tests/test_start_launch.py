"""The test helper that starts a run in the background (conftest.start_launch): an Open MPI
launch failure is repeated, any other early end fails with its output, a run that gets its
ranks started is handed back running."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import start_launch

# first launch: Open MPI's own start-up failure (status 213); the next: ranks "start"
FLAKY = r"""
import sys, time
from pathlib import Path
count, ready = Path(sys.argv[1]), Path(sys.argv[2])
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if n == 0:
    print("The PMIx server's listener thread failed to start. We cannot", file=sys.stderr)
    sys.exit(213)
ready.write_text("{}")
time.sleep(0.5)
"""


def test_an_open_mpi_launch_failure_is_repeated(tmp_path):
    count, ready = tmp_path / "count", tmp_path / "ranks.json"
    p = start_launch([sys.executable, "-c", FLAKY, str(count), str(ready)], ready)
    assert ready.exists() and count.read_text() == "2"
    p.communicate(timeout=30)
    assert p.returncode == 0


def test_another_early_end_fails_with_its_output(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('config key x: bad', file=sys.stderr); "
           "sys.exit(2)"]  # fmt: skip
    with pytest.raises(AssertionError, match=r"status 2\):\nconfig key x: bad"):
        start_launch(cmd, tmp_path / "ranks.json")


def test_a_slow_start_comes_back_running_at_the_timeout(tmp_path):
    p = start_launch([sys.executable, "-c", "import time; time.sleep(5)"], tmp_path / "never",
                     timeout=0.3)  # fmt: skip
    assert p.poll() is None
    p.kill()
    p.communicate()
    assert isinstance(p, subprocess.Popen)
