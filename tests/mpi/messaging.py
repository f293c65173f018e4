"""Run under ``mpiexec -n 3``: every message kind round-trips; forged messages are rejected
and duplicates ignored while the conversation goes on. Exits 0 only if every check passed.

Phase 1 chunks every payload (1 KiB chunks). Phase 2 (default chunks) sends model-sized
payloads on the model tags, into receives posted in advance, among forged messages of that
kind and raw bytes on the header tag (short, too long, bad magic).

Launched by tests/test_mpi_messaging.py.
"""

import json
import struct
import sys
import time

import numpy as np
from mpi4py import MPI

from edgefl.algorithms.ordering.kinds import ORDER
from edgefl.comm.mpi import TAG_HEADER, MPITransport
from edgefl.comm.wire import HEADER_STRUCT, MAGIC, VERSION, Kind, Validator

NUMEL = 1000
CHUNK = 1024  # forces 4000-byte payloads into 4 chunks
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 3, "run with mpiexec -n 3"
HOSTED = {1: [0, 2], 2: [1, 3]}


def recv_one(t, kinds=None):
    while True:
        for m in t.poll(timeout=5.0):
            return m
        raise AssertionError(f"rank {rank}: nothing arrived")


def expect(cond, what):
    if not cond:
        print(f"rank {rank}: FAILED: {what}", file=sys.stderr, flush=True)
        comm.Abort(1)


v = Validator(rank, model_numel=NUMEL)
t = MPITransport(v, chunk_bytes=CHUNK)

if rank != 0:
    devs = HOSTED[rank]
    reg = np.frombuffer(json.dumps({"devices": devs}).encode(), np.uint8)
    t.send(0, Kind.REGISTER, payload=reg)
    t.send(0, Kind.HEARTBEAT)
    # forged: unknown kind, wrong length, wrong dtype, a device this rank does not host
    t.send(0, 99, device=devs[0])
    t.send(0, Kind.UPDATE, device=devs[0], payload=np.zeros(NUMEL + 3, np.float32))
    t.send(0, Kind.UPDATE, device=devs[0], payload=np.zeros(NUMEL, np.float64))
    t.send(0, Kind.UPDATE, device=99, payload=np.zeros(NUMEL, np.float32))
    good = np.arange(NUMEL, dtype=np.float32) * rank
    seq = t.send(0, Kind.UPDATE, device=devs[0], round=1, aux=(10, 0.5, 0.1, 1), payload=good)
    t.send(
        0, Kind.UPDATE, device=devs[0], round=1, payload=np.full(NUMEL, 7.0, np.float32), seq=seq
    )  # re-delivery of the same sequence number with other contents
    t.send(0, Kind.UPDATE, device=devs[1], round=1, payload=good + 1)
    t.send(0, Kind.ERROR, payload=np.frombuffer(f"hello from {rank}".encode(), np.uint8))
    t.wait_sends()
    # downlink: MODEL, TRAIN, ORDER, HEARTBEAT, then STOP
    got = {}
    while Kind.STOP not in got:
        m = recv_one(t)
        got[m.kind] = m
    expect(
        np.array_equal(got[Kind.MODEL].payload, np.linspace(0, 1, NUMEL, dtype=np.float32)),
        "MODEL payload",
    )
    expect(got[Kind.TRAIN].device == devs[1] and got[Kind.TRAIN].round == 5, "TRAIN header")
    expect(got[ORDER].payload.dtype == np.int32, "ORDER dtype")
    expect(np.array_equal(got[ORDER].payload, np.arange(17, dtype=np.int32)[::-1]), "ORDER")
    expect(Kind.HEARTBEAT in got, "HEARTBEAT down")
    expect(got[Kind.STOP].aux[0] == 0.0, "STOP status")
    expect(sum(t.stats.rejected.values()) == 0, "worker rejected nothing")
else:
    per = {r: [] for r in (1, 2)}
    need = 5  # REGISTER, HEARTBEAT, 2 UPDATE, ERROR per worker
    while sum(len(x) for x in per.values()) < 2 * need:
        for m in t.poll(timeout=10.0):
            per[m.src].append(m)
            if m.kind == Kind.REGISTER:
                info = json.loads(bytes(m.payload).decode())
                v.hosted[m.src] = frozenset(info["devices"])
    for r in (1, 2):
        kinds = [m.kind for m in per[r]]
        expect(
            kinds == [Kind.REGISTER, Kind.HEARTBEAT, Kind.UPDATE, Kind.UPDATE, Kind.ERROR],
            f"kinds from rank {r}: {kinds}",
        )
        u1, u2 = per[r][2], per[r][3]
        expect(
            u1.device == HOSTED[r][0] and u1.round == 1 and u1.aux == (10, 0.5, 0.1, 1),
            "UPDATE header",
        )
        expect(
            np.array_equal(u1.payload, np.arange(NUMEL, dtype=np.float32) * r),
            "UPDATE payload (chunked)",
        )
        expect(
            np.array_equal(u2.payload, np.arange(NUMEL, dtype=np.float32) * r + 1),
            "second UPDATE payload",
        )
        expect(bytes(per[r][4].payload).decode() == f"hello from {r}", "ERROR text")
        expect(t.stats.rejected[r] == 4, f"rejected from rank {r}: {t.stats.rejected[r]}")
        expect(t.stats.duplicates[r] == 1, f"duplicates from rank {r}: {t.stats.duplicates[r]}")
    model = np.linspace(0, 1, NUMEL, dtype=np.float32)
    for r in (1, 2):
        t.send(r, Kind.MODEL, payload=model)
        t.send(r, Kind.TRAIN, device=HOSTED[r][1], round=5)
        t.send(r, ORDER, device=HOSTED[r][0], payload=np.arange(17, dtype=np.int32)[::-1])
        t.send(r, Kind.HEARTBEAT)
        t.send(r, Kind.STOP, aux=(0.0,))
    t.wait_sends()
