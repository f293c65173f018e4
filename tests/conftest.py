"""Shared fixtures: locating mpiexec and launching real multi-rank jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _launcher():
    from edgefl.errors import EdgeflError
    from edgefl.launcher import find_mpiexec

    try:
        import mpi4py  # noqa: F401

        return find_mpiexec()
    except (ImportError, EdgeflError):
        return None


@pytest.fixture(scope="session")
def launcher():
    """The MPI launcher; MPI tests fail (not skip) when it is missing, since MPI is required."""
    found = _launcher()
    if found is None:
        pytest.fail("no mpiexec/mpi4py: install with pip install -e '.[mpi,test]'")
    return found


def run_edgefl(*args: str, cwd: Path | None = None, timeout: float = 300, env=None):
    """Run ``python -m edgefl ARGS`` and return the CompletedProcess (text)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "edgefl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=e,
    )


@pytest.fixture
def edgefl_cli():
    return run_edgefl
