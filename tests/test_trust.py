"""The trust boundary of a resume (issue 25, F1): a checkpoint's SHA-256 proves the file
intact, not who wrote it, so the code its config names runs only on the user's say-so.

The forged checkpoint of the issue, reproduced from outside: a real run's checkpoint whose
``[data]`` was edited to ``source = "logging:basicConfig"`` with a victim file in its
arguments and sealed again. ``edgefl simulate --resume forged.h5`` (with and without
``--dry-run``) must refuse in one line before anything is imported, called or written: the
victim keeps its bytes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_edgefl, set_args

from edgefl.ckpt import load_checkpoint, save_checkpoint
from edgefl.cli import main
from edgefl.config.code import is_code_spec, named_code
from edgefl.errors import EdgeflError
from edgefl.trust import check_resumed_config, untrusted_values

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TINY = [
    "fleet.devices=4",
    "run.rounds=2",
    "data.args.dim=10",
    "data.args.classes=4",
    "model.args.hidden=[8]",
    "fleet.device=cpu",
    "sim.reference_s_per_sample=0.0001",
    "output.progress=quiet",
]
VICTIM_BYTES = b"precious data\n" * 10


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder (None) below ``root``."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def sets(*extra: str) -> list[str]:
    return set_args(*TINY, *extra)


def forge(ckpt: Path, out: Path, victim: Path) -> Path:
    """F1's forgery: the checkpoint's [data] replaced, the file sealed again."""
    state = load_checkpoint(ckpt)
    text = state["config_toml"]
    i, j = text.index("[data]"), text.index("[model]")
    args = f'{{filename = "{victim}", filemode = "w", force = true}}'
    state["config_toml"] = (
        text[:i] + f'[data]\nsource = "logging:basicConfig"\nargs = {args}\n\n' + text[j:]
    )
    save_checkpoint(out, state)  # a valid trailer: inspect verifies it
    return out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, launcher) -> Path:
    """A real run directory (tiny job over mpiexec, a checkpoint every round)."""
    run = tmp_path_factory.mktemp("trust") / "run"
    proc = run_edgefl("simulate", "--out", str(run), *sets("run.checkpoint_every=1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "checkpoints" / "ckpt-000002.h5").is_file()
    return run


@pytest.fixture
def forged(real_run, tmp_path) -> tuple[Path, Path]:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    ckpt = forge(real_run / "checkpoints" / "ckpt-000002.h5", tmp_path / "forged.h5", victim)
    return ckpt, victim


# -------------------------------------------------------------------- from outside (F1)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "launch"])
def test_forged_checkpoint_runs_nothing(forged, tmp_path, dry_run):
    ckpt, victim = forged
    before = snapshot(tmp_path)
    args = ["simulate", "--resume", "forged.h5", *(["--dry-run"] if dry_run else [])]
    proc = run_edgefl(*args, cwd=tmp_path, timeout=120)
    line = assert_one_line_error(
        proc, "forged.h5", "data.source = 'logging:basicConfig'", "--trust-checkpoint", "CONFIG"
    )
    assert "intact, not who wrote it" in line
    assert victim.read_bytes() == VICTIM_BYTES  # (F1: truncated to 0 bytes before)
    assert snapshot(tmp_path) == before  # nothing written: no run directory either
    assert not (tmp_path / "runs").exists()


def test_forged_newest_checkpoint_of_a_run_directory(forged, real_run, tmp_path):
    """``--resume RUN_DIR`` picks the newest good checkpoint: the forged one, refused."""
    ckpt, victim = forged
    run = tmp_path / "copy"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.toml", "metrics.jsonl", "run_id"):
        (run / name).write_bytes((real_run / name).read_bytes())
    (run / "checkpoints" / "ckpt-000009.h5").write_bytes(ckpt.read_bytes())
    before = snapshot(tmp_path)
    proc = run_edgefl("simulate", "--resume", str(run), cwd=tmp_path, timeout=120)
    assert_one_line_error(proc, "ckpt-000009.h5", "logging:basicConfig")
    assert victim.read_bytes() == VICTIM_BYTES
    assert snapshot(tmp_path) == before


def test_the_config_file_is_the_say_so(forged, real_run, tmp_path):
    """Passing the run's config file explicitly resumes with that file's code (here the
    built-in synthetic data): the forged [data] is never imported."""
    ckpt, victim = forged
    cfg = real_run / "config.toml"
    proc = run_edgefl("simulate", str(cfg), "--resume", str(ckpt), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"--resume {ckpt}" in proc.stdout
    assert victim.read_bytes() == VICTIM_BYTES


def test_trust_checkpoint_hands_over_to_the_user(forged, tmp_path):
    """``--trust-checkpoint`` is the user's say-so: the checkpoint's code runs (and does
    what the forger wanted: the victim is truncated, then the data source fails)."""
    ckpt, victim = forged
    proc = run_edgefl(
        "simulate", "--resume", str(ckpt), "--trust-checkpoint", "--dry-run", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.source 'logging:basicConfig'" in proc.stderr
    assert victim.read_bytes() == b""


def test_inspect_says_integrity_not_origin_and_names_the_code(forged, capsys):
    ckpt, victim = forged
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "sha256 and crc32 verified" in out
    assert "verified proves integrity, not origin" in out
    assert "anyone can edit a checkpoint and seal it again" in out
    assert "its config names code a resume imports and calls: data.source = " in out
    assert "'logging:basicConfig'" in out
    assert victim.read_bytes() == VICTIM_BYTES


def test_inspect_of_a_plain_run_names_no_code(real_run, capsys):
    assert main(["inspect", str(real_run / "checkpoints" / "ckpt-000001.h5")]) == 0
    out = capsys.readouterr().out
    assert "integrity, not origin" in out
    assert "names code" not in out


# -------------------------------------------------------------------- the pure parts


def test_named_code_finds_every_spec_by_its_shape():
    doc = {
        "seed": 1,
        "data": {"source": "pkg.mod:load", "args": {"base": "other:fn", "n": 3, "u": "a b"}},
        "model": {"name": "mlp", "args": {}},
        "train": {"client": "", "loss": "auto", "optimizer": "mine.opt:Adam.make"},
        "algorithm": {"plugins": ["update_stats:UpdateStats", "x.y:Z"]},
        "evaluation": {"metrics": ["évaluer:f1"]},
        "output": {"mlflow_uri": "http://host:5000", "trackers": ["csv"]},
        "sim": {"profiles": "/abs/profiles.toml"},
        "odd": {"time": "12:30", "win": "C:\\data", "spaced": "os :system"},
    }
    assert named_code(doc) == [
        ("data.source", "pkg.mod:load"),
        ("data.args.base", "other:fn"),
        ("train.optimizer", "mine.opt:Adam.make"),
        ("algorithm.plugins[0]", "update_stats:UpdateStats"),
        ("algorithm.plugins[1]", "x.y:Z"),
        ("evaluation.metrics[0]", "évaluer:f1"),
    ]
    assert is_code_spec("__main__:Net") and not is_code_spec("synthetic")
    assert not is_code_spec(3) and not is_code_spec(":f") and not is_code_spec("m:")


def test_named_code_of_the_default_config_is_empty():
    from edgefl.config import dump_config, load_config

    assert named_code(tomllib.loads(dump_config(load_config()))) == []


def test_a_set_key_is_the_users_value(tmp_path):
    doc = {
        "data": {"source": "evil:f", "args": {"base": "evil:g"}},
        "algorithm": {"plugins": ["evil:P"]},
    }
    ck = str(tmp_path / "c.h5")
    assert [k for k, _ in untrusted_values(doc, ck)] == [
        "data.source",
        "data.args.base",
        "algorithm.plugins[0]",
    ]
    got = untrusted_values(doc, ck, ["data.source=synthetic", "algorithm.plugins=[]"])
    assert got == [("data.args.base", "evil:g")]
    assert untrusted_values(doc, ck, ["data=x", "algorithm.plugins=[]"]) == []
    assert untrusted_values(doc, ck, ["data.sourcex=1", "algorithm.plugins=[]"]) != []
    check_resumed_config(doc, ck, trusted=True)  # --trust-checkpoint: no refusal
    with pytest.raises(EdgeflError) as e:
        check_resumed_config(doc, ck)
    assert "\n" not in str(e.value)
    assert "data.source = 'evil:f', data.args.base = 'evil:g'" in str(e.value)


def test_run_out_of_a_checkpoint_needs_the_same_say_so(tmp_path):
    """``run.out`` says where the resume writes; only the checkpoint's own run directory
    (or an explicit --out / --set) passes."""
    run = tmp_path / "run"
    ck = str(run / "checkpoints" / "ckpt-000002.h5")
    assert untrusted_values({"run": {"out": str(run)}}, ck) == []
    assert untrusted_values({"run": {"out": ""}}, ck) == []
    elsewhere = {"run": {"out": str(tmp_path / "victim")}}
    assert untrusted_values(elsewhere, ck) == [("run.out", str(tmp_path / "victim"))]
    assert untrusted_values(elsewhere, ck, out=str(tmp_path / "new")) == []
    assert untrusted_values(elsewhere, ck, [f"run.out={run}"]) == []
    with pytest.raises(EdgeflError, match=re.escape("says where it would write (run.out = ")):
        check_resumed_config(elsewhere, ck)
