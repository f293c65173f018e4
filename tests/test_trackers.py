"""Experiment trackers (csv, TensorBoard, MLflow) and the progress bar, without MPI.

TensorBoard and MLflow are optional and not needed here: when the real package is missing,
a small fake module in ``sys.modules`` records the calls the tracker makes.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import sys
import types
from pathlib import Path

import pytest
from conftest import run_loopback_job

from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.runtime import trackers as tr
from edgefl.runtime.output import Progress


def _row(r: int, **extra) -> dict:
    row = {
        "round": r,
        "time_s": 0.5 * r,
        "train_loss": 1.0 / r,
        "major_updates": [1, 2],
        "consistency": "sync",
        "devices": {"0": {"bytes_up": 100 * r, "msgs_up": 1}},
    }
    row.update(extra)
    return row


def _cfg(trackers: list[str], **output) -> dict:
    return {"output": {"trackers": trackers, "mlflow_uri": "", "mlflow_experiment": "x", **output},
            "train": {"lr": 0.1, "client": ""}, "model": {"args": {"hidden": [16]}}}  # fmt: skip


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# -- flattening ---------------------------------------------------------------------------
def test_flatten_nests_devices_and_drops_lists():
    row = {
        "round": 3,
        "ps": {"shard": {"bytes": 7}},
        "devices": {"3": {"bytes_up": 10, "time_s": 0.25}, "12": {"msgs_up": 1}},
        "major_updates": [3, 12],
        "note": "x",
        "test_accuracy": None,
        "ok": True,
    }
    flat = tr.flatten(row)
    assert flat == {
        "round": 3,
        "ps/shard/bytes": 7,
        "device/3/bytes_up": 10,
        "device/3/time_s": 0.25,
        "device/12/msgs_up": 1,
        "note": "x",
        "test_accuracy": None,
        "ok": True,
    }
    num = tr.numeric(flat)
    assert "note" not in num and "test_accuracy" not in num
    assert num["ok"] == 1.0 and num["device/3/time_s"] == 0.25
    assert all(isinstance(v, float) for v in num.values())


def test_flatten_numpy_scalars_are_numeric():
    np = pytest.importorskip("numpy")
    num = tr.numeric(tr.flatten({"round": np.int64(2), "loss": np.float32(0.5)}))
    assert num == {"round": 2.0, "loss": 0.5}


# -- csv ----------------------------------------------------------------------------------
def test_csv_late_columns_rewrite_keeps_every_value(tmp_path):
    path = tmp_path / "metrics.csv"
    t = tr.CsvTracker(path)
    t.log(_row(1))
    t.log(_row(2, test_accuracy=0.5))  # a new column: the file is rewritten
    t.log(_row(3, devices={"0": {"bytes_up": 3}, "10": {"bytes_up": 9}}))
    t.log(_row(4))  # no new column: appended
    t.close()
    rows = _read_csv(path)
    assert [r["round"] for r in rows] == ["1", "2", "3", "4"]
    header = next(csv.reader(open(path, encoding="utf-8")))
    assert header[0] == "round"
    assert "major_updates" not in header and "consistency" in header
    # device columns after the run-wide ones, by numeric id: 0 before 10
    assert header.index("device/0/bytes_up") < header.index("device/10/bytes_up")
    assert header.index("test_accuracy") < header.index("device/0/bytes_up")
    assert rows[0]["test_accuracy"] == "" and rows[1]["test_accuracy"] == "0.5"
    assert rows[0]["device/10/bytes_up"] == "" and rows[2]["device/10/bytes_up"] == "9"
    assert rows[0]["device/0/bytes_up"] == "100" and rows[3]["device/0/bytes_up"] == "400"
    assert not path.with_name("metrics.csv.tmp").exists()


def test_csv_resume_keeps_earlier_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    first = tr.CsvTracker(path)
    for r in (1, 2, 3):
        first.log(_row(r))
    # the job died after round 3; its checkpoint holds rounds 1-2: those are the history
    history = [_row(1), _row(2)]
    again = tr.CsvTracker(path, history)
    again.log(_row(3, test_accuracy=0.75))
    rows = _read_csv(path)
    assert [r["round"] for r in rows] == ["1", "2", "3"]
    assert rows[2]["test_accuracy"] == "0.75" and rows[0]["train_loss"] == "1.0"


# -- tensorboard and mlflow (real packages if installed, else recording fakes) -------------
class _FakeWriter:
    instances: list = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.scalars: list = []
        self.closed = False
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        _FakeWriter.instances.append(self)

    def add_scalar(self, tag, value, global_step=None) -> None:
        self.scalars.append((tag, value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    if importlib.util.find_spec("tensorboard") is not None:
        return None
    _FakeWriter.instances = []
    mod = types.ModuleType("torch.utils.tensorboard")
    mod.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", mod)
    return _FakeWriter


def test_tensorboard_tracker_scalars_by_round(tmp_path, fake_tensorboard):
    t = tr.make_trackers(_cfg(["tensorboard"]), tmp_path)
    t.log(_row(1))
    t.log(_row(2, test_accuracy=0.5))
    t.close()
    assert (tmp_path / "tensorboard").is_dir()
    if fake_tensorboard is None:  # the real package: read the event file back
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train_loss")] == [1, 2]
        assert "device/0/bytes_up" in acc.Tags()["scalars"]
        return
    (w,) = fake_tensorboard.instances
    assert w.log_dir == str(tmp_path / "tensorboard") and w.closed
    got = {(tag, step): v for tag, v, step in w.scalars}
    assert got[("train_loss", 2)] == 0.5 and got[("test_accuracy", 2)] == 0.5
    assert got[("device/0/bytes_up", 1)] == 100.0
    tags = {tag for tag, _, _ in w.scalars}
    assert not tags & {"round", "consistency", "major_updates"}


class _FakeClient:
    runs: dict = {}
    experiments: dict = {}

    def __init__(self, tracking_uri: str) -> None:
        self.uri = tracking_uri

    def get_experiment_by_name(self, name):
        eid = self.experiments.get(name)
        return types.SimpleNamespace(experiment_id=eid) if eid else None

    def create_experiment(self, name, artifact_location=None):
        self.experiments[name] = f"e{len(self.experiments) + 1}"
        return self.experiments[name]

    def create_run(self, experiment_id, run_name=None):
        rid = f"r{len(self.runs) + 1}"
        self.runs[rid] = {"exp": experiment_id, "name": run_name, "params": {}, "metrics": [],
                          "status": "RUNNING", "uri": self.uri}  # fmt: skip
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid))

    def log_batch(self, run_id, metrics=(), params=()):
        assert len(params) <= 100 and len(metrics) <= 1000
        run = self.runs[run_id]
        run["params"].update({p.key: p.value for p in params})
        run["metrics"] += [(m.key, m.value, m.step) for m in metrics]

    def update_run(self, run_id, status=None):
        self.runs[run_id]["status"] = status

    def set_terminated(self, run_id, status="FINISHED"):
        self.runs[run_id]["status"] = status


def _entity(*fields):
    return lambda *a: types.SimpleNamespace(**dict(zip(fields, a)))


@pytest.fixture
def fake_mlflow(monkeypatch):
    if importlib.util.find_spec("mlflow") is not None:
        return None
    _FakeClient.runs, _FakeClient.experiments = {}, {}
    root = types.ModuleType("mlflow")
    ent = types.ModuleType("mlflow.entities")
    ent.Metric = _entity("key", "value", "timestamp", "step")
    ent.Param = _entity("key", "value")
    trk = types.ModuleType("mlflow.tracking")
    trk.MlflowClient = _FakeClient
    for name, mod in (("mlflow", root), ("mlflow.entities", ent), ("mlflow.tracking", trk)):
        monkeypatch.setitem(sys.modules, name, mod)
    return _FakeClient


def test_mlflow_tracker_one_run_params_and_resume(tmp_path, fake_mlflow):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _cfg(["mlflow"])
    t = tr.make_trackers(cfg, run_dir)
    t.log(_row(1))
    t.log(_row(2, test_accuracy=float("nan")))
    t.close()
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    # a resume continues the same MLflow run (no second run, params not logged again)
    t2 = tr.make_trackers(cfg, run_dir, history=[_row(1), _row(2)])
    t2.log(_row(3))
    t2.close()
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    if fake_mlflow is None:  # the real package: read the run back
        from mlflow.tracking import MlflowClient

        c = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlruns').resolve()}/mlflow.db")
        run = c.get_run(run_id)
        assert run.data.params["train.lr"] == "0.1" and run.info.status == "FINISHED"
        assert run.data.params["model.args.hidden"] == "[16]"
        assert [m.step for m in c.get_metric_history(run_id, "train_loss")] == [1, 2, 3]
        assert c.get_metric_history(run_id, "device/0/bytes_up")[0].value == 100.0
        assert "test_accuracy" not in run.data.metrics and "round" not in run.data.metrics
        assert len(c.search_runs([run.info.experiment_id])) == 1
        return
    run = fake_mlflow.runs[run_id]
    db = (run_dir / "mlruns" / "mlflow.db").resolve()
    assert run["uri"] == f"sqlite:///{db}" and run["name"] == "run"
    assert fake_mlflow.experiments == {"x": run["exp"]}
    assert run["params"]["train.lr"] == "0.1"
    assert run["params"]["model.args.hidden"] == "[16]"
    assert ("train_loss", 0.5, 2) in run["metrics"]
    assert ("device/0/bytes_up", 100.0, 1) in run["metrics"]
    assert [m[2] for m in run["metrics"] if m[0] == "train_loss"] == [1, 2, 3]
    assert not [m for m in run["metrics"] if m[0] in ("round", "test_accuracy", "consistency")]
    assert list(fake_mlflow.runs) == [run_id] and run["status"] == "FINISHED"


def test_failing_tracker_is_turned_off_not_fatal(tmp_path, caplog):
    class Broken:
        def log(self, row):
            raise OSError("disk full")

        def close(self):
            raise AssertionError("closed after being turned off")

    path = tmp_path / "metrics.csv"
    t = tr.Trackers([Broken(), tr.CsvTracker(path)])
    t.log(_row(1))
    t.log(_row(2))
    t.close()
    assert "disk full" in caplog.text
    assert [r["round"] for r in _read_csv(path)] == ["1", "2"]


# -- config time --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_missing_package_error_names_key_and_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        tr.check_trackers(_cfg(["csv", name]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("output.trackers")
    assert f"{name!r} needs the {name} package" in msg and f"pip install 'edgefl[{name}]'" in msg
    with pytest.raises(ConfigError):  # also when the job builds them (edgefl run by hand)
        tr.make_trackers(_cfg([name]), Path("unused"))


def test_no_run_directory_no_trackers(tmp_path):
    assert tr.make_trackers(_cfg(["csv"]), None).trackers == []
    assert tr.make_trackers(_cfg([]), tmp_path).trackers == []
    assert list(tmp_path.iterdir()) == []
    tr.check_trackers(_cfg(["csv"]))  # no package needed


def test_preflight_refuses_missing_tracker_package(monkeypatch):
    from edgefl.preflight import preflight

    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = load_config(None, ["output.trackers=['csv', 'mlflow']"])
    with pytest.raises(ConfigError, match=r"pip install 'edgefl\[mlflow\]'"):
        preflight(cfg)


# -- progress -----------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_shows_rate_eta_and_metrics(monkeypatch):
    monkeypatch.delenv("EDGEFL_TTY", raising=False)
    term = _Terminal()
    p = Progress("auto", rounds=4, stream=term, min_interval_s=0)
    assert p.mode == "bar"
    p.update({"round": 1, "test_accuracy": 0.25, "test_loss": 1.5})
    p.update({"round": 2, "test_accuracy": 0.5, "test_loss": 1.25})
    mid = term.getvalue().split("\r")[-1]
    assert re.search(r"2/4", mid) and "acc=0.5000 loss=1.2500" in mid
    assert re.search(r"<\d\d:\d\d", mid)  # time left
    assert re.search(r"(round/s|s/round)", mid)  # rate
    p.update({"round": 3})  # no evaluation this round: keeps the last values
    p.update({"round": 4, "test_accuracy": 0.75, "test_loss": 1.0})
    out = term.getvalue()
    assert "4/4" in out and "acc=0.7500" in out and out.endswith("\n")
    assert "test_acc" not in out
    p.close()  # idempotent
    assert term.getvalue() == out


def test_progress_bar_resumed_starts_at_the_checkpoint_round(monkeypatch):
    term = _Terminal()
    p = Progress("bar", rounds=10, stream=term, start=6, min_interval_s=0)
    p.update({"round": 7, "test_accuracy": 0.5, "test_loss": 1.0})
    assert "7/10" in term.getvalue().split("\r")[-1]
    p.close()


def test_progress_lines_when_not_a_terminal_and_edgefl_tty_hint(monkeypatch):
    monkeypatch.delenv("EDGEFL_TTY", raising=False)
    pipe = io.StringIO()
    p = Progress("auto", rounds=3, stream=pipe)
    assert p.mode == "lines"
    p.update({"round": 1, "test_accuracy": 0.5, "test_loss": 1.25, "train_loss": 2.0,
              "time_s": 1.5, "wall_time_s": 0.25})  # fmt: skip
    p.update({"round": 2, "train_loss": 1.0, "wall_time_s": 0.5})
    lines = pipe.getvalue().splitlines()
    assert lines == [
        "round    1/3  test_acc 0.5000  test_loss 1.2500  train_loss 2.0000  clock      1.500s"
        "  wall    0.25s",
        "round    2/3  test_acc   -     test_loss   -     train_loss 1.0000  wall    0.50s",
    ]
    p.close()
    assert pipe.getvalue().count("\n") == 2
    monkeypatch.setenv("EDGEFL_TTY", "1")  # `edgefl simulate` on a terminal: mpiexec's pipe
    assert Progress("auto", 3, stream=io.StringIO()).mode == "bar"
    monkeypatch.setenv("EDGEFL_TTY", "0")
    assert Progress("auto", 3, stream=_Terminal()).mode == "lines"
    quiet = io.StringIO()
    Progress("quiet", 3, stream=quiet).update({"round": 1})
    assert quiet.getvalue() == ""


# -- end to end ---------------------------------------------------------------------------
def test_loopback_job_writes_metrics_csv(tmp_path):
    """A small whole job (3 ranks in threads) with output.trackers = ["csv"] and a run
    directory: metrics.csv holds every metrics.jsonl row, per-device columns included."""
    from edgefl.runtime.coordinator import Coordinator

    cfg = load_config(
        None,
        [
            "run.rounds=3",
            "fleet.devices=4",
            'data.source="synthetic"',
            "data.args.dim=10",
            "data.args.classes=3",
            "model.args.hidden=[8]",
            'output.progress="quiet"',
            "output.trackers=['csv']",
            "run.checkpoint_every=0",
        ],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    class WithRunDir(Coordinator):
        def __init__(self, *a, out_dir=None, **k) -> None:
            super().__init__(*a, out_dir=run_dir, **k)

    _, statuses = run_loopback_job(cfg, ranks=3, coordinator_cls=WithRunDir)
    assert statuses[0] == 0
    jsonl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = _read_csv(run_dir / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [r["round"] for r in jsonl] == [1, 2, 3]
    for want, got in zip(jsonl, rows):
        assert float(got["train_loss"]) == pytest.approx(want["train_loss"])
        assert float(got["test_accuracy"]) == pytest.approx(want["test_accuracy"])
        for d, v in want["devices"].items():
            assert int(got[f"device/{d}/bytes_up"]) == v["bytes_up"]
    assert {f"device/{d}/bytes_up" for d in range(4)} <= set(rows[0])
