"""The run directory: where a job's config, metrics, checkpoints and final model go."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..config import dump_config
from ..errors import EdgeflError


def resolve_run_dir(cfg: dict, out: str | None, resume: str | None, stem: str) -> Path:
    """Pick the run directory: ``--out``, else ``run.out``, else the resumed checkpoint's run
    directory, else ``runs/<YYYYmmdd-HHMMSS>-<stem>``."""
    if out:
        return Path(out)
    if cfg["run"]["out"]:
        return Path(cfg["run"]["out"])
    if resume:
        p = Path(resume).resolve()
        if p.parent.name == "checkpoints":
            return p.parent.parent
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}"


def prepare_run_dir(path: Path, cfg: dict, resuming: bool) -> Path:
    """Create the run directory and write the effective config (atomically).

    Refuses a directory that already holds a run's metrics unless resuming, so a finished
    run is never overwritten by accident.
    """
    if path.exists() and not path.is_dir():
        raise EdgeflError(f"run directory '{path}' exists and is not a directory")
    if (path / "metrics.jsonl").exists() and not resuming:
        raise EdgeflError(
            f"run directory '{path}' already holds a run (metrics.jsonl); choose another --out "
            "or continue it with --resume"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / ".config.toml.tmp"
        tmp.write_text(dump_config(cfg), encoding="utf-8")
        os.replace(tmp, path / "config.toml")
    except OSError as e:
        raise EdgeflError(f"cannot write run directory '{path}': {e.strerror}") from None
    return path
