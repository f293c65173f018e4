"""Configuration: defaults, TOML round trip, --set overrides, validation messages, docs page."""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from edgefl.config import (
    SCHEMA,
    config_from_toml,
    defaults,
    dump_config,
    iter_fields,
    load_config,
    parse_override,
)
from edgefl.config.docs import reference_markdown
from edgefl.config.schema import DEFAULT_ARGS, Field
from edgefl.errors import ConfigError, EdgeflError

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "configuration.md"


def config_error(*, path=None, overrides=(), doc=None) -> str:
    """The message of the ConfigError that loading raises (fails if none is raised)."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), doc=doc)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ------------------------------------------------------------------------- defaults, dumps


def test_defaults_load():
    cfg = load_config()
    expected = defaults()
    expected["data"]["args"] = DEFAULT_ARGS["data"]["synthetic"]
    expected["model"]["args"] = DEFAULT_ARGS["model"]["mlp"]
    assert cfg == expected
    assert cfg["data"]["source"] == "synthetic" and cfg["model"]["name"] == "mlp"
    assert cfg["run"]["rounds"] == 20 and cfg["fleet"]["ranks"] == "auto"
    assert isinstance(cfg["train"]["lr"], float)
    # every schema key is present, with the schema's type
    for path, f in iter_fields():
        node = cfg
        for part in path.split("."):
            node = node[part]
        if f.type == "float":
            assert (f.auto and node == "auto") or isinstance(node, float), path
        elif f.type == "int":
            auto = f.auto and node == "auto"
            assert auto or (isinstance(node, int) and not isinstance(node, bool)), path


def test_defaults_are_fresh_copies():
    a, b = load_config(), load_config()
    a["data"]["args"]["alpha"] = 99.0
    a["debug"]["inject"].append("duplicate")
    assert b["data"]["args"]["alpha"] == 0.5 and b["debug"]["inject"] == []
    assert DEFAULT_ARGS["data"]["synthetic"]["alpha"] == 0.5
    assert load_config() == b


def test_dump_round_trips_defaults():
    cfg = load_config()
    text = dump_config(cfg)
    tomllib.loads(text)  # valid TOML
    assert config_from_toml(text) == cfg


def test_dump_round_trips_non_defaults(tmp_path):
    path = write(
        tmp_path,
        """
