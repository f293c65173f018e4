"""Per-rank wrapper for MPICH / Intel MPI (Hydra) launches (docs/architecture.md, Failures).

Hydra tears every rank down when one dies of a signal. With ``-disable-auto-cleanup`` it
does not, but it still sends the survivors SIGUSR1. ``edgefl simulate`` therefore starts
each rank as ``python -m edgefl.rankwrap ARGV...``: the wrapper ignores SIGUSR1 (inherited
by the rank it starts) and turns a signal death of the rank into an ordinary exit status
(128 + signal), so the launcher sees an exit, not a crash. Failure detection itself then
comes from time-outs (``comm.failure_timeout_s``), since these MPIs have no ULFM.
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    """Run ``argv`` with SIGUSR1 ignored; its exit status, or 128 + signal number."""
    if not argv:
        print("usage: python -m edgefl.rankwrap COMMAND [ARG...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    proc = subprocess.run(argv, close_fds=False)  # Hydra hands the PMI socket down as an fd
    return 128 - proc.returncode if proc.returncode < 0 else proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
