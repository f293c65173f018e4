"""The ``edgefl`` command: simulate, run, inspect, config, data, bench, report.

User errors (:class:`~edgefl.errors.EdgeflError`) print one line ``edgefl: error: ...`` and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .errors import EdgeflError
from .hardexit import flush_and_exit
from .launcher import GATE_ENV

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


# commands whose parsing does not need the parsers of ``bench`` and ``report`` (whose modules
# every rank of a job would otherwise import just to build them)
LIGHT_COMMANDS = ("simulate", "run", "inspect", "config", "data", "recipes")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``edgefl`` argument parser; given the ``command`` about to run (one of
    :data:`LIGHT_COMMANDS`), without the ``bench`` and ``report`` sub-commands."""
    parser = argparse.ArgumentParser(
        prog="edgefl", description="Federated / edge training over MPI."
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "simulate", help="run a job on this machine (mpiexec, or --backend inline: in-process)"
    )
    _add_config_args(p, config_optional=True)
    p.add_argument("--devices", type=int, help="number of devices (fleet.devices)")
    p.add_argument(
        "--ranks",
        type=_ranks_arg,
        help="MPI ranks incl. the coordinator, or auto: one worker per core (fleet.ranks)",
    )
    p.add_argument("--rounds", type=int, help="global rounds (run.rounds)")
    p.add_argument("--out", help="run directory (default runs/<time>-<name>)")
    p.add_argument("--resume", metavar="CKPT.h5", help="continue from a checkpoint")
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="--resume without a config file: run the code the checkpoint's config names",
    )
    p.add_argument(
        "--backend",
        choices=("mpi", "inline"),
        help="mpi: launch mpiexec; inline: every rank in this process, threads, no MPI "
        "(run.backend, default mpi)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print what would run (the mpiexec command) only"
    )
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

    p = sub.add_parser("data", help="work with the data sources")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    dsub.required = True
    q = dsub.add_parser(
        "export",
        help="write the config's federated data as federated HDF5 (examples/<client>/<feature>)",
    )
    _add_config_args(q, config_optional=True)
    q.add_argument("--out", required=True, metavar="OUT.h5", help="training clients file")
    q.add_argument("--test-out", metavar="TEST.h5", help="also write the test set here")
    q.add_argument("--devices", type=int, help="number of devices (fleet.devices)")
    q.set_defaults(func=cmd_data_export)

    p = sub.add_parser("recipes", help="list the shipped configs that train real data, or show one")
    p.add_argument("action", nargs="?", choices=("list", "show", "path"), default="list")
    p.add_argument("name", nargs="?", help="the recipe (show, path)")
    p.set_defaults(func=cmd_recipes)

    if command not in LIGHT_COMMANDS:
        from .bench import add_bench_parser
        from .report import add_parser as add_report_parser

        add_bench_parser(sub)
        add_report_parser(sub)
    return parser


def cmd_recipes(args: argparse.Namespace) -> int:
    """``edgefl recipes``: the table of recipes; ``show NAME``: its TOML; ``path NAME``."""
    from . import recipes

    if args.action == "list":
        if args.name:
            raise EdgeflError(f"edgefl recipes list takes no name (got {args.name!r})")
        print(recipes.table_markdown(), end="")
        print("run one: edgefl simulate recipe:NAME; copy one: edgefl recipes show NAME > my.toml")
        return 0
    if not args.name:
        raise EdgeflError(f"edgefl recipes {args.action} needs a recipe name")
    found = recipes.path(args.name)
    print(found.read_text(encoding="utf-8") if args.action == "show" else found, end="")
    if args.action == "path":
        print()
    return 0


