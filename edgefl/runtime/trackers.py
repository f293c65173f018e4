"""Experiment trackers: every metrics row rank 0 records also goes to csv, TensorBoard, MLflow.

Config ``output.trackers`` picks them (docs/tracking.md). A row is flattened first
(:func:`flatten`): nested dicts become ``a/b`` keys and the per-device counters
``row["devices"][id][name]`` become ``device/<id>/<name>``; lists are left out, and the numeric
trackers (TensorBoard, MLflow) also leave out every value that is not a number.

TensorBoard and MLflow are optional packages: :func:`check_trackers` names the missing one
and its extra in a one-line :class:`~edgefl.errors.ConfigError`, at config check time
(``edgefl simulate``'s preflight, before any MPI rank starts).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger("edgefl.coordinator")

#: tracker name -> (module it needs, pip extra that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
}
CSV_NAME = "metrics.csv"
MLFLOW_RUN_FILE = "mlflow_run_id"


# -- rows ---------------------------------------------------------------------------------
def flatten(row: Mapping[str, Any], sep: str = "/", lists: bool = False) -> dict[str, Any]:
    """One flat dict of a metrics row: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}``; the top-level
    ``devices`` table -> ``device/<id>/<name>``. Lists and tuples are left out (kept as they
    are with ``lists=True``); other values (numbers, strings, booleans, None) are kept."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif lists or not isinstance(value, (list, tuple, set)):
            flat[prefix] = value

    for key, value in row.items():
        walk("device" if key == "devices" else str(key), value)
    return flat


