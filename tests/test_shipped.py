"""Objects passed by value to the MPI ranks (edgefl/shipped.py): what is shipped and under
which names, the trust boundary (only the launcher's own payload, with the digest it gave,
is ever unpickled; a tampered payload, a checkpoint's or a config file's naming, a peer's
message carrying a pickle are refused) and, over real MPI, that notebook objects train
exactly the model the inline backend trains."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import re
import stat
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NOTEBOOK_NET, run_launch

import edgefl
from edgefl import shipped
from edgefl.cli import main
from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import Kind, Validator, encode_header
from edgefl.config import load_config
from edgefl.errors import ConfigError, EdgeflError
from edgefl.runtime import devstate
from edgefl.shipped import PREFIX, SHIPPED_ENV, ObjectTable, load_on_rank, registered

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "fleet.devices": 4,
    "fleet.ranks": 3,
    "fleet.device": "cpu",
    "run.rounds": 2,
    "data.args.dim": 10,
    "data.args.classes": 4,
    "sim.reference_s_per_sample": 0.0001,
    "output.progress": "quiet",
}


class Importable(torch.nn.Module):
    """A model the ranks import by name (``test_shipped:Importable``)."""

    def __init__(self, info):
        super().__init__()
        self.lin = torch.nn.Linear(info.input_shape[0], info.num_classes)

    def forward(self, x):
        return self.lin(x)


def write_marker(path: str) -> str:
    """What a malicious pickle runs when loaded: it writes ``path``."""
    Path(path).write_text("unpickled!")
    return path


class Evil:
    """An object whose unpickling writes a file (``__reduce__``)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (write_marker, (self.path,))


def _local_objects():
    """A class and a function defined inside a function: no name the ranks can import."""

    class Net(torch.nn.Module):
        def __init__(self, info, width=6):
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(info.input_shape[0], width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, info.num_classes),
            )

        def forward(self, x):
            return self.body(x)

    def loss(output, target):
        return torch.nn.functional.cross_entropy(output, target)

    return Net, loss


@pytest.fixture
def fresh_namespace(monkeypatch):
    """This process as a rank that has loaded nothing yet (restored afterwards)."""
    monkeypatch.delitem(sys.modules, shipped.MODULE, raising=False)
    monkeypatch.setattr(shipped, "_manifest", {})
    monkeypatch.setattr(shipped, "_loaded", set())


def _shipment(tmp_path):
    net, loss = _local_objects()
    table = ObjectTable()
    doc = table.take({"model": {"name": net}, "train": {"loss": loss}})
    cfg, shipment = table.ship(doc)
    return cfg, shipment


# -- names ------------------------------------------------------------------------------
def test_take_names_what_the_ranks_can_import_and_ships_the_rest():
    net, loss = _local_objects()
    part = functools.partial(loss)
    table = ObjectTable()
    got = table.take(
        {
            "model.name": Importable,
            "train": {"loss": loss},
            "evaluation.metrics": [part, lambda o, t: o, loss],
            "run.rounds": 3,
            "data.source": "synthetic",
        }
    )
    assert got["model.name"] == "test_shipped:Importable"  # by name, as before
    assert got["train"]["loss"] == PREFIX + "local_objects_locals_loss"
    assert got["evaluation.metrics"] == [
        PREFIX + "local_objects_locals_loss_partial",
        PREFIX + "test_take_names_what_the_ranks_can_import_and_ships_the_rest_locals_lambda",
        PREFIX + "local_objects_locals_loss",  # the same object: the same name
    ]
    assert got["run.rounds"] == 3 and got["data.source"] == "synthetic"
    # two objects with one qualname get two names
    other_net, _ = _local_objects()
    names = ObjectTable().take([net, other_net])
    assert names == [PREFIX + "local_objects_locals_Net", PREFIX + "local_objects_locals_Net_2"]


