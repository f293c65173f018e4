"""The MPI transport's BUNDLE (with ``train.vectorize``: a burst of TRAINs from rank 0 to
one rank, and a stack's UPDATEs from a worker to rank 0, go out as one MPI message): order
kept with the messages around it, counted as the messages it carries (headers and
payloads), payloads delivered intact, and a malformed bundle rejected message by message
as far as it can be framed.

Runs the real MPITransport on ``MPI.COMM_SELF`` (a rank sending to itself) in a child
process, so this pytest process never initialises MPI."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, struct
import numpy as np
from mpi4py import MPI
from edgefl.comm.mpi import MPITransport
from edgefl.comm.wire import HEADER_BYTES, HEADER_STRUCT, MAGIC, VERSION, Kind, Validator

# rank 0 talking to itself: it accepts what goes down (TRAIN, MODEL) and up (UPDATE)
t = MPITransport(Validator(0, model_numel=4), comm=MPI.COMM_SELF, peers=[0])
t.bundle_kinds = frozenset({Kind.TRAIN, Kind.UPDATE})

def take(n):
    got = []
    for _ in range(2000):
        got += t.poll(timeout=0.005)
        if len(got) >= n:
            break
    return got

released = []
for d in range(3):
    t.send(0, Kind.TRAIN, device=d, round=7, aux=(2.0, 0.0, 0.0, 1.0))
upd = np.arange(4, dtype=np.float32) + 0.5
t.send(0, Kind.UPDATE, device=3, round=7, payload=upd, release=lambda: released.append(3))
upd[:] = -1  # (the sender's buffer is free once released: the bundle holds a copy)
t.send(0, Kind.MODEL, device=-1, round=2, payload=np.arange(4, dtype=np.float32))
t.send(0, Kind.TRAIN, device=9, round=8)
got = take(6)
order = [(m.kind.name, m.device, m.round) for m in got]
payload = [m.payload.tolist() for m in got if m.kind == Kind.UPDATE]
sent = (dict(t.stats.msgs_sent), dict(t.stats.bytes_sent))
recv = (dict(t.stats.msgs_recv), dict(t.stats.bytes_recv))

def hdr(kind, device, seq, nbytes=0, magic=MAGIC, dtype=0):
    return HEADER_STRUCT.pack(magic, VERSION, int(kind), device, dtype, 0, 1 if nbytes else 0,
                              seq, 1, 0.0, nbytes, 0.0, 0.0, 0.0, 0.0)

# a hostile bundle: a good TRAIN; a TRAIN claiming a payload (rejected, its 16 bytes
# skipped); a good UPDATE with its payload; a header with a bad magic (rejected, and
# nothing after it can be framed: the TRAIN behind it is dropped)
four = np.arange(4, dtype=np.float32).tobytes()
hostile = (hdr(Kind.TRAIN, 5, 99) + hdr(Kind.TRAIN, 6, 100, 16, dtype=1) + four
           + hdr(Kind.UPDATE, 8, 101, 16, dtype=1) + four
           + hdr(Kind.TRAIN, 7, 102, magic=1234) + hdr(Kind.TRAIN, 10, 103))
t.bundle_kinds = frozenset()
t.send(0, Kind.BUNDLE, payload=np.frombuffer(hostile, np.uint8))
# a payload that runs past the bundle's end; bytes short of a header at the end
t.send(0, Kind.BUNDLE, payload=np.frombuffer(hdr(Kind.UPDATE, 11, 104, 16, dtype=1) + four[:8],
                                             np.uint8))
t.send(0, Kind.BUNDLE, payload=np.zeros(HEADER_BYTES + 3, np.uint8))
t.send(0, Kind.HEARTBEAT)
hostile = take(3)
print(json.dumps({"order": order, "payload": payload, "released": released, "sent": sent,
                  "recv": recv, "hostile": [(m.kind.name, m.device) for m in hostile],
                  "hostile_payload": [m.payload.tolist() for m in hostile
                                      if m.payload is not None],
                  "rejected": dict(t.stats.rejected)}))
t.close()
"""


def test_bundled_messages_keep_their_order_counts_and_checks():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the bundled TRAINs and UPDATE arrive before the MODEL sent after them, the later
    # TRAIN after it; the UPDATE's payload as it was sent (copied into the bundle)
    assert out["order"] == [["TRAIN", 0, 7], ["TRAIN", 1, 7], ["TRAIN", 2, 7],
                            ["UPDATE", 3, 7], ["MODEL", -1, 2], ["TRAIN", 9, 8]]  # fmt: skip
    assert out["payload"] == [[0.5, 1.5, 2.5, 3.5]] and out["released"] == [3]
    # counted as the 6 messages sent and received, each its header and payload bytes as
    # if it went alone (+ one BUNDLE header's bytes each way)
    (msgs_sent, bytes_sent), (msgs_recv, bytes_recv) = out["sent"], out["recv"]
    assert msgs_sent["0"] == 6 and msgs_recv["0"] == 6
    assert bytes_sent["0"] == bytes_recv["0"] == 6 * 80 + 16 + 16 + 2 * 80
    # the good messages of the hostile bundle are delivered (the UPDATE with its payload);
    # the TRAIN with a payload, the bad magic, the payload past the end and the bytes
    # short of a header are rejected, and the transport goes on (the HEARTBEAT after)
    assert out["hostile"] == [["TRAIN", 5], ["UPDATE", 8], ["HEARTBEAT", -1]]
    assert out["hostile_payload"] == [[0.0, 1.0, 2.0, 3.0]]
    assert out["rejected"]["0"] == 4


REAP_CHILD = r"""
import json
from mpi4py import MPI
from edgefl.comm.mpi import MPITransport
from edgefl.comm.wire import Validator

t = MPITransport(Validator(1, model_numel=4), comm=MPI.COMM_SELF, peers=[0])
released = []

def release_1():  # releasing a send to a dead rank reaps again (as a callback may)
    released.append(1)
    t._reap()

t._dead.update({1, 2})
for dest, rel in ((1, release_1), (2, lambda: released.append(2))):
    t._pend(([], None, rel, dest, None))
t._reap()
print(json.dumps({"released": released, "pending": len(t._pending), "n": t._npending}))
t.close()
"""


def test_a_reap_nested_in_a_release_callback_leaves_the_outer_reap_consistent():
    """Every worker killed (tests/fault/test_stops.py) once ended rank 0 with a KeyError:
    abandoning a send to one dead rank ran a callback that reaped again, took the other
    dead rank's queue, and the outer reap then deleted it a second time. Each send is now
    released once and the count of pending sends stays right."""
    proc = subprocess.run([sys.executable, "-c", REAP_CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got["released"]) == [1, 2] and got["pending"] == 0 and got["n"] == 0
