"""One MPI rank of an edgefl job: set up the transport, then act as coordinator or worker.

Failure handling keeps every rank from hanging: rank 0 sends STOP (with an exit status) to
all workers whenever it stops, also after an error; a worker that fails sends ERROR to
rank 0, which then stops everybody. Every rank also runs a :class:`edgefl.rankwrap.RankGuard`:
a stop signal, or the loss of ``mpiexec`` or ``edgefl simulate``, ends it within a second.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from ..ckpt import resume_checkpoint
from ..comm import Kind, Validator, mpi_transport
from ..config import with_values
from ..errors import ConfigError, EdgeflError
from ..launcher import write_status
from ..rankwrap import RankGuard, defer_stop
from ..training.eager import defer_dynamo
from .placement import is_shard
from .policies import check_policies, check_shards
from .rundir import check_run_identity, prepare_run_dir, resolve_run_dir
from .state import build_task

log = logging.getLogger("edgefl")


def _transport(cfg: dict, rank: int):
    c = cfg["comm"]
    validator = Validator(rank, max_payload_bytes=c["max_payload_bytes"])
    t = mpi_transport(
        validator,
        chunk_bytes=c["chunk_bytes"],
        payload_timeout_s=c["payload_timeout_s"],
        poll_max_s=c["poll_max_s"],
    )
    if cfg["train"]["vectorize"] != "off":
        # a round's TRAINs reach a worker together: it trains them as one stack; a stack's
        # UPDATEs reach rank 0 together (one message, not two per device)
        t.bundle_kinds = frozenset({Kind.TRAIN} if rank == 0 else {Kind.UPDATE})
    if rank == 0 and c["failure_timeout_s"] > 0:
        from ..comm.liveness import Liveness

        t.liveness = Liveness(c["failure_timeout_s"])
    return t


def run_rank(cfg: dict, out: str | None, resume: str | None, stem: str, local_rank: int) -> int:
    """Run this rank's part of the job and return its exit status (0 ok, 2 user error, 3
    stopped early); a stop signal or a lost launcher ends the process instead (RankGuard).

    Args:
        cfg: the effective config (identical on every rank).
        out: ``--out`` (rank 0 resolves the run directory).
        resume: checkpoint path to continue from (read by rank 0 only).
        stem: config file stem, for the default run directory name.
        local_rank: node-local rank (GPU choice).
    """
    from ..preflight import checked_test_set
    from .coordinator import Coordinator
    from .worker import Worker, error_payload, error_text

    torch.set_num_threads(cfg["fleet"]["threads"])
    defer_dynamo()  # (a rank that never compiles need not load the compiler: 1 CPU s)
    if cfg["sim"]["clock"] == "auto":  # (`edgefl simulate` resolves it to "virtual")
        cfg = with_values(cfg, {"sim.clock": "wall"})
    guard = RankGuard(_rank()).start()
    t = _transport(cfg, guard.rank)
    status = 2
    out_dir = None
    try:
        if t.rank == 0:
            try:
                state = resume_checkpoint(resume)[1] if resume else None  # (a run's)
                run_dir = resolve_run_dir(cfg, out, resume, stem)
                if state is not None:  # not into another run's directory (rundir.py)
                    check_run_identity(run_dir, state.get("run_id"), str(resume))
                out_dir = prepare_run_dir(run_dir, cfg, resuming=state is not None)
                guard.use_status_file(out_dir / "exit_status")
                check_policies(cfg)
                check_shards(cfg, t.size)
                task = build_task(cfg, "cpu")
                task.test_set = checked_test_set(cfg)  # (built by this rank's preflight)
                _check_chunks(cfg, task.flat.nbytes)
                t.validator.model_numel = task.flat.numel
                coord = Coordinator(cfg, t, task, out_dir, state)
                coord.register()
                if state is not None:
                    coord.restore()
                status = coord.run()
            except EdgeflError as e:
                print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
                status = 2
            except Exception:  # a bug: shown now (the job may be torn down before it rises)
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                raise
            finally:
                _stop_all(t, status)
                if t.failed:  # (declared dead by a time-out: MPI_Finalize would wait for it)
                    from ..comm.mpi import note_failure

                    note_failure()
                if out_dir is not None:  # what `edgefl simulate` reports, whatever the MPI
                    write_status(out_dir / "exit_status", status)
        else:
            worker = None
            try:
                task = build_task(cfg, "cpu")
                _check_chunks(cfg, task.flat.nbytes)
                t.validator.model_numel = task.flat.numel
                if is_shard(t.rank, cfg["ps"]["servers"]):
                    from ..server.shard import Shard

                    worker = Shard(cfg, t, task.flat.numel, task.signature)
                else:
                    worker = Worker(cfg, t, task, local_rank, out_dir=out)
                worker.register()
                # a stop signal (edgefl simulate's SIGINT, passed on): serve on while rank 0
                # stops the run in order; the guard ends this rank if it has not by then
                defer_stop(lambda status, why: None)
                status = worker.run()
                if getattr(worker, "peer_failures", False):
                    from ..comm.mpi import note_failure

                    note_failure()
            except Exception as e:  # report, so rank 0 stops everyone instead of hanging
                where = worker.doing if worker is not None else "set-up"
                t.send(0, Kind.ERROR, payload=error_payload(error_text(where, e)))
                t.wait_sends()
                status = _await_stop(t)
                t.send(0, Kind.HEARTBEAT)
                t.wait_sends()
                return status
    finally:
        t.close()
    return status


def _check_chunks(cfg: dict, model_bytes: int) -> None:
    """The header counts chunks in 16 bits: refuse a chunk size that would need more."""
    chunk = cfg["comm"]["chunk_bytes"]
    if -(-model_bytes // chunk) > 65535:
        raise ConfigError(
            f"config key 'comm.chunk_bytes' = {chunk}: too small for a model of {model_bytes} "
            f"bytes (at most 65535 chunks); use >= {-(-model_bytes // 65535)}"
        )


def _rank() -> int:
    from ..comm.mpi import MPI

    return MPI.COMM_WORLD.Get_rank()


def _stop_all(t, status: int, timeout: float = 60.0) -> None:
    """Send STOP to every worker, then receive (and drop) whatever they still send until
    each acknowledged, so no worker is left blocked on an unmatched send."""
    failures = 1.0 if t.failed else 0.0  # tells the workers not to wait in MPI_Finalize
    for w in range(1, t.size):
        t.send(w, Kind.STOP, aux=(float(status), failures))
    t.wait_sends()
    waiting = set(range(1, t.size)) - t.failed - t.retired  # (retired: stopped already)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for msg in t.poll(timeout=0.5):
            if msg.kind in (Kind.HEARTBEAT, Kind.ERROR):
                waiting.discard(msg.src)
                t.retire(msg.src)  # it may now exit: not a failure
            t.release(msg)
        t.take_failures()
        waiting -= t.failed
    if waiting:
        log.warning("ranks %s did not acknowledge STOP within %.0f s", sorted(waiting), timeout)


def _await_stop(t, timeout: float = 120.0) -> int:
    """After reporting an error, wait for rank 0's STOP (so the job ends together)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msg in t.poll(timeout=1.0):
            if msg.kind == Kind.STOP:
                return 2
        if 0 in t.take_failures() or 0 in t.failed:
            return 2
    return 2
