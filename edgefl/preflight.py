"""The pre-launch check of ``edgefl simulate`` and :func:`edgefl.simulate`: what would
otherwise fail only once the job runs, found before anything is written, each as one line.

:func:`check_ranks_can_import` (no ``__main__`` names for MPI ranks) and :func:`check_cuda`
are cheap; :func:`preflight` builds the data and the model once (it loads torch). It runs
in this process (:func:`edgefl.simulate`, the in-process backend), in a child process
(:func:`preflight_apart`: ``--dry-run``, ``python -m edgefl.preflight --preflight``), or on
rank 0 while the other ranks start (:func:`gate_check`, the ranks' half of
:func:`edgefl.launching.launch_checked`; the ``CHECK_*`` files of its check directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .config.ranks import rank_count
from .config.sources import main_specs
from .errors import ConfigError, EdgeflError
from .hardexit import flush_and_exit

# files of the check directory of :func:`edgefl.launching.launch_checked` (``EDGEFL_GATE``)
CHECK_CONFIG, CHECK_VERDICT, CHECK_OPEN = "config.pickle", "verdict.json", "open"


def check_ranks_can_import(cfg: dict) -> None:
    """Refuse, before any launch, a config naming objects of ``__main__`` (``"__main__:Net"``):
    MPI ranks are new processes that import ``python -m edgefl``, not the caller's script.
    (:func:`edgefl.simulate` passes such objects by value first, :mod:`edgefl.shipped`, so
    this refuses them only for ``edgefl simulate``.)"""
    for key, spec in main_specs(cfg)[:1]:
        raise ConfigError(
            f"config key '{key}' = {spec!r}: the MPI ranks are new processes that cannot "
            "import your script's __main__; move it into a module file (e.g. mymodels.py, "
            "then 'mymodels:Name'), or pass the object itself to edgefl.simulate() from "
            "your script or notebook, which ships it to the ranks by value"
        )


def check_cuda(cfg: dict) -> None:
    """``edgefl simulate`` runs its ranks on this machine: a CUDA torch device asked for in
    ``fleet.device`` or ``fleet.device_map`` where torch sees no GPU is one line now, not a
    worker's error after MPI started (``edgefl run`` on a cluster checks on each rank)."""
    import torch

    if torch.cuda.is_available():
        return
    f = cfg["fleet"]
    asked = [("fleet.device", f["device"])]
    asked += [(f"fleet.device_map.{d}", v) for d, v in sorted(f["device_map"].items())]
    for key, value in asked:
        if str(value).startswith("cuda"):
            raise ConfigError(
                f"config key '{key}' = {value!r}: torch device requested but CUDA is not "
                "available here (torch.cuda.is_available() is False); use cpu or auto"
            )


_CHECKED_TEST: tuple[str, Any] | None = None  # (its data's key, the test set a check built)


def _data_key(cfg: dict) -> str:
    """What the test set depends on: the data source and its arguments, the fleet's size
    and the seed (and whether it is spilled: run.test_memory_mb)."""
    import json

    return json.dumps([cfg["data"], cfg["fleet"]["devices"], cfg["seed"],
                       cfg["run"]["test_memory_mb"]], sort_keys=True, default=repr)  # fmt: skip


def checked_test_set(cfg: dict) -> Any:
    """The test set :func:`preflight` built in this process for ``cfg``'s data when asked to
    keep it (rank 0 of ``edgefl simulate`` under MPI, and the in-process backend: the
    coordinator takes it rather than building a large fleet's test set a second time:
    100,000 synthetic devices, about 7 s), handed over once; None otherwise."""
    global _CHECKED_TEST
    kept, _CHECKED_TEST = _CHECKED_TEST, None
    return kept[1] if kept is not None and kept[0] == _data_key(cfg) else None


