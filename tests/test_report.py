"""``edgefl report``: PNGs from synthetic run directories, task splitting, errors, the
``--x`` axes, federated evaluation, the Gantt chart's minimum task width, and one real run.

Most run directories are written by hand here (no MPI): a few devices over a few rounds, with
every timeline state, evaluated and unevaluated metric rows, major-update rows and federated
evaluations. One small FedBuff run on the edge-mix fleet (inline backend, module-scoped) checks
the figures against what a real run writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl import report, reportplots
from edgefl.errors import EdgeflError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(
    root: Path,
    name: str,
    consistency: str = "bsp",
    devices: int = 4,
    rounds: int = 5,
    hist: dict[str, int] | None = None,
    major: bool = False,
    config: str | None = None,
    fed: bool = False,
) -> Path:
    """A BSP-shaped run: device d downloads 0.1 s, computes 0.2·(d+1) s, uploads 0.1 s, then
    waits for the round to end; device 1 is offline 1 s at the start of round 2 (its task
    starts late) and the last device dies halfway through the last round. Every row sends
    1000 uplink bytes per update. With ``fed``, rows 1, 3, 5, ... carry the federated
    evaluation of versions 0, 2, 4, ...: device d has 10 + d held-out samples and accuracy
    (d + 1 + version) / 20, except device 0, which reports 0 samples."""
    run = root / name
    run.mkdir(parents=True)
    tl = ["device,state,start_s,end_s"]
    rows = []
    t = 0.0
    busy_end: dict[int, float] = {}
    for k in range(rounds):
        ends = []
        for d in range(devices):
            s = t
            if d == 1 and k == 2:
                tl.append(f"1,offline,{s!r},{s + 1.0!r}")
                s += 1.0
            if d == devices - 1 and k == rounds - 1:
                continue  # dead: handled below
            a, b, c, e = s, s + 0.1, s + 0.1 + 0.2 * (d + 1), s + 0.3 + 0.2 * (d + 1)
            tl += [f"{d},download,{a!r},{b!r}", f"{d},compute,{b!r},{c!r}"]
            tl.append(f"{d},upload,{c!r},{e!r}")
            busy_end[d] = e
            ends.append(e)
        end = max(ends)
        for d in range(devices):
            if d == devices - 1 and k == rounds - 1:
                tl.append(f"{d},dead,{t!r},{end!r}")
            elif busy_end[d] < end:
                tl.append(f"{d},waiting,{busy_end[d]!r},{end!r}")
        row = {
            "round": k + 1,
            "time_s": end,
            "wall_time_s": 0.01 * (k + 1),
            "updates": devices,
            "train_loss": 2.0 - 0.2 * k,
            "staleness": 0.0,
            "bytes_up": 1000 * len(ends),
        }
        if fed and k % 2 == 0:
            row["fed_version"] = k
            row["fed_eval"] = {
                str(d): {"samples": 10 + d if d else 0, "loss": 1.0, "accuracy": (d + 1 + k) / 20}
                for d in range(devices)
            }
            row["fed_loss"] = 1.5 - 0.1 * k
            row["fed_accuracy"] = 0.5
        if k % 2 == 0 or k == rounds - 1:
            row["test_accuracy"] = 0.1 + 0.15 * k
            row["test_loss"] = 2.0 - 0.3 * k
        if major and k in (1, 3):
            row["major_updates"] = [0, 2] if k == 1 else [1]
        rows.append(row)
        t = end
    (run / "timeline.csv").write_text("\n".join(tl) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "clock": "virtual",
        "time_s": t,
        "idle_fraction": 0.4,
        "consistency": consistency,
        "staleness_hist": hist if hist is not None else {"0": rounds * devices},
        "devices": {
            str(d): {"rounds": rounds, "idle_fraction": d / devices} for d in range(devices)
        },
        "final_accuracy": rows[-1].get("test_accuracy"),
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "events.jsonl").write_text("")
    if config is not None:
        (run / "config.toml").write_text(config)
    return run


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def check_png(path: Path) -> tuple[int, int]:
    """A real, decodable, non-blank PNG of plausible size; returns (width, height)."""
    import matplotlib.image

    assert path.is_file(), path
    assert path.stat().st_size > 10_000, (path, path.stat().st_size)
    w, h = png_size(path)
    img = matplotlib.image.imread(path)  # a truncated or corrupt file fails to decode
    assert img.shape[:2] == (h, w)
    assert img.std() > 0.01  # not a blank canvas
    return w, h


# -- the full report -------------------------------------------------------------------------
def test_report_two_runs_writes_every_png(tmp_path, capsys):
    a = make_run(
        tmp_path, "run_a", "bsp", major=True, fed=True, config='[algorithm]\nconsistency="bsp"\n'
    )
    b = make_run(
        tmp_path,
        "run_b",
        "ssp",
        hist={"0": 6, "1": 7, "3": 5, "9": 2},
        config='[algorithm]\nconsistency = "ssp"\nstaleness = 3\n',
    )
    out = tmp_path / "plots"
    assert report.main([str(a), str(b), "--out", str(out), "--label", "A", "B"]) == 0
    got = capsys.readouterr()
    assert got.out.split() == [str(out / name) for name in report.PLOTS]  # all nine
    assert got.err == ""  # nothing left out
    sizes = {name: check_png(out / name) for name in report.PLOTS}
    # the Gantt chart grows 0.22 in per device from 3 in, at 110 dpi: 4 devices -> 427 px
    assert abs(sizes["gantt.png"][1] - (3.0 + 0.22 * 4) * 110) <= 1
    assert not (a / "report").exists()  # --out given: nothing in the run directory


def test_report_default_out_large_fleet_caps_devices(tmp_path, capsys):
    hist = {str(s): 1 + s % 3 for s in range(0, 120, 7)}  # staleness up to 119: binned
    a = make_run(tmp_path, "big", "asp", devices=30, rounds=3, hist=hist)
    assert report.main([str(a), "--max-devices", "8", "--xscale", "linear"]) == 0
    out = a / "report"
    got = capsys.readouterr()
    # one run: no comparison; no federated evaluation: a note says so
    want = [n for n in report.PLOTS if n not in ("fed_eval.png", "compare.png")]
    assert got.out.split() == [str(out / n) for n in want]
    assert got.err.splitlines() == [
        "edgefl report: note: fed_eval.png left out: no run has federated evaluation "
        "(metrics rows with 'fed_eval'; turn it on with evaluation.every, docs/evaluation.md)"
    ]
    sizes = {name: check_png(out / name) for name in want}
    # capped at 8 devices: the Gantt chart is sized for 8 rows, not 30
    assert abs(sizes["gantt.png"][1] - (3.0 + 0.22 * 8) * 110) <= 1


# -- matplotlib missing ------------------------------------------------------------------------
def test_missing_matplotlib_gives_the_install_line(tmp_path, monkeypatch):
    a = make_run(tmp_path, "run_a")
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(EdgeflError) as e:
        report.main([str(a)])
    assert str(e.value) == "edgefl report needs matplotlib: pip install 'edgefl[plot]'"
    assert f"edgefl: error: {e.value}" == (
        "edgefl: error: edgefl report needs matplotlib: pip install 'edgefl[plot]'"
    )
    assert not (a / "report").exists()


def test_add_parser_registers_report_subcommand(tmp_path):
    parser = argparse.ArgumentParser(prog="edgefl")
    sub = parser.add_subparsers(dest="command")
    report.add_parser(sub)
    args = parser.parse_args(["report", "r1", "r2", "--label", "x", "--label", "y"])
    assert args.func is report.main
    assert args.runs == ["r1", "r2"] and args.labels == ["x", "y"]
    assert args.out is None and args.xscale == "auto" and args.max_devices == 64
    assert args.x == "time"
    args = parser.parse_args(["report", "r1", "--label", "x", "y", "--out", "o", "--x", "bytes"])
    assert args.labels == ["x", "y"] and args.out == "o" and args.x == "bytes"


# -- bad input -------------------------------------------------------------------------------
def _garble(run: Path, name: str, text: str | None) -> Path:
    p = run / name
    if text is None:
        p.unlink()
    else:
        p.write_text(text)
    return p


BAD_INPUTS = [
    ("metrics.jsonl", None, "not found"),
    ("metrics.jsonl", '{"round": 1, "time_s": 1.0}\n{"round": 2, "time_s"\n', "line 2"),
    ("metrics.jsonl", '{"round": 1}\n', "'time_s'"),
    ("metrics.jsonl", "[1, 2]\n", "line 1: expected a JSON object"),
    ("metrics.jsonl", '{"time_s": 1.0, "major_updates": 3}\n', "'major_updates'"),
    ("summary.json", None, "not found"),
    ("summary.json", "{not json", "not valid JSON"),
    ("summary.json", '{"staleness_hist": {"x": 1}}', "staleness_hist"),
    ("summary.json", '{"devices": {"0": {"idle_fraction": "a"}}}', "devices.0.idle_fraction"),
    ("timeline.csv", None, "not found"),
    ("timeline.csv", "device,state,start_s,end_s\n0,compute,0.0\n", "row 2: expected 4 fields"),
    ("timeline.csv", "device,state,start_s,end_s\n0,compute,0,1\n0,upload,x,2\n", "row 3"),
    ("timeline.csv", "dev,what\n", "row 1: header"),
    ("timeline.csv", "device,state,start_s,end_s\n0,compute,2.0,1.0\n", "row 2: interval"),
    ("config.toml", "[algorithm\n", "invalid TOML"),
    ("metrics.jsonl", '{"time_s": 1.0, "fed_version": 0, "fed_eval": [1]}\n', "'fed_eval'"),
    ("metrics.jsonl", '{"time_s": 1.0, "fed_eval": {"0": {}}}\n', "'fed_version'"),
]


@pytest.mark.parametrize("name,text,why", BAD_INPUTS)
def test_bad_run_file_names_the_file(tmp_path, name, text, why):
    a = make_run(tmp_path, "run_a", config="seed = 0\n")
    p = _garble(a, name, text)
    with pytest.raises(EdgeflError) as e:
        report.make_report([a])
    msg = str(e.value)
    assert str(p) in msg and why in msg, msg
    assert "\n" not in msg
    assert not (a / "report").exists()  # nothing written before the input is checked


def test_missing_run_dir_and_second_run_checked(tmp_path):
    a = make_run(tmp_path, "run_a")
    with pytest.raises(EdgeflError, match="run directory '.*nope' not found"):
        report.make_report([a, tmp_path / "nope"])
    b = make_run(tmp_path, "run_b")
    (b / "timeline.csv").unlink()  # only the first run's timeline is drawn: not needed
    (b / "summary.json").write_text("[]")
    with pytest.raises(EdgeflError, match=r"run_b/summary.json': expected a JSON object"):
        report.make_report([a, b])


def test_label_count_and_options_checked(tmp_path):
    a = make_run(tmp_path, "run_a")
    with pytest.raises(EdgeflError, match=r"--label given 1 name\(s\) for 2 run directories"):
        report.make_report([a, a], labels=["x"])
    with pytest.raises(EdgeflError, match="--max-devices 0"):
        report.make_report([a], max_devices=0)
    with pytest.raises(EdgeflError, match="--xscale 'sideways'"):
        report.make_report([a], xscale="sideways")
    assert not (a / "report").exists()


def test_bad_x_value_is_one_line_naming_the_option(tmp_path, capsys):
    from edgefl import cli

    a = make_run(tmp_path, "run_a")
    assert cli.main(["report", str(a), "--x", "sideways"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "edgefl: error: --x 'sideways': expected one of time, round, virtual, wall, bytes\n"
    )
    assert not (a / "report").exists()
    with pytest.raises(EdgeflError, match="^--x 'rounds': expected one of"):
        report.row_x(report.load_run(a), "rounds")


# -- labels --------------------------------------------------------------------------------
def test_default_labels(tmp_path):
    cfg = '[algorithm]\nconsistency = "ssp"\nstaleness = 4\nbuffer_k = 2\n'
    r = report.load_run(make_run(tmp_path, "rep_ssp", "ssp", config=cfg))
    assert r.label == "ssp s=4 (rep_ssp)"
    r = report.load_run(make_run(tmp_path, "bsp", "bsp"))
    assert r.label == "bsp"  # folder named after the policy: not repeated
    assert report.policy_name({"consistency": "fedbuff"}, {"algorithm": {"buffer_k": 4}}) == (
        "fedbuff K=4"
    )
    assert report.policy_name({}, {"algorithm": {"consistency": "asp", "gate": "hermes"}}) == (
        "asp + hermes"
    )
    assert report.policy_name({}, None) == "run"
    runs = [report.load_run(make_run(tmp_path / s, "x", "bsp")) for s in ("p", "q")]
    report._dedupe_labels(runs)
    assert runs[0].label != runs[1].label and runs[0].label.startswith("bsp (x) [")


# -- task splitting ----------------------------------------------------------------------------
def test_task_times_hand_computed():
    rows = [
        # device 0: one full task, one cut by going offline, one cut by the run's end
        (0, "download", 0.0, 1.0),
        (0, "compute", 1.0, 3.0),
        (0, "upload", 3.0, 4.0),
        (0, "waiting", 4.0, 6.0),
        (0, "download", 6.0, 7.0),
        (0, "compute", 7.0, 8.0),
        (0, "offline", 8.0, 9.0),
        (0, "download", 9.0, 10.0),
        (0, "compute", 10.0, 12.0),
        # device 1: local iterations back to back, a push, then a cut-off iteration
        (1, "compute", 0.0, 1.0),
        (1, "compute", 1.0, 3.0),
        (1, "compute", 3.0, 4.0),
        (1, "upload", 4.0, 5.5),
        (1, "compute", 5.5, 6.0),
        # device 2: a hole in the timeline ends the first task unfinished
        (2, "download", 0.0, 1.0),
        (2, "compute", 2.0, 3.0),
        (2, "upload", 3.0, 3.25),
        (2, "dead", 3.25, 12.0),
    ]
    got = {
        d: [(t.index, t.start_s, t.busy_s, t.states) for t in ts]
        for d, ts in report.task_times(rows).items()
    }
    assert got == {
        0: [(0, 0.0, 4.0, ["download", "compute", "upload"])],
        1: [
            (0, 0.0, 1.0, ["compute"]),
            (1, 1.0, 2.0, ["compute"]),
            (2, 3.0, 2.5, ["compute", "upload"]),
        ],
        2: [(1, 2.0, 1.25, ["compute", "upload"])],
    }


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.001, 10.0),  # download s
            st.floats(0.001, 10.0),  # compute s
            st.floats(0.001, 10.0),  # upload s
            st.floats(0.0, 5.0),  # waiting before the next task
        ),
        min_size=1,
        max_size=12,
    )
)
def test_task_times_recovers_task_durations(tasks):
    rows = []
    want = []
    t = 0.0
    for dl, c, up, wait in tasks:
        want.append((t, dl + c + up))
        for state, dur in (("download", dl), ("compute", c), ("upload", up)):
            rows.append((7, state, t, t + dur))
            t += dur
        if wait > 0:
            rows.append((7, "waiting", t, t + wait))
            t += wait
    got = report.task_times(rows)[7]
    assert [x.index for x in got] == list(range(len(tasks)))
    assert [x.start_s for x in got] == [w[0] for w in want]
    assert [x.busy_s for x in got] == pytest.approx([w[1] for w in want], rel=1e-9)


# -- axis and bin choices ----------------------------------------------------------------------
def test_auto_xscale_and_staleness_bins():
    assert report.auto_xscale([40.0, 0.2, 0.1]) == "log"
    assert report.auto_xscale([40.0, 3.0]) == "linear"
    assert report.auto_xscale([5.0]) == "linear"
    assert report.auto_xscale([0.0, 10.0]) == "linear"
    assert report.staleness_bin_width([{"0": 1, "39": 2}]) == 1
    assert report.staleness_bin_width([{"0": 1}, {"41": 2}]) == 2  # 42 values -> bins of 2
    assert report.bin_staleness({"0": 5, "3": 2, "2": 1, "41": 1}, 2) == {0: 5, 2: 3, 40: 1}
    assert report.bin_staleness({"0": 5, "3": 0}, 1) == {0: 5}


# -- the x axes -------------------------------------------------------------------------------
def test_row_x_each_axis_and_missing_ones(tmp_path):
    run = report.load_run(make_run(tmp_path, "r", rounds=4))
    times = [r["time_s"] for r in run.metrics]
    assert report.row_x(run, "time") == (times, "")
    assert report.row_x(run, "virtual") == (times, "")  # summary.json: clock = virtual
    assert report.row_x(run, "round") == ([1.0, 2.0, 3.0, 4.0], "")
    assert report.row_x(run, "wall") == ([0.01, 0.02, 0.03, 0.04], "")
    # bytes: cumulative; the last round has one device dead, so 3 updates of 1000 bytes
    assert report.row_x(run, "bytes") == ([4000.0, 8000.0, 12000.0, 15000.0], "")
    run.summary["clock"] = "wall"  # an edgefl run: time_s is wall time, no virtual time
    assert report.row_x(run, "wall") == (times, "")
    xs, why = report.row_x(run, "virtual")
    assert xs is None and "wall clock" in why
    for r in run.metrics:
        del r["bytes_up"]
    assert report.row_x(run, "bytes") == (None, "its metrics rows have no 'bytes_up'")
    axis = report.x_axis([run], "bytes")
    assert axis.values == [None] and axis.label.startswith("uplink traffic, cumulative (bytes")
    assert axis.version_x(0, run) == {}


def test_x_axis_scale_labels_and_version_positions(tmp_path):
    a = report.load_run(make_run(tmp_path, "a", rounds=3))
    b = report.load_run(make_run(tmp_path, "b", rounds=80))
    axis = report.x_axis([a, b], "round")
    assert axis.scale == "log" and axis.label == "model version (round)"  # 3 vs 80 rounds
    assert report.x_axis([a, b], "round", "linear").scale == "linear"
    assert report.x_axis([a], "time").label == "time (s, virtual clock)"
    assert report.x_axis([a], "virtual").label == "virtual time (s, simulated clock)"
    assert report.x_axis([a], "wall").label == "wall-clock time (s, real seconds the run took)"
    t = report.x_axis([a], "time")
    assert t.version_x(0, a) == {0: 0.0, **{r["round"]: r["time_s"] for r in a.metrics}}


def test_accuracy_vs_bytes_uses_cumulative_uplink_bytes(tmp_path):
    new_figure = report.require_matplotlib()
    run = report.load_run(make_run(tmp_path, "r", rounds=5))
    axis = report.x_axis([run], "bytes", "linear")
    fig = reportplots.plot_accuracy(new_figure, [run], axis, "Test accuracy vs uplink traffic")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("uplink traffic, cumulative (bytes")
    assert ax.get_title() == "Test accuracy vs uplink traffic"
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [4000, 12000, 19000]  # rounds 1, 3, 5 (5: one dead)
    assert ax.xaxis.get_major_formatter().format_data(2e6).replace("\u2009", " ") == "2 MB"


# -- federated evaluation ---------------------------------------------------------------------
def test_fed_evals_and_latest_per_device(tmp_path):
    run = report.load_run(make_run(tmp_path, "r", devices=3, rounds=5, fed=True))
    evals = report.fed_evals(run)
    assert [(e.version, e.row) for e in evals] == [(0, 0), (2, 2), (4, 4)]
    # device 0 reports 0 held-out samples: left out, as the fedeval means leave it out
    assert evals[1].accuracy == {1: 4 / 20, 2: 5 / 20} and evals[1].samples == {1: 11, 2: 12}
    assert evals[1].mean == 0.5
    assert report.latest_per_device(evals) == {1: (4, 6 / 20, 11), 2: (4, 7 / 20, 12)}
    # asynchronous: only the devices that started from a version report it
    run.metrics[4]["fed_eval"] = {"1": {"samples": 5, "loss": 1.0, "accuracy": 0.9}}
    latest = report.latest_per_device(report.fed_evals(run))
    assert latest == {1: (4, 0.9, 5), 2: (2, 5 / 20, 12)}


def test_fed_eval_figure_draws_the_devices_and_the_spread(tmp_path):
    new_figure = report.require_matplotlib()
    run = report.load_run(make_run(tmp_path, "r", devices=5, rounds=5, fed=True))
    axis = report.x_axis([run], "round", "linear")
    fig = reportplots.plot_fed_eval(new_figure, run, axis, 0)
    left, right = fig.axes
    heights = [p.get_height() for p in left.patches]
    assert heights == pytest.approx([100 * (d + 5) / 20 for d in range(1, 5)])  # version 4
    assert [t.get_text() for t in left.get_xticklabels()] == ["1", "2", "3", "4"]
    assert "last evaluation (version 4)" in left.get_title()
    # weighted mean of version 4: weights 11..14 on accuracies 6/20..9/20
    mean = 100 * sum((10 + d) * (d + 5) / 20 for d in range(1, 5)) / sum(range(11, 15))
    assert f"{mean:.1f}%" in left.get_title()
    median = next(ln for ln in right.get_lines() if ln.get_label() == "median device")
    # versions 0, 2, 4 sit at x 0, 2, 4 (the rows that made them); medians of devices 1..4
    assert list(median.get_xdata()) == [0, 2, 4]
    assert list(median.get_ydata()) == pytest.approx([100 * (2.5 + 1 + k) / 20 for k in (0, 2, 4)])
    assert right.get_xlabel() == "model version (round)"
    assert "3 evaluations (4 devices each)" in right.get_title()


# -- Gantt: the minimum task width ------------------------------------------------------------
def test_busy_blocks_split_tasks_and_gantt_bars_widen_short_ones():
    rows = [
        (0, "download", 0.0, 0.0005),
        (0, "compute", 0.0005, 0.0025),
        (0, "upload", 0.0025, 0.003),  # task 1: 3 ms, mostly compute
        (0, "download", 0.003, 1.0),  # task 2 right after: ~1 s
        (0, "compute", 1.0, 2.0),
        (0, "upload", 2.0, 2.5),
        (0, "waiting", 2.5, 3.0),
        (0, "compute", 3.0, 3.004),  # local iterations: 2 tasks of 4 ms, the second cut off
        (0, "compute", 3.004, 3.008),
        (1, "offline", 0.0, 5.0),
    ]
    blocks = report.busy_blocks(rows)
    assert [[s for s, _, _ in b] for b in blocks[0]] == [
        ["download", "compute", "upload"],
        ["download", "compute", "upload"],
        ["compute"],
        ["compute"],
    ]
    assert blocks[1] == []
    bars = report.gantt_bars(rows, min_width_s=0.05)
    assert (bars.tasks, bars.widened, bars.min_width_s) == (4, 3, 0.05)
    assert bars.spans[(0, "download")] == [(0.003, 0.997)]  # the 1 s task as it is
    # the 3 ms task: drawn as one 0.05 s bar from its start, in its longest state's colour
    assert sorted(bars.spans[(0, "compute")]) == [
        (0.0, 0.05),
        (1.0, 1.0),
        (3.0, 0.05),
        (3.004, 0.05),
    ]
    assert bars.spans[(1, "offline")] == [(0.0, 5.0)]
    assert report.gantt_bars(rows, [1], 0.05).tasks == 0


def _add_short_tasks(run: Path, n: int, device: int = 0, length: float = 1e-4) -> None:
    """Append ``n`` tasks of ``length`` s to ``device``'s timeline, 0.2 s apart from t = 0.5
    s of the dead device's round (none of the existing intervals is that short)."""
    lines = (run / "timeline.csv").read_text().splitlines()
    t0 = max(float(x.split(",")[3]) for x in lines[1:]) + 1.0
    for i in range(n):
        a = t0 + 0.2 * i
        lines += [f"{device},download,{a!r},{a + length / 2!r}"]
        lines += [f"{device},upload,{a + length / 2!r},{a + length!r}"]
    (run / "timeline.csv").write_text("\n".join(lines) + "\n")


