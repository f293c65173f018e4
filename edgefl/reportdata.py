"""What ``edgefl report`` reads and computes, in plain Python (no matplotlib): the run
directories (``metrics.jsonl``, ``summary.json``, ``timeline.csv``, ``config.toml``), the x
axes (seconds, model versions or bytes), the federated evaluations, the tasks of a timeline
and the bars of the Gantt chart. Tested without drawing; :mod:`edgefl.reportplots` draws
from it and :mod:`edgefl.report` is the command."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EdgeflError

LOSS_KEYS = ("train_loss", "test_loss", "fed_loss")
"""Loss fields of the metrics rows drawn in ``loss.png`` (mean per example)."""

STATE_COLOURS = {
    "download": "#1f77b4",
    "compute": "#2ca02c",
    "upload": "#ff7f0e",
    "waiting": "#d0d0d0",
    "offline": "#505050",
    "dead": "#d62728",
}
"""Gantt colour of each timeline state (unknown future states get :data:`SPARE_COLOURS`)."""

SPARE_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")

# Busy states of one task, in the order a task goes through them.
_TASK_ORDER = {"download": 0, "compute": 1, "upload": 2}

DEFAULT_MAX_DEVICES = 64
"""Most devices drawn one by one in the Gantt chart and the idle-fraction bars."""


@dataclass
class Run:
    """One run directory, read and checked.

    Args:
        path: the run directory.
        label: legend name of the run.
        metrics: the rows of ``metrics.jsonl`` (one per model version), in file order.
        summary: ``summary.json``.
        config: ``config.toml`` as a dict, or None when the run has none.
        timeline: ``timeline.csv`` rows ``(device, state, start_s, end_s)``, or None when not
            loaded (only the first run's timeline is needed).
        profile_names: device id -> device profile name (e.g. ``"phone"``), when the run's
            virtual-clock fleet could be rebuilt from its config; else empty (the labels of
            the Gantt chart, the idle bars and the federated-evaluation bars).
    """

    path: Path
    label: str
    metrics: list[dict]
    summary: dict
    config: dict | None = None
    timeline: list[tuple[int, str, float, float]] | None = None
    profile_names: dict[int, str] = field(default_factory=dict)

    @property
    def clock(self) -> str:
        """``"virtual"`` or ``"wall"`` (from the summary; ``""`` when unknown)."""
        c = self.summary.get("clock")
        return c if isinstance(c, str) else ""


# -- reading --------------------------------------------------------------------------------
def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; every row must be a JSON object with a finite
    ``time_s`` (seconds). Raises EdgeflError naming the file (and line) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise EdgeflError(f"run file '{path}' not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EdgeflError(f"run file '{path}': cannot read it as UTF-8 text ({e})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EdgeflError(f"run file '{path}' line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise EdgeflError(f"run file '{path}' line {i}: expected a JSON object")
        if not is_number(row.get("time_s")):
            raise EdgeflError(
                f"run file '{path}' line {i}: field 'time_s' = {row.get('time_s')!r}: "
                "expected a finite number of seconds"
            )
        acc = row.get("test_accuracy")
        if acc is not None and not isinstance(acc, (int, float)):
            raise EdgeflError(
                f"run file '{path}' line {i}: field 'test_accuracy' = {acc!r}: expected a number"
            )
        major = row.get("major_updates")
        if major is not None and not isinstance(major, list):
            raise EdgeflError(
                f"run file '{path}' line {i}: field 'major_updates' = {major!r}: "
                "expected a list of device ids"
            )
        fe = row.get("fed_eval")
        if fe is not None and not (
            isinstance(fe, dict) and all(isinstance(e, dict) for e in fe.values())
        ):
            raise EdgeflError(
                f"run file '{path}' line {i}: field 'fed_eval': expected an object of "
                "device id -> {samples, loss, accuracy}"
            )
        if fe is not None and not isinstance(row.get("fed_version"), int):
            raise EdgeflError(
                f"run file '{path}' line {i}: field 'fed_version' = {row.get('fed_version')!r}"
                ": expected the integer model version that 'fed_eval' evaluated"
            )
        rows.append(row)
    return rows


def read_summary(path: Path) -> dict:
    """``summary.json`` as a dict, with ``staleness_hist`` and ``devices`` checked.

    Raises EdgeflError naming the file (and the field) when it is missing or garbled."""
    path = Path(path)
    if not path.is_file():
        raise EdgeflError(f"run file '{path}' not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise EdgeflError(f"run file '{path}': cannot read it as UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise EdgeflError(
            f"run file '{path}': not valid JSON ({e.msg} at line {e.lineno})"
        ) from None
    if not isinstance(doc, dict):
        raise EdgeflError(f"run file '{path}': expected a JSON object")
    hist = doc.get("staleness_hist", {})
    if not isinstance(hist, dict):
        raise EdgeflError(f"run file '{path}': field 'staleness_hist' must be an object")
    for k, v in hist.items():
        if not (k.lstrip("-").isdigit() and isinstance(v, int) and not isinstance(v, bool)):
            raise EdgeflError(
                f"run file '{path}': field 'staleness_hist' entry {k!r}: {v!r}: expected "
                "an integer staleness mapped to an integer count"
            )
    devices = doc.get("devices", {})
    if not isinstance(devices, dict):
        raise EdgeflError(f"run file '{path}': field 'devices' must be an object")
    for k, v in devices.items():
        if not k.isdigit() or not isinstance(v, dict):
            raise EdgeflError(
                f"run file '{path}': field 'devices' entry {k!r}: expected a device id "
                "mapped to an object"
            )
        idle = v.get("idle_fraction")
        if idle is not None and not is_number(idle):
            raise EdgeflError(
                f"run file '{path}': devices.{k}.idle_fraction = {idle!r}: expected a number"
            )
    return doc


def read_timeline(path: Path) -> list[tuple[int, str, float, float]]:
    """``timeline.csv`` rows ``(device, state, start_s, end_s)``, read with
    :func:`edgefl.sim.timeline.read_csv`. Raises EdgeflError naming the file and the first
    bad row when it is missing or garbled."""
    from .sim.timeline import read_csv

    path = Path(path)
    if not path.is_file():
        raise EdgeflError(f"run file '{path}' not found")
    try:
        with open(path, encoding="utf-8") as f:
            header = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise EdgeflError(f"run file '{path}': cannot read it as UTF-8 text ({e})") from None
    if header != "device,state,start_s,end_s":
        raise EdgeflError(
            f"run file '{path}' row 1: header {header!r}, expected 'device,state,start_s,end_s'"
        )
    try:
        rows = read_csv(path)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise EdgeflError(f"run file '{path}' {_first_bad_row(path)}") from None
    for i, (_, _, a, b) in enumerate(rows, 2):
        if not (math.isfinite(a) and math.isfinite(b) and b >= a):
            raise EdgeflError(
                f"run file '{path}' row {i}: interval [{a!r}, {b!r}]: expected finite "
                "start_s <= end_s"
            )
    return rows


def _first_bad_row(path: Path) -> str:
    """Where and why ``read_csv`` failed, e.g. ``row 7: expected 4 fields, got 3``."""
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        for i, rec in enumerate(csv.reader(f), 1):
            if i == 1:
                continue
            if len(rec) != 4:
                return f"row {i}: expected 4 fields (device,state,start_s,end_s), got {len(rec)}"
            try:
                int(rec[0])
            except ValueError:
                return f"row {i}: field 'device' = {rec[0]!r}: expected an integer"
            for name, v in zip(("start_s", "end_s"), rec[2:]):
                try:
                    float(v)
                except ValueError:
                    return f"row {i}: field '{name}' = {v!r}: expected a number of seconds"
    return "cannot be parsed as device,state,start_s,end_s rows"


def _read_config(path: Path) -> dict | None:
    if not path.exists():
        return None
    from .config.load import read_toml

    try:
        return read_toml(path)
    except EdgeflError as e:
        raise EdgeflError(f"run file '{path}': {e}") from None


def _profile_names(cfg: dict | None, summary: dict) -> dict[int, str]:
    """Device id -> profile name for a virtual-clock run whose fleet can be rebuilt from its
    config (best effort: an empty dict when it cannot)."""
    if not cfg or summary.get("clock") != "virtual":
        return {}
    try:
        from .sim.profiles import load_fleet

        fleet = load_fleet(cfg["sim"]["profiles"], int(cfg["fleet"]["devices"]), cfg["seed"])
    except (EdgeflError, KeyError, TypeError, ValueError):
        return {}
    return {d: p.name for d, p in enumerate(fleet)}


def policy_name(summary: dict, cfg: dict | None) -> str:
    """Short name of a run's policy, e.g. ``"bsp"``, ``"ssp s=4"``, ``"fedbuff K=4"``."""
    alg = (cfg or {}).get("algorithm", {})
    name = summary.get("consistency") or alg.get("consistency") or "run"
    name = str(name)
    if name == "ssp" and "staleness" in alg:
        name += f" s={alg['staleness']}"
    elif name == "fedbuff" and "buffer_k" in alg:
        name += f" K={alg['buffer_k']}"
    gate = alg.get("gate")
    if isinstance(gate, str) and gate not in ("", "always", "none"):
        name += f" + {gate}"
    return name


def load_run(path: str | Path, label: str | None = None, timeline: bool = False) -> Run:
    """Read one run directory.

    Args:
        path: the run directory.
        label: legend name; default None = the policy and the folder name, e.g.
            ``"ssp s=4 (rep_ssp)"``.
        timeline: also read ``timeline.csv`` (required then); default False.

    Raises EdgeflError naming the directory or file that is missing or garbled.
    """
    p = Path(path)
    if not p.is_dir():
        raise EdgeflError(f"run directory '{p}' not found")
    metrics = read_metrics(p / "metrics.jsonl")
    summary = read_summary(p / "summary.json")
    cfg = _read_config(p / "config.toml")
    if label is None:
        pol = policy_name(summary, cfg)
        name = p.resolve().name
        label = pol if name == pol else f"{pol} ({name})"
    run = Run(p, label, metrics, summary, cfg)
    if timeline:
        run.timeline = read_timeline(p / "timeline.csv")
    run.profile_names = _profile_names(cfg, summary)
    return run


# -- derived quantities ---------------------------------------------------------------------
@dataclass
class Task:
    """One task of one device, from its timeline.

    Args:
        index: the device's task number (0 = its first task), counting cut-off tasks too.
        start_s: when its first busy interval began (s).
        busy_s: download + compute + upload time of the task (s).
        states: the busy states it went through, in order.
    """

    index: int
    start_s: float
    busy_s: float
    states: list[str]


def task_times(rows: Sequence[tuple[int, str, float, float]]) -> dict[int, list[Task]]:
    """Split each device's timeline into tasks and time them.

    A task is a run of back-to-back busy intervals (download, compute, upload) in that order;
    a new task starts when the order restarts (e.g. a compute after a compute: local
    iterations between pushes) or after a non-busy state (waiting, offline, dead). A task
    counts as finished when it ends with an upload or the device goes straight on to its next
    task; one that stops otherwise (cut off by the run's end, by going offline or dying, or
    abandoned) is left out, though its index is still used up. Returns device -> finished
    tasks in time order.
    """
    by_dev: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for d, s, a, b in rows:
        by_dev[d].append((a, b, s))
    out: dict[int, list[Task]] = {}
    for d in sorted(by_dev):
        ivs = sorted(by_dev[d])
        tasks: list[Task] = []
        cur: Task | None = None
        last_order = -1
        last_end = 0.0
        count = 0
        for a, b, s in ivs:
            order = _TASK_ORDER.get(s)
            if order is None:  # waiting / offline / dead / other: closes the task
                if cur is not None and cur.states[-1] == "upload":
                    tasks.append(cur)
                cur = None
                continue
            tol = 1e-9 * max(1.0, abs(a))
            if cur is not None and (order <= last_order or a > last_end + tol):
                if order <= last_order and a <= last_end + tol:
                    tasks.append(cur)  # straight on to the next task
                elif cur.states[-1] == "upload":
                    tasks.append(cur)
                cur = None
            if cur is None:
                cur = Task(count, a, 0.0, [])
                count += 1
            cur.busy_s += b - a
            cur.states.append(s)
            last_order = order
            last_end = b
        if cur is not None and cur.states[-1] == "upload":
            tasks.append(cur)
        out[d] = tasks
    return out


def auto_xscale(spans: Sequence[float]) -> str:
    """``"log"`` when the runs' time spans (s) differ by 20x or more, else ``"linear"``."""
    pos = [s for s in spans if s > 0]
    if len(pos) >= 2 and max(pos) / min(pos) >= 20:
        return "log"
    return "linear"


def staleness_bin_width(hists: Sequence[dict[str, int]], max_bars: int = 40) -> int:
    """Width (in model versions) of the staleness bins shared by all runs: 1 while the
    largest staleness is below ``max_bars`` (default 40), else wide enough for ``max_bars``
    bins."""
    top = max((int(k) for h in hists for k in h), default=0)
    return max(1, math.ceil((top + 1) / max_bars))


def bin_staleness(hist: dict[str, int], width: int) -> dict[int, int]:
    """Counts of a ``staleness_hist`` ({staleness: count}) per bin, keyed by the bin's left
    edge (a multiple of ``width``); empty bins are left out."""
    out: dict[int, int] = defaultdict(int)
    for k, v in hist.items():
        out[max(int(k), 0) // width * width] += int(v)
    return {k: out[k] for k in sorted(out) if out[k]}


def has_staleness(run: Run) -> bool:
    """True when the run applied at least one update at a staleness above 0 (not all-BSP)."""
    return any(int(k) > 0 and int(v) > 0 for k, v in run.summary.get("staleness_hist", {}).items())


# -- the x axis of the curves -----------------------------------------------------------------
X_AXES = ("time", "round", "virtual", "wall", "bytes")
"""Values of ``--x``, the x axis of the curves: ``time`` (each run's clock, ``time_s``, s),
``round`` (model version), ``virtual`` (virtual clock, s), ``wall`` (wall clock, s),
``bytes`` (cumulative uplink bytes)."""

DEFAULT_X = "time"
"""``--x`` when not given: each run's own clock, as ``edgefl report`` always drew it."""


def time_label(runs: Sequence[Run]) -> str:
    clocks = {r.clock for r in runs}
    if clocks == {"virtual"}:
        return "time (s, virtual clock)"
    if clocks == {"wall"}:
        return "time (s, wall clock)"
    return "time (s, each run's clock)"


def x_label(x: str, runs: Sequence[Run]) -> str:
    """Axis label of ``--x`` value ``x`` (with its unit) for these runs."""
    if x == "time":
        return time_label(runs)
    return {
        "round": "model version (round)",
        "virtual": "virtual time (s, simulated clock)",
        "wall": "wall-clock time (s, real seconds the run took)",
        "bytes": "uplink traffic, cumulative (bytes; 1 MB = 10^6 B)",
    }[x]


def check_x(x: str) -> None:
    if x not in X_AXES:
        raise EdgeflError(f"--x {x!r}: expected one of {', '.join(X_AXES)}")


def row_x(run: Run, x: str) -> tuple[list[float] | None, str]:
    """Each ``metrics.jsonl`` row's position on the ``--x`` axis ``x``.

    Returns ``(values, "")`` with one value per row, in file order (seconds for ``time``,
    ``virtual`` and ``wall``; the model version for ``round``; cumulative uplink bytes,
    the rows' ``bytes_up`` summed up to and including the row, for ``bytes``), or
    ``(None, why)`` when the run has no such axis (``virtual`` of a wall-clock run,
    ``wall`` without ``wall_time_s``, ``bytes`` without ``bytes_up``).
    Raises EdgeflError for an unknown ``x``.
    """
    check_x(x)
    rows = run.metrics
    times = [float(r["time_s"]) for r in rows]
    if x == "time":
        return times, ""
    if x == "round":
        return [
            float(r["round"]) if is_number(r.get("round")) else float(i)
            for i, r in enumerate(rows, 1)
        ], ""
    if x == "virtual":
        if run.clock == "virtual":
            return times, ""
        if run.clock == "wall":
            return None, "it ran on the wall clock (edgefl run), so it has no virtual time"
        return None, "its summary.json names no clock, so its time_s may not be virtual"
    if x == "wall":
        if run.clock == "wall":
            return times, ""
        walls = [r.get("wall_time_s") for r in rows]
        if rows and all(is_number(w) for w in walls):
            return [float(w) for w in walls], ""
        return None, "its metrics rows have no 'wall_time_s'"
    if not any(is_number(r.get("bytes_up")) for r in rows):
        return None, "its metrics rows have no 'bytes_up'"
    out, total = [], 0.0
    for r in rows:
        b = r.get("bytes_up")
        total += float(b) if is_number(b) else 0.0
        out.append(total)
    return out, ""


@dataclass
class XAxis:
    """The x axis of the curves, resolved for a list of runs.

    Args:
        name: the ``--x`` value (one of :data:`X_AXES`).
        label: the axis label, with its unit.
        scale: ``"linear"`` or ``"log"`` (``--xscale``, ``auto`` resolved).
        values: per run, each metrics row's x (see :func:`row_x`); None when the run has no
            such axis.
        why: per run, why it has none (``""`` when it has).
    """

    name: str
    label: str
    scale: str
    values: list[list[float] | None]
    why: list[str]

    def version_x(self, i: int, run: Run) -> dict[int, float]:
        """Model version -> x of the row that made it, for run ``i``; version 0 (the initial
        model) sits at 0. Empty when the run has no such axis."""
        xs = self.values[i]
        if xs is None:
            return {}
        out = {0: 0.0}
        for j, (r, xv) in enumerate(zip(run.metrics, xs), 1):
            v = r.get("round", j)
            if is_number(v):
                out[int(v)] = xv
        return out


def x_axis(runs: Sequence[Run], x: str = DEFAULT_X, xscale: str = "auto") -> XAxis:
    """Resolve the ``--x`` axis ``x`` and its ``--xscale`` for ``runs``: ``auto`` is log
    when the runs' spans on it differ by 20x or more (:func:`auto_xscale`)."""
    check_x(x)
    got = [row_x(r, x) for r in runs]
    values = [v for v, _ in got]
    spans = [max(v) for v in values if v]
    scale = auto_xscale(spans) if xscale == "auto" else xscale
    return XAxis(x, x_label(x, runs), scale, values, [w for _, w in got])


# -- federated evaluation ---------------------------------------------------------------------
@dataclass
class FedEval:
    """One federated evaluation of a run: the ``fed_eval`` of a metrics row, or the final
    model's (``summary.json`` ``fed_eval.final``).

    Args:
        version: the global model version the devices evaluated (``fed_version``).
        row: index (0-based, file order) of the metrics row it landed in; None for the final
            model's evaluation (in ``summary.json``, not in a row).
        accuracy: device -> accuracy on its held-out data (fraction), for the devices that
            reported samples > 0 and a finite accuracy.
        samples: device -> its held-out samples (the weights of the mean).
        mean: the sample-weighted mean accuracy (``fed_accuracy``, fraction), or None.
        loss: the sample-weighted mean loss (``fed_loss``, per example), or None.
    """

    version: int
    row: int | None
    accuracy: dict[int, float]
    samples: dict[int, int]
    mean: float | None
    loss: float | None = None


def _fed_eval(version: int, row: int | None, doc: dict, devices: Any) -> FedEval:
    acc, samples = {}, {}
    for k, e in devices.items() if isinstance(devices, dict) else ():
        if not (isinstance(e, dict) and str(k).isdigit()):
            continue
        n, a = e.get("samples"), e.get("accuracy")
        if is_number(n) and n > 0 and is_number(a):
            acc[int(k)] = float(a)
            samples[int(k)] = int(n)
    mean, loss = doc.get("fed_accuracy"), doc.get("fed_loss")
    return FedEval(
        version,
        row,
        acc,
        samples,
        float(mean) if is_number(mean) else None,
        float(loss) if is_number(loss) else None,
    )


def fed_evals(run: Run, final: bool = True) -> list[FedEval]:
    """The run's federated evaluations, by version (empty when evaluation was off): those of
    the metrics rows and, with ``final`` (default True), the final model's from
    ``summary.json`` (``fed_eval.final``, every live device; left out when skipped)."""
    out = []
    for i, r in enumerate(run.metrics):
        if isinstance(r.get("fed_eval"), dict) and is_number(r.get("fed_version")):
            out.append(_fed_eval(int(r["fed_version"]), i, r, r["fed_eval"]))
    fe = run.summary.get("fed_eval")
    last = fe.get("final") if final and isinstance(fe, dict) else None
    if isinstance(last, dict) and isinstance(last.get("version"), int) and "skipped" not in last:
        out.append(_fed_eval(last["version"], None, last, last.get("devices")))
    return sorted(out, key=lambda e: (e.version, e.row is None, e.row or 0))


def latest_per_device(evals: Sequence[FedEval]) -> dict[int, tuple[int, float, int]]:
    """Device -> ``(version, accuracy, samples)`` of its latest (highest-version) evaluation.

    With the final model's evaluation (every live device) these are its values; without it,
    under BSP, the last evaluated version's (every device evaluates each); under asynchronous
    policies only the devices that started a task from a version report it, so devices may
    show different versions."""
    out: dict[int, tuple[int, float, int]] = {}
    for e in evals:
        for d, a in e.accuracy.items():
            out[d] = (e.version, a, e.samples[d])
    return out


# -- Gantt bars -------------------------------------------------------------------------------
MIN_TASK_PX = 2.0
"""Narrowest task drawn in the Gantt chart, in pixels of the PNG: a shorter task is drawn
this wide (and counted in the figure's note), so tasks shorter than a pixel do not vanish."""


def busy_blocks(
    rows: Sequence[tuple[int, str, float, float]],
) -> dict[int, list[list[tuple[str, float, float]]]]:
    """Device -> its tasks as drawn in the Gantt chart: each a run of back-to-back busy
    intervals ``(state, start_s, end_s)`` in task order (download, compute, upload), in time
    order. A non-busy state, a gap or the order starting over (the next task right after an
    upload, or a compute after a compute: local iterations) starts a new one; unlike
    :func:`task_times`, unfinished tasks count too (they are drawn)."""
    by_dev: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for d, s, a, b in rows:
        by_dev[d].append((a, b, s))
    out: dict[int, list[list[tuple[str, float, float]]]] = {}
    for d in sorted(by_dev):
        blocks: list[list[tuple[str, float, float]]] = []
        cur: list[tuple[str, float, float]] | None = None
        for a, b, s in sorted(by_dev[d]):
            if s not in _TASK_ORDER:
                cur = None
                continue
            if (
                cur is None
                or a > cur[-1][2] + 1e-9 * max(1.0, abs(a))
                or _TASK_ORDER[s] <= _TASK_ORDER[cur[-1][0]]
            ):
                cur = []
                blocks.append(cur)
            cur.append((s, a, b))
        out[d] = blocks
    return out


@dataclass
class GanttBars:
    """What the Gantt chart draws.

    Args:
        spans: ``(device, state)`` -> ``[(start_s, width_s), ...]`` bars.
        tasks: busy blocks (tasks, see :func:`busy_blocks`) of the devices drawn.
        widened: those shorter than ``min_width_s``, drawn ``min_width_s`` wide in the colour
            of their longest state.
        min_width_s: the narrowest bar (s).
    """

    spans: dict[tuple[int, str], list[tuple[float, float]]]
    tasks: int
    widened: int
    min_width_s: float


def gantt_bars(
    rows: Sequence[tuple[int, str, float, float]],
    devices: Sequence[int] | None = None,
    min_width_s: float = 0.0,
) -> GanttBars:
    """The Gantt bars of ``devices`` (default None = all) from timeline rows: non-busy
    intervals as they are; a task (busy block) at least ``min_width_s`` seconds long as its
    intervals; a shorter one as one bar ``min_width_s`` wide from its start, in its longest
    state's colour."""
    keep = None if devices is None else set(devices)
    rows = [r for r in rows if keep is None or r[0] in keep]
    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for d, s, a, b in rows:
        if s not in _TASK_ORDER and b > a:
            spans[(d, s)].append((a, b - a))
    tasks = widened = 0
    for d, blocks in busy_blocks(rows).items():
        for block in blocks:
            tasks += 1
            start, end = block[0][1], block[-1][2]
            if end - start >= min_width_s:
                for s, a, b in block:
                    if b > a:
                        spans[(d, s)].append((a, b - a))
                continue
            widened += 1
            per_state: dict[str, float] = defaultdict(float)
            for s, a, b in block:
                per_state[s] += b - a
            longest = max(per_state, key=lambda s: (per_state[s], -_TASK_ORDER[s]))
            spans[(d, longest)].append((start, min_width_s))
    return GanttBars(dict(spans), tasks, widened, min_width_s)