def preflight(cfg: dict, show: Any = None, keep_test: bool = False) -> str:
    """Check in this process, before the job starts (``edgefl simulate``: rank 0 while the
    other ranks wait, :func:`edgefl.launching.launch_checked`; ``--dry-run`` and
    :func:`edgefl.simulate`: before any rank starts), what would otherwise fail only once the
    job runs, each as a one-line error: the trackers; the data source and the model (built
    once); the job's memory, estimated from four devices before anything of the fleet's size
    is built (:mod:`edgefl.data.checks`; over what this machine has available: a ConfigError
    naming ``fleet.devices``); the policies; the devices' training data and the test set
    (labels, shapes, dtypes, NaN/inf, empty devices; ``run.preflight`` chooses all devices,
    a sample or none); the training hooks; the device profiles.

    Returns one line: what was checked and the memory estimate (empty with
    ``run.preflight = "off"``). It is printed on stderr when worth reading (the estimate
    is over half the available memory, or not every device was checked), else logged at
    INFO (``EDGEFL_LOG=info``); ``show``: what prints it instead (called with the line).
    ``keep_test``: keep the test set for :func:`checked_test_set` (the process goes on to run
    the job's rank 0).
    """
    import logging
    import tempfile
    import time

    from .data.checks import (
        available_memory,
        check_memory,
        check_test,
        estimate_memory,
        fmt_bytes,
        scan_devices,
    )
    from .data.spill import SpilledTensors, load_test, spill_budget
    from .runtime.policies import check_policies
    from .runtime.stacking import check_vectorize
    from .runtime.state import build_task
    from .runtime.trackers import check_trackers
    from .training import check_training

    check_trackers(cfg)  # optional packages of output.trackers (tensorboard, mlflow)
    check_cuda(cfg)
    task = build_task(cfg, "cpu")
    mode = cfg["run"].get("preflight", "auto")
    source = cfg["data"]["source"]
    line = ""
    budget = spill_budget(cfg)
    if mode == "off":
        check_policies(cfg)
        test = load_test(task.data, budget)
    else:
        # the estimate comes before anything of the fleet's size (policies, test set)
        ranks = rank_count(cfg)
        est = estimate_memory(task.data, ranks + 1, 4 * int(task.flat.numel))
        room = available_memory()
        check_memory(est, room)
        check_policies(cfg)
        t0 = time.perf_counter()
        scan = scan_devices(task.data, mode, source)
        test, est.test_bytes = check_test(task.data, source, budget)
        seconds = time.perf_counter() - t0
        check_memory(est, room)
        checked = (
            f"all {scan.devices} devices"
            if scan.checked == scan.devices
            else f'{scan.checked} of {scan.devices} devices (run.preflight = "full": all, '
            f"about {scan.projected_s:.0f} s)"
        )
        of = f" of {fmt_bytes(room[0])} available" if room else ""
        spilled = isinstance(test, SpilledTensors)
        where = (
            f" ({fmt_bytes(test.nbytes)}, kept in a temporary file in {tempfile.gettempdir()}: "
            "run.test_memory_mb)"
            if spilled
            else ""
        )
        line = (
            f"edgefl simulate: checked the data of {checked} and the test set{where} in "
            f"{seconds:.2f} s; memory estimate {fmt_bytes(est.total)}{of}"
        )
        if scan.checked < scan.devices or (room and est.total > room[0] / 2) or spilled:
            if show is not None:
                show(line)
            else:
                print(line, file=sys.stderr, flush=True)
        else:
            logging.getLogger(__name__).info(line)
    check_training(cfg, task)  # train.loss, train.optimizer, train.client
    check_vectorize(cfg, task.model, task.data)  # train.vectorize = "on" on a job that cannot stack
    if cfg["sim"]["clock"] == "virtual":
        from .sim.profiles import load_fleet

        load_fleet(cfg["sim"]["profiles"], cfg["fleet"]["devices"], cfg["seed"])
    if keep_test:  # (every check passed: the job starts)
        global _CHECKED_TEST
        _CHECKED_TEST = (_data_key(cfg), test)
    return line


def preflight_apart(cfg: dict) -> None:
    """:func:`preflight` in a child process (``edgefl simulate --dry-run``; a real launch has
    rank 0 check, :func:`edgefl.launching.launch_checked`), so that this process never loads
    torch: about 30 MB instead of 250 MB, and an exit that costs nothing. The child sees what a rank
    sees (started as the ranks are, the working directory last on ``sys.path``) and prints
    what :func:`preflight` prints; a user error is its one line, raised here as
    :class:`PreflightFailed` (nothing more to print). In a process that has torch already
    (a notebook, a test), the check runs right here."""
    if "torch" in sys.modules:
        preflight(cfg)
        return
    import pickle

    from .launcher import rank_python

    proc = subprocess.run(
        [*rank_python(), "-m", "edgefl.preflight", "--preflight"], input=pickle.dumps(cfg)
    )  # (stdout and stderr are this process's own)
    if proc.returncode == 130:
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise PreflightFailed(proc.returncode)


class PreflightFailed(EdgeflError):
    """The child of :func:`preflight_apart` failed; it said why on stderr already."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"the pre-launch check failed with exit status {status}")


def _preflight_child() -> int:
    """``python -m edgefl.preflight --preflight``: :func:`preflight` of the pickled config on
    stdin; 0, or 2 after printing the user error's line. Leaves at once (the process has
    nothing else to do), so its torch costs no exit time."""
    import logging
    import pickle

    if getattr(sys.flags, "safe_path", False):
        sys.path.append(os.getcwd())  # (as edgefl.cli.main does for the ranks)
    logging.basicConfig(
        level=os.environ.get("EDGEFL_LOG", "WARNING").upper(),
        format="edgefl %(levelname)s %(name)s: %(message)s",
    )
    status = 0
    try:
        preflight(pickle.load(sys.stdin.buffer))
    except EdgeflError as e:
        print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        status = 2
    except KeyboardInterrupt:
        status = 130
    logging.shutdown()
    flush_and_exit(status)


def gate_check(check_dir: str) -> None:
    """Rank 0 of a job started by :func:`edgefl.launching.launch_checked`: :func:`preflight` of
    the config pickled in ``check_dir``; the verdict goes there as JSON (``ok``; ``error``: a user
    error's line; ``traceback``: any other failure; ``lines``: what the check prints),
    written atomically. Never raises (the launcher reports and ends the job)."""
    import json
    import pickle
    import traceback

    d = Path(check_dir)
    lines: list[str] = []
    try:
        preflight(pickle.loads((d / CHECK_CONFIG).read_bytes()), show=lines.append, keep_test=True)
        verdict: dict = {"ok": True}
    except EdgeflError as e:
        verdict = {"ok": False, "error": str(e)}
    except Exception:  # noqa: BLE001 - reported by the launcher, as it would have crashed
        verdict = {"ok": False, "traceback": traceback.format_exc()}
    verdict["lines"] = lines
    tmp = d / f".{CHECK_VERDICT}.tmp"
    tmp.write_text(json.dumps(verdict), encoding="utf-8")
    os.replace(tmp, d / CHECK_VERDICT)


if __name__ == "__main__":
    if sys.argv[1:] == ["--preflight"]:
        _preflight_child()
    sys.exit("usage: python -m edgefl.preflight --preflight < PICKLED_CONFIG")