def test_gantt_note_counts_the_widened_tasks(tmp_path):
    new_figure = report.require_matplotlib()
    path = make_run(tmp_path, "r", devices=4, rounds=3)
    _add_short_tasks(path, 7)
    run = report.load_run(path, timeline=True)
    fig = reportplots.plot_gantt(new_figure, run)
    ax = fig.axes[0]
    bars = ax.gantt
    # 4 devices x 3 rounds, the last device dead in the last round: 11 tasks, plus the 7
    assert (bars.tasks, bars.widened) == (18, 7)
    # the minimum is 2 pixels of the saved PNG
    px = ax.bbox.width / (ax.get_xlim()[1] - ax.get_xlim()[0])
    assert bars.min_width_s * px == pytest.approx(report.MIN_TASK_PX, rel=0.02)
    assert f"\n7 of 18 tasks are shorter than {report.MIN_TASK_PX:g} px" in ax.get_title()
    widths = [w for (_, s), spans in bars.spans.items() if s != "waiting" for _, w in spans]
    assert min(widths) == pytest.approx(bars.min_width_s)
    run.timeline = [r for r in run.timeline if r[3] - r[2] > 0.01]  # without them: no note
    title = reportplots.plot_gantt(new_figure, run).axes[0].get_title()
    assert "shorter than" not in title and title == "Per-device timeline: bsp (r)"


