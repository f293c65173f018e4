"""Rank 0's registration of the worker (and server) ranks (called by the coordinator)."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import TYPE_CHECKING

from ..comm import Kind
from ..errors import EdgeflError
from ..kernels import differences
from .events import WorkerFailed, error_text
from .placement import devices_of_rank

if TYPE_CHECKING:  # (annotations only)
    from .coordinator import Coordinator

log = logging.getLogger("edgefl.coordinator")


def register(core: Coordinator) -> None:
    """Wait for every worker's REGISTER and check it hosts the expected devices; then
    set up the run (policy, clocks, plugins) so that :meth:`restore` can load into it."""
    timeout = core.cfg["comm"]["register_timeout_s"]
    deadline = time.monotonic() + timeout
    waiting = set(range(1, core.t.size))
    while waiting:
        if time.monotonic() > deadline:
            raise EdgeflError(
                f"ranks {sorted(waiting)} did not register within {timeout} s "
                "(comm.register_timeout_s)"
            )
        for msg in core.t.poll(timeout=0.5):
            if msg.kind == Kind.ERROR:
                raise WorkerFailed(error_text(msg))
            if msg.kind != Kind.REGISTER:
                log.warning("ignoring %s from rank %d during registration", msg.kind.name,
                            msg.src)  # fmt: skip
                continue
            info = json.loads(bytes(msg.payload).decode("utf-8"))
            core.rank_info[msg.src] = info  # (plugins read their on_register fields)
            if not core.server.register(msg.src, info):
                register_worker(core, msg.src, info)
            waiting.discard(msg.src)
    _write_ranks(core)
    check_numerics(core)
    core.setup()
    for p in core.plugins:
        p.on_registered()


def check_numerics(core: Coordinator) -> None:
    """Warn (one line per rank) about a rank whose kernels compute differently from rank 0's
    (another CPU capability, MKL path, thread count or torch: :mod:`edgefl.kernels`); such
    a rank's devices train a model that is not bit-identical to other machines' runs. The
    differences go into summary.json (``numerics_differ``)."""
    for r, info in sorted(core.rank_info.items()):
        diff = differences(core.numerics, info.get("numerics"))
        if diff:
            core.numerics_differ[str(r)] = diff
            log.warning(
                "rank %d (%s) computes with other numerics than rank 0 (%s): its devices' "
                "updates are not promised bit-identical across machines (run.kernels = "
                '"portable" on every rank pins them; docs/reproducibility.md)',
                r, info.get("host"), "; ".join(diff),
            )  # fmt: skip


def rehost_numerics(core: Coordinator, d: int, old: int, new: int) -> None:
    """Warn when device ``d`` moves from rank ``old`` to a rank ``new`` whose numerics
    differ: from then on it trains as the new host's CPU computes."""
    a = core.rank_info.get(old, {}).get("numerics")
    diff = differences(a, core.rank_info.get(new, {}).get("numerics"))
    if diff:
        log.warning(
            "device %d moved from rank %d to rank %d, which computes with other numerics "
            "(%s): the run's model is not promised bit-identical to a run without the failure",
            d, old, new, "; ".join(diff),
        )  # fmt: skip


def _write_ranks(core: Coordinator) -> None:
    """``ranks.json`` in the run directory: every rank's host, pid and devices (what a user
    or a test needs to signal one rank from outside)."""
    if core.out_dir is None:
        return
    import os

    doc = {"0": {"host": socket.gethostname(), "pid": os.getpid(), "devices": []}}
    for r, info in sorted(core.rank_info.items()):
        doc[str(r)] = {"host": info.get("host"), "pid": info.get("pid"),
                       "devices": [d["id"] for d in info.get("devices", [])]}  # fmt: skip
    tmp = core.out_dir / ".ranks.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, core.out_dir / "ranks.json")


def register_worker(core: Coordinator, rank: int, info: dict) -> None:
    expect = devices_of_rank(rank, core.num_devices, core.t.size, core.server.servers)
    got = [d["id"] for d in info["devices"]]
    if got != expect:
        raise EdgeflError(f"rank {rank} registered devices {got}, expected {expect}")
    core.check_signature(rank, info)
    for d in info["devices"]:
        core.devices[d["id"]] = {
            "rank": rank, "torch": d["torch"], "samples": int(d["samples"]), "rounds": 0,
            "bytes_up": 0, "bytes_down": 0, "msgs_up": 0, "msgs_down": 0, "time_s": 0.0,
            "requests": 0, "iterations": 0,
        }  # fmt: skip
    core.t.validator.hosted[rank] = frozenset(got)
