"""The MPI transport's BUNDLE (rank 0 with ``train.vectorize``: a burst of header-only
TRAINs to one rank goes out as one MPI message): order kept with the messages around it,
counted as the messages it carries, and a malformed bundle rejected header by header.

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

t = MPITransport(Validator(1, model_numel=4), comm=MPI.COMM_SELF, peers=[0])
t.bundle_kinds = frozenset({Kind.TRAIN})

def take(n):
    got = []
    for _ in range(2000):
        got += t.poll(timeout=0.005)
        if len(got) >= n:
            break
    return got

for d in range(3):
    t.send(0, Kind.TRAIN, device=d, round=7, aux=(2.0, 0.0, 0.0, 1.0))
t.send(0, Kind.MODEL, device=-1, round=2, payload=np.arange(4, dtype=np.float32))
t.send(0, Kind.TRAIN, device=9, round=8)
got = take(5)
order = [(m.kind.name, m.device, m.round) for m in got]
sent = (dict(t.stats.msgs_sent), dict(t.stats.bytes_sent))
recv = (dict(t.stats.msgs_recv), dict(t.stats.bytes_recv))

# a hostile bundle: a good TRAIN, a header with a bad magic, one claiming a payload
good = HEADER_STRUCT.pack(MAGIC, VERSION, int(Kind.TRAIN), 5, 0, 0, 0, 99, 1, 0.0, 0,
                          0.0, 0.0, 0.0, 0.0)
bad = HEADER_STRUCT.pack(1234, VERSION, int(Kind.TRAIN), 6, 0, 0, 0, 100, 1, 0.0, 0,
                         0.0, 0.0, 0.0, 0.0)
payload = HEADER_STRUCT.pack(MAGIC, VERSION, int(Kind.TRAIN), 7, 1, 0, 1, 101, 1, 0.0, 16,
                             0.0, 0.0, 0.0, 0.0)
t.bundle_kinds = frozenset()
t.send(0, Kind.BUNDLE, payload=np.frombuffer(good + bad + payload, np.uint8))
t.send(0, Kind.BUNDLE, payload=np.zeros(HEADER_BYTES + 3, np.uint8))  # not whole headers
t.send(0, Kind.HEARTBEAT)
hostile = take(2)
print(json.dumps({"order": order, "sent": sent, "recv": recv,
                  "hostile": [(m.kind.name, m.device) for m in hostile],
                  "rejected": dict(t.stats.rejected)}))
t.close()
"""


def test_bundled_messages_keep_their_order_counts_and_checks():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the bundled TRAINs arrive before the MODEL sent after them, the later TRAIN after it
    assert out["order"] == [["TRAIN", 0, 7], ["TRAIN", 1, 7], ["TRAIN", 2, 7],
                            ["MODEL", -1, 2], ["TRAIN", 9, 8]]  # fmt: skip
    # counted as the 5 messages sent and received (+ one BUNDLE header's bytes each way)
    (msgs_sent, bytes_sent), (msgs_recv, bytes_recv) = out["sent"], out["recv"]
    assert msgs_sent["0"] == 5 and msgs_recv["0"] == 5
    assert bytes_sent["0"] == bytes_recv["0"] == 5 * 80 + 16 + 2 * 80
    # the good header of the hostile bundle is delivered, the two bad ones and the
    # truncated bundle are rejected, and the transport goes on (the HEARTBEAT after)
    assert out["hostile"] == [["TRAIN", 5], ["HEARTBEAT", -1]]
    assert out["rejected"]["0"] == 3


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