# -- idle fraction labels, staleness, comparison ----------------------------------------------
EDGE_MIX = 'seed = 3\n[fleet]\ndevices = 4\n[sim]\nprofiles = "edge-mix"\n'


def test_idle_bars_are_labelled_with_the_profile_names(tmp_path):
    from edgefl.sim.profiles import load_fleet

    new_figure = report.require_matplotlib()
    run = report.load_run(make_run(tmp_path, "r", config=EDGE_MIX), timeline=True)
    names = [p.name for p in load_fleet("edge-mix", 4, 3)]
    want = [f"{d} {n}" for d, n in enumerate(names)]
    gantt = reportplots.plot_gantt(new_figure, run).axes[0]
    assert [t.get_text() for t in gantt.get_yticklabels()] == want
    idle = reportplots.plot_idle(new_figure, [run]).axes[0]
    assert [t.get_text() for t in idle.get_xticklabels()] == want
    other = report.load_run(make_run(tmp_path, "q", config=EDGE_MIX.replace("3", "4", 1)))
    mixed = reportplots.idle_device_labels([run, other], range(4))
    # where the two fleets disagree on a device's profile, only its id is shown
    assert mixed == [
        w if other.profile_names[d] == names[d] else str(d) for d, w in enumerate(want)
    ]


def test_staleness_ticks_are_integers_and_the_legend_is_off_the_bars(tmp_path):
    new_figure = report.require_matplotlib()
    runs = [
        report.load_run(make_run(tmp_path, "a", "bsp", hist={"0": 20})),
        report.load_run(make_run(tmp_path, "b", "asp", hist={"0": 5, "1": 9, "2": 4, "5": 2})),
    ]
    fig = reportplots.plot_staleness(new_figure, runs)
    ax = fig.axes[0]
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    legend = ax.get_legend().get_window_extent()
    assert legend.y1 < ax.get_window_extent().y0  # below the axes, not over the bars
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == ["bsp (a): 20 updates, mean 0.0, max 0", "asp (b): 20 updates, mean 1.4, max 5"]


