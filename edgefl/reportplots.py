"""The figures of ``edgefl report`` (matplotlib, Agg canvas, never ``pyplot``).

Each ``plot_*`` function takes the figure factory of :func:`edgefl.report.require_matplotlib`
and runs read by :func:`edgefl.report.load_run`, draws and lays out one figure and returns it
(unsaved); :func:`edgefl.report.build_report` saves it. What they draw comes from the plain
functions of :mod:`edgefl.report` (x axes, federated evaluations, Gantt bars, task times),
which are tested without matplotlib. Guide: docs/report.md.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from .reportdata import (
    DEFAULT_MAX_DEVICES,
    MIN_TASK_PX,
    SPARE_COLOURS,
    STATE_COLOURS,
    Run,
    XAxis,
    bin_staleness,
    fed_evals,
    gantt_bars,
    is_number,
    latest_per_device,
    staleness_bin_width,
    task_times,
    time_label,
    x_axis,
)

Figure = Any  # matplotlib.figure.Figure (matplotlib is optional: not imported at load time)
NewFigure = Callable[[float, float], Any]

LINES_PER_DEVICE_MAX = 20
"""iteration_time.png: one labelled line per device up to this many devices."""

SMOOTH_ROWS_FROM = 200
"""loss.png: a run with more rows than this has its training loss drawn as a rolling mean
(one value per row is one update's loss under asynchronous policies: very noisy)."""

_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
_TAB10 += ("#7f7f7f", "#bcbd22", "#17becf")


def _colours(n: int) -> list[str]:
    base = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
    base += ["#7f7f7f", "#bcbd22", "#17becf"]
    return [base[i % len(base)] for i in range(n)]


def _tab20(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(n)]


def _device_label(run: Run, d: int) -> str:
    name = run.profile_names.get(d)
    return f"{d} {name}" if name else str(d)


def _set_x(ax, axis: XAxis) -> None:
    """Scale, label (with the unit) and tick format of a curve's x axis."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    ax.set_xscale(axis.scale)
    ax.set_xlabel(axis.label + (", log scale" if axis.scale == "log" else ""))
    if axis.name == "bytes":
        ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=" "))
    elif axis.name == "round" and axis.scale == "linear":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _keep(points: list[tuple[float, float]], axis: XAxis) -> list[tuple[float, float]]:
    """The points a log x axis can show (x > 0); all of them on a linear one."""
    return [p for p in points if p[0] > 0] if axis.scale == "log" else points


def _series(run: Run, xs: list[float] | None, key: str, axis: XAxis, scale: float = 1.0):
    """(x, scale * row[key]) of the rows with a finite ``key``, in row order."""
    if xs is None:
        return []
    pts = [(x, scale * r[key]) for x, r in zip(xs, run.metrics) if is_number(r.get(key))]
    return _keep(pts, axis)


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _log_y_if_spread(ax, values: Sequence[float]) -> None:
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) >= 20:
        ax.set_yscale("log")


# -- accuracy -------------------------------------------------------------------------------
def _draw_accuracy(ax, runs: Sequence[Run], axis: XAxis, markers: bool = True) -> None:
    marked = False
    for i, (run, colour) in enumerate(zip(runs, _colours(len(runs)))):
        xs = axis.values[i]
        if xs is None:
            ax.plot([], [], color=colour, label=f"{run.label}: no {axis.name} axis")
            continue
        evals = _series(run, xs, "test_accuracy", axis, 100.0)
        if not evals:
            ax.plot([], [], color=colour, label=f"{run.label}: no evaluated rows")
            continue
        ts, acc = zip(*evals)
        ax.plot(ts, acc, color=colour, lw=1.6, label=f"{run.label}: final {acc[-1]:.1f}%")
        major = _keep(
            [
                (x, len(r["major_updates"]))
                for x, r in zip(xs, run.metrics)
                if r.get("major_updates")
            ],
            axis,
        )
        if markers and major:
            import numpy as np

            mt = [m[0] for m in major]
            ax.scatter(
                mt,
                np.interp(mt, ts, acc),
                s=[18 + 6 * min(n, 10) for _, n in major],
                marker="v",
                facecolor=colour,
                edgecolor="black",
                linewidths=0.5,
                zorder=3,
                label=None if marked else "major updates (size = devices pushing)",
            )
            marked = True
    _set_x(ax, axis)
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3, which="both")


def plot_accuracy(
    new_figure: NewFigure, runs: Sequence[Run], axis: XAxis, title: str | None = None
) -> Figure:
    """Test accuracy (%) of every run against ``axis`` (``--x``), major updates marked."""
    fig = new_figure(9.5, 5.5)
    ax = fig.add_subplot()
    _draw_accuracy(ax, runs, axis)
    what = {
        "round": "model version",
        "virtual": "virtual time",
        "wall": "wall-clock time",
        "bytes": "uplink traffic",
    }.get(axis.name, "time")
    ax.set_title(title or f"Test accuracy vs {what}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


# -- loss -------------------------------------------------------------------------------------
_LOSS_STYLES = (
    ("train_loss", "training (updates applied)", "--"),
    ("test_loss", "central test set", "-"),
    ("fed_loss", "federated (devices' held-out data)", ":"),
)


def _draw_loss(
    ax, runs: Sequence[Run], axis: XAxis, keys: Sequence[str]
) -> tuple[list[tuple[str, str]], bool]:
    """Draws the ``keys`` losses of every run (solid when one key, else the key's line
    style); returns the ``(kind, line style)`` drawn, for the legend, and whether a training
    loss was smoothed."""
    drawn: dict[str, str] = {}
    values: list[float] = []
    smoothed = False
    for i, (run, colour) in enumerate(zip(runs, _colours(len(runs)))):
        xs = axis.values[i]
        vx = axis.version_x(i, run) if "fed_loss" in keys else {}
        for key, kind, style in _LOSS_STYLES:
            if key not in keys:
                continue
            if key == "fed_loss":
                evals = fed_evals(run)  # the final model's too
                pts = _keep(
                    sorted(
                        (vx[e.version], e.loss)
                        for e in evals
                        if e.loss is not None and e.version in vx
                    ),
                    axis,
                )
            else:
                pts = _series(run, xs, key, axis)
            if not pts:
                continue
            px, py = zip(*pts)
            if key == "train_loss" and len(py) > SMOOTH_ROWS_FROM:
                py = tuple(_rolling_mean(py, math.ceil(len(py) / 100)))
                smoothed = True
            style = "-" if len(keys) == 1 else style
            ax.plot(px, py, color=colour, ls=style, lw=1.4)
            values += py
            drawn.setdefault(kind, style)
    _set_x(ax, axis)
    _log_y_if_spread(ax, values)
    ax.grid(True, alpha=0.3, which="both")
    return list(drawn.items()), smoothed


def plot_loss(new_figure: NewFigure, runs: Sequence[Run], axis: XAxis) -> Figure:
    """Training loss (dashed; the mean loss of the updates a row applied, a rolling mean in
    runs of over :data:`SMOOTH_ROWS_FROM` rows), central test loss (solid) and federated
    loss (dotted, at the x of the version evaluated) of every run against ``axis``; one
    colour per run."""
    from matplotlib.lines import Line2D

    fig = new_figure(10.5, 5.5)
    ax = fig.add_subplot()
    kinds, smoothed = _draw_loss(ax, runs, axis, [k for k, _, _ in _LOSS_STYLES])
    ax.set_ylabel("loss (mean per example; nats for cross-entropy)")
    title = "Training, test and federated loss"
    if smoothed:
        title += (
            f"\ntraining loss of runs with over {SMOOTH_ROWS_FROM} rows: rolling mean over 1% "
            "of their rows"
        )
    ax.set_title(title, fontsize=11)
    handles = [Line2D([], [], color="black", lw=1.4, ls=ls, label=k) for k, ls in kinds]
    handles += [
        Line2D([], [], color=c, lw=2.5, label=r.label) for r, c in zip(runs, _colours(len(runs)))
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


# -- federated evaluation ---------------------------------------------------------------------
def plot_fed_eval(new_figure: NewFigure, run: Run, axis: XAxis, index: int) -> Figure:
    """Federated evaluation of one run (``index``: its place in ``axis``): left, each
    device's accuracy (%) on its held-out data at its latest evaluation (the final model's
    when the run evaluated it), sorted, coloured by profile, with the sample-weighted mean;
    right, per evaluated version, the median over the reporting devices with the
    interquartile and min-max bands, the sample-weighted mean and the central test accuracy,
    against ``axis`` (at the x of the row that made the version evaluated)."""
    import numpy as np
    from matplotlib.patches import Patch

    evals = fed_evals(run)
    latest = latest_per_device(evals)
    fig = new_figure(13, 5.8)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.25]})

    order = sorted(latest, key=lambda d: (latest[d][1], d))
    names = sorted({run.profile_names[d] for d in order if d in run.profile_names})
    colour_of = {n: _TAB10[i % len(_TAB10)] for i, n in enumerate(names)}
    colours = [colour_of.get(run.profile_names.get(d, ""), "#1f77b4") for d in order]
    heights = [100 * latest[d][1] for d in order]
    left.bar(range(len(order)), heights, color=colours, width=0.8)
    versions = sorted({latest[d][0] for d in order})
    final = [e.version for e in evals if e.row is None]
    if len(versions) == 1:
        what = "the final model" if final == versions else "the last evaluation"
        title = f"Each device at {what} (version {versions[0]})"
    else:
        title = "Each device at its latest evaluation (version above each bar)"
    n_samples = sum(latest[d][2] for d in order)
    if n_samples:
        mean = 100 * sum(latest[d][1] * latest[d][2] for d in order) / n_samples
        left.axhline(mean, color="black", ls="--", lw=1)
        title += f"\nsample-weighted mean (dashed): {mean:.1f}%"
    if len(versions) > 1 and len(order) <= 40:  # asynchronous: devices at different versions
        for i, d in enumerate(order):
            left.text(
                i,
                heights[i] + 1,
                f"v{latest[d][0]}",
                ha="center",
                va="bottom",
                rotation=90,
                fontsize=6,
            )
    if len(order) <= 40:  # the tick labels name the profiles: no colour legend needed
        left.set_xticks(range(len(order)))
        left.set_xticklabels(
            [_device_label(run, d) for d in order],
            rotation=45,
            ha="right",
            rotation_mode="anchor",
            fontsize=7,
        )
        left.set_xlabel("device, sorted by accuracy")
    else:
        left.set_xticks([])
        left.set_xlabel(f"devices, sorted by accuracy ({len(order)} devices)")
        if names:
            left.legend(
                handles=[Patch(color=colour_of[n], label=n) for n in names],
                loc="upper center",
                bbox_to_anchor=(0.5, -0.08),
                ncol=min(len(names), 4),
                fontsize=7,
                frameon=False,
            )
    left.set_xlim(-0.6, len(order) - 0.4)
    left.set_ylim(0, 118 if len(versions) > 1 else 105)
    left.set_yticks(range(0, 101, 20))
    left.set_ylabel("accuracy on the device's held-out data (%)")
    left.set_title(title, fontsize=10)
    left.grid(True, axis="y", alpha=0.3)

    vx = axis.version_x(index, run)
    pts = sorted(
        (vx[e.version], sorted(e.accuracy.values()), e.mean)
        for e in evals
        if e.version in vx and e.accuracy
    )
    pts = [p for p in pts if p[0] > 0] if axis.scale == "log" else pts
    if pts:
        xs = [p[0] for p in pts]
        q = np.array([np.percentile(100 * np.array(p[1]), [0, 25, 50, 75, 100]) for p in pts])
        right.fill_between(
            xs, q[:, 0], q[:, 4], color="#1f77b4", alpha=0.15, lw=0, label="min-max over devices"
        )
        right.fill_between(
            xs, q[:, 1], q[:, 3], color="#1f77b4", alpha=0.35, lw=0, label="interquartile range"
        )
        right.plot(xs, q[:, 2], color="#1f77b4", lw=1.8, label="median device")
        means = [(x, 100 * m) for x, _, m in pts if m is not None]
        if means:
            right.plot(*zip(*means), color="black", ls="--", lw=1.2, label="sample-weighted mean")
        test = _series(run, axis.values[index], "test_accuracy", axis, 100.0)
        if test:
            right.plot(*zip(*test), color="#7f7f7f", ls=":", lw=1.4, label="central test set")
        counts = [len(p[1]) for p in pts]
        span = str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        right.set_title(
            f"Spread over devices, {len(pts)} evaluations ({span} devices each)", fontsize=10
        )
        right.legend(loc="lower right", fontsize=7)
    else:
        why = axis.why[index] or "no evaluation at a drawable x"
        right.text(
            0.5,
            0.5,
            f"no {axis.name} axis: {why}",
            ha="center",
            va="center",
            transform=right.transAxes,
            fontsize=9,
            wrap=True,
        )
    _set_x(right, axis)
    right.set_ylim(0, 105)
    right.set_ylabel("accuracy on held-out data (%)")
    right.grid(True, alpha=0.3, which="both")
    fig.suptitle(f"Federated evaluation: {run.label}")
    fig.tight_layout()
    return fig


# -- Gantt ------------------------------------------------------------------------------------
def plot_gantt(new_figure: NewFigure, run: Run, max_devices: int = DEFAULT_MAX_DEVICES) -> Figure:
    """The run's per-device timeline: one row per device, a colour per state; a task
    shorter than :data:`~edgefl.report.MIN_TASK_PX` pixels is drawn that wide, and the title
    says how many were. The axes carry ``gantt``: the :class:`~edgefl.report.GanttBars`
    drawn (bars, task counts, the minimum width in s)."""
    from matplotlib.patches import Patch

    rows = run.timeline or []
    devices = sorted({d for d, *_ in rows})
    shown = devices[:max_devices]
    height = min(3.0 + 0.22 * len(shown), 18.0)
    fig = new_figure(11, height)
    ax = fig.add_subplot()
    end = max((b for *_, b in rows), default=0.0)
    ax.set_xlim(0, end if end > 0 else 1.0)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    step = max(1, math.ceil(len(shown) / 40))
    ticks = list(range(0, len(shown), step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([_device_label(run, shown[i]) for i in ticks], fontsize=7)
    ax.set_ylabel("device")
    ax.set_xlabel(time_label([run]))
    states = list(STATE_COLOURS)
    extra = sorted({s for _, s, _, _ in rows} - set(states))
    colours = dict(STATE_COLOURS)
    for i, s in enumerate(extra):
        colours[s] = SPARE_COLOURS[i % len(SPARE_COLOURS)]
    present = {s for d, s, a, b in rows if d in set(shown)}
    handles = [Patch(color=colours[s], label=s) for s in states + extra if s in present]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="state"
    )
    title = f"Per-device timeline: {run.label}"
    if len(devices) > len(shown):
        title += f"\n(showing the first {len(shown)} of {len(devices)} devices)"
    ax.set_title(title + "\nplaceholder", fontsize=11)
    fig.tight_layout()  # the axes' final width in pixels sets the narrowest bar
    min_w = MIN_TASK_PX * (ax.get_xlim()[1] / ax.bbox.width) if ax.bbox.width > 0 else 0.0
    bars = gantt_bars(rows, shown, min_w)
    pos = {d: i for i, d in enumerate(shown)}
    for (d, s), spans in sorted(bars.spans.items()):
        busy = s in ("download", "compute", "upload")
        ax.broken_barh(
            spans, (pos[d] - 0.4, 0.8), facecolors=colours[s], linewidth=0, zorder=3 if busy else 2
        )
    if bars.widened:
        title += (
            f"\n{bars.widened} of {bars.tasks} tasks are shorter than {MIN_TASK_PX:g} px "
            f"({min_w:.3g} s): drawn {MIN_TASK_PX:g} px wide in their longest state's colour"
        )
    ax.set_title(title, fontsize=11)
    ax.gantt = bars  # what was drawn (the task counts), for whoever inspects the figure
    fig.tight_layout()
    return fig


# -- idle fraction ----------------------------------------------------------------------------
def _idle(run: Run) -> dict[int, float]:
    out = {}
    for k, v in run.summary.get("devices", {}).items():
        if is_number(v.get("idle_fraction")):
            out[int(k)] = float(v["idle_fraction"])
    return out


def idle_device_labels(runs: Sequence[Run], devices: Sequence[int]) -> list[str]:
    """Tick label of each device: ``"<id> <profile>"`` (as the Gantt chart) when the runs
    that know profile names agree on the device's, else the id alone."""
    out = []
    for d in devices:
        names = {r.profile_names[d] for r in runs if d in r.profile_names}
        out.append(f"{d} {names.pop()}" if len(names) == 1 else str(d))
    return out


