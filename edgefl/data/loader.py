"""``load_federated``: pick a data source by name and build its :class:`FederatedDataset`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from edgefl.data._args import check_run_params
from edgefl.data.base import FederatedDataset
from edgefl.data.clicks import ClicksFederated
from edgefl.data.fedh5 import FedH5Federated
from edgefl.data.partition import PartitionedFederated
from edgefl.data.plugin import load_plugin
from edgefl.data.synthetic import SyntheticFederated
from edgefl.data.text import TextFederated
from edgefl.errors import DataError

BUILTIN_SOURCES: dict[str, Callable[[dict[str, Any] | None, int, int], FederatedDataset]] = {
    "synthetic": SyntheticFederated,
    "partition": PartitionedFederated,
    "fedh5": FedH5Federated,
    "text": TextFederated,
    "clicks": ClicksFederated,
}


def load_federated(
    source: str, args: Mapping[str, Any] | None, num_devices: int, seed: int
) -> FederatedDataset:
    """Build the federated dataset named by ``source``.

    Args:
        source: a built-in (``"synthetic"``, ``"partition"``, ``"fedh5"``, ``"text"``) or a
            plug-in ``"package.module:function"``.
        args: the source's options (the ``[data.args]`` table); unknown names are rejected.
        num_devices: number of devices (>= 1); device ids are ``0 .. num_devices - 1``.
        seed: non-negative integer; the data is a pure function of ``(source, args, seed)``.

    Construction is cheap for the generated sources: a device's data is built on its first
    ``train(k)`` call and the test set on the first ``test()`` call.

    Raises:
        DataError: unknown source, bad args, unreadable files or a misbehaving plug-in.
    """
    num_devices, seed = check_run_params(num_devices, seed)
    if not isinstance(source, str) or not source:
        raise DataError(f"data.source must be a non-empty string, got {source!r}")
    if args is not None and not isinstance(args, Mapping):
        raise DataError(f"data.args must be a table/dict, got {type(args).__name__}")
    args_dict = dict(args) if args is not None else {}
    if source in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[source](args_dict, num_devices, seed)
    if ":" in source:
        return load_plugin(source, args_dict, num_devices, seed)
    raise DataError(
        f"data.source {source!r}: unknown source; built-ins are "
        f"{', '.join(repr(s) for s in BUILTIN_SOURCES)}, or name a plug-in as "
        "'package.module:function' (called as function(num_devices=..., seed=..., **args))"
    )