def test_compare_legend_holds_the_run_directory_names(tmp_path):
    new_figure = report.require_matplotlib()
    names = ["exp_bsp", "exp_fedbuff", "exp_asp"]
    runs = [
        report.load_run(make_run(tmp_path, n, "bsp", rounds=3 + i)) for i, n in enumerate(names)
    ]
    axis = report.x_axis(runs, "time")
    fig = reportplots.plot_compare(new_figure, runs, axis, report.x_axis(runs, "bytes"))
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert [t.split(": final")[0] for t in texts] == [f"bsp ({n})" for n in names]
    assert [ax.get_xlabel() for ax in fig.axes] == [
        "time (s, virtual clock)",
        "time (s, virtual clock)",
        "uplink traffic, cumulative (bytes; 1 MB = 10^6 B)",
        "time (s, virtual clock)",
    ]
    assert len(fig.axes[0].get_lines()) == 3


# -- a real run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bsp_run(tmp_path_factory) -> Path:
    """A small BSP run on 10 edge-mix devices (edge server to microcontroller: tasks 500x
    apart, so the fast ones are narrower than a pixel) with federated evaluation every
    version; inline backend, no MPI, about 1 s after the imports."""
    from edgefl.api import simulate

    out = tmp_path_factory.mktemp("report") / "bsp"
    overrides = {
        "fleet.devices": 10,
        "sim.profiles": "edge-mix",
        "run.rounds": 3,
        "run.checkpoint_every": 0,
        "evaluation.every": 1,
        "model.args.hidden": [8],
    }
    simulate(overrides=overrides, out=out, backend="inline")
    return out