seed = 7
[run]
rounds = 3
out = 'C:\\runs\\"x"'
[fleet]
devices = 4
device_map = {"0" = "cpu", "3" = "cuda:1"}
[data]
source = "fedh5"
[data.args]
path = "a b/é.h5"
"odd.key" = 1
nested = {m = [1, 2], e = []}
tab = "a\\tb"
nl = "x\\ny"
[model]
name = "logreg"
[train]
lr = 1e-7
weight_decay = 1e300
[debug]
inject = ["duplicate", "bad-kind"]
""",
    )
    cfg = load_config(path)
    assert cfg["model"]["args"] == {}  # logreg has no DEFAULT_ARGS
    assert cfg["data"]["args"]["nl"] == "x\ny"
    again = config_from_toml(dump_config(cfg))
    assert again == cfg
    assert dump_config(again) == dump_config(cfg)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(
            {"sep": "a\rb"},
            id="carriage-return",
        ),
        pytest.param(
            {"sep": "a\x01b"},
            id="control-char",
        ),
        pytest.param(
            {"é": 1},
            id="non-ascii-key",
        ),
    ],
)
def test_dump_round_trips_awkward_free_table_values(args):
    """Anything a TOML file can put in a free table must survive dump -> load (run
    directories and checkpoints store the config as dumped TOML)."""
    cfg = load_config(doc={"data": {"args": args}})
    assert config_from_toml(dump_config(cfg)) == cfg


# ------------------------------------------------------------------------- overrides


def test_dates_in_free_tables_are_rejected_not_crashing_later():
    msg = config_error(doc={"data": {"args": {"day": datetime.date(2020, 1, 1)}}})
    assert "data.args" in msg and "date" in msg


def test_set_overrides_each_type():
    cfg = load_config(
        overrides=[
            "run.rounds=7",
            "train.lr=0.3",
            "train.momentum=1",  # an integer is accepted for a float
            "output.progress=quiet",  # not TOML: read as a string
            'algorithm.aggregation="mean"',
            'debug.inject=["duplicate", "bad-kind"]',
            "model.args.hidden=[128,64]",
            "seed = 3",  # spaces around '=' are fine
        ]
    )
    assert cfg["run"]["rounds"] == 7
    assert cfg["train"]["lr"] == 0.3
    assert cfg["train"]["momentum"] == 1.0 and isinstance(cfg["train"]["momentum"], float)
    assert cfg["output"]["progress"] == "quiet"
    assert cfg["algorithm"]["aggregation"] == "mean"
    assert cfg["debug"]["inject"] == ["duplicate", "bad-kind"]
    assert cfg["model"]["args"] == {"hidden": [128, 64]}
    assert cfg["seed"] == 3
    # untouched keys keep their defaults
    assert cfg["fleet"] == load_config()["fleet"]


def test_set_overrides_win_over_file(tmp_path):
    path = write(tmp_path, "[train]\nlr = 0.2\nbatch_size = 8\n")
    cfg = load_config(path, ["train.lr=0.4"])
    assert cfg["train"]["lr"] == 0.4 and cfg["train"]["batch_size"] == 8
    # later overrides win over earlier ones
    assert load_config(overrides=["run.rounds=2", "run.rounds=9"])["run"]["rounds"] == 9


def test_set_key_inside_free_table_keeps_other_default_args():
    cfg = load_config(overrides=["data.args.alpha=0.3"])
    assert cfg["data"]["args"] == {**DEFAULT_ARGS["data"]["synthetic"], "alpha": 0.3}
    cfg = load_config(overrides=["data.args.extra.depth=2"])
    assert cfg["data"]["args"]["extra"] == {"depth": 2}
    assert cfg["data"]["args"]["dim"] == 60


def test_set_key_inside_table_given_by_file(tmp_path):
    """Keys an explicit [data.args] gives win; the rest keep edgefl's defaults for the
    source (the same whether the key comes from a file or from --set)."""
    path = write(tmp_path, "[data.args]\ndim = 5\n")
    base = {"alpha": 0.5, "beta": 0.5, "classes": 10}
    assert load_config(path)["data"]["args"] == {**base, "dim": 5}
    assert load_config(path, ["data.args.alpha=1"])["data"]["args"] == {
        **base,
        "dim": 5,
        "alpha": 1,
    }
    assert load_config(overrides=["data.args.dim=5"])["data"]["args"] == {**base, "dim": 5}


def test_set_source_without_args_gives_empty_args():
    cfg = load_config(overrides=["data.source=fedh5"])
    assert cfg["data"] == {"source": "fedh5", "args": {}}
    cfg = load_config(overrides=["data.source=fedh5", "data.args.path=x.h5"])
    assert cfg["data"]["args"] == {"path": "x.h5"}
    cfg = load_config(overrides=["model.name=cnn"])
    assert cfg["model"]["args"] == {}


def test_source_in_file_without_args_gives_empty_args(tmp_path):
    path = write(tmp_path, '[data]\nsource = "fedh5"\n[model]\nname = "logreg"\n')
    cfg = load_config(path)
    assert cfg["data"]["args"] == {} and cfg["model"]["args"] == {}
    # and back to the named default when an override names the built-in again
    cfg = load_config(path, ["data.source=synthetic"])
    assert cfg["data"]["args"] == DEFAULT_ARGS["data"]["synthetic"]


def test_parse_override():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a.b = [1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=x=y") == ("a", "x=y")
    assert parse_override("a=cuda:0") == ("a", "cuda:0")
    assert parse_override("a=") == ("a", "")


# ------------------------------------------------------------------------- errors


def test_errors_are_edgefl_errors():
    assert issubclass(ConfigError, EdgeflError)


@pytest.mark.parametrize(
    "override, typo, suggestion",
    [
        ("train.lrr=1", "train.lrr", "train.lr"),
        ("trian.lr=1", "trian.lr", "train.lr"),
        ("run.round=3", "run.round", "run.rounds"),
        ("fleet.devics=3", "fleet.devics", "fleet.devices"),
    ],
)
def test_unknown_key_suggests_closest(override, typo, suggestion):
    msg = config_error(overrides=[override])
    assert f"'{typo}'" in msg and "unknown key" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    path = write(tmp_path, "[train]\nlrr = 0.1\n")
    msg = config_error(path=path)
    assert "'train.lrr'" in msg and str(path) in msg and "did you mean 'train.lr'" in msg
    path = write(tmp_path, "[trian]\nlr = 0.1\n", "b.toml")
    msg = config_error(path=path)
    assert "'trian" in msg and "did you mean 'train" in msg and str(path) in msg
    path = write(tmp_path, "rounds = 3\n", "c.toml")
    msg = config_error(path=path)
    assert "'rounds'" in msg and "did you mean 'run.rounds'" in msg


def test_unknown_key_below_a_scalar():
    msg = config_error(overrides=["seed.x=1"])
    assert "'seed.x'" in msg and "unknown key" in msg


@pytest.mark.parametrize(
    "override, key, value, expect",
    [
        ("run.rounds=ten", "run.rounds", "'ten'", "an integer"),
        ("run.rounds=2.0", "run.rounds", "2.0", "an integer"),
        ("train.lr=fast", "train.lr", "'fast'", "a number"),
        ("train.lr=nan", "train.lr", "nan", "a finite number"),
        ("output.progress=3", "output.progress", "3", "a string"),
        ("data.args=5", "data.args", "5", "a table"),
        ("debug.inject=[1]", "debug.inject", "[1]", "a list of strings"),
        ("fleet.device_map=[]", "fleet.device_map", "[]", "a table"),
    ],
)
def test_wrong_type_names_key_value_and_expectation(override, key, value, expect):
    msg = config_error(overrides=[override])
    assert f"'{key}' = {value}" in msg
    assert f"expected {expect}" in msg


def test_wrong_type_in_file_names_file(tmp_path):
    path = write(tmp_path, '[run]\nrounds = "ten"\n')
    msg = config_error(path=path)
    assert "'run.rounds' = 'ten'" in msg and str(path) in msg and "expected an integer" in msg


@pytest.mark.parametrize(
    "override, key, expect",
    [
        ("seed=true", "seed", "an integer"),
        ("run.rounds=true", "run.rounds", "an integer"),
        ("comm.chunk_bytes=false", "comm.chunk_bytes", "an integer"),
        ("train.lr=true", "train.lr", "a number"),
    ],
)
def test_bool_is_not_a_number(override, key, expect):
    msg = config_error(overrides=[override])
    assert f"'{key}' = {override.split('=')[1].title()}" in msg
    assert f"expected {expect}" in msg


def test_bool_is_not_an_integer_in_file(tmp_path):
    path = write(tmp_path, "seed = true\n")
    msg = config_error(path=path)
    assert "'seed' = True" in msg and "expected an integer" in msg


def test_int_list_rejects_bools():
    from edgefl.config.load import _check_value

    f = Field([], "list[int]", "x")
    assert _check_value("k", f, [1, 2], None) == [1, 2]
    with pytest.raises(ConfigError, match="a list of integers"):
        _check_value("k", f, [1, True], None)


@pytest.mark.parametrize(
    "override, expect",
    [
        ("run.rounds=0", "expected a value >= 1"),
        ("server.participation=0", "expected a value > 0"),
        ("server.participation=1.5", "expected a value <= 1"),
        ("train.lr=-1", "expected a value > 0"),
        ("train.lr=0", "expected a value > 0"),
        ("train.momentum=-0.1", "expected a value >= 0"),
        ("fleet.ranks=1", "expected a value >= 2"),
        ("comm.chunk_bytes=1023", "expected a value >= 1024"),
        ("comm.chunk_bytes=2147483648", "expected a value <= 2.14748e+09"),
        ("seed=-1", "expected a value >= 0"),
    ],
)
def test_out_of_range(override, expect):
    key = override.split("=")[0]
    msg = config_error(overrides=[override])
    assert f"'{key}' = " in msg and expect in msg


def test_range_edges_are_accepted():
    cfg = load_config(
        overrides=[
            "run.rounds=1",
            "server.participation=1",
            "train.momentum=0",
            "comm.chunk_bytes=1024",
            "fleet.ranks=2",
            "run.checkpoint_every=0",
        ]
    )
    assert cfg["server"]["participation"] == 1.0 and cfg["comm"]["chunk_bytes"] == 1024


def test_bad_choice():
    msg = config_error(overrides=['algorithm.aggregation="bogus"'])
    assert "'algorithm.aggregation' = 'bogus'" in msg
    assert "one of sample-weighted, mean, loss-weighted" in msg
    msg = config_error(overrides=['debug.inject=["duplicate", "nope"]'])
    assert "'debug.inject'" in msg and "bad-kind" in msg


def test_section_given_a_scalar(tmp_path):
    msg = config_error(doc={"run": 5})
    assert "'run' = 5" in msg and "expected a table [run]" in msg
    path = write(tmp_path, "train = 0.1\n")
    msg = config_error(path=path)
    assert "'train' = 0.1" in msg and "[train]" in msg and str(path) in msg
    msg = config_error(overrides=["run=5"])
    assert "'run'" in msg and "section" in msg


@pytest.mark.parametrize("text", ["train.lr", "train.lr 0.1", ""])
def test_set_without_equals(text):
    msg = config_error(overrides=[text])
    assert "expected KEY=VALUE" in msg and repr(text) in msg


def test_set_with_empty_key():
    assert "empty key" in config_error(overrides=["=1"])


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    msg = config_error(path=missing)
    assert str(missing) in msg and "not found" in msg
    msg = config_error(path=tmp_path)  # a folder is not a config file
    assert str(tmp_path) in msg


def test_invalid_toml_names_file(tmp_path):
    path = write(tmp_path, "[train\nlr = 0.1\n")
    msg = config_error(path=path)
    assert str(path) in msg and "invalid TOML" in msg
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    msg = config_error(path=path)
    assert str(path) in msg and "UTF-8" in msg


def test_config_from_toml_invalid_names_source():
    with pytest.raises(ConfigError) as info:
        config_from_toml("x = [", source="ckpt-000003.h5")
    assert "ckpt-000003.h5" in str(info.value) and "invalid TOML" in str(info.value)
    with pytest.raises(ConfigError, match="train.lrr"):
        config_from_toml("[train]\nlrr = 1\n")


@pytest.mark.parametrize("device", ["tpu", "cuda:", "cuda:x", "CPU", "gpu"])
def test_bad_fleet_device(device):
    msg = config_error(overrides=[f'fleet.device="{device}"'])
    assert f"'fleet.device' = {device!r}" in msg and "auto, cpu, cuda or cuda:N" in msg


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_good_fleet_device(device):
    assert load_config(overrides=[f'fleet.device="{device}"'])["fleet"]["device"] == device


def test_device_map_device_out_of_range():
    msg = config_error(overrides=['fleet.device_map={"8" = "cpu"}'])
    assert "'fleet.device_map'" in msg and "'8'" in msg and "0..7" in msg
    msg = config_error(overrides=["fleet.devices=2", 'fleet.device_map.2="cpu"'])
    assert "'2'" in msg and "0..1" in msg
    msg = config_error(overrides=['fleet.device_map.x="cpu"'])
    assert "'x'" in msg
    msg = config_error(overrides=['fleet.device_map.0="tpu"'])
    assert "'fleet.device_map.0' = 'tpu'" in msg
    cfg = load_config(overrides=['fleet.device_map.7="cuda:1"', 'fleet.device_map.0="cpu"'])
    assert cfg["fleet"]["device_map"] == {"7": "cuda:1", "0": "cpu"}


def test_device_map_value_cuda_without_number():
    config_error(overrides=['fleet.device_map.0="cuda:x"'])


def test_set_below_a_scalar_inside_free_table():
    msg = config_error(overrides=["data.args.alpha.x=1"])
    assert "data.args" in msg


# ------------------------------------------------------------------------- reference page


def test_docs_page_is_current():
    assert DOCS_PAGE.is_file(), (
        f"{DOCS_PAGE} is missing; generate it: edgefl config docs > docs/configuration.md"
    )
    assert DOCS_PAGE.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/configuration.md is stale; regenerate: edgefl config docs > docs/configuration.md"
    )


def _page_rows(page: str) -> dict[str, list[str]]:
    """{dotted key: table cells} from the reference page."""
    rows: dict[str, list[str]] = {}
    section = None
    for line in page.splitlines():
        m = re.match(r"^## (?:\[(?P<name>[\w.]+)\]|\(top level\))\s*$", line)
        if m:
            section = m.group("name")
            continue
        if line.startswith("## "):
            section = "<other>"
            continue
        m = re.match(r"^\| `(?P<key>[^`]+)` \|", line)
        if m and section != "<other>":
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            key = m.group("key") if section is None else f"{section}.{m.group('key')}"
            assert key not in rows, f"{key} listed twice"
            rows[key] = cells
    return rows


def test_every_schema_key_is_documented():
    page = reference_markdown()
    rows = _page_rows(page)
    fields = dict(iter_fields())
    assert set(rows) == set(fields)
    for path, f in fields.items():
        cells = rows[path]
        assert cells[1] == f.type, path
        assert f.doc in cells[4], path
        if f.choices:
            for choice in f.choices:
                assert choice in cells[3], path
    for section, table in DEFAULT_ARGS.items():
        for name in table:
            assert f"`{section}` `{name}`" in page
    # each section of the schema has its own table
    for name, spec in SCHEMA.items():
        if not isinstance(spec, Field):
            assert f"\n## [{name}]\n" in page


def test_ranks_auto_fits_the_cores_and_the_devices():
    """fleet.ranks = "auto" (the default): the coordinator, the server shards and one
    worker per usable core, never more workers than devices; a number is kept."""
    from edgefl.config.ranks import rank_count, usable_cores

    cfg = load_config()
    assert rank_count(cfg, cores=2) == 3
    assert rank_count(cfg, cores=16) == 9  # (8 devices)
    assert rank_count(load_config(None, ["ps.servers=2", "fleet.devices=4"]), cores=3) == 6
    assert rank_count(load_config(None, ["fleet.ranks=4"]), cores=64) == 4
    assert rank_count(load_config(None, ["fleet.ranks=12"])) == 9
    assert rank_count(cfg) == 1 + min(8, usable_cores())
    with pytest.raises(ConfigError, match='expected an integer or "auto"'):
        load_config(None, ["fleet.ranks=many"])


def test_the_banner_says_why_the_job_has_its_ranks():
    """The launch banner's reason: auto (one per core), a number, the device cap, and a
    warning when the worker processes are more than the cores."""
    from edgefl.config.ranks import rank_count, rank_reason

    def why(sets, cores):
        cfg = load_config(None, sets)
        return rank_reason(cfg, rank_count(cfg, cores=cores), cores=cores)

    assert why([], 2) == "one worker rank per core"
    assert why([], 16) == "one worker rank per core, at most one per device"
    assert why(["fleet.ranks=3"], 2) == "fleet.ranks = 3"
    assert why(["fleet.ranks=12"], 64) == "fleet.ranks = 12, at most one per device"
    assert why(["fleet.ranks=5"], 2) == (
        "fleet.ranks = 5; 4 worker processes on 2 cores: oversubscribed, slower rounds"
        " (fewer fleet.ranks, or --backend inline)"
    )