def _ranks_arg(text: str) -> int | str:
    """``--ranks N`` or ``--ranks auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, not {text!r}") from None


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
    from .recipes import is_recipe, stem

    if is_recipe(config):
        return stem(config)
    return Path(config).stem if config else "default"


def _quick_exit() -> None:
    """Make this interpreter's exit cheap (``edgefl simulate``, every rank of a job): at exit,
    after the other exit handlers, freeze the objects still alive so that the interpreter's
    last garbage collections skip them. Tearing torch down otherwise costs each process
    0.5 to 1.5 s of CPU (more with torch._dynamo and sympy loaded), paid by every rank of a job at
    once. Nothing is left undone: files are closed, exit handlers run; the memory goes back
    to the system with the process."""
    global _quick_exit_armed
    if not _quick_exit_armed:
        import atexit
        import gc

        atexit.register(gc.freeze)  # (registered first: runs after the handlers of later imports)
        _quick_exit_armed = True


_quick_exit_armed = False


def cmd_simulate(args: argparse.Namespace) -> int:
    from . import kernels

    # before anything loads numpy (the config does): an in-process run's OpenBLAS pinned
    kernels.pin_configured(args.config, _overrides(args))
    from .config.sources import simulation_config
    from .launching import (
        banner,
        inline_plan,
        launch_checked,
        mpi_command,
        mpi_launcher,
        run_in_process,
    )
    from .preflight import PreflightFailed, check_ranks_can_import, preflight_apart
    from .runtime.rundir import check_run_dir, resolve_run_dir
    from .shipped import refuse_unshipped

    _quick_exit()
    doc = None
    if args.resume:
        from .ckpt import resume_checkpoint
        from .trust import check_resume_args

        # before MPI: a bad file (digest, schema) is one line; a directory: its newest good one
        resume, resumed = resume_checkpoint(args.resume)
        args.resume = str(resume)
        if not args.config:
            # no config given: continue the checkpoint's own run (its config, plus any --set)
            import tomllib

            doc = tomllib.loads(resumed["config_toml"])
            # fault-test hooks describe the interrupted job, not its continuation
            doc.get("debug", {}).pop("kill_ranks", None)
            # objects edgefl.simulate() passed by value are not in any file (edgefl/shipped.py)
            refuse_unshipped(doc, args.resume, _overrides(args))
            check_resume_args(doc, args)  # its code runs only on your say-so (edgefl/trust.py)
        del resumed
    # the effective config the ranks run with (written to the run directory)
    backend = [f'run.backend="{args.backend}"'] if args.backend else []  # (wins over --set)
    cfg, ranks = simulation_config(args.config, _overrides(args) + backend, doc=doc)
    refuse_unshipped(cfg)  # (e.g. the config.toml of a run directory of such a run)
    inline = cfg["run"]["backend"] == "inline"
    if inline:  # every rank in this process, as edgefl.simulate(backend="inline")
        from .runtime.inline import check_inline

        check_inline(cfg)
    else:
        check_ranks_can_import(cfg)
        launcher, cfg = mpi_launcher(cfg)
    run_dir = resolve_run_dir(cfg, args.out, args.resume, _stem(args.config))
    check_run_dir(run_dir, args.resume)  # not another job's, not another run's (rundir.py)
    try:
        if inline:
            if args.dry_run:
                preflight_apart(cfg)
                print(f"{inline_plan(cfg, ranks)}, run directory {run_dir}")
                return 0
            return run_in_process(cfg, ranks, run_dir, args.resume)[0]
        cmd = mpi_command(launcher, ranks, run_dir, args.resume)
        if args.dry_run:
            preflight_apart(cfg)  # (in a child process: this one never loads torch)
            print(" ".join(cmd))
            return 0
        # the check runs while the ranks start (they wait for it before reading the config)
        line = banner(cfg, ranks, launcher, run_dir)
        return launch_checked(cmd, cfg, run_dir, bool(args.resume), line)
    except PreflightFailed as e:
        return e.status  # (the check printed the error)
    except KeyboardInterrupt:
        return 130


def cmd_run(args: argparse.Namespace) -> int:
    if not any(v in os.environ for v in MPI_ENV):
        raise EdgeflError(
            "edgefl run must be started by an MPI launcher with at least 2 ranks, e.g. "
            f"'mpiexec -n 2 edgefl run {args.config}' (Open MPI: add --oversubscribe for "
            f"more ranks than cores; or let 'edgefl simulate {args.config}' launch it)"
        )
    from . import kernels

    if os.environ.get(kernels.KERNELS_ENV) not in kernels.MODES:
        # started by hand (mpirun ... edgefl run): pinned before numpy loads (its OpenBLAS).
        # A rank edgefl simulate launched has its mode pinned in its environment already,
        # and may start before the run directory's config.toml is written.
        kernels.pin_configured(args.config, args.overrides)
    from .launcher import check_mpi4py

    _quick_exit()
    check_mpi4py()
    from .comm.mpi import world_info

    rank, size, local_rank = world_info()
    if size < 2:
        if rank == 0:
            print(
                "edgefl: error: edgefl run needs at least 2 MPI ranks (1 coordinator + workers),"
                f" e.g. 'mpiexec -n 2 edgefl run {args.config}'",
                file=sys.stderr,
            )
        return 2
    check = os.environ.get(GATE_ENV)
    if check:  # started by edgefl simulate before its pre-launch check (launching.launch_checked)
        from .preflight import CHECK_OPEN, gate_check

        if rank == 0:  # rank 0 checks (the check's imports are its own); the others wait
            gate_check(check)  # before loading torch: a failed check ends the job sooner
        _await_gate(os.path.join(check, CHECK_OPEN), rank)
    from .config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except EdgeflError as e:
        if rank == 0:  # every rank reads the same file and fails the same way
            print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        return 2
    from . import kernels

    kernels.pin(cfg["run"]["kernels"])  # before torch loads (mpirun ... edgefl run by hand)
    from .shipped import load_on_rank

    try:  # objects edgefl.simulate() passed by value: its payload, digest checked first
        load_on_rank(cfg)
    except EdgeflError as e:
        if rank == 0:  # (every rank finds the same)
            print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
        return 2
    from .comm.mpi import finalize
    from .runtime.job import run_rank

    status = run_rank(cfg, args.out, args.resume, _stem(args.config), local_rank)
    finalize(status)  # after a rank failure: leaves at once (Open MPI may hang finalizing)
    _leave_rank(status)
    return status


def _await_gate(gate: str, rank: int) -> None:
    """Wait until ``gate`` exists (``edgefl simulate``'s pre-launch check passed and the run
    directory is written). If ``edgefl simulate`` or mpiexec is gone meanwhile (it killed
    the job: the check failed), leave at once, quietly: nothing of the job has started."""
    from .rankwrap import RankGuard

    guard = RankGuard(rank)  # (not started: only its checks of the parent and launcher)
    while not os.path.exists(gate):
        found = guard.check(0.005)
        if found is not None:
            os._exit(found[0])


def _leave_rank(status: int) -> None:
    """End a rank whose job is over and whose MPI is finalized without the interpreter's
    teardown (with torch loaded 0.1 to 0.3 s of CPU per rank even with the objects frozen,
    over 1 s without; all the ranks pay it at once while ``edgefl simulate`` waits): the
    exit handlers run, the output is flushed, then the process leaves with ``status``.
    Not while another non-daemon thread runs (the interpreter would wait for it)."""
    import atexit
    import threading

    main = threading.main_thread()
    if threading.current_thread() is not main or any(
        t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main
    ):
        return
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_handlers is None:
        return
    run_handlers()  # (logging.shutdown among them: log files flushed and closed)
    flush_and_exit(status)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .ckpt import describe_checkpoint, read_checkpoint

    ck = read_checkpoint(args.checkpoint)  # verifies all of it before printing any
    sys.stdout.write(describe_checkpoint(args.checkpoint, ck) + "\n")
    sys.stdout.flush()  # a closed pipe (| head) raises here, inside main(), not at exit
    _compare_numerics(ck.nodes)
    return 0


def _compare_numerics(nodes: list) -> None:
    """One warning line when this machine (in the checkpoint's kernels mode) computes
    differently from the one that wrote the checkpoint (``nodes``: its entries): a resume
    here goes on, but is not promised to end with the uninterrupted run's model."""
    from .ckpt.describe import checkpoint_numerics

    saved = checkpoint_numerics(nodes)
    if not saved:
        return
    from . import kernels

    kernels.pin(saved.get("kernels", "native"))  # (before torch loads: as a resume would)
    import torch

    torch.set_num_threads(int(saved.get("threads") or 1))
    here = kernels.as_launched(kernels.fingerprint())  # (what a resume's ranks compute with)
    line = kernels.mismatch_line("it was written", saved, here)
    if line:
        print(f"edgefl: warning: resuming on this machine: {line}", file=sys.stderr, flush=True)


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


def cmd_data_export(args: argparse.Namespace) -> int:
    from .config import load_config
    from .data import export_fedh5, load_federated

    cfg = load_config(args.config, _overrides(args))
    data, n = cfg["data"], cfg["fleet"]["devices"]
    fd = load_federated(data["source"], dict(data["args"]), n, cfg["seed"])
    export_fedh5(fd, args.out, args.test_out)
    total = sum(fd.num_samples(k) for k in range(n))
    test = f", test set -> {args.test_out}" if args.test_out else ""
    print(
        f"wrote {n} clients ({total} training examples) of {data['source']!r} -> {args.out}{test}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgefl`` console script; returns the exit status: 0, 2 for a
    user error (one line on stderr), 130 after Ctrl-C, 141 when the reader of the output
    went away (``edgefl config docs | head``: the status of a process ended by SIGPIPE,
    as ``git log | head`` gives; nothing is printed)."""
    if getattr(sys.flags, "safe_path", False):
        # started as `python -P` (the ranks of edgefl simulate): the working directory
        # still imports the user's modules, but after the installed packages, so a folder
        # named edgefl there cannot shadow this one
        sys.path.append(os.getcwd())
    logging.basicConfig(
        level=os.environ.get("EDGEFL_LOG", "WARNING").upper(),
        format="edgefl %(levelname)s %(name)s: %(message)s",
    )
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["bench"]:  # (its modules load numpy: OpenBLAS pinned first)
        from . import kernels

        kernels.pin_blas(_flag(words, "--kernels") or "portable")
    parser = build_parser(words[0] if words and words[0] in LIGHT_COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        try:
            status = int(args.func(args) or 0)
        except EdgeflError as e:
            print(f"edgefl: error: {e}", file=sys.stderr, flush=True)
            return 2
        sys.stdout.flush()  # a closed pipe raises here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _output_gone():
            raise  # some other pipe of the program broke: a bug, keep the traceback
        _silence_output()
        return 141


def _flag(words: list[str], name: str) -> str | None:
    """The value of option ``name`` in ``words`` (``--name V`` or ``--name=V``), else None."""
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(f"{name}="):
            return w.split("=", 1)[1]
    return None


def _output_gone() -> bool:
    """Whether stdout or stderr is a pipe whose reader has closed it."""
    try:
        import select

        poller = select.poll()
        for stream in (sys.stdout, sys.stderr):
            poller.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or no real file descriptor
        return True


def _silence_output() -> None:
    """Point stdout and stderr at the null device, so that flushing what Python still holds
    for them at exit cannot raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    os.close(devnull)
