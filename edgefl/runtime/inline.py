"""The in-process backend of :func:`edgefl.simulate` (``backend="inline"``): a whole job in
this process, no MPI.

Rank 0 (the coordinator) runs in the calling thread, ranks >= 1 (workers, or server shards
with ``ps.servers``) in threads, over the loopback transport (:mod:`edgefl.comm.loopback`).
Each rank does what :func:`edgefl.runtime.job.run_rank` does under MPI: it reads the run
directory's ``config.toml``, builds its own task, and rank 0 writes the run directory
(metrics.jsonl, summary.json, final_model.pt, checkpoints, exit_status). So the job trains
the model the MPI run trains, bit for bit, for the same config and seed.

Every rank's task is built here, in order, before any thread starts: a worker's warm-up
step draws from torch's global random generator, shared by the threads, and a draw landing
inside another rank's seeded model initialisation would change that model (see
tests/golden/configs.py ``run_loopback``).

The threads share one interpreter (the GIL), so how they wait matters more than how they
send: a waiting rank sleeps until a message for it arrives (:class:`Bells`: no polling on a
timer, which takes the interpreter from the threads doing the work), and under the virtual
clock the worker ranks take turns (:class:`Turns`): one trains at a time while the
coordinator handles what has arrived, instead of all of them handing the interpreter back
and forth at every torch call. Neither changes what is computed: the messages, their order
per sender and every rank's arithmetic are those of any other schedule, and under the
virtual clock the model does not depend on when a rank runs (nor on the rank count).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import torch

from ..comm import Kind, Transport, Validator
from ..comm.loopback import Fabric, LoopbackTransport
from ..config import load_config, with_values
from ..errors import ConfigError, EdgeflError
from ..preflight import checked_test_set
from .placement import is_shard
from .rundir import release_run_dir
from .state import Task, build_task

log = logging.getLogger("edgefl")

INTERRUPTED = 130  # exit status of a job stopped by Ctrl-C (edgefl.launcher.INTERRUPTED)
JOIN_TIMEOUT_S = 120.0  # how long rank 0 waits for the other ranks to return after STOP


def check_inline(cfg: dict) -> None:
    """Refuse what cannot run inside the calling process (ConfigError naming the key): a
    killed worker rank's thread ends, but a server shard kills its process."""
    shards = [r for r in cfg["debug"]["kill_ranks"] if 1 <= r <= cfg["ps"]["servers"]]
    if shards:
        raise ConfigError(
            f"config key 'debug.kill_ranks' = {cfg['debug']['kill_ranks']}: server shard ranks "
            f'{shards} kill their process, which inline is the caller\'s; use backend="mpi"'
        )


def run_inline(run_dir: Path, ranks: int, resume: dict | None = None) -> tuple[int, str]:
    """Run the job of the prepared run directory ``run_dir`` (its ``config.toml``) on
    ``ranks`` ranks in this process; ``resume``: the state of the checkpoint to continue
    from (:func:`edgefl.ckpt.resume_checkpoint`), restored by rank 0 as under MPI.
    Returns (exit status, error message or ""); status 0 = completed, 2 = an error (the
    message), 3 = stopped early. A KeyboardInterrupt (Ctrl-C) stops every rank, leaves
    exit status 130 in the run directory and is raised again."""
    cfg = load_config(run_dir / "config.toml")  # as every MPI rank reads it
    if cfg["sim"]["clock"] == "auto":  # (simulate resolves it to "virtual")
        cfg = with_values(cfg, {"sim.clock": "wall"})
    from ..kernels import not_in_effect

    # (torch ran, or numpy loaded, before edgefl pinned them)
    kernels_line = not_in_effect(cfg["run"]["kernels"], cfg["train"]["vectorize"] != "off")
    if kernels_line:
        print(f"edgefl: warning: {kernels_line}", file=sys.stderr, flush=True)
    from ..training.eager import defer_dynamo

    defer_dynamo()  # (as every MPI rank: a job that never compiles need not load the compiler)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg["fleet"]["threads"])
    try:
        return _run(cfg, run_dir, ranks, resume)
    finally:
        torch.set_num_threads(threads_before)
        release_run_dir(run_dir)  # (claimed by prepare_run_dir for the job's life)


