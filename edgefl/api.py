"""The Python API: :func:`simulate` runs a job and returns its :class:`Result`.

``edgefl simulate`` (edgefl/cli.py) is built on the same functions:
:func:`edgefl.config.sources.simulation_config` (the effective config and the rank count),
:mod:`edgefl.preflight` (the pre-launch checks) and :mod:`edgefl.launching` (the MPI
backend: :func:`~edgefl.launching.mpi_launcher`, :func:`~edgefl.launching.mpi_command`,
:func:`~edgefl.launching.launch_mpi`, or :func:`~edgefl.launching.launch_checked` with the
check done by rank 0 while the other ranks start; with ``--backend inline``,
:func:`~edgefl.launching.run_in_process`, as :func:`simulate`). Heavy modules (torch, the
runtime) are imported only when a function needs them, so ``import edgefl`` stays cheap.
docs/python-api.md is the walkthrough.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config.sources import config_source, override_list, simulation_config
from .errors import EdgeflError
from .launching import banner, launch_mpi, mpi_command, mpi_launcher, needs_relay, run_in_process
from .preflight import check_ranks_can_import, preflight
from .shipped import ObjectTable

BACKENDS = ("mpi", "inline")


class RunFailed(EdgeflError):
    """A run that ended with a nonzero exit status (2: an error, see the message; 3: the
    job stopped early, e.g. a rank failed or nothing could progress; 4: the model diverged,
    see ``Result(run_dir).diverged``; 128 + N: killed by signal N from outside;
    docs/fault-tolerance.md section 9 lists them all).

    Attributes:
        status: the job's exit status.
        run_dir: its run directory (metrics and checkpoints written so far are there).
    """

    def __init__(self, status: int, run_dir: Path, detail: str = "") -> None:
        self.status = status
        self.run_dir = Path(run_dir)
        more = f": {detail}" if detail else ""
        super().__init__(
            f"the run failed with exit status {status} (run directory {run_dir}){more}"
        )


class Result:
    """A finished run, read from its run directory.

    ``Result(run_dir)`` also opens an earlier run (``edgefl simulate --out DIR``).

    Attributes:
        run_dir: the run directory (Path).
        metrics: one dict per model version (round), as in ``metrics.jsonl``; times in
            seconds, traffic in bytes.
        summary: ``summary.json`` as a dict.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.metrics: list[dict] = _read_jsonl(self.run_dir / "metrics.jsonl")
        self.summary: dict = _read_json(self.run_dir / "summary.json")

    @staticmethod
    def rows_so_far(run_dir: str | Path) -> list[dict]:
        """The metrics rows a running (or killed) run has written so far: ``metrics.jsonl``
        without a last line cut off mid-write; [] while there is none. (A finished run:
        ``Result(run_dir).metrics``.)"""
        try:
            text = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return []
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # (the line being written, or one a kill cut off)
        return rows

    @property
    def final_accuracy(self) -> float | None:
        """Test accuracy (fraction in [0, 1]) of the final model; None if never evaluated."""
        return self.summary.get("final_accuracy")

    @property
    def model_sha256(self) -> str:
        """SHA-256 (hex) of the final global model's float32 parameters."""
        return self.summary["model_sha256"]

    @property
    def config(self) -> dict:
        """The effective config the run used (its ``config.toml``)."""
        from .config import load_config

        return load_config(self.run_dir / "config.toml")

    @property
    def best_accuracy(self) -> float | None:
        """The highest test accuracy (fraction in [0, 1]) of any evaluated model version;
        None if never evaluated. Its version: ``summary["best_round"]``."""
        return self.summary.get("best_accuracy")

    @property
    def diverged(self) -> dict | None:
        """The first sign of divergence the run saw (``{"version", "reason", "cause"}``,
        docs/fault-tolerance.md), or None."""
        return self.summary.get("diverged")

    def metrics_frame(self, flat: bool = True) -> Any:
        """:attr:`metrics` as a pandas DataFrame, one row per round.

        ``flat=True`` (default): nested values are columns, named as in the csv tracker's
        ``metrics.csv`` (``device/<id>/bytes_up``, ``fed_eval/<id>/accuracy``,
        ``client/...``); lists are left out. ``flat=False``: one column per top-level key
        (``devices``, ``fed_eval`` hold dicts). Raises ImportError when pandas is missing."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Result.metrics_frame() needs pandas: pip install pandas") from None
        if not flat:
            return pd.DataFrame(self.metrics)
        from .runtime.trackers import flatten

        return pd.DataFrame([flatten(r) for r in self.metrics])

    def model(self) -> Any:
        """A torch module of the configured model holding the final weights
        (``final_model.pt``), on the CPU, in eval mode."""
        import torch

        from .runtime.state import build_task

        path = self.run_dir / "final_model.pt"
        if not path.is_file():
            raise EdgeflError(f"run directory '{self.run_dir}' has no final_model.pt")
        model = build_task(self.config, "cpu").model
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()

    def __repr__(self) -> str:
        acc = self.final_accuracy
        acc_s = f"{acc:.4f}" if acc is not None else "-"
        return (
            f"Result(run_dir='{self.run_dir}', rounds={len(self.metrics)}, final_accuracy={acc_s})"
        )


def simulate(
    config: str | Path | Mapping[str, Any] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    out: str | Path | None = None,
    backend: str | None = None,
) -> Result:
    """Run a job on this machine and return its :class:`Result`.

    Args:
        config: default None, the built-in job. A path (str or Path) to a TOML config, or a
            dict: sections nested as in the TOML (``{"fleet": {"devices": 4}}``) or dotted
            keys (``{"fleet.devices": 4}``), checked like a config file.
        overrides: default None. Dotted keys applied after ``config`` with exactly the
            validation of ``edgefl simulate --set KEY=VALUE``; values are Python values
            (``{"run.rounds": 3, "model.args.hidden": [8]}``), not TOML text.
        out: default None: ``run.out`` if set, else ``runs/<YYYYmmdd-HHMMSS>-<name>`` below
            the current directory (``-2``, ``-3``, ... appended if taken; ``<name>``: the
            config file's stem, ``default`` or ``config`` for a dict). A given directory
            must not already hold a run.
        backend: default None: the config's ``run.backend`` (``"mpi"`` unless set).
            ``"mpi"``: launch ``mpiexec`` with ``fleet.ranks`` ranks, as ``edgefl simulate``
            does. ``"inline"``: coordinator and workers in this process (threads over the
            in-process loopback transport, no MPI), as ``edgefl simulate --backend inline``
            does; same run directory and, for the same config and seed, the same final
            model. A backend given here wins over ``run.backend``.

    A class, function or other callable given as a config value (``{"model.name": MyNet}``)
    stands for its ``'module:qualname'`` when the ranks can import it by that name. One
    they cannot (defined in ``__main__``: a notebook, a script; inside a function; a lambda,
    a ``functools.partial``) is passed by value (:mod:`edgefl.shipped`): with
    ``backend="mpi"`` it is pickled with cloudpickle into a payload that only this call's
    ranks load, after checking its SHA-256 against the digest this call gives them; the
    config names it ``"edgefl.shipped.by_value:Name"``. With ``backend="inline"`` it is used
    as it is (``__main__`` objects keep their ``"__main__:Name"``).

    Raises:
        ConfigError: a bad key or value, before anything starts (nothing is written).
        EdgeflError: another user error found before the start (missing mpiexec, data).
        RunFailed: the run ended with a nonzero exit status.
        ValueError: an unknown ``backend``.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(map(repr, BACKENDS))}")
    objects = ObjectTable()  # callables the ranks cannot import by name (edgefl/shipped.py)
    if isinstance(config, Mapping):
        config = objects.take(config)
    if overrides is not None:
        overrides = objects.take(overrides)
    path, doc, stem = config_source(config)
    cfg, ranks = simulation_config(path, override_list(overrides), doc=doc)
    backend = cfg["run"]["backend"] if backend is None else backend
    from .runtime.rundir import prepare_run_dir, resolve_run_dir

    def run_dir_of(cfg: dict) -> Path:
        found = resolve_run_dir(cfg, str(out) if out is not None else None, None, stem)
        if out is None and not cfg["run"]["out"]:
            found = _unused(found)  # runs started within the same second (a sweep)
        return found

    detail = ""
    if backend == "mpi":
        cfg, shipment = objects.ship(cfg)  # by value: __main__'s and other unimportable ones
        check_ranks_can_import(cfg)
        launcher, cfg = mpi_launcher(cfg)
        preflight(cfg)
        run_dir = run_dir_of(cfg)
        prepare_run_dir(run_dir, cfg, resuming=False)
        print(banner(cfg, ranks, launcher, run_dir), flush=True)
        with shipment.staged(run_dir) as env:  # the payload, for this job's ranks only
            cmd = mpi_command(launcher, ranks, run_dir)
            status = launch_mpi(cmd, run_dir, relay=needs_relay(), env=env)
    else:
        from .runtime.inline import check_inline

        objects.register(cfg)
        check_inline(cfg)
        run_dir = run_dir_of(cfg)
        status, detail = run_in_process(cfg, ranks, run_dir)
    if status != 0:
        if not detail and (run_dir / "summary.json").is_file():
            detail = _read_json(run_dir / "summary.json").get("stopped") or ""
        raise RunFailed(status, run_dir, detail)
    return Result(run_dir)


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... if it exists."""
    n = 1
    found = path
    while found.exists():
        n += 1
        found = path.with_name(f"{path.name}-{n}")
    return found


# -- reading a run directory --------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeflError(f"'{path}' not found: not a finished run directory") from None
    except (OSError, ValueError) as e:
        raise EdgeflError(f"cannot read '{path}': {e}") from None


def _read_jsonl(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeflError(f"'{path}' not found: not a run directory") from None
    except OSError as e:
        raise EdgeflError(f"cannot read '{path}': {e.strerror}") from None
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise EdgeflError(f"cannot read '{path}': {e}") from None
