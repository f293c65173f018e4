"""Model construction: built-ins, plug-ins, deterministic seeding and error messages."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from edgefl.errors import ConfigError
from edgefl.models import MODEL_NAMES, FlatParams, build_model


def info(shape=(1, 8, 8), classes=10, task="classification", dtype="float32"):
    return SimpleNamespace(input_shape=shape, num_classes=classes, task=task, input_dtype=dtype)


IMG = info()
SEQ = info(shape=(12,), classes=50, task="lm", dtype="int64")


def flat_vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_model_names():
    assert MODEL_NAMES == ("logreg", "mlp", "cnn", "lstm")


@pytest.mark.parametrize(
    ("name", "inf", "args", "x", "out_shape"),
    [
        ("logreg", IMG, {}, torch.randn(3, 1, 8, 8), (3, 10)),
        ("mlp", info(shape=(20,), classes=4), {"hidden": [16, 8]}, torch.randn(5, 20), (5, 4)),
        ("mlp", info(shape=(20,), classes=4), {"hidden": []}, torch.randn(5, 20), (5, 4)),
        ("cnn", IMG, {}, torch.randn(2, 1, 8, 8), (2, 10)),
        ("cnn", info(shape=(3, 32, 32)), {"channels": [4, 8]}, torch.randn(2, 3, 32, 32), (2, 10)),
        ("cnn", info(shape=(28, 28), classes=3), {}, torch.randn(2, 28, 28), (2, 3)),
        (
            "cnn",
            info(shape=(4, 5), classes=3),
            {"channels": [2, 3, 4]},
            torch.randn(1, 4, 5),
            (1, 3),
        ),
        ("lstm", SEQ, {}, torch.randint(0, 50, (4, 12)), (4, 12, 50)),
        (
            "lstm",
            SEQ,
            {"embed": 8, "hidden": 16, "layers": 2},
            torch.randint(0, 50, (2, 7)),
            (2, 7, 50),
        ),
    ],
)
def test_builtin_output_shapes(name, inf, args, x, out_shape):
    model = build_model(name, inf, args, seed=1)
    assert tuple(model(x).shape) == out_shape
    assert list(model.buffers()) == []
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert not any(isinstance(m, (torch.nn.Dropout, torch.nn.BatchNorm2d)) for m in model.modules())


def test_int_inputs_to_classifier_are_cast():
    model = build_model("mlp", info(shape=(6,), classes=2, dtype="int64"), {}, seed=0)
    assert model(torch.randint(0, 5, (3, 6))).shape == (3, 2)


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_seed_determinism(name):
    a = flat_vector(build_model(name, IMG, {}, seed=7))
    b = flat_vector(build_model(name, IMG, {}, seed=7))
    c = flat_vector(build_model(name, IMG, {}, seed=8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_lstm_seed_determinism():
    a = FlatParams(build_model("lstm", SEQ, {}, seed=3)).snapshot()
    b = FlatParams(build_model("lstm", SEQ, {}, seed=3)).snapshot()
    c = FlatParams(build_model("lstm", SEQ, {}, seed=4)).snapshot()
    assert (a == b).all() and not (a == c).all()


def test_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    build_model("mlp", IMG, {"hidden": [32]}, seed=99)
    assert torch.equal(torch.rand(5), expected)


def test_unknown_name_lists_builtins():
    with pytest.raises(ConfigError, match=r"unknown model.*logreg, mlp, cnn, lstm.*module:Class"):
        build_model("resnet", IMG, {}, seed=0)


def test_unknown_arg_named():
    with pytest.raises(ConfigError) as e:
        build_model("mlp", IMG, {"hiden": [3]}, seed=0)
    assert str(e.value) == "model.args: unknown argument 'hiden' for 'mlp' (accepted: hidden)"
    with pytest.raises(ConfigError, match=r"'depth' for 'logreg' \(accepted: none\)"):
        build_model("logreg", IMG, {"depth": 2}, seed=0)


@pytest.mark.parametrize(
    ("name", "args", "key"),
    [
        ("mlp", {"hidden": [0]}, "model.args.hidden"),
        ("mlp", {"hidden": 64}, "model.args.hidden"),
        ("cnn", {"channels": []}, "model.args.channels"),
        ("lstm", {"layers": True}, "model.args.layers"),
        ("lstm", {"embed": -1}, "model.args.embed"),
    ],
)
def test_bad_arg_values(name, args, key):
    inf = SEQ if name == "lstm" else IMG
    with pytest.raises(ConfigError, match=key):
        build_model(name, inf, args, seed=0)


def test_cnn_needs_image_input():
    with pytest.raises(ConfigError, match="cnn.*image-shaped input"):
        build_model("cnn", info(shape=(64,)), {}, seed=0)


def test_lstm_rejects_classification():
    with pytest.raises(ConfigError, match="lstm.*needs task 'lm'.*float32"):
        build_model("lstm", IMG, {}, seed=0)


def test_classifier_rejects_lm_task():
    with pytest.raises(ConfigError, match="'mlp'.*task 'lm'"):
        build_model("mlp", SEQ, {}, seed=0)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "edgefl_test_plugin.py").write_text(
        textwrap.dedent(
            """
            import torch

            class WithInfo(torch.nn.Module):
                def __init__(self, info, width=4):
                    super().__init__()
                    self.fc = torch.nn.Linear(info.input_shape[0], info.num_classes)
                    self.width = width

                def forward(self, x):
                    return self.fc(x)

            class NoInfo(torch.nn.Module):
                def __init__(self, n=3):
                    super().__init__()
                    self.fc = torch.nn.Linear(n, 2)

            class NotAModule:
                def __init__(self):
                    pass
            """
        )
    )
    (tmp_path / "edgefl_broken_plugin.py").write_text("import nonexistent_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "edgefl_test_plugin"


def test_custom_model_gets_info(plugin):
    model = build_model(f"{plugin}:WithInfo", info(shape=(5,), classes=3), {"width": 9}, seed=0)
    assert model.width == 9 and model(torch.randn(2, 5)).shape == (2, 3)
    a = flat_vector(build_model(f"{plugin}:WithInfo", info(shape=(5,)), {}, seed=1))
    b = flat_vector(build_model(f"{plugin}:WithInfo", info(shape=(5,)), {}, seed=1))
    assert torch.equal(a, b)


def test_custom_model_without_info(plugin):
    model = build_model(f"{plugin}:NoInfo", IMG, {"n": 6}, seed=0)
    assert model.fc.in_features == 6


def test_custom_model_errors(plugin):
    with pytest.raises(ConfigError) as e:
        build_model("pkg_missing_xyz.mod:Net", IMG, {}, seed=0)
    msg = str(e.value)
    assert msg.startswith("model.name 'pkg_missing_xyz.mod:Net': cannot import module")
    assert "'pkg_missing_xyz.mod'" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="cannot import module 'edgefl_broken_plugin'"):
        build_model("edgefl_broken_plugin:Net", IMG, {}, seed=0)
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        build_model(f"{plugin}:Missing", IMG, {}, seed=0)
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        build_model(f"{plugin}:NotAModule", IMG, {}, seed=0)
    with pytest.raises(ConfigError, match="model.args: cannot construct"):
        build_model(f"{plugin}:NoInfo", IMG, {"bogus": 1}, seed=0)
    with pytest.raises(ConfigError, match="package.module:Class"):
        build_model(f"{plugin}:", IMG, {}, seed=0)