def test_ship_pickles_by_value_registers_and_renames(tmp_path):
    cfg, shipment = _shipment(tmp_path)
    name = "local_objects_locals_Net"
    assert cfg["model"]["name"] == PREFIX + name
    assert shipment.digest == hashlib.sha256(shipment.payload).hexdigest()
    content = pickle.loads(shipment.payload)  # (this test's own payload)
    assert content["format"] == shipped.FORMAT and set(content["objects"]) == {
        name,
        "local_objects_locals_loss",
    }
    assert "class _local_objects.<locals>.Net of test_shipped" == content["origins"][name]
    # registered here too: the pre-launch check and Result.model() resolve the spec
    assert registered(name) is not None
    note = shipped.config_note(cfg)
    assert f"model.name = '{PREFIX}{name}': class" in note and shipment.digest in note
    assert all(line.startswith("#") for line in note.splitlines())
    assert ObjectTable().ship({"model": {"name": "mlp"}})[1].payload == b""  # nothing to ship


def test_a_main_name_that_main_lacks_is_refused_before_launch(tmp_path, monkeypatch):
    import edgefl.launcher

    def no_launch(*a, **k):
        raise AssertionError("mpiexec was looked up: the refusal came too late")

    monkeypatch.setattr(edgefl.launcher, "find_mpiexec", no_launch)
    with pytest.raises(ConfigError) as e:
        edgefl.simulate(
            overrides={**TINY, "algorithm.plugins": ["__main__:Mine"]},
            out=tmp_path / "run",
            backend="mpi",
        )
    assert str(e.value) == (
        "config key 'algorithm.plugins[0]' = '__main__:Mine': __main__ has no 'Mine'"
    )
    assert not (tmp_path / "run").exists()


def test_what_cloudpickle_cannot_serialize_is_one_line_naming_the_key(tmp_path, monkeypatch):
    import edgefl.launcher

    monkeypatch.setattr(edgefl.launcher, "find_mpiexec", lambda: pytest.fail("launched"))
    lock = threading.Lock()

    def locked_loss(output, target):
        with lock:
            return torch.nn.functional.cross_entropy(output, target)

    with pytest.raises(ConfigError) as e:
        edgefl.simulate(
            overrides={**TINY, "train.loss": locked_loss}, out=tmp_path / "run", backend="mpi"
        )
    text = str(e.value)
    assert "\n" not in text and text.startswith("config key 'train.loss': cloudpickle cannot")
    assert "locked_loss" in text and "lock" in text and 'backend="inline"' in text
    assert not (tmp_path / "run").exists()


# -- the ranks' side: only the launcher's payload, digest checked first ---------------------
def test_staged_payload_is_private_and_gone_after_the_launch(tmp_path):
    _, shipment = _shipment(tmp_path)
    with shipment.staged(tmp_path) as env:
        digest, _, path = env[SHIPPED_ENV].partition(":")
        assert digest == shipment.digest and Path(path) == tmp_path / shipped.PAYLOAD_FILE
        assert Path(path).read_bytes() == shipment.payload
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not Path(path).exists()


def test_a_rank_loads_the_launchers_payload(tmp_path, fresh_namespace):
    net, loss = _local_objects()
    table = ObjectTable()
    cfg, shipment = table.ship(table.take({"model": {"name": net}, "train": {"loss": loss}}))
    sys.modules.pop(shipped.MODULE)  # (ship registered them here: a rank has none)
    with shipment.staged(tmp_path) as env:
        load_on_rank(cfg, env)
    loaded = registered("local_objects_locals_Net")
    assert isinstance(loaded, type) and issubclass(loaded, torch.nn.Module)
    out = loaded(type("Info", (), {"input_shape": (3,), "num_classes": 2})())(torch.ones(1, 3))
    assert out.shape == (1, 2)
    assert shipment.digest in shipped.config_note(cfg)


def test_a_tampered_payload_is_refused_and_never_unpickled(tmp_path, fresh_namespace):
    cfg, shipment = _shipment(tmp_path)
    sys.modules.pop(shipped.MODULE)  # (ship registered them here: a rank has none)
    marker = tmp_path / "pwned"
    with shipment.staged(tmp_path) as env:
        path = Path(env[SHIPPED_ENV].partition(":")[2])
        path.write_bytes(pickle.dumps(Evil(marker)))  # replaced after the launcher wrote it
        with pytest.raises(EdgeflError) as e:
            load_on_rank(cfg, env)
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"refusing to unpickle '{path}'")
        assert shipment.digest in text and hashlib.sha256(path.read_bytes()).hexdigest() in text
        path.write_bytes(shipment.payload[:-1] + b"\0")  # one byte changed
        with pytest.raises(EdgeflError, match="^refusing to unpickle"):
            load_on_rank(cfg, env)
    assert not marker.exists()
    assert registered("local_objects_locals_Net") is None
    pickle.loads(pickle.dumps(Evil(tmp_path / "control")))  # (the blob does what it says)
    assert (tmp_path / "control").exists()


