"""``edgefl bench staging``: a GPU worker's push, device-to-host staging included, vs raw mpi4py.

Two ranks. Rank 1 holds a float32 model of each size on ``--device`` (default ``cuda``), the
way a CUDA worker does: the parameters live in one flat device tensor
(:class:`edgefl.models.FlatParams`) and a push first copies them into its pinned host buffer
(``FlatParams.to_host``). Per message:

* ``edgefl``: ``FlatParams.to_host()`` then the transport's UPDATE push (header, validation);
* ``raw``: ``host.copy_(flat)`` into a pinned tensor, then ``comm.Isend(...).Wait()``.

Rank 0 acknowledges every message with a 1-byte raw send, so each timed message is fully
delivered before the next starts. Trials alternate; medians are reported. ``stage_GBps`` is
the device-to-host copy alone (synchronized). ``ratio`` = edgefl MB/s / raw MB/s.

``--device cpu`` runs the same code without a GPU (staging is then a no-op for edgefl and a
memory copy for raw): a dry run of the script, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NAME = "staging"
HELP = "CUDA worker push (device->host staging + edgefl push) vs raw mpi4py, 64 KB to 64 MB"
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="torch device of the pushing rank")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--trials", type=int, default=7, help="alternating trials per system")
    p.add_argument("--mbytes-per-trial", type=float, default=128.0, help="MB moved per trial")


def check_device(device: str) -> None:
    """Fail with one line when ``device`` is not usable by torch here."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"edgefl bench staging: --device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"edgefl bench staging: --device {device!r}: torch sees no CUDA device here "
            "(torch.cuda.is_available() is False); run on a GPU machine or use --device cpu"
        )


def main(args: argparse.Namespace) -> int:
    from ..launcher import child_env, find_mpiexec, own_session
    from .common import header, table, write_json

    check_device(args.device)
    cfg = {
        "device": args.device,
        "sizes": args.sizes,
        "trials": args.trials,
        "mbytes_per_trial": args.mbytes_per_trial,
    }
    header(NAME, sys.argv, cfg, None)
    launcher = find_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        prog = [sys.executable, "-m", "edgefl.bench.staging", str(out), json.dumps(cfg)]
        cmd = launcher.command(2, prog, ulfm=False)
        print(f"# mpi: {launcher.flavor} {launcher.version}: {' '.join(cmd)}", flush=True)
        with own_session(child_env(False)) as env:
            failed = subprocess.run(cmd, env=env).returncode != 0
        if failed:
            print("edgefl: error: staging benchmark ranks failed", file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    print(table(rows, ["bytes", "stage_GBps", "edgefl_MBps", "raw_MBps", "ratio"]))
    big = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    if big:
        print(f"# min ratio for payloads >= 1 MB: {min(big):.3f} (target >= 0.95)")
    write_json(args.json, rows)
    return 0


def _one_size(comm, rank: int, size: int, cfg: dict) -> dict | None:
    import torch
    from mpi4py import MPI
    from torch import nn

    from ..comm.mpi import MPITransport
    from ..comm.wire import Kind, Validator
    from ..models.flat import FlatParams

    n = size // 4
    reps = max(3, int(cfg["mbytes_per_trial"] * 1e6 // size))
    validator = Validator(rank, model_numel=n)
    validator.hosted[1] = frozenset({0})
    t = MPITransport(validator, comm=comm, peers=[1 - rank])
    ack = np.zeros(1, np.uint8)
    dev = torch.device(cfg["device"] if rank == 1 else "cpu")
    model = nn.Module()
    model.w = nn.Parameter(torch.rand(n, generator=torch.Generator().manual_seed(0)))
    flat = FlatParams(model, dev)
    pinned = torch.empty(n, dtype=torch.float32, pin_memory=dev.type == "cuda")
    recv = np.empty(n, np.float32)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"raw": [], "edgefl": [], "stage": []}
    for _trial in range(cfg["trials"]):
        if rank == 1:
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                pinned.copy_(flat.flat)
            sync()
            times["stage"].append(time.perf_counter() - t0)
        for system in ("raw", "edgefl"):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                if rank == 1:
                    if system == "raw":
                        pinned.copy_(flat.flat)
                        comm.Isend([pinned.numpy(), MPI.FLOAT], 0, 7).Wait()
                    else:
                        t.send(0, Kind.UPDATE, device=0, payload=flat.to_host())
                    comm.Recv([ack, MPI.BYTE], 0, 8)
                elif system == "raw":
                    comm.Irecv([recv, MPI.FLOAT], 1, 7).Wait()
                    comm.Send([ack, MPI.BYTE], 1, 8)
                else:
                    msgs: list = []
                    while not msgs:
                        msgs = t.poll(timeout=1.0)
                    comm.Send([ack, MPI.BYTE], 1, 8)
                    for m in msgs:
                        t.release(m)
            t.wait_sends()
            times[system].append(time.perf_counter() - t0)
    stage = comm.bcast(times["stage"], root=1)
    t.close()
    if rank != 0:
        return None
    med = {k: float(np.median(v)) for k, v in (*times.items(), ("stage", stage))}
    raw, ours = size * reps / med["raw"] / 1e6, size * reps / med["edgefl"] / 1e6
    row = {"bytes": size, "stage_GBps": round(size * reps / med["stage"] / 1e9, 2),
           "edgefl_MBps": round(ours, 1), "raw_MBps": round(raw, 1),
           "ratio": round(ours / raw, 3), "reps": reps}  # fmt: skip
    print(f"# {size} bytes: {row}", flush=True)
    return row


def _ranks(out: str, cfg: dict) -> None:  # runs inside mpiexec
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)  # (as the runtime's fleet.threads: idle OpenMP threads spin)
    comm = MPI.COMM_WORLD
    rows = [_one_size(comm, comm.Get_rank(), int(s), cfg) for s in cfg["sizes"].split(",")]
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


if __name__ == "__main__":
    _ranks(sys.argv[1], json.loads(sys.argv[2]))
