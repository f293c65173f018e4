"""Federated HDF5 files: writer, reader, the ``fedh5`` source and the sample generator."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from edgefl.data import load_federated, pooled, read_fedh5_clients, write_fedh5
from edgefl.errors import DataError

ROOT = Path(__file__).resolve().parent.parent


def _clients(num: int, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(num):
        n = int(rng.integers(5, 15))
        out[f"c{i:03d}_{(7 * i) % 10}"] = {
            "pixels": rng.random((n, 4, 4)).astype(np.float32),
            "label": rng.integers(0, 6, size=n).astype(np.int32),
        }
    return out


def test_round_trip(tmp_path: Path) -> None:
    data = _clients(6)
    path = tmp_path / "fed.h5"
    write_fedh5(path, data)
    assert read_fedh5_clients(path) == sorted(data)
    with h5py.File(path, "r") as f:
        for cid, feats in data.items():
            for name, arr in feats.items():
                stored = f[f"examples/{cid}/{name}"][()]
                assert stored.dtype == arr.dtype and np.array_equal(stored, arr)
    assert [p.name for p in tmp_path.iterdir()] == ["fed.h5"]  # no temp file left behind
    write_fedh5(path, _clients(2, seed=1))  # overwriting replaces the file
    assert len(read_fedh5_clients(path)) == 2


def test_source_with_test_file(tmp_path: Path) -> None:
    data, test = _clients(6), _clients(3, seed=9)
    write_fedh5(tmp_path / "train.h5", data)
    write_fedh5(tmp_path / "test.h5", test)
    args = {"path": str(tmp_path / "train.h5"), "test_path": str(tmp_path / "test.h5")}
    fd = load_federated("fedh5", args, 4, seed=0)  # 6 clients, 4 devices: first 4 used
    assert fd.info.input_shape == (4, 4) and fd.info.input_dtype == "float32"
    labels = np.concatenate([c["label"] for c in [*data.values(), *test.values()]])
    assert fd.info.num_classes == labels.max() + 1
    for k, cid in enumerate(sorted(data)[:4]):
        x, y = fd.train(k).tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert np.array_equal(x.numpy(), data[cid]["pixels"])
        assert np.array_equal(y.numpy(), data[cid]["label"])
        assert fd.num_samples(k) == len(data[cid]["label"])
    xt, yt = fd.test().tensors
    assert np.array_equal(yt.numpy(), np.concatenate([test[c]["label"] for c in sorted(test)]))
    assert xt.shape == (len(yt), 4, 4)


def test_source_holdout_split(tmp_path: Path) -> None:
    data = _clients(5)
    write_fedh5(tmp_path / "f.h5", data)
    args = {"path": str(tmp_path / "f.h5"), "test_fraction": 0.25, "num_classes": 8}
    fd = load_federated("fedh5", args, 5, seed=3)
    assert fd.info.num_classes == 8
    total_test = 0
    for k, cid in enumerate(sorted(data)):
        n = len(data[cid]["label"])
        n_test = round(0.25 * n)
        assert fd.num_samples(k) == len(fd.train(k)) == n - n_test
        total_test += n_test
        # every training row is one of the client's rows
        rows = {r.tobytes() for r in data[cid]["pixels"]}
        assert all(r.numpy().tobytes() in rows for r in fd.train(k).tensors[0])
    assert len(fd.test()) == total_test
    assert len(pooled(fd)) + len(fd.test()) == sum(len(c["label"]) for c in data.values())
    again = load_federated("fedh5", args, 5, seed=3)
    assert torch.equal(again.train(2).tensors[0], fd.train(2).tensors[0])
    assert torch.equal(again.test().tensors[1], fd.test().tensors[1])


def test_missing_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.h5")
    with pytest.raises(DataError, match="not found") as err:
        load_federated("fedh5", {"path": missing}, 2, 0)
    assert "nope.h5" in str(err.value)
    with pytest.raises(DataError, match="not found"):
        read_fedh5_clients(missing)


def test_not_hdf5(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.h5"
    bogus.write_text("this is not HDF5\n")
    with pytest.raises(DataError, match="not an HDF5 file") as err:
        load_federated("fedh5", {"path": str(bogus)}, 2, 0)
    assert "bogus.h5" in str(err.value)


def test_missing_examples_group(tmp_path: Path) -> None:
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DataError, match="no 'examples' group"):
        load_federated("fedh5", {"path": str(path)}, 1, 0)


def test_missing_client_feature(tmp_path: Path) -> None:
    data = _clients(3)
    broken = sorted(data)[1]
    del data[broken]["label"]
    path = tmp_path / "f.h5"
    write_fedh5(path, data)
    with pytest.raises(DataError) as err:
        load_federated("fedh5", {"path": str(path)}, 3, 0)
    msg = str(err.value)
    assert "f.h5" in msg and broken in msg and "missing feature 'label'" in msg
    with pytest.raises(DataError, match="missing feature 'img'"):
        load_federated("fedh5", {"path": str(path), "x": "img"}, 1, 0)


def test_mismatched_lengths(tmp_path: Path) -> None:
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["examples/a/pixels"] = np.zeros((4, 2), np.float32)
        f["examples/a/label"] = np.zeros(3, np.int64)
    with pytest.raises(DataError) as err:
        load_federated("fedh5", {"path": str(path)}, 1, 0)
    msg = str(err.value)
    assert "client 'a'" in msg and "4 examples" in msg and "'label' has 3" in msg
    with pytest.raises(DataError, match="different lengths"):
        write_fedh5(path, {"a": {"pixels": np.zeros((4, 2)), "label": np.zeros(3)}})


def test_too_few_clients(tmp_path: Path) -> None:
    path = tmp_path / "small.h5"
    write_fedh5(path, _clients(3))
    with pytest.raises(DataError) as err:
        load_federated("fedh5", {"path": str(path)}, 5, 0)
    msg = str(err.value)
    assert "small.h5" in msg and "3 clients" in msg and "num_devices = 5" in msg


def test_bad_args_and_labels(tmp_path: Path) -> None:
    path = tmp_path / "f.h5"
    write_fedh5(path, _clients(2))
    with pytest.raises(DataError, match="data.args.path is required"):
        load_federated("fedh5", {}, 1, 0)
    with pytest.raises(DataError, match="not both"):
        load_federated(
            "fedh5", {"path": str(path), "test_path": str(path), "test_fraction": 0.1}, 1, 0
        )
    with pytest.raises(DataError, match="num_classes"):
        load_federated("fedh5", {"path": str(path), "num_classes": 2}, 2, 0).train(0)
    with pytest.raises(DataError, match="bad client id"):
        write_fedh5(path, {"a/b": {"label": np.zeros(2)}})
    with pytest.raises(DataError, match="numeric"):
        write_fedh5(path, {"a": {"label": np.array(["x", "y"])}})
    neg = tmp_path / "neg.h5"
    write_fedh5(neg, {"a": {"pixels": np.zeros((2, 3)), "label": np.array([0, -1])}})
    with pytest.raises(DataError, match=">= 0"):
        load_federated("fedh5", {"path": str(neg)}, 1, 0)


def test_sample_generator_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "datasets"))
    import make_fed_h5

    out, test_out = tmp_path / "glyphs.h5", tmp_path / "glyphs_test.h5"
    argv = [str(out), "--clients", "6", "--seed", "0", "--test-out", str(test_out)]
    assert make_fed_h5.main(argv) == 0
    assert len(read_fedh5_clients(out)) == 6
    fd = load_federated("fedh5", {"path": str(out), "test_path": str(test_out)}, 6, 0)
    assert fd.info.input_shape == (8, 8) and fd.info.num_classes <= 10
    x, y = fd.train(0).tensors
    assert x.dtype == torch.float32 and float(x.min()) >= 0 and float(x.max()) <= 1
    assert y.dtype == torch.int64
    first = make_fed_h5.make_clients(3, seed=5)
    second = make_fed_h5.make_clients(3, seed=5)
    for cid in first:
        assert np.array_equal(first[cid]["pixels"], second[cid]["pixels"])
    assert not os.path.exists(str(out) + ".tmp")


@pytest.mark.parametrize("mode", ["test_path", "test_fraction"])
def test_test_set_in_parts_and_on_disk(tmp_path: Path, mode: str) -> None:
    """run.test_memory_mb: the test set's size from metadata, its parts (whole clients) in
    test()'s order, and a spilled copy that reads back the same rows."""
    from edgefl.data.spill import SpilledTensors, load_test

    write_fedh5(tmp_path / "f.h5", _clients(7))
    write_fedh5(tmp_path / "t.h5", _clients(4, seed=5))
    args = {"path": str(tmp_path / "f.h5")}
    args |= {"test_path": str(tmp_path / "t.h5")} if mode == "test_path" else {"test_fraction": 0.3}
    fd = load_federated("fedh5", args, 6, seed=1)
    x, y = load_federated("fedh5", args, 6, seed=1).test().tensors
    assert fd.test_nbytes() == x.numel() * 4 + y.numel() * 8
    for rows in (1, 10, 10_000):
        parts = list(fd.test_parts(rows))
        assert all(len(p) >= rows for p in parts[:-1])
        assert torch.equal(torch.cat([p.tensors[0] for p in parts]), x)
        assert torch.equal(torch.cat([p.tensors[1] for p in parts]), y)
    assert fd._test is None  # (no part kept)
    spilled = load_test(fd, fd.test_nbytes() - 1)
    assert isinstance(spilled, SpilledTensors) and len(spilled) == len(y)
    got = list(spilled.batches(7))
    assert torch.equal(torch.cat([b[0] for b in got]), x)
    assert torch.equal(torch.cat([b[1] for b in got]), y)
