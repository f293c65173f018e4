"""``edgefl report``: PNG plots of one or more run directories.

``edgefl report RUN_DIR [RUN_DIR ...] [--out DIR] [--label NAME ...]`` reads what a run left
in its directory (``metrics.jsonl``, ``summary.json``, ``timeline.csv``, ``config.toml``) and
writes five PNGs, by default into ``<first RUN_DIR>/report/``:

- ``accuracy_vs_time.png``: test accuracy over clock time (s), all runs overlaid, with a
  marker where a row applied significance-gated major updates (``major_updates``);
- ``gantt.png``: the first run's per-device timeline, one colour per state;
- ``idle_fraction.png``: each device's idle fraction (waiting / online time), one bar group
  per device, one bar per run;
- ``staleness_hist.png``: the share of applied updates at each staleness, runs side by side;
- ``iteration_time.png``: the first run's per-device task time (download + compute + upload
  of one task, s) over the device's task index.

matplotlib is an optional extra (``pip install 'edgefl[plot]'``); the plots are drawn on
:class:`matplotlib.figure.Figure` objects with the Agg canvas, never through ``pyplot``, so
no global backend state is touched. The reading and the task splitting are plain Python and
are tested without matplotlib. Guide: docs/report.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EdgeflError

MATPLOTLIB_HINT = "edgefl report needs matplotlib: pip install 'edgefl[plot]'"
"""The one-line error when matplotlib is not installed (the CLI prefixes ``edgefl: error:``)."""

PLOTS = (
    "accuracy_vs_time.png",
    "gantt.png",
    "idle_fraction.png",
    "staleness_hist.png",
    "iteration_time.png",
)
"""The files one report writes, in this order."""

STATE_COLOURS = {
    "download": "#1f77b4",
    "compute": "#2ca02c",
    "upload": "#ff7f0e",
    "waiting": "#d0d0d0",
    "offline": "#505050",
    "dead": "#d62728",
}
"""Gantt colour of each timeline state (unknown future states get :data:`_SPARE_COLOURS`)."""

_SPARE_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")

# Busy states of one task, in the order a task goes through them.
_TASK_ORDER = {"download": 0, "compute": 1, "upload": 2}

DEFAULT_MAX_DEVICES = 64
"""Most devices drawn one by one in the Gantt chart and the idle-fraction bars."""

_LINES_PER_DEVICE_MAX = 20  # iteration_time.png: one labelled line per device up to this many

_DPI = 110


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
            virtual-clock fleet could be rebuilt from its config; else empty.
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
def _number(v: Any) -> bool:
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
        if not _number(row.get("time_s")):
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
        if idle is not None and not _number(idle):
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


# -- plotting -------------------------------------------------------------------------------
def require_matplotlib():
    """The matplotlib ``Figure`` class with an Agg canvas factory; EdgeflError with
    :data:`MATPLOTLIB_HINT` when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise EdgeflError(MATPLOTLIB_HINT) from None

    def new_figure(width: float, height: float):
        fig = Figure(figsize=(width, height), dpi=_DPI)
        FigureCanvasAgg(fig)
        return fig

    return new_figure


def _time_label(runs: Sequence[Run]) -> str:
    clocks = {r.clock for r in runs}
    if clocks == {"virtual"}:
        return "time (s, virtual clock)"
    if clocks == {"wall"}:
        return "time (s, wall clock)"
    return "time (s, each run's clock)"


