"""Federated HDF5 files in the TensorFlow Federated layout ``examples/<client_id>/<feature>``.

Each client group holds one dataset per feature; all features of a client have the same
first (example) dimension. Clients are ordered by sorted client id; device ``k`` gets the
``k``-th client. If the file has more clients than devices, only the first ``num_devices``
clients (in sorted order) are used; fewer clients than devices is an error.

The test set is either every client of a second file (``test_path``) pooled in sorted
client order, or a ``test_fraction`` held out from each *used* client (deterministic in
``(seed, device)``), pooled in device order.

Files are opened read-only for each read and closed again, so no HDF5 handle is shared
between ranks or processes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import TensorDataset

from edgefl.data._args import Args
from edgefl.data.base import (
    DOMAIN_FEDH5,
    DataInfo,
    FederatedDataset,
    as_feature_tensor,
    as_label_tensor,
    dataset_tensors,
    one_line,
    stream_rng,
)
from edgefl.errors import DataError

EXAMPLES = "examples"
ACCEPTED_ARGS = ["path", "x", "y", "test_path", "test_fraction", "num_classes"]
_HOLDOUT = 1


def write_fedh5(path: str | os.PathLike[str], clients: Mapping[str, Mapping[str, Any]]) -> None:
    """Write ``{client_id: {feature: array}}`` as ``examples/<client_id>/<feature>``.

    The file is written to a temporary name in the same folder and moved into place with
    :func:`os.replace`, so readers never see a half-written file. Arrays keep their dtype
    (numeric only); within a client every feature must have the same number of examples
    (first dimension).
    """
    path = os.fspath(path)
    if not isinstance(clients, Mapping):
        raise DataError(f"write_fedh5 {path!r}: clients must be a dict, got {type(clients)}")
    checked: dict[str, dict[str, np.ndarray]] = {}
    for cid, feats in clients.items():
        if not isinstance(cid, str) or not cid or "/" in cid or cid in (".", ".."):
            raise DataError(f"write_fedh5 {path!r}: bad client id {cid!r} (non-empty, no '/')")
        if not isinstance(feats, Mapping) or not feats:
            raise DataError(
                f"write_fedh5 {path!r}, client {cid!r}: features must be a non-empty dict"
            )
        arrays: dict[str, np.ndarray] = {}
        for name, value in feats.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise DataError(f"write_fedh5 {path!r}, client {cid!r}: bad feature name {name!r}")
            arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            arr = np.asarray(arr)
            if arr.dtype.kind not in "biuf" or arr.ndim == 0:
                raise DataError(
                    f"write_fedh5 {path!r}, client {cid!r}, feature {name!r}: need a numeric "
                    f"array with an example dimension, got dtype {arr.dtype}, shape {arr.shape}"
                )
            arrays[name] = arr
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(
                f"write_fedh5 {path!r}, client {cid!r}: features have different lengths {lengths}"
            )
        checked[cid] = arrays

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DataError(f"write_fedh5 {path!r}: folder {folder!r} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            group = f.create_group(EXAMPLES)
            for cid in sorted(checked):
                client = group.create_group(cid)
                for name, arr in checked[cid].items():
                    client.create_dataset(name, data=arr)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def client_ids(num_devices: int) -> list[str]:
    """Client ids ``"0" .. str(num_devices - 1)``, zero-padded to one width so that their
    sorted order is the device order (what :class:`FedH5Federated` uses)."""
    width = len(str(max(int(num_devices) - 1, 0)))
    return [f"{k:0{width}d}" for k in range(int(num_devices))]


def export_fedh5(
    fd: FederatedDataset,
    path: str | os.PathLike[str],
    test_path: str | os.PathLike[str] | None = None,
    *,
    x_name: str = "pixels",
    y_name: str = "label",
) -> list[str]:
    """Write every device of ``fd`` as one client of a federated HDF5 file.

    Device ``k`` becomes client ``client_ids(fd.num_devices)[k]`` with features ``x_name``
    and ``y_name`` (the ``fedh5`` source's defaults). With ``test_path``, ``fd.test()`` is
    written there as the single client ``"test"``. Reading ``path`` back with source
    ``fedh5`` (``num_devices = fd.num_devices``, ``test_path`` given) yields the same
    training arrays per device and the same test set. This builds every device's data.

    Returns:
        The client ids written, in device order.
    """
    if fd.info.task != "classification":
        raise DataError(
            f"export_fedh5 {os.fspath(path)!r}: only classification data can be written "
            f"(one label per example), this dataset's task is {fd.info.task!r}"
        )
    ids = client_ids(fd.num_devices)
    clients: dict[str, dict[str, Any]] = {}
    for k, cid in enumerate(ids):
        x, y = dataset_tensors(fd.train(k), f"device {k} training data")
        clients[cid] = {x_name: x, y_name: y}
    if test_path is not None:
        x, y = dataset_tensors(fd.test(), "test data")
        write_fedh5(test_path, {"test": {x_name: x, y_name: y}})
    write_fedh5(path, clients)
    return ids


def _open(path: str) -> h5py.File:
    if not os.path.exists(path):
        raise DataError(f"fedh5 file not found: {path!r}")
    if os.path.isdir(path):
        raise DataError(f"fedh5 path {path!r} is a folder, not an HDF5 file")
    if not h5py.is_hdf5(path):
        raise DataError(f"fedh5 file {path!r} is not an HDF5 file")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise DataError(f"fedh5 file {path!r}: cannot open ({one_line(exc)})") from exc


def _examples(f: h5py.File, path: str) -> h5py.Group:
    group = f.get(EXAMPLES)
    if not isinstance(group, h5py.Group):
        raise DataError(
            f"fedh5 file {path!r} has no '{EXAMPLES}' group "
            f"(expected the layout {EXAMPLES}/<client_id>/<feature>)"
        )
    return group


def read_fedh5_clients(path: str | os.PathLike[str]) -> list[str]:
    """The client ids of a federated HDF5 file, sorted (device ``k`` gets entry ``k``)."""
    path = os.fspath(path)
    with _open(path) as f:
        return sorted(_examples(f, path).keys())


def _feature(client: h5py.Group, path: str, cid: str, name: str) -> h5py.Dataset:
    ds = client.get(name)
    if not isinstance(ds, h5py.Dataset):
        have = ", ".join(sorted(client.keys())) or "nothing"
        raise DataError(
            f"fedh5 file {path!r}, client {cid!r}: missing feature {name!r} (has: {have})"
        )
    return ds


def _client_meta(
    examples: h5py.Group, path: str, cid: str, xname: str, yname: str
) -> tuple[int, tuple[int, ...], np.dtype]:
    """``(num_examples, example_shape, x_dtype)`` of one client, from metadata only."""
    client = examples.get(cid)
    if not isinstance(client, h5py.Group):
        raise DataError(f"fedh5 file {path!r}: client {cid!r} is not a group")
    xs = _feature(client, path, cid, xname)
    ys = _feature(client, path, cid, yname)
    if xs.ndim == 0 or ys.ndim == 0:
        raise DataError(
            f"fedh5 file {path!r}, client {cid!r}: features {xname!r} and {yname!r} need an "
            "example dimension (got a scalar)"
        )
    if xs.shape[0] != ys.shape[0]:
        raise DataError(
            f"fedh5 file {path!r}, client {cid!r}: feature {xname!r} has {xs.shape[0]} "
            f"examples but {yname!r} has {ys.shape[0]}"
        )
    if ys.ndim > 2 or (ys.ndim == 2 and ys.shape[1] != 1):
        raise DataError(
            f"fedh5 file {path!r}, client {cid!r}: feature {yname!r} must hold one label per "
            f"example, got shape {ys.shape}"
        )
    if ys.dtype.kind not in "iuf" or xs.dtype.kind not in "biuf":
        raise DataError(
            f"fedh5 file {path!r}, client {cid!r}: features {xname!r} ({xs.dtype}) and "
            f"{yname!r} ({ys.dtype}) must be numeric"
        )
    return int(xs.shape[0]), tuple(int(d) for d in xs.shape[1:]), xs.dtype


def _read_client(
    examples: h5py.Group, path: str, cid: str, xname: str, yname: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _client_meta(examples, path, cid, xname, yname)
    client = examples[cid]
    where = f"fedh5 file {path!r}, client {cid!r}"
    x = as_feature_tensor(client[xname][()], f"{where}, feature {xname!r}")
    y = as_label_tensor(np.reshape(client[yname][()], -1), f"{where}, feature {yname!r}")
    return x, y


class FedH5Federated(FederatedDataset):
    """Devices backed by the clients of a federated HDF5 file (see the module docstring)."""

    def __init__(self, args: dict[str, Any] | None, num_devices: int, seed: int) -> None:
        a = Args("fedh5", args, ACCEPTED_ARGS)
        self.path = a.text("path")
        self.xname = a.text("x", "pixels")
        self.yname = a.text("y", "label")
        self.test_path = a.text("test_path") if a.has("test_path") else None
        if self.test_path is not None and a.has("test_fraction"):
            raise DataError(
                "data.args: give either test_path or test_fraction for source 'fedh5', not both"
            )
        self.test_fraction = a.number(
            "test_fraction", 0.2, lo=0.0, hi=1.0, lo_open=True, hi_open=True
        )
        num_classes = a.optional_int("num_classes", lo=1)
        infer_classes = num_classes is None
        self.seed = seed

        with _open(self.path) as f:
            examples = _examples(f, self.path)
            all_clients = sorted(examples.keys())
            if len(all_clients) < num_devices:
                raise DataError(
                    f"fedh5 file {self.path!r} has {len(all_clients)} clients but "
                    f"num_devices = {num_devices} (need at least one client per device)"
                )
            self.clients = all_clients[:num_devices]
            metas = [
                _client_meta(examples, self.path, cid, self.xname, self.yname)
                for cid in self.clients
            ]
            shape, dtype = metas[0][1], metas[0][2]
            for cid, (n, shp, _) in zip(self.clients, metas, strict=True):
                if n == 0:
                    raise DataError(f"fedh5 file {self.path!r}, client {cid!r} has no examples")
                if shp != shape:
                    raise DataError(
                        f"fedh5 file {self.path!r}, client {cid!r}: feature {self.xname!r} has "
                        f"example shape {shp} but client {self.clients[0]!r} has {shape}"
                    )
            self._sizes = [m[0] for m in metas]
            if infer_classes:
                num_classes = self._max_label(examples, self.path, all_clients) + 1
        if self.test_path is not None:
            with _open(self.test_path) as f:
                test_examples = _examples(f, self.test_path)
                test_clients = sorted(test_examples.keys())
                if not test_clients:
                    raise DataError(f"fedh5 test file {self.test_path!r} has no clients")
                if infer_classes:
                    test_max = self._max_label(test_examples, self.test_path, test_clients)
                    num_classes = max(int(num_classes or 0), test_max + 1)
        assert num_classes is not None
        input_dtype = "int64" if dtype.kind in "iu" and dtype != np.uint8 else "float32"
        super().__init__(DataInfo(shape, num_classes, "classification", input_dtype), num_devices)
        self._train: dict[int, TensorDataset] = {}
        self._test: TensorDataset | None = None

    def _max_label(self, examples: h5py.Group, path: str, clients: list[str]) -> int:
        best = 0
        for cid in clients:
            client = examples.get(cid)
            if not isinstance(client, h5py.Group):
                raise DataError(f"fedh5 file {path!r}: client {cid!r} is not a group")
            ys = _feature(client, path, cid, self.yname)
            y = as_label_tensor(
                np.reshape(ys[()], -1),
                f"fedh5 file {path!r}, client {cid!r}, feature {self.yname!r}",
            )
            if y.numel():
                best = max(best, int(y.max()))
        return best

    def _num_test(self, n: int) -> int:
        if self.test_path is not None:
            return 0
        return min(n - 1, int(round(self.test_fraction * n)))

    def _split(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(train, held_out)`` positions of device ``k``'s client."""
        perm = stream_rng(self.seed, DOMAIN_FEDH5, _HOLDOUT, k).permutation(n)
        n_test = self._num_test(n)
        return np.sort(perm[n_test:]), np.sort(perm[:n_test])

    def _checked(self, x: torch.Tensor, y: torch.Tensor, path: str, cid: str) -> None:
        if tuple(x.shape[1:]) != self.info.input_shape:
            raise DataError(
                f"fedh5 file {path!r}, client {cid!r}: feature {self.xname!r} has example "
                f"shape {tuple(x.shape[1:])}, expected {self.info.input_shape}"
            )
        if y.numel() and int(y.max()) >= self.info.num_classes:
            raise DataError(
                f"fedh5 file {path!r}, client {cid!r}: label {int(y.max())} >= num_classes "
                f"{self.info.num_classes}"
            )

    def _read_device(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        cid = self.clients[k]
        with _open(self.path) as f:
            x, y = _read_client(_examples(f, self.path), self.path, cid, self.xname, self.yname)
        self._checked(x, y, self.path, cid)
        if len(y) != self._sizes[k]:
            raise DataError(f"fedh5 file {self.path!r}, client {cid!r} changed while in use")
        return x, y

    def num_samples(self, device: int) -> int:
        """Training examples of ``device`` (client size minus its held-out part)."""
        k = self.check_device(device)
        return self._sizes[k] - self._num_test(self._sizes[k])

    def train(self, device: int) -> TensorDataset:
        """The training part of the ``device``-th client (sorted by client id)."""
        k = self.check_device(device)
        if k not in self._train:
            x, y = self._read_device(k)
            idx = torch.from_numpy(self._split(k, len(y))[0])
            self._train[k] = TensorDataset(x[idx], y[idx])
        return self._train[k]

    def forget(self, device: int) -> None:
        """Drop the cached training set of ``device`` (:meth:`train` builds it again)."""
        self._train.pop(self.check_device(device), None)

    def test(self) -> TensorDataset:
        """All clients of ``test_path`` pooled, or every used client's held-out part."""
        if self._test is None:
            xs, ys = [], []
            for x, y in self._test_pieces():
                xs.append(x)
                ys.append(y)
            test = TensorDataset(torch.cat(xs), torch.cat(ys))
            if len(test) == 0:
                raise DataError(
                    f"fedh5 file {self.path!r}: the test set is empty (clients too small for "
                    f"data.args.test_fraction = {self.test_fraction}; give a test_path)"
                )
            self._test = test
        return self._test

    def test_nbytes(self) -> int:
        """Bytes of :meth:`test` (float32 or int64 features, int64 labels), from the files'
        metadata: no example is read."""
        width = 8 if self.info.input_dtype == "int64" else 4
        row = width * int(np.prod(self.info.input_shape, dtype=np.int64)) + 8
        if self.test_path is None:
            return row * sum(self._num_test(n) for n in self._sizes)
        with _open(self.test_path) as f:
            examples = _examples(f, self.test_path)
            return row * sum(
                _client_meta(examples, self.test_path, cid, self.xname, self.yname)[0]
                for cid in sorted(examples.keys())
            )

    def test_parts(self, rows: int) -> Iterator[TensorDataset]:
        """:meth:`test` in parts of whole clients (at least ``rows`` examples each but the
        last), read one at a time and not kept."""
        xs: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        for x, y in self._test_pieces():
            xs.append(x)
            ys.append(y)
            if sum(len(t) for t in ys) >= rows:
                yield TensorDataset(torch.cat(xs), torch.cat(ys))
                xs, ys = [], []
        if ys:
            yield TensorDataset(torch.cat(xs), torch.cat(ys))

    def _test_pieces(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each test client's examples, or each used client's held-out part, in order."""
        if self.test_path is not None:
            with _open(self.test_path) as f:
                examples = _examples(f, self.test_path)
                for cid in sorted(examples.keys()):
                    x, y = _read_client(examples, self.test_path, cid, self.xname, self.yname)
                    self._checked(x, y, self.test_path, cid)
                    yield x, y
        else:
            for k in range(self.num_devices):
                x, y = self._read_device(k)
                idx = torch.from_numpy(self._split(k, len(y))[1])
                yield x[idx], y[idx]