# -- scheduling the ranks' threads ----------------------------------------------------------
TURN_S = 0.05  # a worker rank's turn (seconds) before it lets the next waiting one in


class Turns:
    """Worker ranks that take turns: at most one of them runs at a time (the coordinator
    and server shards are not in it). Under the GIL, worker threads training at once only
    take the interpreter from each other: every torch call hands it over, and each thread
    then waits for it again. Taking turns, each trains its tasks at full speed while the
    coordinator, on the other core, handles what already arrived.

    A rank holds its turn until it waits for messages (:meth:`InlineTransport.poll` with
    nothing there), or until it held it ``turn_s`` and another is waiting (then it queues
    again: first come, first served). Used under the virtual clock only, where what the
    job computes does not depend on when a rank runs."""

    def __init__(self, turn_s: float = TURN_S) -> None:
        self.turn_s = turn_s
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None
        self._queue: list[int] = []  # ranks waiting for a turn, first come first
        self._since = 0.0  # when the holder got its turn

    def take(self, rank: int) -> None:
        """Wait for ``rank``'s turn (at once when nobody holds one)."""
        with self._cond:
            if self._holder == rank:
                return
            if self._holder is None and not self._queue:
                self._holder, self._since = rank, time.monotonic()
                return
            self._queue.append(rank)
            while self._holder is not None or self._queue[0] != rank:
                self._cond.wait()
            self._queue.pop(0)
            self._holder, self._since = rank, time.monotonic()

    def give(self, rank: int) -> None:
        """End ``rank``'s turn (nothing when it holds none)."""
        with self._cond:
            if self._holder == rank:
                self._holder = None
                self._cond.notify_all()

    def share(self, rank: int) -> None:
        """``rank`` may go on: queue again if its turn is over and another rank waits."""
        if self._queue and self._holder == rank:  # (unlocked reads: a hint, checked below)
            if time.monotonic() - self._since >= self.turn_s:
                self.give(rank)
                self.take(rank)


class Bells(Fabric):
    """The loopback fabric with a doorbell per rank, rung by every message to it (and by a
    death): a waiting :class:`InlineTransport` wakes when something arrives, instead of
    polling on a timer (each poll of an idle thread costs the working ones the GIL)."""

    def __init__(self, size: int, turns: Turns | None = None) -> None:
        super().__init__(size)
        self.bells = [threading.Event() for _ in range(size)]
        self.turns = turns

    def inject(self, src: int, dest: int, header, payload) -> None:
        super().inject(src, dest, header, payload)
        self.bells[dest].set()

    def kill(self, rank: int) -> None:
        super().kill(rank)
        for bell in self.bells:
            bell.set()


class InlineTransport(LoopbackTransport):
    """The loopback transport of the in-process backend: the same messages, validation and
    failures, but a poll that waits for its doorbell (:class:`Bells`) instead of spinning
    and sleeping, and, for a rank in ``fabric.turns``, that ends its turn while it waits."""

    fabric: Bells
    WAKE_S = 0.1  # longest wait between checks of the liveness detector

    def __init__(self, fabric: Bells, rank: int, validator: Validator, turns: bool = False,
                 **kw) -> None:  # fmt: skip
        super().__init__(fabric, rank, validator, **kw)
        self.turns = fabric.turns if turns else None
        self._bell = fabric.bells[rank]

    def poll(self, timeout: float = 0.0) -> list:
        turns = self.turns
        if turns is not None:
            turns.take(self.rank)
        known = len(self.failed)
        self._check_liveness()
        self._bell.clear()  # (before looking: a message sent after this rings it again)
        msgs = self._poll_once()
        if msgs or timeout <= 0:
            if turns is not None:
                turns.share(self.rank)
            return msgs
        deadline = time.monotonic() + timeout
        if turns is not None:
            turns.give(self.rank)
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return []
                self._bell.wait(min(deadline - now, self.WAKE_S))
                self._bell.clear()
                self._check_liveness()
                msgs = self._poll_once()
                if msgs or len(self.failed) != known:
                    return msgs
        finally:
            if turns is not None:
                turns.take(self.rank)

    def close(self) -> None:
        super().close()
        if self.turns is not None:
            self.turns.give(self.rank)