def test_a_rank_without_its_launchers_payload_refuses(tmp_path, fresh_namespace):
    cfg, shipment = _shipment(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_on_rank(cfg, {})  # a hand-started job, a resume: no launcher shipped anything
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"config key 'model.name' = '{PREFIX}")
    assert "edgefl.simulate()" in text and "never unpickles" in text
    with pytest.raises(EdgeflError, match=f"^{SHIPPED_ENV}="):
        load_on_rank(cfg, {SHIPPED_ENV: f"abc:{tmp_path / 'x'}"})
    load_on_rank({"model": {"name": "mlp"}}, {})  # nothing shipped: nothing needed


def test_the_namespace_says_why_where_nothing_was_shipped(fresh_namespace):
    import importlib

    with pytest.raises(ImportError, match="exist only in the Python session that launched"):
        importlib.import_module(shipped.MODULE)


def test_inline_local_objects_and_the_cli_refuses_to_resume_them(tmp_path, capsys):
    net, loss = _local_objects()
    out = tmp_path / "run"
    r = edgefl.simulate(
        overrides={**TINY, "model.name": net, "train.loss": loss}, out=out, backend="inline"
    )
    assert r.config["model"]["name"] == PREFIX + "local_objects_locals_Net"
    assert isinstance(r.model(), net)  # (registered in this process)
    text = (out / "config.toml").read_text()
    assert text.startswith("# Objects edgefl.simulate() passed by value")
    assert "registered in the launching process" in text
    assert load_config(out / "config.toml")["train"]["loss"] == r.config["train"]["loss"]
    capsys.readouterr()
    ckpt = out / "checkpoints" / "ckpt-000002.h5"
    for argv in (
        ["simulate", "--resume", str(ckpt)],
        ["simulate", "--resume", str(ckpt), "--trust-checkpoint"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot be resumed from the command line" in err
        assert err.startswith(f"edgefl: error: checkpoint '{ckpt}': its config key 'model.name'")
    assert main(["simulate", str(out / "config.toml"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "passed by value" in err and not (tmp_path / "b").exists()


# -- peers: a message carrying a pickle is bytes, never unpickled ------------------------------
def test_a_forged_message_carrying_a_pickle_is_rejected_and_never_unpickled(tmp_path, caplog):
    marker = tmp_path / "pwned"
    blob = np.frombuffer(pickle.dumps(Evil(marker)), np.uint8)
    fabric = Fabric(2)
    v0 = Validator(0, model_numel=blob.size)
    v0.hosted[1] = frozenset({0})
    coord = LoopbackTransport(fabric, 0, v0)
    worker = LoopbackTransport(fabric, 1, Validator(1, model_numel=blob.size))
    # a model update or a global model is float32 by the wire format: a byte blob is refused
    for kind, src, dest in ((Kind.UPDATE, 1, 0), (Kind.MODEL, 0, 1)):
        fabric.inject(src, dest, encode_header(kind, 0, 1, 0, 0.0, blob), blob.tobytes())
    assert coord.poll() == [] and worker.poll() == []
    assert coord.stats.rejected[1] == 1 and worker.stats.rejected[0] == 1
    assert "dtype uint8, expected float32" in caplog.text
    # kinds that carry bytes deliver bytes: their decoders (JSON, the device-state
    # encoding) reject the blob; nothing in the path unpickles
    for seq, kind in enumerate((Kind.REGISTER, Kind.STATE, Kind.ERROR), start=2):
        fabric.inject(1, 0, encode_header(kind, 0, seq, 0, 0.0, blob), blob.tobytes())
    got = coord.poll()
    assert [m.kind for m in got] == [Kind.REGISTER, Kind.STATE, Kind.ERROR]
    for m in got:
        assert isinstance(m.payload, np.ndarray) and m.payload.dtype == np.uint8
    with pytest.raises(ValueError):
        json.loads(bytes(got[0].payload).decode("utf-8"))  # (registration's decoding)
    with pytest.raises(ValueError, match="malformed device state"):
        devstate.decode(got[1].payload)
    assert not marker.exists()


def test_nothing_but_the_launchers_payload_is_unpickled():
    """The only pickle loads in edgefl: the ranks' payload (digest checked) and the
    launcher's own pre-launch check handing its config to a child or rank 0 (a private
    temporary directory or a pipe, never a run directory or a checkpoint)."""
    allowed = {"shipped.py": 1, "preflight.py": 2}
    found: dict[str, int] = {}
    for path in (ROOT / "edgefl").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        n = len(re.findall(r"\b(?:c?pickle|cloudpickle|torch)\.loads?\(", text))
        n += len(re.findall(r"\ballow_pickle\s*=\s*True|weights_only\s*=\s*False", text))
        if n:
            found[str(path.relative_to(ROOT / "edgefl"))] = n
    torch_loads = {k: v for k, v in found.items() if k not in allowed}
    for name, n in torch_loads.items():  # torch.load only with weights_only=True
        text = (ROOT / "edgefl" / name).read_text(encoding="utf-8")
        calls = re.findall(r"torch\.load\(([^)]*)\)", text)
        assert len(calls) == n and all("weights_only=True" in c for c in calls), name
    assert {k: v for k, v in found.items() if k in allowed} == allowed


# -- over MPI --------------------------------------------------------------------------------
SCRIPT = (
    """
import functools, json, sys
import torch
import torch.nn.functional as F
import edgefl

SCALE = 1.0  # a global of __main__ that a shipped function reads
"""
    + NOTEBOOK_NET
    + """


def my_loss(output, target):
    return SCALE * F.cross_entropy(output, target)


def hit(output, target, k=1.0):
    return (output.argmax(dim=-1) == target).float() * k


out = sys.argv[1]
sets = {**json.loads(sys.argv[2]), "model.name": Net, "model.args": {"width": 6},
        "train.loss": my_loss, "evaluation.every": 1,
        "evaluation.metrics": [hit, functools.partial(hit, k=2.0)]}
mpi = edgefl.simulate(overrides=sets, out=out + "-mpi", backend="mpi")
inline = edgefl.simulate(overrides=sets, out=out + "-inline", backend="inline")
print(json.dumps({"mpi": mpi.model_sha256, "inline": inline.model_sha256,
                  "mpi_cfg": mpi.config, "inline_cfg": inline.config,
                  "mpi_rows": mpi.metrics, "inline_rows": inline.metrics,
                  "is_net": isinstance(mpi.model(), Net)}))
"""
)


@pytest.mark.mpi
def test_main_objects_over_mpi_train_the_inline_model(tmp_path, launcher):
    script = tmp_path / "train_it.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = run_launch(
        [sys.executable, str(script), str(tmp_path / "run"), json.dumps(TINY)],
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["mpi"] == got["inline"] and got["is_net"]
    mpi, inline = got["mpi_cfg"], got["inline_cfg"]
    assert mpi["model"]["name"] == PREFIX + "Net" and inline["model"]["name"] == "__main__:Net"
    assert mpi["train"]["loss"] == PREFIX + "my_loss"
    assert mpi["evaluation"]["metrics"] == [PREFIX + "hit", PREFIX + "hit_partial"]
    assert [r["test_accuracy"] for r in got["mpi_rows"]] == [
        r["test_accuracy"] for r in got["inline_rows"]
    ]
    assert got["mpi_rows"][-1]["fed_eval"] == got["inline_rows"][-1]["fed_eval"]
    run = tmp_path / "run-mpi"
    text = (run / "config.toml").read_text()
    digest = re.search(r"payload SHA-256 ([0-9a-f]{64})", text)
    assert digest and "class Net of __main__" in text
    assert not (run / shipped.PAYLOAD_FILE).exists()  # there for the job's life only
    assert "edgefl simulate: 4 devices on 2 worker ranks" in proc.stdout
