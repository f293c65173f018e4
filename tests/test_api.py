"""The Python API (edgefl.simulate, edgefl.Result): the inline backend writes a run
directory like an MPI run and trains the same model; overrides are checked like --set;
objects of __main__ work inline (over MPI they are shipped by value: tests/test_shipped.py);
a __main__ name that names nothing is refused before anything is launched."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from conftest import NOTEBOOK_NET
from golden.configs import CONFIGS, expand, load_models

import edgefl
from edgefl.cli import main
from edgefl.config import load_config, parse_override
from edgefl.config.ranks import usable_cores
from edgefl.config.sources import config_doc, simulation_config
from edgefl.errors import ConfigError
from edgefl.models.flat import FlatParams
from edgefl.runtime.summary import model_sha256

ROOT = Path(__file__).resolve().parent.parent

# a tiny deterministic job: 4 devices on 2 worker ranks, 3 rounds, an 8-unit MLP
TINY = {
    "fleet.devices": 4,
    "fleet.ranks": 3,
    "fleet.device": "cpu",
    "run.rounds": 3,
    "data.args.dim": 10,
    "data.args.classes": 4,
    "model.args.hidden": [8],
    "sim.reference_s_per_sample": 0.0001,
    "output.progress": "quiet",
}


def _boom(grad):
    raise RuntimeError("boom in backward")


class Boom(torch.nn.Module):
    """A model whose backward fails: every worker's first (warm-up) step raises (its
    forward works, so the pre-launch check, which only runs forward, passes)."""

    def __init__(self, info):
        super().__init__()
        self.lin = torch.nn.Linear(10, info.num_classes)

    def forward(self, x):
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(_boom)
        return y


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory) -> edgefl.Result:
    out = tmp_path_factory.mktemp("api") / "inline"
    # the config as nested sections and dotted keys, the rest as overrides
    config = {"fleet": {"devices": 4, "ranks": 3}, "run.rounds": 3}
    return edgefl.simulate(config, overrides=TINY, out=out, backend="inline")


def test_inline_run_result(inline_run):
    r = inline_run
    assert [m["round"] for m in r.metrics] == [1, 2, 3]
    assert r.summary["rounds_done"] == 3 and r.summary["workers"] == 2
    assert r.final_accuracy == r.metrics[-1]["test_accuracy"]
    assert 0.25 < r.final_accuracy <= 1.0  # 4 classes: above chance
    for name in ("config.toml", "metrics.jsonl", "summary.json", "final_model.pt"):
        assert (r.run_dir / name).is_file(), name
    assert (r.run_dir / "checkpoints" / "ckpt-000003.h5").is_file()
    assert (r.run_dir / "exit_status").read_text().strip() == "0"
    assert r.config["fleet"]["devices"] == 4 and r.config["sim"]["clock"] == "virtual"
    model = r.model()
    assert type(model).__name__ == "MLP" and not model.training
    # the returned module holds exactly the final global model
    assert model_sha256(FlatParams(model, "cpu").to_host()) == r.model_sha256
    again = edgefl.Result(r.run_dir)  # an earlier run opened by its directory
    assert again.model_sha256 == r.model_sha256 and again.metrics == r.metrics


@pytest.mark.parametrize("name", ["fedavg_small", "churn_gddr_replay"])
def test_inline_trains_the_recorded_mpi_model(name, tmp_path):
    """tests/golden/models.json holds models trained by edgefl simulate over mpiexec;
    churn_gddr_replay is recorded over MPI only (it needs the workers' run directory)."""
    overrides = dict(parse_override(s) for s in expand(CONFIGS[name]))
    r = edgefl.simulate(overrides=overrides, out=tmp_path / "run", backend="inline")
    assert r.model_sha256 == load_models()[name]["model_sha256"]


@pytest.mark.mpi
def test_inline_and_mpi_give_the_same_model(inline_run, tmp_path, launcher, capsys):
    config = {"fleet": {"devices": 4, "ranks": 3}, "run.rounds": 3}
    for attempt in range(3):  # Open MPI sometimes fails to start at all (conftest.py)
        try:
            r = edgefl.simulate(config, overrides=TINY, out=tmp_path / f"mpi{attempt}")
            break
        except edgefl.RunFailed:
            if "PMIx server's listener" not in capsys.readouterr().err or attempt == 2:
                raise
    assert "edgefl simulate: 4 devices on 2 worker ranks" in capsys.readouterr().out
    assert r.model_sha256 == inline_run.model_sha256
    assert [m["test_accuracy"] for m in r.metrics] == [
        m["test_accuracy"] for m in inline_run.metrics
    ]


@pytest.mark.parametrize(
    "key, value, set_text",
    [
        ("fleet.devicez", 4, "4"),  # unknown key (with a suggestion)
        ("fleet.devices", "four", "four"),  # wrong type
        ("fleet.devices", 0, "0"),  # out of range
        ("fleet", 3, "3"),  # a section
        ("algorithm.consistency", "bogus", "bogus"),  # not one of the choices
    ],
)
def test_overrides_are_checked_like_set(key, value, set_text, tmp_path):
    with pytest.raises(ConfigError) as cli:
        load_config(None, [f"{key}={set_text}"])
    with pytest.raises(ConfigError) as api:
        edgefl.simulate(overrides={key: value}, out=tmp_path / "run", backend="inline")
    assert str(api.value) == str(cli.value)
    assert key.split(".")[-1] in str(api.value)
    assert not (tmp_path / "run").exists()  # nothing started


def test_bad_override_values_and_backend(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="'run.rounds' = None: expected a string"):
        edgefl.simulate(overrides={"run.rounds": None}, out=out, backend="inline")
    with pytest.raises(ValueError, match="backend='threads': expected one of 'mpi', 'inline'"):
        edgefl.simulate(out=out, backend="threads")
    assert not out.exists()


def test_config_dict_forms():
    nested = config_doc({"fleet": {"devices": 3}, "run.rounds": 2, "data.args": {"dim": 7}})
    cfg, ranks = simulation_config(None, [], doc=nested)
    want, _ = simulation_config(None, ["fleet.devices=3", "run.rounds=2", "data.args.dim=7"])
    # fleet.ranks = auto: a worker per core, capped at devices + 1
    assert cfg == want and ranks == min(1 + usable_cores(), 4)
    assert config_doc({"model.name": Boom}) == {"model": {"name": "test_api:Boom"}}
    with pytest.raises(ConfigError, match="'fleet.devices' is given twice"):
        config_doc({"fleet.devices": 3, "fleet": {"devices": 4}})


def test_failed_run_raises_run_failed(tmp_path):
    sets = {**TINY, "model.name": Boom, "model.args": {}}
    with pytest.raises(edgefl.RunFailed) as e:
        edgefl.simulate(overrides=sets, out=tmp_path / "run", backend="inline")
    assert e.value.status == 2 and e.value.run_dir == tmp_path / "run"
    assert "exit status 2" in str(e.value) and "boom in backward" in str(e.value)
    assert (tmp_path / "run" / "exit_status").read_text().strip() == "2"


def test_default_run_directories_do_not_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quick = {**TINY, "run.rounds": 1, "fleet.devices": 2}
    dirs = [edgefl.simulate(overrides=quick, backend="inline").run_dir for _ in range(2)]
    assert dirs[0] != dirs[1] and all(d.parent == Path("runs") for d in dirs)
    assert dirs[0].name.endswith("-default") and dirs[1].name.endswith(("-default", "-2"))


def _refuses(tmp_path, monkeypatch, overrides: dict, key: str) -> None:
    import edgefl.launcher

    def no_launch(*a, **k):
        raise AssertionError("mpiexec was looked up: the refusal came too late")

    monkeypatch.setattr(edgefl.launcher, "find_mpiexec", no_launch)
    with pytest.raises(ConfigError) as e:
        edgefl.simulate(overrides={**TINY, **overrides}, out=tmp_path / "run", backend="mpi")
    text = str(e.value)
    assert f"config key '{key}'" in text and "__main__ has no" in text and "\n" not in text
    assert not (tmp_path / "run").exists()


def test_main_names_of_nothing_refused_for_mpi_before_launch(tmp_path, monkeypatch):
    # (a __main__ object that exists is shipped by value: tests/test_shipped.py)
    _refuses(tmp_path, monkeypatch, {"model.name": "__main__:Net"}, "model.name")
    _refuses(
        tmp_path, monkeypatch, {"algorithm.plugins": ["__main__:Mine"]}, "algorithm.plugins[0]"
    )


def test_cli_refuses_main_specs(capsys):
    status = main(["simulate", "--set", "model.name=__main__:Net", "--dry-run"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith("edgefl: error: config key 'model.name' = '__main__:Net': the MPI")
    assert err.count("\n") == 1


SCRIPT = (
    """
import json, sys
import torch
import edgefl
"""
    + NOTEBOOK_NET
    + """

sets = {**json.loads(sys.argv[2]), "model.name": Net, "model.args": {"width": 6}}
r = edgefl.simulate(overrides=sets, out=sys.argv[1], backend="inline")
print(json.dumps({"rounds": len(r.metrics), "is_net": isinstance(r.model(), Net),
                  "name": r.config["model"]["name"]}))
"""
)


def test_main_object_works_inline_from_a_script(tmp_path):
    script = tmp_path / "train_it.py"
    script.write_text(textwrap.dedent(SCRIPT))
    sets = {k: v for k, v in TINY.items() if k != "model.args.hidden"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run"), json.dumps(sets)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rounds"] == 3 and got["is_net"] and got["name"] == "__main__:Net"


def test_metrics_frame(inline_run, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with pytest.raises(
        ImportError, match=r"^Result.metrics_frame\(\) needs pandas: pip install pandas$"
    ):
        inline_run.metrics_frame()
    fake = types.ModuleType("pandas")
    fake.DataFrame = lambda rows: ("frame", rows)
    monkeypatch.setitem(sys.modules, "pandas", fake)
    assert inline_run.metrics_frame(flat=False) == ("frame", inline_run.metrics)
    _, rows = inline_run.metrics_frame()  # flat: the csv tracker's columns
    assert len(rows) == len(inline_run.metrics)
    for row, raw in zip(rows, inline_run.metrics):
        assert not any(isinstance(v, dict) for v in row.values())
        for d, counters in raw["devices"].items():
            assert row[f"device/{d}/bytes_up"] == counters["bytes_up"]
    from edgefl.runtime.trackers import CsvTracker

    csv_cols = CsvTracker(tmp_path / "metrics.csv", inline_run.metrics).columns
    assert set(rows[-1]) <= set(csv_cols)  # the same names as the csv tracker's


def test_import_edgefl_stays_cheap():
    code = (
        "import sys, edgefl; heavy = [m for m in ('torch', 'numpy', 'edgefl.api') "
        "if m in sys.modules]; edgefl.simulate; print(heavy, 'edgefl.api' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "[] True", proc.stderr
    with pytest.raises(AttributeError, match="no attribute 'simulat'"):
        edgefl.simulat  # noqa: B018


def test_rows_so_far_reads_a_running_runs_rows_without_the_cut_off_line(tmp_path):
    from edgefl.api import Result

    assert Result.rows_so_far(tmp_path) == []  # nothing written yet
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert Result.rows_so_far(tmp_path) == [{"round": 1}, {"round": 2}]
    (tmp_path / "metrics.jsonl").write_bytes(b'{"round": 1}\n\xff\xfe')
    assert Result.rows_so_far(tmp_path) == []  # (not text: nothing to read yet)