def _colours(n: int) -> list[str]:
    base = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
    base += ["#7f7f7f", "#bcbd22", "#17becf"]
    return [base[i % len(base)] for i in range(n)]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_accuracy(new_figure, runs: Sequence[Run], path: Path, xscale: str = "auto") -> Path:
    """Test accuracy (%) over clock time (s), one line per run, major updates marked."""
    fig = new_figure(9.5, 5.5)
    ax = fig.add_subplot()
    spans = []
    marked = False
    for run, colour in zip(runs, _colours(len(runs))):
        evals = [
            (r["time_s"], 100.0 * r["test_accuracy"])
            for r in run.metrics
            if _number(r.get("test_accuracy"))
        ]
        if run.metrics:
            spans.append(max(r["time_s"] for r in run.metrics))
        if not evals:
            ax.plot([], [], color=colour, label=f"{run.label}: no evaluated rows")
            continue
        ts, acc = zip(*evals)
        ax.plot(ts, acc, color=colour, lw=1.6, label=f"{run.label}: final {acc[-1]:.1f}%")
        major = [r for r in run.metrics if r.get("major_updates")]
        if major:
            import numpy as np

            mt = [r["time_s"] for r in major]
            my = np.interp(mt, ts, acc)
            sizes = [18 + 6 * min(len(r["major_updates"]), 10) for r in major]
            ax.scatter(
                mt,
                my,
                s=sizes,
                marker="v",
                facecolor=colour,
                edgecolor="black",
                linewidths=0.5,
                zorder=3,
                label=None if marked else "major updates (size = devices pushing)",
            )
            marked = True
    scale = auto_xscale(spans) if xscale == "auto" else xscale
    ax.set_xscale(scale)
    ax.set_xlabel(_time_label(runs) + (", log scale" if scale == "log" else ""))
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy vs time")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def _device_label(run: Run, d: int) -> str:
    name = run.profile_names.get(d)
    return f"{d} {name}" if name else str(d)


def plot_gantt(new_figure, run: Run, path: Path, max_devices: int = DEFAULT_MAX_DEVICES) -> Path:
    """The first run's per-device timeline: one row per device, a colour per state."""
    rows = run.timeline or []
    devices = sorted({d for d, *_ in rows})
    shown = devices[:max_devices]
    keep = set(shown)
    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for d, s, a, b in rows:
        if d in keep and b > a:
            spans[(d, s)].append((a, b - a))
    states = list(STATE_COLOURS)
    extra = sorted({s for _, s in spans} - set(states))
    colours = dict(STATE_COLOURS)
    for i, s in enumerate(extra):
        colours[s] = _SPARE_COLOURS[i % len(_SPARE_COLOURS)]
    height = min(3.0 + 0.22 * len(shown), 18.0)
    fig = new_figure(11, height)
    ax = fig.add_subplot()
    pos = {d: i for i, d in enumerate(shown)}
    for (d, s), bars in sorted(spans.items()):
        ax.broken_barh(bars, (pos[d] - 0.4, 0.8), facecolors=colours[s], linewidth=0)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    step = max(1, math.ceil(len(shown) / 40))
    ticks = list(range(0, len(shown), step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([_device_label(run, shown[i]) for i in ticks], fontsize=7)
    ax.set_ylabel("device")
    ax.set_xlabel(_time_label([run]))
    if rows:
        ax.set_xlim(0, max(b for *_, b in rows))
    title = f"Per-device timeline: {run.label}"
    if len(devices) > len(shown):
        title += f"\n(showing the first {len(shown)} of {len(devices)} devices)"
    ax.set_title(title)
    from matplotlib.patches import Patch

    present = {s for _, s in spans}
    handles = [Patch(color=colours[s], label=s) for s in states + extra if s in present]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="state"
    )
    return _save(fig, path)


def _idle(run: Run) -> dict[int, float]:
    out = {}
    for k, v in run.summary.get("devices", {}).items():
        if _number(v.get("idle_fraction")):
            out[int(k)] = float(v["idle_fraction"])
    return out


def plot_idle(
    new_figure, runs: Sequence[Run], path: Path, max_devices: int = DEFAULT_MAX_DEVICES
) -> Path:
    """Idle fraction (%) per device: grouped bars (one per run) up to ``max_devices``
    devices, else each run's idle fractions sorted (one curve per run)."""
    idle = [_idle(r) for r in runs]
    devices = sorted(set().union(*idle)) if idle else []
    fig = new_figure(11, 5.5)
    ax = fig.add_subplot()
    colours = _colours(len(runs))
    labels = []
    for run in runs:
        tot = run.summary.get("idle_fraction")
        labels.append(f"{run.label}: overall {100 * tot:.1f}%" if _number(tot) else f"{run.label}")
    if len(devices) <= max_devices:
        width = 0.8 / max(1, len(runs))
        for j, (vals, colour, label) in enumerate(zip(idle, colours, labels)):
            xs = [i - 0.4 + width * (j + 0.5) for i, d in enumerate(devices) if d in vals]
            ys = [100 * vals[d] for d in devices if d in vals]
            # the edge keeps a 0% bar visible as a line just above the axis
            ax.bar(xs, ys, width=width, color=colour, edgecolor=colour, lw=0.8, label=label)
        step = max(1, math.ceil(len(devices) / 40))
        ticks = list(range(0, len(devices), step))
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(devices[i]) for i in ticks], fontsize=8)
        ax.set_xlim(-0.6, len(devices) - 0.4)
        ax.set_xlabel("device")
        title = "Idle fraction per device"
    else:
        for vals, colour, label in zip(idle, colours, labels):
            ys = sorted((100 * v for v in vals.values()), reverse=True)
            ax.plot(range(len(ys)), ys, color=colour, lw=1.5, label=label)
        ax.set_xlabel(f"devices, sorted by idle fraction ({len(devices)} devices)")
        title = "Idle fraction per device (sorted)"
    ax.set_ylabel("idle fraction (% of online time spent waiting)")
    ax.set_ylim(-1.5, 105)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(fig, path)


