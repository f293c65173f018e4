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
from .placement import is_shard
from .state import Task, build_task

log = logging.getLogger("edgefl")

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


def run_inline(run_dir: Path, ranks: int) -> tuple[int, str]:
    """Run the job of the prepared run directory ``run_dir`` (its ``config.toml``) on
    ``ranks`` ranks in this process. Returns (exit status, error message or "");
    status 0 = completed, 2 = an error (the message), 3 = stopped early."""
    cfg = load_config(run_dir / "config.toml")  # as every MPI rank reads it
    if cfg["sim"]["clock"] == "auto":  # (simulate resolves it to "virtual")
        cfg = with_values(cfg, {"sim.clock": "wall"})
    from ..kernels import not_in_effect

    kernels_line = not_in_effect(cfg["run"]["kernels"])  # (torch ran before edgefl pinned it)
    if kernels_line:
        print(f"edgefl: warning: {kernels_line}", file=sys.stderr, flush=True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg["fleet"]["threads"])
    try:
        return _run(cfg, run_dir, ranks)
    finally:
        torch.set_num_threads(threads_before)


def _transport(cfg: dict, fabric: Fabric, rank: int, task: Task) -> Transport:
    c = cfg["comm"]
    validator = Validator(rank, max_payload_bytes=c["max_payload_bytes"])
    validator.model_numel = task.flat.numel
    t = LoopbackTransport(fabric, rank, validator, poll_max_s=c["poll_max_s"])
    if rank == 0 and c["failure_timeout_s"] > 0:
        from ..comm.liveness import Liveness

        t.liveness = Liveness(c["failure_timeout_s"])
    return t


def _run(cfg: dict, run_dir: Path, ranks: int) -> tuple[int, str]:
    from .coordinator import Coordinator
    from .policies import check_policies, check_shards

    check_policies(cfg)
    check_shards(cfg, ranks)
    fabric = Fabric(ranks)
    tasks = [build_task(cfg, "cpu") for _ in range(ranks)]  # before any thread (see above)
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
        coord = Coordinator(cfg, t, tasks[0], run_dir, None)
        coord.register()
        status = coord.run()
    except EdgeflError as e:
        print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        status, message = 2, str(e)
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