def numeric(flat: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a flattened row as floats (booleans as 0/1; strings, None and
    anything else left out)."""
    out: dict[str, float] = {}
    for k, v in flat.items():
        if isinstance(v, numbers.Real):  # also numpy scalars and bool
            out[k] = float(v)
    return out


# -- config time --------------------------------------------------------------------------
def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_trackers(cfg: Mapping[str, Any]) -> None:
    """Raise a one-line :class:`ConfigError` when a tracker of ``output.trackers`` needs a
    package that is not installed (names the key, the package and the pip extra)."""
    for name in cfg["output"]["trackers"]:
        if name in PACKAGES:
            module, extra = PACKAGES[name]
            if not _installed(module):
                raise ConfigError(
                    f"output.trackers: {name!r} needs the {module} package: "
                    f"pip install 'edgefl[{extra}]'"
                )
        elif name != "csv":
            raise ConfigError(
                f"config key 'output.trackers': unknown tracker {name!r} (csv, tensorboard, mlflow)"
            )


# -- the trackers -------------------------------------------------------------------------
class CsvTracker:
    """``metrics.csv`` in the run directory: one line per row, one column per flattened key.

    A key that first appears in a later row (a device's first update, a late evaluation)
    adds a column: the file is then rewritten with the union of the columns (to a temporary
    file, then renamed), so no earlier value is lost. Otherwise a row is appended.

    Args:
        path: the csv file.
        history: rows of the run so far (a resume): written first, replacing the file.
    """

    def __init__(self, path: Path, history: list[dict] | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = [flatten(r) for r in history or []]
        self.columns: list[str] = []
        self._rewrite()

    @staticmethod
    def _order(keys: list[str]) -> list[str]:
        """``round`` first, then run-wide keys in first-seen order, then the per-device
        columns by device id (numerically) and name."""

        def dev_key(k: str) -> tuple:
            _, d, name = (k.split("/", 2) + ["", ""])[:3]
            return (0, int(d), name) if d.isdigit() else (1, d, name)

        plain = [k for k in keys if not k.startswith("device/")]
        dev = sorted((k for k in keys if k.startswith("device/")), key=dev_key)
        if "round" in plain:
            plain.remove("round")
            plain.insert(0, "round")
        return plain + dev

    @staticmethod
    def _cell(v: Any) -> Any:
        if v is None:
            return ""
        if isinstance(v, bool):
            return int(v)
        return v

    def _line(self, flat: dict[str, Any]) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(
            [self._cell(flat.get(c)) for c in self.columns]
        )
        return buf.getvalue()

    def _rewrite(self) -> None:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys(r))
        self.columns = self._order(list(seen))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            if self.columns:
                csv.writer(f, lineterminator="\n").writerow(self.columns)
                f.writelines(self._line(r) for r in self.rows)
        os.replace(tmp, self.path)

    def log(self, row: dict) -> None:
        """Add one metrics row."""
        flat = flatten(row)
        self.rows.append(flat)
        if not self.columns or any(k not in self.columns for k in flat):
            self._rewrite()
        else:
            with open(self.path, "a", encoding="utf-8", newline="") as f:
                f.write(self._line(flat))

    def close(self) -> None:
        """Nothing to do: every row is on disk when :meth:`log` returns."""


class TensorBoardTracker:
    """``torch.utils.tensorboard.SummaryWriter`` under ``<run_dir>/tensorboard``: one scalar
    per numeric key, step = the row's round.

    Args:
        log_dir: the event-file directory.
        history: rows of the run so far; written first when the directory holds no event
            file yet (trackers turned on at a resume), else left to the existing files.
    """

    def __init__(self, log_dir: Path, history: list[dict] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        fresh = not (log_dir.is_dir() and any(log_dir.iterdir()))
        self.writer = SummaryWriter(log_dir=str(log_dir))
        if fresh:
            for row in history or []:
                self.log(row)

    def log(self, row: dict) -> None:
        """Add one metrics row (``add_scalar`` per numeric key, step = round)."""
        step = int(row["round"])
        for k, v in numeric(flatten(row)).items():
            if k != "round":
                self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class MlflowTracker:
    """One MLflow run: ``log_metric`` per numeric key with step = round; params = the
    flattened config (``section.key``).

    The run's id is kept in ``<run_dir>/mlflow_run_id`` so that a resumed job continues the
    same MLflow run.

    Args:
        run_dir: the run directory.
        cfg: the effective config (``output.mlflow_uri``, ``output.mlflow_experiment``).
        history: rows of the run so far; logged first when a new MLflow run is made.
    """

    MAX_PARAMS = 100  # per log_batch call (an MLflow limit)
    MAX_METRICS = 1000
    MAX_PARAM_CHARS = 500

    def __init__(self, run_dir: Path, cfg: Mapping[str, Any], history: list[dict] | None) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        out = cfg["output"]
        store = (run_dir / "mlruns").resolve()
        uri = out.get("mlflow_uri") or ""
        if not uri:  # a SQLite store (MLflow 3 refuses a bare ./mlruns file store)
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self._metric, self._param = Metric, Param
        name = out.get("mlflow_experiment") or "edgefl"
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:  # artifacts (none are logged yet) next to the store, not in the working dir
            art = (store / "artifacts").as_uri() if not out.get("mlflow_uri") else None
            exp_id = self.client.create_experiment(name, artifact_location=art)
        id_file = run_dir / MLFLOW_RUN_FILE
        run_id = id_file.read_text().strip() if history and id_file.is_file() else ""
        self.uri = uri
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        run = self.client.create_run(exp_id, run_name=run_dir.name)
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id + "\n", encoding="utf-8")
        params = [
            self._param(k, str(v)[: self.MAX_PARAM_CHARS])
            for k, v in flatten(cfg, sep=".", lists=True).items()
        ]
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i : i + self.MAX_PARAMS])
        for row in history or []:
            self.log(row)

    def log(self, row: dict) -> None:
        """Add one metrics row (one metric per numeric key, step = round)."""
        step = int(row["round"])
        ms = int(time.time() * 1000)
        metrics = [
            self._metric(k, v, ms, step)
            for k, v in numeric(flatten(row)).items()
            if k != "round" and math.isfinite(v)
        ]
        for i in range(0, len(metrics), self.MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self.MAX_METRICS])

    def close(self) -> None:
        """Mark the MLflow run finished."""
        self.client.set_terminated(self.run_id, status="FINISHED")


class Trackers:
    """The configured trackers as one: :meth:`log` feeds each of them a row. A tracker that
    fails (disk full, tracking server gone) is reported once and turned off: the job goes
    on, its metrics.jsonl is complete anyway."""

    def __init__(self, trackers: list[Any] | None = None) -> None:
        self.trackers = list(trackers or [])

    def _each(self, what: str, *args: Any) -> None:
        for t in list(self.trackers):
            try:
                getattr(t, what)(*args)
            except Exception as e:  # noqa: BLE001 - a side channel must not end the job
                name = type(t).__name__
                log.warning("tracker %s failed (%s: %s): turned off", name, type(e).__name__, e)
                self.trackers.remove(t)

    def log(self, row: dict) -> None:
        """Feed one metrics row to every tracker."""
        self._each("log", row)

    def close(self) -> None:
        """Close every tracker (idempotent)."""
        self._each("close")
        self.trackers = []


def make_trackers(
    cfg: Mapping[str, Any], run_dir: Path | None, history: list[dict] | None = None
) -> Trackers:
    """The trackers of ``output.trackers`` for a job writing to ``run_dir`` (None: none).

    Args:
        cfg: the effective config.
        run_dir: the run directory; without one, trackers are off.
        history: the rows recorded before a resume (``[]`` for a new run).
    """
    names = list(dict.fromkeys(cfg["output"]["trackers"]))
    if run_dir is None or not names:
        return Trackers()
    check_trackers(cfg)
    made: list[Any] = []
    for name in names:
        if name == "csv":
            made.append(CsvTracker(run_dir / CSV_NAME, history))
        elif name == "tensorboard":
            made.append(TensorBoardTracker(run_dir / "tensorboard", history))
        elif name == "mlflow":
            made.append(MlflowTracker(run_dir, cfg, history))
    return Trackers(made)