t.close()
comm.Barrier()

# -- phase 2: model tags and payload receives posted in advance --------------------------
c2 = comm.Dup()
v2 = Validator(rank, model_numel=NUMEL)
t2 = MPITransport(v2, comm=c2, peers=[0] if rank else None)  # workers: the one-peer path
raw_header = bytearray(HEADER_STRUCT.pack(MAGIC, VERSION, 8, -1, 0, 0, 0, 1, 0, 0.0, 0, *[0.0] * 4))
if rank != 0:
    devs = HOSTED[rank]
    reg = np.frombuffer(json.dumps({"devices": devs}).encode(), np.uint8)
    t2.send(0, Kind.REGISTER, payload=reg)
    forged = np.zeros(NUMEL, np.float32)
    t2.send(0, Kind.UPDATE, device=99, payload=forged)  # model tag, nothing posted yet
    good = np.arange(NUMEL, dtype=np.float32) + 10 * rank
    seq = t2.send(0, Kind.UPDATE, device=devs[0], round=2, payload=good)
    t2.send(0, Kind.UPDATE, device=98, payload=forged)  # into the receive posted for it
    t2.send(0, Kind.UPDATE, device=devs[0], round=2, payload=forged, seq=seq)  # duplicate
    try:  # a header that cannot be packed, once its payload is out on the model tag
        t2.send(0, Kind.UPDATE, device=1 << 40, payload=good)
        expect(False, "an unpackable header was sent")
    except struct.error:
        pass
    c2.Send([raw_header[:40], MPI.BYTE], 0, TAG_HEADER)  # a short header
    c2.Send([raw_header + bytes(20), MPI.BYTE], 0, TAG_HEADER)  # a header too long
    bad = bytearray(raw_header)
    bad[0] ^= 0xFF
    c2.Send([bad, MPI.BYTE], 0, TAG_HEADER)  # bad magic
    t2.send(0, Kind.UPDATE, device=devs[1], round=3, payload=good * 2)
    t2.send(0, Kind.ERROR, payload=np.frombuffer(b"end", np.uint8))
    t2.wait_sends()
    models = []
    while True:
        m = recv_one(t2)
        if m.kind == Kind.STOP:
            break
        expect(m.kind == Kind.MODEL, f"phase 2: {m.kind} instead of MODEL")
        models.append(m.payload.copy())
        t2.release(m)
    expect(len(models) == 3, f"phase 2: {len(models)} models")
    for k, got in enumerate(models):
        expect(np.array_equal(got, np.full(NUMEL, k, np.float32) + rank), f"model {k}")
    expect(sum(t2.stats.rejected.values()) == 2, f"worker rejected {dict(t2.stats.rejected)}")
    expect(t2.stats.duplicates[0] == 1, f"worker duplicates {dict(t2.stats.duplicates)}")
else:
    per = {r: [] for r in (1, 2)}
    while not all(any(m.kind == Kind.ERROR for m in x) for x in per.values()):
        for m in t2.poll(timeout=10.0):
            per[m.src].append(m)
            if m.kind == Kind.REGISTER:
                v2.hosted[m.src] = frozenset(json.loads(bytes(m.payload).decode())["devices"])
    for r in (1, 2):
        kinds = [m.kind for m in per[r]]
        expect(
            kinds == [Kind.REGISTER, Kind.UPDATE, Kind.UPDATE, Kind.ERROR],
            f"phase 2 kinds from rank {r}: {kinds}",
        )
        u1, u2 = per[r][1], per[r][2]
        base = np.arange(NUMEL, dtype=np.float32) + 10 * r
        expect(u1.round == 2 and np.array_equal(u1.payload, base), "phase 2 UPDATE")
        expect(u2.round == 3 and np.array_equal(u2.payload, base * 2), "phase 2 UPDATE 2")
        expect(t2.stats.rejected[r] == 6, f"phase 2 rejected from rank {r}: {t2.stats.rejected}")
        expect(t2.stats.duplicates[r] == 1, f"phase 2 duplicates from {r}")
        for m in per[r]:
            t2.release(m)
    for r in (1, 2):
        t2.send(r, Kind.MODEL, payload=np.zeros(NUMEL + 1, np.float32))  # wrong size
        for k in range(3):  # the first on a fresh receive, then into ones posted in advance
            seq = t2.send(r, Kind.MODEL, round=k, payload=np.full(NUMEL, k, np.float32) + r)
            if k == 0:  # a duplicate, then a short header: dropped while the worker waits
                t2.send(r, Kind.MODEL, payload=np.full(NUMEL, -1, np.float32), seq=seq)
                t2.wait_sends()
                time.sleep(0.01)
                c2.Send([raw_header[:40], MPI.BYTE], r, TAG_HEADER)
                time.sleep(0.01)
        t2.send(r, Kind.STOP, aux=(0.0,))
    t2.wait_sends()
t2.close()
c2.Barrier()
print(f"rank {rank} OK", flush=True)
