"""Plug-in sources (``package.module:function``) and the worked ``custom_plugin`` example."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from edgefl.data import DataInfo, FederatedDataset, load_federated, pooled
from edgefl.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
MOD = "edgefl_test_data_plugins"

PLUGINS = """
import numpy as np
import torch
from torch.utils.data import TensorDataset

from edgefl.data import DataInfo, load_federated


def _ds(k, n=10, dim=3):
    g = torch.Generator().manual_seed(k)
    return TensorDataset(torch.randn(n, dim, generator=g), torch.arange(n) % 4)


def as_list(num_devices, seed, n=10):
    return [_ds(seed * 100 + k, n) for k in range(num_devices)], _ds(999, 8)


def as_dict(num_devices, seed):
    return {k: _ds(k) for k in range(num_devices)}, _ds(999)


def as_arrays(num_devices, seed):
    train = [(np.ones((4, 2), np.float64), np.array([0, 1, 2, 1])) for _ in range(num_devices)]
    return train, (np.zeros((3, 2)), np.array([0, 5, 1]))


def with_info(num_devices, seed):
    info = DataInfo((3,), 7)
    return [_ds(k) for k in range(num_devices)], _ds(1), info


def passthrough(num_devices, seed):
    return load_federated("synthetic", {"dim": 5}, num_devices, seed)


def two_devices(num_devices, seed):
    return load_federated("synthetic", {}, 2, seed)


def wrong_count(num_devices, seed):
    return [_ds(k) for k in range(num_devices + 1)], _ds(0)


def bad_keys(num_devices, seed):
    return {"a": _ds(0)}, _ds(0)


def bad_type(num_devices, seed):
    return 42


def bad_train(num_devices, seed):
    return _ds(0), _ds(0)


def empty_device(num_devices, seed):
    return [_ds(0, n=0)] + [_ds(k) for k in range(1, num_devices)], _ds(0)


not_a_function = 3
"""


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / f"{MOD}.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MOD
    sys.modules.pop(MOD, None)


def test_custom_plugin_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "datasets"))
    args = {"radius_noise": 0.05, "samples_per_device": 50}
    fd = load_federated("custom_plugin:make_rings", args, 6, seed=2)
    assert fd.num_devices == 6
    assert fd.info == DataInfo((2,), 3, "classification", "float32")
    assert all(fd.num_samples(k) == 50 for k in range(6))
    x, y = fd.train(4).tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    radius = x.norm(dim=1)
    assert torch.all((radius - (y + 1).float()).abs() < 0.4)  # points lie on their ring
    again = load_federated("custom_plugin:make_rings", args, 6, seed=2)
    assert torch.equal(again.train(4).tensors[0], x)
    other = load_federated("custom_plugin:make_rings", args, 6, seed=3)
    assert not torch.equal(other.train(4).tensors[0], x)
    more = load_federated("custom_plugin:make_rings", args, 9, seed=2)
    assert torch.equal(more.train(4).tensors[0], x)  # device 4 independent of the count
    assert len(pooled(fd)) == 300


def test_plugin_return_forms(plugins: str) -> None:
    fd = load_federated(f"{plugins}:as_list", {"n": 6}, 3, seed=1)
    assert fd.info == DataInfo((3,), 4) and [fd.num_samples(k) for k in range(3)] == [6, 6, 6]
    assert len(fd.test()) == 8
    fd = load_federated(f"{plugins}:as_dict", {}, 2, seed=1)
    assert len(fd.train(1)) == 10
    fd = load_federated(f"{plugins}:as_arrays", {}, 2, seed=1)
    assert fd.info == DataInfo((2,), 6)  # largest test label 5 + 1
    x, y = fd.train(0).tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    fd = load_federated(f"{plugins}:with_info", {}, 2, seed=1)
    assert fd.info.num_classes == 7
    fd = load_federated(f"{plugins}:passthrough", {}, 3, seed=1)
    assert isinstance(fd, FederatedDataset) and fd.info.input_shape == (5,)
    with pytest.raises(DataError, match="device id"):
        fd.train(3)


def test_plugin_num_classes_arg(plugins: str, tmp_path: Path) -> None:
    (tmp_path / f"{MOD}_nc.py").write_text(
        "from edgefl_test_data_plugins import _ds\n"
        "def make(num_devices, seed, num_classes):\n"
        "    return [_ds(k) for k in range(num_devices)], _ds(0)\n"
    )
    try:
        fd = load_federated(f"{MOD}_nc:make", {"num_classes": 12}, 2, seed=0)
        assert fd.info.num_classes == 12
    finally:
        sys.modules.pop(f"{MOD}_nc", None)


def test_bad_import() -> None:
    with pytest.raises(DataError) as err:
        load_federated("mypkg_missing_xyz.mod:fn", {}, 2, seed=0)
    assert str(err.value) == (
        "data.source 'mypkg_missing_xyz.mod:fn': cannot import module 'mypkg_missing_xyz.mod' "
        "(No module named 'mypkg_missing_xyz')"
    )


def test_import_error_inside_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "edgefl_test_broken_mod.py").write_text("x = (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DataError, match="importing module 'edgefl_test_broken_mod' failed"):
        load_federated("edgefl_test_broken_mod:fn", {}, 2, seed=0)


def test_missing_function(plugins: str) -> None:
    with pytest.raises(DataError, match=f"module '{plugins}' has no function 'nope'"):
        load_federated(f"{plugins}:nope", {}, 2, seed=0)
    with pytest.raises(DataError, match="not a function"):
        load_federated(f"{plugins}:not_a_function", {}, 2, seed=0)
    with pytest.raises(DataError, match="package.module:function"):
        load_federated("bad name:fn", {}, 2, seed=0)


def test_bad_arguments(plugins: str) -> None:
    with pytest.raises(DataError, match="cannot be called with") as err:
        load_federated(f"{plugins}:as_list", {"colour": "red"}, 2, seed=0)
    assert "colour" in str(err.value)
    with pytest.raises(DataError, match="data.args.seed"):
        load_federated(f"{plugins}:as_list", {"seed": 3}, 2, seed=0)


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (
            "bad_type",
            ["returned an object of type int", "FederatedDataset or a tuple (train, test)"],
        ),
        ("wrong_count", ["train has 4 entries", "num_devices = 3"]),
        ("bad_keys", ["device ids 0..2"]),
        ("bad_train", ["list or dict of 3 datasets"]),
        ("two_devices", ["2 devices", "num_devices = 3"]),
        ("empty_device", ["train[0] (device 0) is empty"]),
    ],
)
def test_bad_return(plugins: str, fn: str, words: list[str]) -> None:
    with pytest.raises(DataError) as err:
        load_federated(f"{plugins}:{fn}", {}, 3, seed=0)
    msg = str(err.value)
    assert f"'{plugins}:{fn}'" in msg and "\n" not in msg
    for word in words:
        assert word in msg
