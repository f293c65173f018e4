"""Leaving a process at once, output kept: the last step of a rank, of ``edgefl simulate``
and of a failed job (see docs/performance.md: the interpreter's own teardown of torch costs
each process up to 1.5 CPU seconds)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def flush_and_exit(status: int) -> NoReturn:
    """Flush stdout and stderr (a closed or broken stream is skipped) and end the process
    with ``status`` without the interpreter's teardown (``os._exit``): exit handlers are
    not run here, so call them first where they matter."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
