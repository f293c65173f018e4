"""The configuration schema: every key, its type, default, range and meaning.

This table is the single source of truth: the loader validates against it, the embedded
default config is built from it, and ``docs/configuration.md`` is generated from it
(``edgefl config docs``; a test checks the page is current). The core's sections are
written here; the plugins' come from the plugin registry through an entry point
(:func:`plugin_sections`), so this layer names no plugin.
"""

from __future__ import annotations

from typing import Any

from .fields import Field, field

_CORE: dict[str, Any] = {
    "seed": field(
        0, "int", "Run seed; data, initial model, shuffling and sampling derive from it.", min=0
    ),
    "run": {
        "rounds": field(20, "int", "Number of global rounds (T).", min=1),
        "target_accuracy": field(
            0.0,
            "float",
            "Stop early once test accuracy reaches this (0 = never stop early).",
            min=0.0,
            max=1.0,
        ),
        "eval_every": field(
            1, "int", "Evaluate the global model on the test set every N rounds.", min=1
        ),
        "on_divergence": field(
            "stop",
            "str",
            "When the run diverges (the global test loss becomes non-finite, or "
            "run.divergence_share of the devices is quarantined for non-finite updates): "
            "stop = stop with exit status 4 and one line naming the likely cause; continue "
            "= say so once and go on. A non-finite global model always stops. summary.json "
            "`diverged` records the first sign either way.",
            choices=("stop", "continue"),
        ),
        "divergence_share": field(
            0.5,
            "float",
            "Share of the fleet's devices quarantined for non-finite updates "
            "(fleet.quarantine_after) at which the run counts as diverged, in (0, 1].",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "max_virtual_s": field(
            0.0,
            "float",
            "Stop once the clock passes this many seconds (virtual under simulate; 0 = no limit).",
            min=0.0,
        ),
        "eval_every_s": field(
            0.0,
            "float",
            "Also evaluate at the first model version after every multiple of this many "
            "clock seconds (0 = only eval_every).",
            min=0.0,
        ),
        "test_memory_mb": field(
            256.0,
            "float",
            "Largest test set in MiB that rank 0 keeps in memory; a larger one (from a "
            "source that knows its size and builds it in parts: the synthetic one) goes to "
            "an unlinked temporary file in $TMPDIR, part by part, and is evaluated from there "
            "batch by batch, with the same results (0 = always in memory; "
            "docs/performance.md).",
            min=0.0,
        ),
        "checkpoint_every": field(
            5, "int", "Write a checkpoint every N rounds (0 = only at the end).", min=0
        ),
        "out": field(
            "",
            "str",
            "Run directory (config, metrics.jsonl, checkpoints, final model); "
            "empty = runs/<time>-<name>.",
        ),
        "preflight": field(
            "auto",
            "str",
            "Data checks of edgefl simulate before launch (labels, shapes, NaN/inf, empty "
            "devices, memory estimate): full = every device and the test set, sample = 16 "
            "devices (the first 8, the last, the rest evenly spaced) and the test set, auto "
            "= full when the sample projects under 3 seconds for all, else sample; off = "
            "none of these.",
            choices=("auto", "full", "sample", "off"),
        ),
        "kernels": field(
            "portable",
            "str",
            "CPU numerics of every rank: portable = the same kernels on any x86-64 CPU with "
            "AVX2 (torch's CPU capability pinned to AVX2, MKL's code path to AVX2, oneDNN "
            "capped at AVX2; set before torch loads), so a config trains the same model bit "
            "for bit on every such machine; native = the fastest kernels of this CPU "
            "(AVX-512 where present), whose rounding differs between CPUs "
            "(docs/reproducibility.md).",
            choices=("portable", "native"),
        ),
        "backend": field(
            "mpi",
            "str",
            "How `edgefl simulate` runs the job: mpi = launch mpiexec with fleet.ranks ranks; "
            "inline = every rank in this one process (threads over an in-process transport, "
            "no MPI), the same model for the same config and seed.",
            choices=("mpi", "inline"),
        ),
    },
    "fleet": {
        "devices": field(8, "int", "Number of logical edge devices (clients).", min=1),
        "ranks": field(
            "auto",
            "int",
            "MPI ranks `edgefl simulate` and `edgefl.simulate` launch, coordinator included "
            "(>= 2); auto = the coordinator plus one worker per core this process may use "
            "(os.sched_getaffinity), no more workers than devices, plus `ps.servers` shards.",
            min=2,
            auto=True,
        ),
        "device": field(
            "auto",
            "str",
            "Torch device of worker ranks: auto (cuda:{local_rank % gpus} where CUDA "
            "exists, else cpu), cpu, cuda or cuda:N.",
        ),
        "device_map": field(
            {}, "table", 'Per-device override of the torch device, e.g. {"0" = "cuda:0"}.'
        ),
        "on_failure": field(
            "continue",
            "str",
            "When a worker rank dies: continue without its devices, or stop (checkpoint, "
            "exit status 3).",
            choices=("continue", "stop"),
        ),
        "rehost": field(
            "auto",
            "str",
            "When a worker rank dies, move its devices to surviving ranks (data rebuilt, "
            "per-device state from the latest checkpoint, lost tasks re-run): on, off, or "
            "auto (on under the virtual clock of edgefl simulate, off under edgefl run).",
            choices=("auto", "on", "off"),
        ),
        "quarantine_after": field(
            3,
            "int",
            "Non-finite (NaN/inf) updates or losses in a row after which a device gets no more "
            "tasks (each one is excluded from aggregation; 0 = keep dispatching).",
            min=0,
        ),
        "task_timeout_s": field(
            "auto",
            "float",
            "Watchdog of one task, in seconds of real time: a worker rank still in a task "
            "after this long is stuck; rank 0 gives up on it and moves its devices, the task "
            "is re-run once, and a second time-out quarantines its device. auto = "
            "max(10 s, 10 x the device's slowest task so far; the fleet's median before it "
            "has one; 60 s when nothing is measured), 60 s more for a device's first task "
            "on a rank, under the virtual clock of edgefl simulate (off under edgefl run); "
            "0 = off.",
            min=0.0,
            auto=True,
        ),
        "threads": field(
            1, "int", "Torch intra-op threads per rank (1 suits many ranks per box).", min=1
        ),
    },
    "data": {
        "source": field(
            "synthetic",
            "str",
            "Dataset: synthetic, partition, fedh5, text, or a plug-in 'package.module:function'.",
        ),
        "args": field(
            {},
            "table",
            "Keyword arguments of the data source (see docs/custom-data-and-models.md); "
            "keys not given take the defaults listed at the end of this page, then the "
            "source's own.",
        ),
    },
    "model": {
        "name": field(
            "mlp", "str", "Model: logreg, mlp, cnn, lstm, or a custom 'package.module:Class'."
        ),
        "args": field(
            {},
            "table",
            "Keyword arguments of the model; keys not given take the defaults at the end of "
            "this page.",
        ),
        "buffers": field(
            "federate",
            "str",
            "Registered floating-point buffers (e.g. BatchNorm running statistics): federate "
            "(averaged like the parameters, sample-weighted) or local (each device keeps its "
            "own, FedBN).",
            choices=("federate", "local"),
        ),
    },
    "train": {
        "local_epochs": field(1, "int", "Local epochs per round (E) when local_steps is 0.", min=1),
        "local_steps": field(
            0, "int", "Local SGD steps per round (K); 0 = use local_epochs.", min=0
        ),
        "batch_size": field(32, "int", "Local mini-batch size in samples; 0 = full batch.", min=0),
        "lr": field(0.05, "float", "Local SGD learning rate.", min=0.0, exclusive_min=True),
        "momentum": field(
            0.0, "float", "Local SGD momentum (reset every round).", min=0.0, max=1.0
        ),
        "weight_decay": field(0.0, "float", "Local SGD L2 weight decay.", min=0.0),
        "vectorize": field(
            "off",
            "str",
            "off: each task trains alone (the reference; every golden hash). auto: a "
            "worker trains its queued tasks of one model version (with a gate: each from "
            "its device's own local model) as one stacked torch.func "
            "computation where it can (equal to off within float32 rounding, not bit for "
            "bit), else alone, saying why once (also a model with an nn.LSTM: stacked, it "
            "runs slower); on: stacks what can be stacked (an LSTM too), and a job whose "
            "workers cannot stack is refused before it starts (docs/performance.md).",
            choices=("off", "auto", "on"),
        ),
        "vectorize_mb": field(
            32.0,
            "float",
            "Memory budget of one stacked computation in MiB (train.vectorize): a worker "
            "trains at most as many devices together as fit (about four model copies plus "
            "the examples per device), in several stacks if more are queued. Results do not "
            "depend on it.",
            min=0.0,
            exclusive_min=True,
        ),
        "client": field(
            "",
            "str",
            "Local training: empty = the built-in trainer, or 'package.module:Name' (a class "
            "or function with the client hook's fit method; docs/custom-data-and-models.md).",
        ),
        "loss": field(
            "auto",
            "str",
            "Training loss: auto (cross-entropy for classification and lm, mse for "
            "regression, bce-with-logits for binary), cross-entropy, bce-with-logits, mse, "
            "or 'package.module:function' (mean over the batch; see the loss contract).",
        ),
        "optimizer": field(
            "sgd",
            "str",
            "Local optimizer, made fresh each task: sgd (momentum, weight_decay), adam, adamw "
            "(beta1, beta2, weight_decay), or 'package.module:function' called as "
            "fn(params, lr, train_section) -> torch optimizer.",
        ),
        "beta1": field(0.9, "float", "Adam/AdamW first-moment decay, in [0, 1).", min=0.0),
        "beta2": field(0.999, "float", "Adam/AdamW second-moment decay, in [0, 1).", min=0.0),
        "lr_schedule": field(
            "constant",
            "str",
            "Per-round learning rate: constant, step (x lr_gamma every lr_step_rounds), "
            "exponential (x lr_gamma per round) or cosine (to 0 at run.rounds); the round is "
            "the global model version the task starts from.",
            choices=("constant", "step", "exponential", "cosine"),
        ),
        "lr_gamma": field(
            0.5,
            "float",
            "Decay factor of the step and exponential schedules, in (0, 1].",
            min=0.0,
            exclusive_min=True,
            max=1.0,
        ),
        "lr_step_rounds": field(10, "int", "Rounds between decays of the step schedule.", min=1),
    },
    "server": {
        "lr": field(
            1.0,
            "float",
            "Server learning rate applied to the aggregated delta.",
            min=0.0,
            exclusive_min=True,
        ),
        "optimizer": field(
            "sgd",
            "str",
            "Server optimizer applied to the aggregated delta: sgd, fedavgm, fedadam, fedyogi, "
            "fedadagrad (Reddi et al., ICLR 2021) or 'package.module:function' "
            "(docs/parameter-server.md).",
        ),
        "beta1": field(0.9, "float", "First-moment decay / FedAvgM momentum, in [0, 1).", min=0.0),
        "beta2": field(
            0.99, "float", "Second-moment decay of FedAdam/FedYogi, in [0, 1).", min=0.0
        ),
        "tau": field(1e-3, "float", "Adaptivity of FedAdam/FedYogi/FedAdagrad (> 0).", min=0.0),
        "l1": field(
            0.0, "float", "L1 proximal threshold per unit lr after each step (0 = off).", min=0.0
        ),
        "min_devices": field(
            1, "int", "Fewest devices a BSP round starts with (waits for more otherwise).", min=1
        ),
        "deadline_s": field(
            0.0,
            "float",
            "BSP round deadline in clock seconds; devices still training then are dropped "
            "from the round (0 = wait for all).",
            min=0.0,
        ),
        "participation": field(
            1.0,
            "float",
            "Fraction of devices sampled each BSP round; for fedbuff/fedasync the fraction "
            "training at once.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
    },
    "algorithm": {
        "consistency": field(
            "bsp",
            "str",
            "Consistency model: bsp (rounds), ssp (bounded staleness), asp (no bound), "
            "fedbuff (buffered async), fedasync (async mixing); see docs/simulation.md.",
            choices=("bsp", "ssp", "asp", "fedbuff", "fedasync"),
        ),
        "staleness": field(
            4, "int", "SSP bound s: no device more than s updates ahead of the slowest.", min=0
        ),
        "buffer_k": field(4, "int", "FedBuff: apply the mean of every K arrivals.", min=1),
        "fedasync_alpha": field(
            0.6,
            "float",
            "FedAsync base mixing weight alpha.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "fedasync_fn": field(
            "polynomial",
            "str",
            "FedAsync staleness function s(t): constant, polynomial (1+t)^-a, hinge.",
            choices=("constant", "polynomial", "hinge"),
        ),
        "fedasync_a": field(
            0.5, "float", "FedAsync exponent (polynomial) or slope (hinge) a.", min=0.0
        ),
        "fedasync_b": field(4, "int", "FedAsync hinge: staleness served at full weight.", min=0),
        "aggregation": field(
            "sample-weighted",
            "str",
            "How deltas are combined: sample-weighted (FedAvg), mean, loss-weighted / "
            "loss-softmax (Hermes), median, trimmed-mean, krum, multi-krum, norm-clip "
            "(docs/robustness.md).",
            choices=(
                "sample-weighted",
                "mean",
                "loss-weighted",
                "loss-softmax",
                "median",
                "trimmed-mean",
                "krum",
                "multi-krum",
                "norm-clip",
            ),
        ),
        "gate": field(
            "always",
            "str",
            "When a device pushes: always (after every task) or hermes (significance-gated "
            "HermesGUP; docs/hermes.md).",
            choices=("always", "hermes"),
        ),
        "allocation": field(
            "fixed",
            "str",
            "Work per device iteration: fixed (all its samples) or hermes (sized toward the "
            "median iteration time).",
            choices=("fixed", "hermes"),
        ),
        "ordering": field(
            "none",
            "str",
            "Example order of each local epoch: none (a seeded shuffle), rr (D-RR), id-grab, "
            "id-grab-bal, cd-grab (coordinator-balanced; docs/ordering.md).",
            choices=("none", "rr", "id-grab", "id-grab-bal", "cd-grab"),
        ),
        "plugins": field(
            [],
            "list[str]",
            "Your own algorithm plugins, each 'module:Class' (a subclass of "
            "edgefl.algorithms.Plugin), run after the built-in ones "
            "(docs/write-your-own-algorithm.md).",
        ),
        "plugin_args": field(
            {},
            "table",
            "Options of your own plugins: one sub-table per plugin name (e.g. "
            "[algorithm.plugin_args.my_plugin]); each plugin checks its own in check_config.",
        ),
        "residual": field(
            "none",
            "str",
            "Worker-side residual: none or gddr (delayed, sum-preserving release; docs/gddr.md).",
            choices=("none", "gddr"),
        ),
    },
    # (the plugins' sections follow "algorithm": plugin_sections(), below)
    "sim": {
        "clock": field(
            "auto",
            "str",
            "virtual (times from device profiles; deterministic), wall (real time), or auto "
            "(virtual under `edgefl simulate`, wall under `edgefl run`).",
            choices=("auto", "virtual", "wall"),
        ),
        "profiles": field(
            "uniform",
            "str",
            "Device profiles: uniform, edge-mix, hermes-12, or a .toml / .csv file "
            "(docs/device-profiles.md).",
        ),
        "reference_s_per_sample": field(
            1e-4,
            "float",
            "Compute cost of the reference device (speed 1.0) in seconds per training "
            "sample; 0 = measure this machine once at start (recorded in the run's config).",
            min=0.0,
        ),
        "event_log": field(
            True, "bool", "Write events.jsonl (every event the coordinator processed)."
        ),
    },
    "comm": {
        "chunk_bytes": field(
            1 << 30,
            "int",
            "Largest payload piece per MPI message (bytes).",
            min=1024,
            max=(1 << 31) - 1,
        ),
        "max_payload_bytes": field(
            1 << 34, "int", "Largest payload a receiver accepts (bytes).", min=1
        ),
        "poll_max_s": field(
            1e-3, "float", "Longest idle back-off sleep while polling (seconds).", min=0.0
        ),
        "payload_timeout_s": field(
            30.0,
            "float",
            "Wait for a payload whose header arrived (seconds).",
            min=0.0,
            exclusive_min=True,
        ),
        "failure_timeout_s": field(
            0.0,
            "float",
            "Declare a worker rank dead when it owes an update and was silent this long "
            "(seconds; also finds frozen ranks under ULFM; 0 = off, rely on ULFM).",
            min=0.0,
        ),
        "straggler_warn_s": field(
            60.0,
            "float",
            "Warn (naming the rank and device) when a rank owes an answer and was silent "
            "this long (seconds of real time; 0 = off).",
            min=0.0,
        ),
        "register_timeout_s": field(
            120.0,
            "float",
            "Wait for all workers to register (seconds).",
            min=0.0,
            exclusive_min=True,
        ),
    },
    "output": {
        "progress": field(
            "auto",
            "str",
            "Rank 0 output: auto (bar on a terminal, lines otherwise), bar, lines, quiet.",
            choices=("auto", "bar", "lines", "quiet"),
        ),
        "trackers": field(
            [],
            "list[str]",
            "Experiment trackers fed every metrics row: csv (metrics.csv in the run "
            "directory), tensorboard (extra 'tensorboard'), mlflow (extra 'mlflow').",
            choices=("csv", "tensorboard", "mlflow"),
        ),
        "mlflow_uri": field(
            "",
            "str",
            "MLflow tracking URI for the mlflow tracker (empty: a SQLite store, "
            "<run directory>/mlruns/mlflow.db).",
        ),
        "mlflow_experiment": field(
            "edgefl", "str", "MLflow experiment the mlflow tracker logs its run under."
        ),
    },
    "debug": {
        "inject": field(
            [],
            "list[str]",
            "Test hooks: rank 1 sends these forged messages before its first update "
            "(bad-kind, bad-length, bad-dtype, duplicate, foreign-device).",
            choices=("bad-kind", "bad-length", "bad-dtype", "duplicate", "foreign-device"),
        ),
        "delay_s": field(
            0.0,
            "float",
            "Test hook: workers sleep a random real time up to this before each task "
            "(results must not change under the virtual clock).",
            min=0.0,
        ),
        "kill_ranks": field(
            [],
            "list[int]",
            "Fault test hook: these ranks SIGKILL themselves: a worker rank when it starts its "
            "kill_after_tasks-th task, a server shard (ps.servers) at that apply.",
        ),
        "kill_after_tasks": field(
            1, "int", "Fault test hook: ... when the rank starts its N-th task.", min=1
        ),
        "inject_every": field(
            0,
            "int",
            "Test hook: repeat the debug.inject forgeries every N-th task of rank 1 (0 = once).",
            min=0,
        ),
        "byzantine": field(
            [], "list[int]", "Test hook: these devices send corrupted updates (byzantine_mode)."
        ),
        "byzantine_mode": field(
            "signflip",
            "str",
            "Test hook: scale (delta x byzantine_scale) or signflip (delta x -byzantine_scale).",
            choices=("scale", "signflip"),
        ),
        "byzantine_scale": field(10.0, "float", "Test hook: factor of corrupted updates."),
        "forget_key_cache_every": field(
            0,
            "int",
            "Test hook: rank 0 forgets its cached key lists every N model versions, forcing "
            "resends (0 = off).",
            min=0,
        ),
        "stop_after_round": field(
            0,
            "int",
            "Stop cleanly after this round with a checkpoint, as if interrupted (0 = off).",
            min=0,
        ),
    },
}


#: the entry-point group through which plugin packages contribute config sections
SECTIONS_GROUP = "edgefl.config_sections"


def plugin_sections(core: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config sections the plugins contribute, through the entry points of group
    :data:`SECTIONS_GROUP`: ``builtin`` (edgefl's own registry,
    ``edgefl.algorithms:config_sections``; setup.cfg) first, then any other, by name. Each
    names a function returning ``{section: {key: Field}}``. The config layer names no
    plugin: adding a built-in touches only its package and the registry's BUILTIN.

    Raises ImportError (one line) when edgefl's own entry point is missing (a source tree
    that was not installed, or installed before the registry moved) or when a section is
    contributed twice or shadows a core one."""
    from importlib.metadata import entry_points

    core = _CORE if core is None else core
    found = sorted(entry_points(group=SECTIONS_GROUP), key=lambda e: (e.name != "builtin", e.name))
    if not any(e.name == "builtin" for e in found):
        raise ImportError(
            f"edgefl's plugin config sections are the entry point 'builtin' of group "
            f"'{SECTIONS_GROUP}', and none is installed: (re)install edgefl "
            "(pip install -e .)"
        )
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for ep in found:
        for name, section in ep.load()().items():
            if name in core or name in out:
                other = "edgefl's core" if name in core else f"entry point {owner[name]!r}"
                raise ImportError(
                    f"config section [{name}] of entry point {ep.name!r} ({ep.value}) is "
                    f"also {other}'s"
                )
            out[name] = section
            owner[name] = ep.name
    return out


def _compose(core: dict[str, Any], plugins: dict[str, Any]) -> dict[str, Any]:
    """``core`` with the plugin sections right after its ``algorithm`` section."""
    out: dict[str, Any] = {}
    for key, value in core.items():
        out[key] = value
        if key == "algorithm":
            out.update(plugins)
    return out


#: every key: the core's sections and, after ``algorithm``, the plugins' (plugin_sections)
SCHEMA: dict[str, Any] = _compose(_CORE, plugin_sections())


# Arguments used when a config names a source/model but gives no [data.args]/[model.args].
DEFAULT_ARGS: dict[str, dict[str, dict]] = {
    "data": {"synthetic": {"alpha": 0.5, "beta": 0.5, "dim": 60, "classes": 10}},
    "model": {"mlp": {"hidden": [64]}},
}


def iter_fields(schema: dict | None = None, prefix: str = ""):
    """Yield (dotted key path, Field) for every key of the schema, in schema order."""
    schema = SCHEMA if schema is None else schema
    for key, val in schema.items():
        path = f"{prefix}{key}"
        if isinstance(val, Field):
            yield path, val
        else:
            yield from iter_fields(val, path + ".")


def defaults(schema: dict | None = None) -> dict:
    """The default configuration as a nested dict (fresh copies of mutable values)."""
    import copy

    schema = SCHEMA if schema is None else schema
    out: dict = {}
    for key, val in schema.items():
        out[key] = copy.deepcopy(val.default) if isinstance(val, Field) else defaults(val)
    return out


__all__ = [
    "DEFAULT_ARGS",
    "Field",
    "SCHEMA",
    "SECTIONS_GROUP",
    "defaults",
    "iter_fields",
    "plugin_sections",
]