def test_real_bsp_run_report(bsp_run, tmp_path):
    rep = report.build_report([bsp_run], out=tmp_path, x="round")
    # BSP: no staleness, so no histogram, and a note saying so; one run: no comparison
    want = [n for n in report.PLOTS if n not in ("staleness_hist.png", "compare.png")]
    assert [p.name for p in rep.paths] == want
    assert [n.split(":")[0] for n in rep.notes] == ["staleness_hist.png left out"]
    for p in rep.paths:
        check_png(p)
    rows = [json.loads(line) for line in (bsp_run / "metrics.jsonl").read_text().splitlines()]
    cum, evaluated = 0, []
    for r in rows:
        cum += r["bytes_up"]
        if r.get("test_accuracy") is not None:
            evaluated.append((r["round"], cum, 100 * r["test_accuracy"]))
    ax = rep.figures["accuracy.png"].axes[0]
    assert ax.get_xlabel() == "model version (round)"
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [e[0] for e in evaluated]
    assert list(line.get_ydata()) == pytest.approx([e[2] for e in evaluated])
    ax = rep.figures["accuracy_vs_bytes.png"].axes[0]
    assert ax.get_xlabel().startswith("uplink traffic, cumulative (bytes")
    assert list(ax.get_lines()[0].get_xdata()) == [e[1] for e in evaluated]
    loss = rep.figures["loss.png"].axes[0]
    assert [ln.get_linestyle() for ln in loss.get_lines()] == ["--", "-", ":"]

    # the Gantt note's count equals the timeline's tasks (each from a download) under the
    # minimum width
    gantt = rep.figures["gantt.png"].axes[0]
    timeline = report.read_timeline(bsp_run / "timeline.csv")
    spans: list[list[float]] = []
    for d in sorted({r[0] for r in timeline}):
        busy = sorted((a, b, s) for dd, s, a, b in timeline if dd == d and s != "waiting")
        for a, b, s in busy:
            if s == "download" or not spans or spans[-1][0] != d:
                spans.append([d, a, b])
            spans[-1][2] = b
    narrow = sum(1 for _, a, b in spans if b - a < gantt.gantt.min_width_s)
    assert narrow > 0 and gantt.gantt.tasks == len(spans) == 30
    assert f"\n{narrow} of 30 tasks are shorter than 2 px" in gantt.get_title()

    # devices labelled "<id> <profile>" alike in the Gantt chart and the idle bars
    gantt_labels = [t.get_text() for t in gantt.get_yticklabels()]
    assert "3 edge-server" in gantt_labels and len(gantt_labels) == 10
    idle = rep.figures["idle_fraction.png"].axes[0]
    assert [t.get_text() for t in idle.get_xticklabels()] == gantt_labels

    # federated evaluation: every device at the final model (summary.json), sorted; the
    # spread over versions 0, 1, 2 (rows 1, 2, 3) and 3 (the final model)
    left, right = rep.figures["fed_eval.png"].axes
    final = json.loads((bsp_run / "summary.json").read_text())["fed_eval"]["final"]
    accs = sorted(100 * e["accuracy"] for e in final["devices"].values() if e["samples"])
    assert len(accs) == 10 and [p.get_height() for p in left.patches] == pytest.approx(accs)
    assert "Each device at the final model (version 3)" in left.get_title()
    assert right.get_xlabel() == "model version (round)"
    median = next(ln for ln in right.get_lines() if ln.get_label() == "median device")
    assert list(median.get_xdata()) == [0, 1, 2, 3]
    assert median.get_ydata()[-1] == pytest.approx(statistics.median(accs))
