"""``edgefl report``: PNGs from synthetic run directories, task splitting, errors.

The run directories are written by hand here (no MPI): a few devices over a few rounds, with
every timeline state, evaluated and unevaluated metric rows and major-update rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl import report
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
) -> Path:
    """A BSP-shaped run: device d downloads 0.1 s, computes 0.2·(d+1) s, uploads 0.1 s, then
    waits for the round to end; device 1 is offline 1 s at the start of round 2 (its task
    starts late) and the last device dies halfway through the last round."""
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
        }
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
def test_report_two_runs_writes_five_valid_pngs(tmp_path, capsys):
    a = make_run(tmp_path, "run_a", "bsp", major=True, config='[algorithm]\nconsistency="bsp"\n')
    b = make_run(
        tmp_path,
        "run_b",
        "ssp",
        hist={"0": 6, "1": 7, "3": 5, "9": 2},
        config='[algorithm]\nconsistency = "ssp"\nstaleness = 3\n',
    )
    out = tmp_path / "plots"
    assert report.main([str(a), str(b), "--out", str(out), "--label", "A", "B"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / name) for name in report.PLOTS]
    sizes = {name: check_png(out / name) for name in report.PLOTS}
    # the Gantt chart grows 0.22 in per device from 3 in, at 110 dpi: 4 devices -> 427 px
    assert abs(sizes["gantt.png"][1] - (3.0 + 0.22 * 4) * 110) <= 1
    assert not (a / "report").exists()  # --out given: nothing in the run directory


def test_report_default_out_large_fleet_caps_devices(tmp_path, capsys):
    hist = {str(s): 1 + s % 3 for s in range(0, 120, 7)}  # staleness up to 119: binned
    a = make_run(tmp_path, "big", "asp", devices=30, rounds=3, hist=hist)
    assert report.main([str(a), "--max-devices", "8", "--xscale", "linear"]) == 0
    out = a / "report"
    assert capsys.readouterr().out.split() == [str(out / n) for n in report.PLOTS]
    sizes = {name: check_png(out / name) for name in report.PLOTS}
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
    args = parser.parse_args(["report", "r1", "--label", "x", "y", "--out", "o"])
    assert args.labels == ["x", "y"] and args.out == "o"


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