def plot_staleness(new_figure, runs: Sequence[Run], path: Path) -> Path:
    """Share of applied updates (%) at each staleness, runs side by side."""
    hists = [r.summary.get("staleness_hist", {}) for r in runs]
    width = staleness_bin_width(hists)
    fig = new_figure(10, 5.5)
    ax = fig.add_subplot()
    bw = 0.85 * width / max(1, len(runs))
    for j, (run, h, colour) in enumerate(zip(runs, hists, _colours(len(runs)))):
        total = sum(int(v) for v in h.values())
        if not total:
            ax.bar([], [], color=colour, label=f"{run.label}: none recorded")
            continue
        mean = sum(int(k) * int(v) for k, v in h.items()) / total
        biggest = max(int(k) for k, v in h.items() if int(v))
        bins = bin_staleness(h, width)
        # bars of run j sit at offset j inside each bin, so the runs stand side by side
        xs = [left + (width - 1) / 2 - 0.425 * width + bw * j for left in bins]
        ys = [100 * c / total for c in bins.values()]
        ax.bar(
            xs,
            ys,
            width=bw,
            align="edge",
            color=colour,
            label=f"{run.label}: {total} updates, mean {mean:.1f}, max {biggest}",
        )
    unit = "model versions" if width == 1 else f"model versions, bins of {width}"
    ax.set_xlabel(f"staleness when applied ({unit})")
    ax.set_ylabel("share of applied updates (%)")
    ax.set_title("Staleness of applied updates")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def plot_iteration_time(new_figure, run: Run, path: Path) -> Path:
    """The first run's per-device task time (s) over task index."""
    tasks = task_times(run.timeline or [])
    devices = [d for d in sorted(tasks) if tasks[d]]
    fig = new_figure(11, 5.5)
    ax = fig.add_subplot()
    times = [t.busy_s for d in devices for t in tasks[d]]
    if len(devices) <= _LINES_PER_DEVICE_MAX:
        colours = _tab20(len(devices))
        for d, colour in zip(devices, colours):
            ax.plot(
                [t.index for t in tasks[d]],
                [t.busy_s for t in tasks[d]],
                color=colour,
                lw=1.2,
                marker=".",
                ms=4,
                label=_device_label(run, d),
            )
        if devices:
            ax.legend(
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, title="device", ncol=1
            )
    else:
        per_index: dict[int, list[float]] = defaultdict(list)
        for d in devices:
            ax.plot(
                [t.index for t in tasks[d]],
                [t.busy_s for t in tasks[d]],
                color="#999999",
                lw=0.5,
                alpha=0.5,
            )
            for t in tasks[d]:
                per_index[t.index].append(t.busy_s)
        idx = sorted(per_index)
        ax.plot(
            idx,
            [statistics.median(per_index[i]) for i in idx],
            color="#d62728",
            lw=2,
            label=f"median over devices ({len(devices)} devices, grey: each)",
        )
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if times and min(times) > 0 and max(times) / min(times) >= 20:
        ax.set_yscale("log")
    last = [tasks[d][-1].busy_s for d in devices]
    if len(last) >= 2 and statistics.mean(last) > 0:
        cv = statistics.pstdev(last) / statistics.mean(last)
        note = f"spread across devices of their latest task time: CV = {100 * cv:.1f}%"
    else:
        note = "fewer than 2 devices finished a task"
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("task index of the device (0 = its first task)")
    ax.set_ylabel("task time (s): download + compute + upload")
    ax.set_title(f"Per-device task time: {run.label}\n{note}", fontsize=11)
    ax.grid(True, alpha=0.3, which="both")
    return _save(fig, path)


