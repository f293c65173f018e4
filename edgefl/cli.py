"""The ``edgefl`` command: simulate, run, inspect, config, bench, report.

User errors (:class:`~edgefl.errors.EdgeflError`) print one line ``edgefl: error: ...`` and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from .errors import EdgeflError

MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK", "MPI_LOCALNRANKS")


def _add_config_args(p: argparse.ArgumentParser, config_optional: bool) -> None:
    if config_optional:
        p.add_argument("config", nargs="?", help="TOML config (default: the built-in job)")
    else:
        p.add_argument("config", help="TOML config")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=0.1 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgefl", description="Federated / edge training over MPI."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("simulate", help="launch mpiexec on this machine and run a job")
    _add_config_args(p, config_optional=True)
    p.add_argument("--devices", type=int, help="number of devices (fleet.devices)")
    p.add_argument("--ranks", type=int, help="MPI ranks incl. the coordinator (fleet.ranks)")
    p.add_argument("--rounds", type=int, help="global rounds (run.rounds)")
    p.add_argument("--out", help="run directory (default runs/<time>-<name>)")
    p.add_argument("--resume", metavar="CKPT.h5", help="continue from a checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command only")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("run", help="run inside an existing mpirun/srun job")
    _add_config_args(p, config_optional=False)
    p.add_argument("--out", help="run directory (default runs/<time>-<name>)")
    p.add_argument("--resume", metavar="CKPT.h5", help="continue from a checkpoint")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="describe a checkpoint")
    p.add_argument("checkpoint", metavar="CKPT.h5")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("config", help="show the effective config or the reference")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION")
    csub.required = True
    q = csub.add_parser("show", help="print the effective config as TOML")
    _add_config_args(q, config_optional=True)
    q.set_defaults(func=cmd_config_show)
    q = csub.add_parser("docs", help="print the configuration reference (Markdown)")
    q.set_defaults(func=cmd_config_docs)
    q = csub.add_parser(
        "matrix", help="print the composition matrix of the algorithm options (Markdown)"
    )
    q.set_defaults(func=cmd_config_matrix)

    from .bench import add_bench_parser
    from .report import add_parser as add_report_parser

    add_bench_parser(sub)
    add_report_parser(sub)
    return parser


def _version() -> str:
    from . import __version__

    return f"edgefl {__version__}"


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = []
    for opt, key in (
        ("devices", "fleet.devices"),
        ("ranks", "fleet.ranks"),
        ("rounds", "run.rounds"),
    ):
        v = getattr(args, opt, None)
        if v is not None:
            extra.append(f"{key}={v}")
    return list(args.overrides) + extra


def _stem(config: str | None) -> str:
    return Path(config).stem if config else "default"


def preflight(cfg: dict) -> None:
    """Build the data source and model once here, so a bad plug-in, missing file or bad
    model argument fails with one line before any MPI rank starts."""
    from .runtime.policies import check_policies
    from .runtime.state import build_task

    check_policies(cfg)
    task = build_task(cfg, "cpu")
    task.data.test()
    if cfg["sim"]["clock"] == "virtual":
        from .sim.profiles import load_fleet

        load_fleet(cfg["sim"]["profiles"], cfg["fleet"]["devices"], cfg["seed"])


def cmd_simulate(args: argparse.Namespace) -> int:
    from .ckpt import load_checkpoint
    from .config import load_config, with_values
    from .launcher import child_env, find_mpiexec
    from .runtime.rundir import prepare_run_dir, resolve_run_dir

    if args.resume and not args.config:
        # no config given: continue the checkpoint's own run (its config, plus any --set)
        import tomllib

        doc = tomllib.loads(load_checkpoint(args.resume)["config_toml"])
        # fault-test hooks describe the interrupted job, not its continuation
        doc.get("debug", {}).pop("kill_ranks", None)
        cfg = load_config(None, _overrides(args), doc=doc)
    else:
        cfg = load_config(args.config, _overrides(args))
    # the effective config the ranks run with (written to the run directory)
    effective: dict = {}
    if cfg["sim"]["clock"] == "auto":
        effective["sim.clock"] = "virtual"
    prof = cfg["sim"]["profiles"]
    if prof.endswith((".toml", ".csv")) and not Path(prof).is_absolute():
        effective["sim.profiles"] = str(Path(prof).resolve())  # the ranks read the run's copy
    cfg = with_values(cfg, effective)
    ranks = cfg["fleet"]["ranks"]
    servers = cfg["ps"]["servers"]  # server shard ranks 1..servers (docs/parameter-server.md)
    if ranks - 1 - servers > cfg["fleet"]["devices"]:
        ranks = cfg["fleet"]["devices"] + 1 + servers  # no idle worker ranks
    if servers:
        from .runtime.policies import check_shards

        check_shards(cfg, ranks)
    if args.resume:
        load_checkpoint(args.resume)  # fail early on a missing or corrupt checkpoint
    _check_mpi4py()
    launcher = find_mpiexec()
    if launcher.failure_detection() == "timeout" and cfg["comm"]["failure_timeout_s"] == 0:
        # this MPI cannot report dead ranks: fall back to time-outs (docs/architecture.md, Failures)
        cfg = with_values(cfg, {"comm.failure_timeout_s": 120.0})
    preflight(cfg)
    run_dir = resolve_run_dir(cfg, args.out, args.resume, _stem(args.config))
    argv = [
        sys.executable,
        "-m",
        "edgefl",
        "run",
        str(run_dir / "config.toml"),
        "--out",
        str(run_dir),
    ]
    if args.resume:
        argv += ["--resume", str(args.resume)]
    cmd = launcher.command(ranks, argv)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    prepare_run_dir(run_dir, cfg, resuming=bool(args.resume))
    print(
        f"edgefl simulate: {cfg['fleet']['devices']} devices on {ranks - 1 - servers} worker "
        f"ranks + {f'{servers} server shards + ' if servers else ''}coordinator "
        f"({launcher.flavor} {launcher.version}), run directory {run_dir}",
        flush=True,
    )
    status_file = run_dir / "exit_status"
    status_file.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, env=child_env(sys.stdout.isatty()))
    except KeyboardInterrupt:
        return 130
    try:  # rank 0's verdict: an MPI without ULFM reports a killed rank as the job's status
        return int(status_file.read_text().strip())
    except (OSError, ValueError):
        return proc.returncode


def _check_mpi4py() -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise EdgeflError(
            "mpi4py is not installed: pip install 'edgefl[mpi]' (mpi4py + Open MPI)"
        ) from None


def cmd_run(args: argparse.Namespace) -> int:
    if not any(v in os.environ for v in MPI_ENV):
        raise EdgeflError(
            "edgefl run must be started by an MPI launcher with at least 2 ranks, e.g. "
            f"'mpiexec -n 4 edgefl run {args.config}' (or let 'edgefl simulate "
            f"{args.config}' launch it)"
        )
    _check_mpi4py()
    from .comm.mpi import world_info

    rank, size, local_rank = world_info()
    if size < 2:
        if rank == 0:
            print(
                "edgefl: error: edgefl run needs at least 2 MPI ranks (1 coordinator + workers),"
                f" e.g. 'mpiexec -n 4 edgefl run {args.config}'",
                file=sys.stderr,
            )
        return 2
    from .config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except EdgeflError as e:
        if rank == 0:  # every rank reads the same file and fails the same way
            print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        return 2
    from .comm.mpi import finalize
    from .runtime.job import run_rank

    status = run_rank(cfg, args.out, args.resume, _stem(args.config), local_rank)
    finalize(status)  # after a rank failure: leaves at once (Open MPI may hang finalizing)
    return status


def cmd_inspect(args: argparse.Namespace) -> int:
    from .ckpt import describe_checkpoint

    print(describe_checkpoint(args.checkpoint))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from .config import dump_config, load_config

    sys.stdout.write(dump_config(load_config(args.config, args.overrides)))
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from .config.docs import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def cmd_config_matrix(args: argparse.Namespace) -> int:
    from .algorithms.compose import matrix_markdown

    sys.stdout.write(matrix_markdown())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgefl`` console script; returns the exit status."""
    logging.basicConfig(
        level=os.environ.get("EDGEFL_LOG", "WARNING").upper(),
        format="edgefl %(levelname)s %(name)s: %(message)s",
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EdgeflError as e:
        print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
