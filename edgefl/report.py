"""``edgefl report``: PNG plots of one or more run directories.

``edgefl report RUN_DIR [RUN_DIR ...] [--out DIR] [--label NAME ...] [--x AXIS]`` reads what
a run left in its directory (``metrics.jsonl``, ``summary.json``, ``timeline.csv``,
``config.toml``) and writes these PNGs, by default into ``<first RUN_DIR>/report/``:

- ``accuracy.png``: test accuracy of every run against ``--x`` (time, round, virtual, wall
  or bytes), with a marker where a row applied significance-gated major updates;
- ``loss.png``: training, central test and federated loss against ``--x``;
- ``accuracy_vs_bytes.png``: test accuracy against cumulative uplink bytes;
- ``fed_eval.png``: federated evaluation (first run that has it): each device's accuracy on
  its held-out data at its latest evaluation, and the spread over devices against ``--x``;
- ``gantt.png``: the first run's per-device timeline, one colour per state, tasks shorter
  than :data:`MIN_TASK_PX` pixels drawn that wide (and counted in the figure);
- ``idle_fraction.png``: each device's idle fraction, one bar per run;
- ``staleness_hist.png``: the share of applied updates at each staleness (only when some
  update was stale);
- ``iteration_time.png``: the first run's per-device task time over the task index;
- ``compare.png``: with two or more runs, one figure of accuracy, loss and traffic curves
  with one legend of the runs' names.

A figure the runs hold no data for is left out, with a one-line note on stderr. matplotlib is
an optional extra (``pip install 'edgefl[plot]'``); the plots (:mod:`edgefl.reportplots`) are
drawn on :class:`matplotlib.figure.Figure` objects with the Agg canvas, never through
``pyplot``, so no global backend state is touched. The reading, the x axes, the federated
evaluations, the task splitting and the Gantt bars are plain Python here and are tested
without drawing. Guide: docs/report.md.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EdgeflError
from .reportdata import (  # noqa: F401  (the data layer, public here too)
    DEFAULT_MAX_DEVICES,
    DEFAULT_X,
    LOSS_KEYS,
    MIN_TASK_PX,
    SPARE_COLOURS,
    STATE_COLOURS,
    X_AXES,
    FedEval,
    GanttBars,
    Run,
    Task,
    XAxis,
    auto_xscale,
    bin_staleness,
    busy_blocks,
    check_x,
    fed_evals,
    gantt_bars,
    has_staleness,
    is_number,
    latest_per_device,
    load_run,
    policy_name,
    read_metrics,
    read_summary,
    read_timeline,
    row_x,
    staleness_bin_width,
    task_times,
    time_label,
    x_axis,
    x_label,
)

MATPLOTLIB_HINT = "edgefl report needs matplotlib: pip install 'edgefl[plot]'"
"""The one-line error when matplotlib is not installed (the CLI prefixes ``edgefl: error:``)."""

PLOTS = (
    "accuracy.png",
    "loss.png",
    "accuracy_vs_bytes.png",
    "fed_eval.png",
    "gantt.png",
    "idle_fraction.png",
    "staleness_hist.png",
    "iteration_time.png",
    "compare.png",
)
"""The files a report may write, in this order (those without data are left out)."""

_DPI = 110


# -- the command ----------------------------------------------------------------------------
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


@dataclass
class Report:
    """What :func:`build_report` made.

    Args:
        paths: the PNGs written, in :data:`PLOTS` order.
        notes: one line per figure left out or curve missing, and why.
        figures: file name -> its matplotlib Figure (to inspect, e.g. in tests).
    """

    paths: list[Path]
    notes: list[str]
    figures: dict[str, Any]


def build_report(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
    xscale: str = "auto",
    max_devices: int = DEFAULT_MAX_DEVICES,
    x: str = DEFAULT_X,
) -> Report:
    """Draw and write the report's PNGs; see :func:`make_report` for the arguments.

    Returns a :class:`Report`: the paths written, the notes (figures left out for want of
    data, runs without the ``x`` axis) and the figures."""
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
    check_x(x)
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

    from . import reportplots as rp

    axis = x_axis(runs, x, xscale)
    bytes_axis = axis if x == "bytes" else x_axis(runs, "bytes", xscale)
    notes = [
        f"{r.label}: no --x {x} axis ({w}): left out of the curves"
        for r, w in zip(runs, axis.why)
        if w
    ]
    figures: dict[str, Any] = {}
    figures["accuracy.png"] = rp.plot_accuracy(new_figure, runs, axis)
    if any(is_number(r.get(k)) for run in runs for r in run.metrics for k in LOSS_KEYS):
        figures["loss.png"] = rp.plot_loss(new_figure, runs, axis)
    else:
        notes.append(f"loss.png left out: no run's metrics rows hold {', '.join(LOSS_KEYS)}")
    if any(
        v is not None and any(is_number(r.get("test_accuracy")) for r in run.metrics)
        for v, run in zip(bytes_axis.values, runs)
    ):
        figures["accuracy_vs_bytes.png"] = rp.plot_accuracy(
            new_figure, runs, bytes_axis, "Test accuracy vs uplink traffic"
        )
    else:
        notes.append(
            "accuracy_vs_bytes.png left out: no run has both 'bytes_up' and 'test_accuracy' "
            "in its metrics rows"
        )
    fed = next(((i, r) for i, r in enumerate(runs) if fed_evals(r)), None)
    if fed is not None:
        figures["fed_eval.png"] = rp.plot_fed_eval(new_figure, fed[1], axis, fed[0])
    else:
        notes.append(
            "fed_eval.png left out: no run has federated evaluation (metrics rows with "
            "'fed_eval'; turn it on with evaluation.every, docs/evaluation.md)"
        )
    figures["gantt.png"] = rp.plot_gantt(new_figure, runs[0], max_devices)
    figures["idle_fraction.png"] = rp.plot_idle(new_figure, runs, max_devices)
    if any(has_staleness(r) for r in runs):
        figures["staleness_hist.png"] = rp.plot_staleness(new_figure, runs)
    else:
        notes.append(
            "staleness_hist.png left out: no run applied a stale update (staleness_hist "
            "holds staleness 0 only: synchronous runs, nothing to show)"
        )
    figures["iteration_time.png"] = rp.plot_iteration_time(new_figure, runs[0])
    if len(runs) >= 2:
        figures["compare.png"] = rp.plot_compare(new_figure, runs, axis, bytes_axis)
    paths = []
    for name in PLOTS:
        if name in figures:
            path = out_dir / name
            figures[name].savefig(path, format="png", dpi=figures[name].dpi)
            paths.append(path)
    return Report(paths, notes, figures)


def make_report(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
    xscale: str = "auto",
    max_devices: int = DEFAULT_MAX_DEVICES,
    x: str = DEFAULT_X,
) -> list[Path]:
    """Write the report PNGs and return their paths; print a note (stderr, one line each)
    for each figure left out for want of data.

    Args:
        run_dirs: one or more run directories; the first one's timeline is drawn.
        out: output folder; default None = ``<first run>/report``.
        labels: legend names, one per run; default None = policy and folder name.
        xscale: scale of the curves' x axis: ``"auto"`` (default; log when the runs' spans
            differ by 20x or more), ``"linear"`` or ``"log"``.
        max_devices: most devices drawn one by one in the Gantt chart and the idle bars
            (default 64).
        x: x axis of the curves, one of :data:`X_AXES`: ``"time"`` (default: each run's
            clock, s), ``"round"`` (model version), ``"virtual"`` (s), ``"wall"`` (s) or
            ``"bytes"`` (cumulative uplink bytes).

    Raises EdgeflError (one line) for a missing or garbled run directory or file, a wrong
    number of labels, a bad option value, or a missing matplotlib.
    """
    rep = build_report(run_dirs, out, labels, xscale, max_devices, x)
    for note in rep.notes:
        print(f"edgefl report: note: {note}", file=sys.stderr)
    return rep.paths


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
        description="Plot accuracy and loss curves, accuracy vs uplink traffic, federated "
        "evaluation, a per-device Gantt chart, idle fractions, staleness, per-device task "
        "times and a comparison of one or more run directories.",
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
        "--x",
        dest="x",
        default=DEFAULT_X,
        metavar="{" + ",".join(X_AXES) + "}",
        help="x axis of the curves: time (default: each run's clock, s), round (model "
        "version), virtual (s), wall (s) or bytes (cumulative uplink bytes)",
    )
    p.add_argument(
        "--xscale",
        choices=("auto", "linear", "log"),
        default="auto",
        help="scale of the curves' x axis (default auto: log when spans differ 20x)",
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
    list such as ``["RUN_DIR", "--out", "DIR"]``. Prints each PNG path (stdout) and each
    note (stderr); returns 0."""
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
        x=getattr(args, "x", DEFAULT_X),
    )
    for p in paths:
        print(p)
    return 0


__all__ = [
    "DEFAULT_X",
    "MATPLOTLIB_HINT",
    "MIN_TASK_PX",
    "PLOTS",
    "STATE_COLOURS",
    "X_AXES",
    "FedEval",
    "GanttBars",
    "Report",
    "Run",
    "Task",
    "XAxis",
    "add_parser",
    "auto_xscale",
    "bin_staleness",
    "build_report",
    "busy_blocks",
    "fed_evals",
    "gantt_bars",
    "has_staleness",
    "latest_per_device",
    "load_run",
    "main",
    "make_report",
    "policy_name",
    "read_metrics",
    "read_summary",
    "read_timeline",
    "require_matplotlib",
    "row_x",
    "staleness_bin_width",
    "task_times",
    "x_axis",
    "x_label",
]