def _tab20(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


# -- the command ----------------------------------------------------------------------------
def make_report(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
    xscale: str = "auto",
    max_devices: int = DEFAULT_MAX_DEVICES,
) -> list[Path]:
    """Write the report PNGs and return their paths.

    Args:
        run_dirs: one or more run directories; the first one's timeline is drawn.
        out: output folder; default None = ``<first run>/report``.
        labels: legend names, one per run; default None = policy and folder name.
        xscale: x axis of the accuracy plot: ``"auto"`` (default; log when the runs' time
            spans differ by 20x or more), ``"linear"`` or ``"log"``.
        max_devices: most devices drawn one by one in the Gantt chart and the idle bars
            (default 64).

    Raises EdgeflError (one line) for a missing or garbled run directory or file, a wrong
    number of labels, or a missing matplotlib.
    """
    new_figure = require_matplotlib()
    if not run_dirs:
        raise EdgeflError("edgefl report needs at least one RUN_DIR")
    if labels is not None and len(labels) != len(run_dirs):
        raise EdgeflError(
            f"--label given {len(labels)} name(s) for {len(run_dirs)} run directories: "
            "give one per run, in the same order"
        )
    if xscale not in ("auto", "linear", "log"):
        raise EdgeflError(f"--xscale {xscale!r}: expected auto, linear or log")
    if isinstance(max_devices, bool) or not isinstance(max_devices, int) or max_devices < 1:
        raise EdgeflError(f"--max-devices {max_devices!r}: expected an integer >= 1")
    runs = [
        load_run(p, labels[i] if labels else None, timeline=(i == 0))
        for i, p in enumerate(run_dirs)
    ]
    _dedupe_labels(runs)
    out_dir = Path(out) if out is not None else runs[0].path / "report"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgeflError(f"report folder '{out_dir}': cannot create it ({e.strerror})") from None
    a, g, i, s, t = (out_dir / name for name in PLOTS)
    return [
        plot_accuracy(new_figure, runs, a, xscale),
        plot_gantt(new_figure, runs[0], g, max_devices),
        plot_idle(new_figure, runs, i, max_devices),
        plot_staleness(new_figure, runs, s),
        plot_iteration_time(new_figure, runs[0], t),
    ]


def _dedupe_labels(runs: Sequence[Run]) -> None:
    seen: dict[str, int] = defaultdict(int)
    for r in runs:
        seen[r.label] += 1
    if all(n == 1 for n in seen.values()):
        return
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} [{r.path}]"


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``edgefl report`` on the CLI's subparsers; returns its parser."""
    p = sub.add_parser(
        "report",
        help="write PNG plots of run directories (needs matplotlib)",
        description="Plot accuracy vs time, a per-device Gantt chart, idle fractions, "
        "staleness and per-device task times of one or more run directories.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to plot")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/report)")
    p.add_argument(
        "--label",
        dest="labels",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="legend name of each run, in order (default: policy and folder name)",
    )
    p.add_argument(
        "--xscale",
        choices=("auto", "linear", "log"),
        default="auto",
        help="time axis of the accuracy plot (default auto: log when spans differ 20x)",
    )
    p.add_argument(
        "--max-devices",
        type=int,
        default=DEFAULT_MAX_DEVICES,
        metavar="N",
        help=f"devices drawn one by one in the Gantt and idle plots (default "
        f"{DEFAULT_MAX_DEVICES})",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run ``edgefl report``: ``args`` is the parsed namespace (from the CLI) or an argv
    list such as ``["RUN_DIR", "--out", "DIR"]``. Prints each PNG path; returns 0."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="edgefl")
        add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["report", *(args or [])])
    paths = make_report(
        args.runs,
        out=args.out,
        labels=args.labels,
        xscale=args.xscale,
        max_devices=args.max_devices,
    )
    for p in paths:
        print(p)
    return 0


__all__ = [
    "MATPLOTLIB_HINT",
    "PLOTS",
    "STATE_COLOURS",
    "Run",
    "Task",
    "add_parser",
    "auto_xscale",
    "load_run",
    "main",
    "make_report",
    "policy_name",
    "read_metrics",
    "read_summary",
    "read_timeline",
    "require_matplotlib",
    "bin_staleness",
    "staleness_bin_width",
    "task_times",
]
