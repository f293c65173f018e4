"""Federated datasets: what each device trains on, plus a shared test set.

Entry point: :func:`load_federated` (``source``, ``args``, ``num_devices``, ``seed``).
Built-in sources: ``"synthetic"`` (LEAF synthetic(alpha, beta)), ``"partition"`` (split a
centralized dataset: a Gaussian mixture, or the real ``digits`` / ``mnist1d`` / ``mnist`` of
:mod:`edgefl.data.real`), ``"fedh5"`` (TFF-layout federated HDF5 files), ``"text"`` (generated
character corpus for language modelling), and plug-ins ``"package.module:function"``.
See ``datasets/README.md``. No MPI here: a rank builds only the devices it asks for.
"""

from edgefl.data.base import DataInfo, FederatedDataset, pooled
from edgefl.data.fedh5 import export_fedh5, read_fedh5_clients, write_fedh5
from edgefl.data.loader import BUILTIN_SOURCES, load_federated
from edgefl.data.partition import gaussian_mixture, partition_indices

__all__ = [
    "BUILTIN_SOURCES",
    "DataInfo",
    "FederatedDataset",
    "export_fedh5",
    "gaussian_mixture",
    "load_federated",
    "partition_indices",
    "pooled",
    "read_fedh5_clients",
    "write_fedh5",
]
