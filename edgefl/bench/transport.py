"""``edgefl bench transport``: edgefl's model push against raw mpi4py, same run.

Two ranks; rank 1 pushes a float32 model of each size to rank 0, which acknowledges every
message with a 1-byte raw send (the same acknowledgement for both systems, so each timed
message is fully delivered before the next one starts). Trials of the two systems alternate.

The sender times every message (push to acknowledgement); ``edgefl_MBps`` and ``raw_MBps``
are the payload size over the median of those times, over all trials, and ``ratio`` =
edgefl MB/s / raw MB/s. A per-message median stays put on a shared machine, where a whole
trial is often stretched by other processes; ``ratio_trials`` is the same ratio from the
median trial duration (equal to ``ratio`` on an idle machine). One verdict line per size
compares ``ratio`` with the target for that size (:func:`target`).
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
# (smallest payload in bytes, lowest acceptable edgefl/raw ratio), largest first
TARGETS = [(1 << 20, 0.95), (256 << 10, 0.9), (64 << 10, 0.7)]


def target(nbytes: int) -> float | None:
    """The lowest acceptable edgefl/raw ratio for a payload of ``nbytes`` (None below 64 KB)."""
    for least, ratio in TARGETS:
        if nbytes >= least:
            return ratio
    return None


def verdicts(rows: list[dict]) -> list[str]:
    """One line per measured size: its ratio against its target, met or not."""
    out = []
    for r in rows:
        want = target(r["bytes"])
        size = f"{r['bytes'] >> 10} KB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MB"
        if want is None:
            out.append(f"# verdict {size}: ratio {r['ratio']:.3f} (no target below 64 KB)")
        else:
            ok = "met" if r["ratio"] >= want else "NOT met"
            out.append(f"# verdict {size}: ratio {r['ratio']:.3f}, target >= {want}: {ok}")
    return out


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
    from ..launcher import child_env, find_mpiexec, own_session
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
        with own_session(child_env(False)) as env:
            proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            print("edgefl: error: transport benchmark ranks failed", file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    cols = ["bytes", "edgefl_MBps", "raw_MBps", "ratio", "ratio_trials", "edgefl_us", "raw_us"]
    print(table(rows, cols))
    for line in verdicts(rows):
        print(line)
    write_json(args.json, rows)
    return 0


def _ranks(out: str, cfg: dict) -> None:  # runs inside mpiexec
    from mpi4py import MPI

    from ..comm.mpi import MPITransport
    from ..comm.wire import Kind, Validator

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ack = np.zeros(1, np.uint8)
    clock = time.perf_counter
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
        each: dict[str, list[np.ndarray]] = {"raw": [], "edgefl": []}  # per message, rank 1
        for _trial in range(cfg["trials"]):
            for system in ("raw", "edgefl"):
                comm.Barrier()
                t0 = clock()
                if rank == 1:
                    lat = np.empty(reps)
                    for k in range(reps):
                        m0 = clock()
                        if system == "raw":
                            comm.Isend([send_buf, MPI.FLOAT], 0, 7).Wait()
                        else:
                            t.send(0, Kind.UPDATE, device=0, payload=send_buf)
                        comm.Recv([ack, MPI.BYTE], 0, 8)
                        lat[k] = clock() - m0
                    each[system].append(lat)
                else:
                    for _ in range(reps):
                        if system == "raw":
                            comm.Irecv([recv_buf, MPI.FLOAT], 1, 7).Wait()
                            comm.Send([ack, MPI.BYTE], 1, 8)
                            continue
                        msgs: list = []
                        while not msgs:
                            msgs = t.poll(timeout=1.0)
                        comm.Send([ack, MPI.BYTE], 1, 8)
                        for m in msgs:
                            t.release(m)
                t.wait_sends()  # completions are reaped as the transport goes; settle them
                times[system].append(clock() - t0)
        t.close()
        medians = comm.bcast(
            {k: float(np.median(np.concatenate(v))) for k, v in each.items()}
            if rank == 1
            else None,
            root=1,
        )
        if rank == 0:
            raw = size / medians["raw"] / 1e6
            ours = size / medians["edgefl"] / 1e6
            trials = float(np.median(times["raw"])) / float(np.median(times["edgefl"]))
            rows.append(
                {
                    "bytes": size,
                    "edgefl_MBps": round(ours, 1),
                    "raw_MBps": round(raw, 1),
                    "ratio": round(ours / raw, 3),
                    "ratio_trials": round(trials, 3),
                    "edgefl_us": round(medians["edgefl"] * 1e6, 1),
                    "raw_us": round(medians["raw"] * 1e6, 1),
                    "reps": reps,
                }
            )
            print(f"# {size} bytes: edgefl {ours:.0f} MB/s, raw {raw:.0f} MB/s", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


if __name__ == "__main__":
    _ranks(sys.argv[1], json.loads(sys.argv[2]))