def _transport(cfg: dict, fabric: Bells, rank: int, task: Task) -> Transport:
    c = cfg["comm"]
    validator = Validator(rank, max_payload_bytes=c["max_payload_bytes"])
    validator.model_numel = task.flat.numel
    worker = rank > 0 and not is_shard(rank, cfg["ps"]["servers"])
    t = InlineTransport(fabric, rank, validator, turns=worker, poll_max_s=c["poll_max_s"])
    if rank == 0 and c["failure_timeout_s"] > 0:
        from ..comm.liveness import Liveness

        t.liveness = Liveness(c["failure_timeout_s"])
    return t


def _run(cfg: dict, run_dir: Path, ranks: int, resume: dict | None) -> tuple[int, str]:
    from .coordinator import Coordinator
    from .policies import check_policies, check_shards

    check_policies(cfg)
    check_shards(cfg, ranks)
    virtual = cfg["sim"]["clock"] == "virtual"
    fabric = Bells(ranks, Turns() if virtual else None)  # (wall clock: every rank at once)
    tasks = [build_task(cfg, "cpu") for _ in range(ranks)]  # before any thread (see above)
    tasks[0].test_set = checked_test_set(cfg)  # (the one run_in_process's check built, if any)
    transports = [_transport(cfg, fabric, r, tasks[r]) for r in range(ranks)]
    statuses: list[int | None] = [None] * ranks
    threads = [
        threading.Thread(
            target=_side, args=(cfg, transports[r], tasks[r], run_dir, statuses),
            name=f"edgefl-rank{r}", daemon=True,
        )
        for r in range(1, ranks)
    ]  # fmt: skip
    for th in threads:
        th.start()
    t = transports[0]
    status, message = 2, ""
    try:
        coord = Coordinator(cfg, t, tasks[0], run_dir, resume)
        coord.register()
        if resume is not None:
            coord.restore()
        status = coord.run()
    except EdgeflError as e:
        print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        status, message = 2, str(e)
    except KeyboardInterrupt:
        status = INTERRUPTED  # (the workers get it with their STOP; raised again below)
        raise
    finally:
        _stop_all(t, status)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for th in threads:
            th.join(timeout=max(deadline - time.monotonic(), 0.0))
        late = [th.name for th in threads if th.is_alive()]
        if late:
            log.warning("%s did not stop within %.0f s", ", ".join(late), JOIN_TIMEOUT_S)
        t.close()
        (run_dir / "exit_status").write_text(f"{status}\n")  # as rank 0 writes it under MPI
    return status, message


def _side(cfg: dict, t: Transport, task: Task, run_dir: Path, statuses: list) -> None:
    """Rank ``t.rank`` >= 1: a server shard or a worker, until rank 0's STOP. An error is
    reported to rank 0 (ERROR), which then stops everybody, as under MPI."""
    from .debughooks import RankKilled
    from .worker import Worker, error_payload, error_text

    side = None
    try:
        if is_shard(t.rank, cfg["ps"]["servers"]):
            from ..server.shard import Shard

            side = Shard(cfg, t, task.flat.numel, task.signature)
        else:
            side = Worker(cfg, t, task, t.rank, out_dir=str(run_dir))
        side.register()
        statuses[t.rank] = side.run()
    except RankKilled:  # (debug.kill_ranks: the fabric already reports it dead)
        statuses[t.rank] = 128 + 9
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which stops the job
        t.send(
            0, Kind.ERROR, payload=error_payload(error_text(getattr(side, "doing", "set-up"), e))
        )
        statuses[t.rank] = _await_stop(t)
    finally:
        t.close()


def _stop_all(t: Transport, status: int) -> None:
    """STOP (with the exit status) to every other rank; they acknowledge and return."""
    for r in range(1, t.size):
        t.send(r, Kind.STOP, aux=(float(status), 0.0))
    t.wait_sends()


def _await_stop(t: Transport, timeout: float = JOIN_TIMEOUT_S) -> int:
    """After reporting an error, wait for rank 0's STOP."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(msg.kind == Kind.STOP for msg in t.poll(timeout=0.5)):
            break
    return 2