def plot_idle(
    new_figure: NewFigure, runs: Sequence[Run], max_devices: int = DEFAULT_MAX_DEVICES
) -> Figure:
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
        labels.append(
            f"{run.label}: overall {100 * tot:.1f}%" if is_number(tot) else f"{run.label}"
        )
    if len(devices) <= max_devices:
        width = 0.8 / max(1, len(runs))
        for j, (vals, colour, label) in enumerate(zip(idle, colours, labels)):
            xs = [i - 0.4 + width * (j + 0.5) for i, d in enumerate(devices) if d in vals]
            ys = [100 * vals[d] for d in devices if d in vals]
            # the edge keeps a 0% bar visible as a line just above the axis
            ax.bar(xs, ys, width=width, color=colour, edgecolor=colour, lw=0.8, label=label)
        step = max(1, math.ceil(len(devices) / 40))
        ticks = list(range(0, len(devices), step))
        names = idle_device_labels(runs, [devices[i] for i in ticks])
        ax.set_xticks(ticks)
        if any(" " in n for n in names):
            ax.set_xticklabels(names, fontsize=7, rotation=45, ha="right", rotation_mode="anchor")
        else:
            ax.set_xticklabels(names, fontsize=8)
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
    fig.tight_layout()
    return fig


# -- staleness --------------------------------------------------------------------------------
def plot_staleness(new_figure: NewFigure, runs: Sequence[Run]) -> Figure:
    """Share of applied updates (%) at each staleness (model versions), runs side by side;
    integer ticks on bin edges; the legend below the axes, off the bars. The y axis is
    logarithmic when the shares span more than two decades (a long, thin tail)."""
    from matplotlib.ticker import MultipleLocator

    hists = [r.summary.get("staleness_hist", {}) for r in runs]
    width = staleness_bin_width(hists)
    fig = new_figure(10, 5.0 + 0.22 * len(runs))
    ax = fig.add_subplot()
    bw = 0.85 * width / max(1, len(runs))
    shares = []
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
        shares += ys
        ax.bar(
            xs,
            ys,
            width=bw,
            align="edge",
            color=colour,
            label=f"{run.label}: {total} updates, mean {mean:.1f}, max {biggest}",
        )
    log = bool(shares) and max(shares) / min(shares) > 100
    if log:
        ax.set_yscale("log")
    # integer ticks on bin edges, about 10 of them
    top = max((int(k) for h in hists for k in h), default=0)
    ax.xaxis.set_major_locator(MultipleLocator(width * max(1, math.ceil((top + 1) / width / 10))))
    unit = "model versions" if width == 1 else f"model versions, bins of {width}"
    ax.set_xlabel(f"staleness when applied ({unit})")
    ax.set_ylabel("share of applied updates (%)" + (", log scale" if log else ""))
    ax.set_title("Staleness of applied updates")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=1, frameon=False)
    fig.tight_layout()
    return fig


