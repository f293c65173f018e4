"""``edgefl bench transport``: edgefl's model push against raw mpi4py, same run.

Two ranks; rank 1 pushes a float32 model of each size to rank 0, which acknowledges every
message with a 1-byte raw send (the same acknowledgement for both systems, so each timed
message is fully delivered before the next one starts). Trials of the two systems alternate
and the median of each is reported. ``ratio`` = edgefl MB/s / raw MB/s.
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

NAME = "transport"
HELP = "edgefl model push vs raw mpi4py Isend/Irecv, 64 KB to 64 MB"
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in SIZES),
        help="payload sizes in bytes, comma-separated",
    )
    p.add_argument("--trials", type=int, default=9, help="alternating trials per system")
    p.add_argument(
        "--mbytes-per-trial",
        type=float,
        default=256.0,
        help="bytes moved per trial (MB); sets repetitions per size",
    )


def main(args: argparse.Namespace) -> int:
    from ..launcher import child_env, find_mpiexec
    from .common import header, table, write_json

    cfg = {"sizes": args.sizes, "trials": args.trials, "mbytes_per_trial": args.mbytes_per_trial}
    header(NAME, sys.argv, cfg, None)
    launcher = find_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = launcher.command(
            2,
            [sys.executable, "-m", "edgefl.bench.transport", str(out), json.dumps(cfg)],
            ulfm=False,
        )
        print(f"# mpi: {launcher.flavor} {launcher.version}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env=child_env(False))
        if proc.returncode != 0:
            print("edgefl: error: transport benchmark ranks failed", file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    print(table(rows, ["bytes", "edgefl_MBps", "raw_MBps", "ratio"]))
    big = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    if big:
        print(f"# min ratio for payloads >= 1 MB: {min(big):.3f} (target >= 0.9)")
    write_json(args.json, rows)
    return 0


def _ranks(out: str, cfg: dict) -> None:  # runs inside mpiexec
    from mpi4py import MPI

    from ..comm.mpi import MPITransport
    from ..comm.wire import Kind, Validator

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ack = np.zeros(1, np.uint8)
    rows = []
    for size in (int(s) for s in cfg["sizes"].split(",")):
        n = size // 4
        reps = max(3, int(cfg["mbytes_per_trial"] * 1e6 // size))
        validator = Validator(rank, model_numel=n)
        validator.hosted[1] = frozenset({0})
        t = MPITransport(validator, comm=comm, peers=[1 - rank])
        send_buf = np.random.default_rng(0).random(n, dtype=np.float32)
        recv_buf = np.empty(n, np.float32)
        times: dict[str, list[float]] = {"raw": [], "edgefl": []}
        for _trial in range(cfg["trials"]):
            for system in ("raw", "edgefl"):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    if rank == 1:
                        if system == "raw":
                            comm.Isend([send_buf, MPI.FLOAT], 0, 7).Wait()
                        else:
                            t.send(0, Kind.UPDATE, device=0, payload=send_buf)
                        comm.Recv([ack, MPI.BYTE], 0, 8)
                    else:
                        if system == "raw":
                            comm.Irecv([recv_buf, MPI.FLOAT], 1, 7).Wait()
                        else:
                            msgs: list = []
                            while not msgs:
                                msgs = t.poll(timeout=1.0)
                        comm.Send([ack, MPI.BYTE], 1, 8)
                        if system == "edgefl":
                            for m in msgs:
                                t.release(m)
                t.wait_sends()  # completions are reaped as the transport goes; settle them
                times[system].append(time.perf_counter() - t0)
        t.close()
        if rank == 0:
            raw = size * reps / float(np.median(times["raw"])) / 1e6
            ours = size * reps / float(np.median(times["edgefl"])) / 1e6
            rows.append(
                {
                    "bytes": size,
                    "edgefl_MBps": round(ours, 1),
                    "raw_MBps": round(raw, 1),
                    "ratio": round(ours / raw, 3),
                    "reps": reps,
                }
            )
            print(f"# {size} bytes: edgefl {ours:.0f} MB/s, raw {raw:.0f} MB/s", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


if __name__ == "__main__":
    _ranks(sys.argv[1], json.loads(sys.argv[2]))
