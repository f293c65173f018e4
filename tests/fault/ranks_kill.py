"""Run under ``mpiexec --with-ft ulfm -n 4``: ranks SIGKILL themselves mid-exchange and the
survivors must notice through the transport and finish on their own.

Usage: ranks_kill.py VICTIMS OUT_DIR   (VICTIMS: "3", "2,3" or "0")

* Worker victims (ranks among 1-3): rank 0 hands out tasks ASP-style (MODEL + TRAIN,
  answered by an UPDATE = model + rank) to ranks 1-3. A victim answers round KILL_ROUND,
  then kills itself while rank 0 already sends it the next model (a send that can never
  complete). Rank 0 must detect it, keep serving the others until ROUNDS rounds each, stop
  them and close.
* VICTIMS = 0 (the coordinator): rank 0 kills itself after rank 1's update of round
  KILL_ROUND; the workers (which listen to rank 0 only) must find rank 0 in
  ``take_failures()`` and leave on their own.

Every surviving rank writes OUT_DIR/rank<r>.json ({"ok": true, ...}); each victim writes
OUT_DIR/killed<r>.json with the monotonic time of its kill (CLOCK_MONOTONIC is machine-wide
on Linux, so a detection latency is a plain difference). Launched by
tests/fault/test_transport_failures.py.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from edgefl.comm.mpi import MPITransport, finalize
from edgefl.comm.wire import Kind, Validator

NUMEL = 1 << 16  # 256 KiB models: above the shared-memory eager limit (rendezvous sends)
ROUNDS = 40
KILL_ROUND = 10
STEP_S = 0.02  # a worker's "compute" per round
LIMIT_S = 20.0  # no rank may spend longer than this in the exchange

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 4, "run with mpiexec -n 4"
victims, out = {int(x) for x in sys.argv[1].split(",")}, Path(sys.argv[2])
assert victims == {0} or 0 not in victims
workers = [1, 2, 3]


def write(name: str, doc: dict) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.rename(out / name)


def die() -> None:
    write(f"killed{rank}.json", {"rank": rank, "at": time.monotonic()})
    os.kill(os.getpid(), signal.SIGKILL)


def killed_at(r: int) -> float:
    return json.loads((out / f"killed{r}.json").read_text())["at"]


def fail(what: str) -> None:
    print(f"rank {rank}: FAILED: {what}", file=sys.stderr, flush=True)
    write(f"rank{rank}.json", {"rank": rank, "ok": False, "error": what})
    finalize(1)
    sys.exit(1)


v = Validator(rank, model_numel=NUMEL)
# when the coordinator dies, the workers listen to rank 0 only: the single-peer receive path
t = MPITransport(v, peers=[0] if rank and victims == {0} else None)
comm.Barrier()  # every transport exists before anybody sends
start = time.monotonic()
model = np.arange(NUMEL, dtype=np.float32)

if rank == 0:
    v.hosted = {w: frozenset({w}) for w in workers}
    done = dict.fromkeys(workers, 0)
    after_detect = dict.fromkeys(workers, 0)
    found_at: dict[int, float] = {}
    live = set(workers)

    def task(w: int, rnd: int) -> None:
        t.send(w, Kind.MODEL, payload=model)
        t.send(w, Kind.TRAIN, device=w, round=rnd)

    for w in workers:
        task(w, 1)
    while any(done[w] < ROUNDS for w in live):
        if time.monotonic() - start > LIMIT_S:
            fail(f"exchange did not finish: rounds {done}, failed {sorted(t.failed)}")
        for m in t.poll(timeout=0.2):
            if m.kind != Kind.UPDATE:
                fail(f"unexpected {m.kind.name} from rank {m.src}")
            if m.round != done[m.src] + 1 or not np.array_equal(m.payload, model + m.src):
                fail(f"bad update from rank {m.src}, round {m.round}")
            t.release(m)
            done[m.src] += 1
            # survivors: after any detection; a victim: after its own (must stay 0)
            if found_at and (m.src not in victims or m.src in found_at):
                after_detect[m.src] += 1
            if victims == {0} and m.src == 1 and done[1] == KILL_ROUND:
                die()
            if done[m.src] < ROUNDS:
                task(m.src, done[m.src] + 1)
        for r in t.take_failures():
            found_at[r] = time.monotonic()
            live.discard(r)
    t0 = time.monotonic()
    for w in workers:  # those to dead ranks are dropped, not an error
        t.send(w, Kind.STOP, aux=(0.0,))
    t.wait_sends()
    t.close()
    close_s = time.monotonic() - t0
    expect = {w: KILL_ROUND if w in victims else ROUNDS for w in workers}
    if done != expect:
        fail(f"rounds {done}, expected {expect}")
    if t.failed != victims or set(found_at) != victims:
        fail(f"failed {sorted(t.failed)}, found {sorted(found_at)}, killed {sorted(victims)}")
    if min(after_detect[w] for w in workers if w not in victims) == 0:
        fail(f"no update from the survivors after the detection: {after_detect}")
    latency = {r: found_at[r] - killed_at(r) for r in sorted(victims)}
    for r, s in latency.items():
        print(f"rank 0: rank {r} detected {s * 1e3:.1f} ms after its kill", flush=True)
    write(
        "rank0.json",
        {
            "rank": 0,
            "ok": True,
            "failed": sorted(t.failed),
            "detect_latency_s": {str(r): s for r, s in latency.items()},
            "rounds": done,
            "after_detection": after_detect,
            "close_s": close_s,
        },
    )
else:
    current = None
    rounds = 0
    lost_at = None
    detected: list[int] = []
    while True:
        if time.monotonic() - start > LIMIT_S:
            fail(f"no STOP and no failure after {rounds} rounds")
        msgs = t.poll(timeout=0.5)
        stop = False
        for m in msgs:
            if m.kind == Kind.MODEL:
                current = m.payload.copy()
                t.release(m)
            elif m.kind == Kind.TRAIN:
                time.sleep(STEP_S)
                t.send(0, Kind.UPDATE, device=rank, round=m.round, payload=current + rank)
                rounds += 1
                if rank in victims and rounds == KILL_ROUND:
                    t.wait_sends()  # the update is out; the next model is not taken
                    die()
            elif m.kind == Kind.STOP:
                stop = True
        if stop:  # later exits of the other workers are no concern of this one
            break
        found = t.take_failures()
        detected += found
        if 0 in found:
            lost_at = time.monotonic()
            print(f"rank {rank}: coordinator (rank 0) died; exiting", flush=True)
            break
    t.wait_sends()
    t.close()
    doc = {"rank": rank, "ok": True, "rounds": rounds, "detected": sorted(detected)}
    if victims == {0}:
        if lost_at is None:
            fail("stopped without noticing the coordinator's death")
        doc["detect_latency_s"] = lost_at - killed_at(0)
        doc["closed_after_s"] = time.monotonic() - killed_at(0)
        print(f"rank {rank}: rank 0 detected {doc['detect_latency_s'] * 1e3:.1f} ms after its kill")
    elif rounds != ROUNDS:
        fail(f"{rounds} rounds")
    write(f"rank{rank}.json", doc)
finalize(0)  # after a process failure: leaves without MPI_Finalize (which may hang)