# -- task time --------------------------------------------------------------------------------
def plot_iteration_time(new_figure: NewFigure, run: Run) -> Figure:
    """The run's per-device task time (s) over task index."""
    from matplotlib.ticker import MaxNLocator

    tasks = task_times(run.timeline or [])
    devices = [d for d in sorted(tasks) if tasks[d]]
    fig = new_figure(11, 5.5)
    ax = fig.add_subplot()
    times = [t.busy_s for d in devices for t in tasks[d]]
    if len(devices) <= LINES_PER_DEVICE_MAX:
        for d, colour in zip(devices, _tab20(len(devices))):
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
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("task index of the device (0 = its first task)")
    ax.set_ylabel("task time (s): download + compute + upload")
    ax.set_title(f"Per-device task time: {run.label}\n{note}", fontsize=11)
    ax.grid(True, alpha=0.3, which="both")
    fig.tight_layout()
    return fig


# -- comparison -------------------------------------------------------------------------------
def plot_compare(
    new_figure: NewFigure, runs: Sequence[Run], axis: XAxis, bytes_axis: XAxis
) -> Figure:
    """Several runs in one figure, one legend of their names: test accuracy, training loss
    and test loss against ``axis``, and test accuracy against cumulative uplink bytes
    (against each run's clock instead when ``axis`` already is bytes)."""
    from matplotlib.lines import Line2D

    ncol = 2 if len(runs) > 3 else len(runs)
    legend_rows = math.ceil(len(runs) / ncol)
    height = 8.5 + 0.25 * legend_rows
    fig = new_figure(12, height)
    (a, b), (c, d) = fig.subplots(2, 2)
    _draw_accuracy(a, runs, axis, markers=False)
    a.set_title("(a) test accuracy", fontsize=10)
    _, smoothed = _draw_loss(b, runs, axis, ["train_loss"])
    b.set_ylabel("training loss (mean per example)")
    b.set_title(
        "(b) training loss of the updates applied" + (" (rolling mean)" if smoothed else ""),
        fontsize=10,
    )
    if axis.name == "bytes":
        other = x_axis(runs, "time", axis.scale)
        _draw_accuracy(c, runs, other, markers=False)
        c.set_title("(c) test accuracy vs time", fontsize=10)
    else:
        _draw_accuracy(c, runs, bytes_axis, markers=False)
        c.set_title("(c) test accuracy vs uplink traffic", fontsize=10)
    _draw_loss(d, runs, axis, ["test_loss"])
    d.set_ylabel("test loss (central test set)")
    d.set_title("(d) test loss", fontsize=10)
    handles = []
    for run, colour in zip(runs, _colours(len(runs))):
        acc = [r["test_accuracy"] for r in run.metrics if is_number(r.get("test_accuracy"))]
        tail = f": final {100 * acc[-1]:.1f}%" if acc else ""
        handles.append(Line2D([], [], color=colour, lw=2.5, label=run.label + tail))
    bottom = (0.25 + 0.25 * legend_rows) / height
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=ncol,
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.suptitle(f"Comparison of {len(runs)} runs")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


__all__ = [
    "LINES_PER_DEVICE_MAX",
    "SMOOTH_ROWS_FROM",
    "idle_device_labels",
    "plot_accuracy",
    "plot_compare",
    "plot_fed_eval",
    "plot_gantt",
    "plot_idle",
    "plot_iteration_time",
    "plot_loss",
    "plot_staleness",
]
