"""The configuration schema: every key, its type, default, range and meaning.

This table is the single source of truth: the loader validates against it, the embedded
default config is built from it, and ``docs/configuration.md`` is generated from it
(``edgefl config docs``; a test checks the page is current).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Field:
    """One config key.

    Args:
        default: value when the key is absent.
        type: one of ``int``, ``float``, ``bool``, ``str``, ``list[int]``, ``list[str]``,
            ``table`` (a free-form table passed through, e.g. plug-in keyword arguments).
        doc: one sentence; units in the text (seconds, bytes, samples).
        min / max: inclusive numeric bounds (None = unbounded).
        choices: allowed string values (None = any).
    """

    default: Any
    type: str
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    exclusive_min: bool = False


def _f(default, type_, doc, **kw) -> Field:
    return Field(default, type_, doc, **kw)


SCHEMA: dict[str, Any] = {
    "seed": _f(
        0, "int", "Run seed; data, initial model, shuffling and sampling derive from it.", min=0
    ),
    "run": {
        "rounds": _f(20, "int", "Number of global rounds (T).", min=1),
        "target_accuracy": _f(
            0.0,
            "float",
            "Stop early once test accuracy reaches this (0 = never stop early).",
            min=0.0,
            max=1.0,
        ),
        "eval_every": _f(
            1, "int", "Evaluate the global model on the test set every N rounds.", min=1
        ),
        "max_virtual_s": _f(
            0.0,
            "float",
            "Stop once the clock passes this many seconds (virtual under simulate; 0 = no limit).",
            min=0.0,
        ),
        "eval_every_s": _f(
            0.0,
            "float",
            "Also evaluate at the first model version after every multiple of this many "
            "clock seconds (0 = only eval_every).",
            min=0.0,
        ),
        "checkpoint_every": _f(
            5, "int", "Write a checkpoint every N rounds (0 = only at the end).", min=0
        ),
        "out": _f(
            "",
            "str",
            "Run directory (config, metrics.jsonl, checkpoints, final model); "
            "empty = runs/<time>-<name>.",
        ),
    },
    "fleet": {
        "devices": _f(8, "int", "Number of logical edge devices (clients).", min=1),
        "ranks": _f(
            5, "int", "MPI ranks `edgefl simulate` launches, coordinator included (>= 2).", min=2
        ),
        "device": _f(
            "auto",
            "str",
            "Torch device of worker ranks: auto (cuda:{local_rank % gpus} where CUDA "
            "exists, else cpu), cpu, cuda or cuda:N.",
        ),
        "device_map": _f(
            {}, "table", 'Per-device override of the torch device, e.g. {"0" = "cuda:0"}.'
        ),
        "on_failure": _f(
            "continue",
            "str",
            "When a worker rank dies: continue without its devices, or stop (checkpoint, "
            "exit status 3).",
            choices=("continue", "stop"),
        ),
        "threads": _f(
            1, "int", "Torch intra-op threads per rank (1 suits many ranks per box).", min=1
        ),
    },
    "data": {
        "source": _f(
            "synthetic",
            "str",
            "Dataset: synthetic, partition, fedh5, text, or a plug-in 'package.module:function'.",
        ),
        "args": _f(
            {},
            "table",
            "Keyword arguments of the data source (see docs/custom-data-and-models.md); "
            "keys not given take the defaults listed at the end of this page, then the "
            "source's own.",
        ),
    },
    "model": {
        "name": _f(
            "mlp", "str", "Model: logreg, mlp, cnn, lstm, or a custom 'package.module:Class'."
        ),
        "args": _f(
            {},
            "table",
            "Keyword arguments of the model; keys not given take the defaults at the end of "
            "this page.",
        ),
    },
    "train": {
        "local_epochs": _f(1, "int", "Local epochs per round (E) when local_steps is 0.", min=1),
        "local_steps": _f(0, "int", "Local SGD steps per round (K); 0 = use local_epochs.", min=0),
        "batch_size": _f(32, "int", "Local mini-batch size in samples; 0 = full batch.", min=0),
        "lr": _f(0.05, "float", "Local SGD learning rate.", min=0.0, exclusive_min=True),
        "momentum": _f(0.0, "float", "Local SGD momentum (reset every round).", min=0.0, max=1.0),
        "weight_decay": _f(0.0, "float", "Local SGD L2 weight decay.", min=0.0),
    },
    "server": {
        "lr": _f(
            1.0,
            "float",
            "Server learning rate applied to the aggregated delta.",
            min=0.0,
            exclusive_min=True,
        ),
        "optimizer": _f(
            "sgd",
            "str",
            "Server optimizer applied to the aggregated delta: sgd, fedavgm, fedadam, fedyogi, "
            "fedadagrad (Reddi et al., ICLR 2021) or 'package.module:function' "
            "(docs/parameter-server.md).",
        ),
        "beta1": _f(0.9, "float", "First-moment decay / FedAvgM momentum, in [0, 1).", min=0.0),
        "beta2": _f(0.99, "float", "Second-moment decay of FedAdam/FedYogi, in [0, 1).", min=0.0),
        "tau": _f(1e-3, "float", "Adaptivity of FedAdam/FedYogi/FedAdagrad (> 0).", min=0.0),
        "l1": _f(
            0.0, "float", "L1 proximal threshold per unit lr after each step (0 = off).", min=0.0
        ),
        "min_devices": _f(
            1, "int", "Fewest devices a BSP round starts with (waits for more otherwise).", min=1
        ),
        "deadline_s": _f(
            0.0,
            "float",
            "BSP round deadline in clock seconds; devices still training then are dropped "
            "from the round (0 = wait for all).",
            min=0.0,
        ),
        "participation": _f(
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
        "consistency": _f(
            "bsp",
            "str",
            "Consistency model: bsp (rounds), ssp (bounded staleness), asp (no bound), "
            "fedbuff (buffered async), fedasync (async mixing); see docs/simulation.md.",
            choices=("bsp", "ssp", "asp", "fedbuff", "fedasync"),
        ),
        "staleness": _f(
            4, "int", "SSP bound s: no device more than s updates ahead of the slowest.", min=0
        ),
        "buffer_k": _f(4, "int", "FedBuff: apply the mean of every K arrivals.", min=1),
        "fedasync_alpha": _f(
            0.6,
            "float",
            "FedAsync base mixing weight alpha.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "fedasync_fn": _f(
            "polynomial",
            "str",
            "FedAsync staleness function s(t): constant, polynomial (1+t)^-a, hinge.",
            choices=("constant", "polynomial", "hinge"),
        ),
        "fedasync_a": _f(
            0.5, "float", "FedAsync exponent (polynomial) or slope (hinge) a.", min=0.0
        ),
        "fedasync_b": _f(4, "int", "FedAsync hinge: staleness served at full weight.", min=0),
        "aggregation": _f(
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
        "gate": _f(
            "always",
            "str",
            "When a device pushes: always (after every task) or hermes (significance-gated "
            "HermesGUP; docs/hermes.md).",
            choices=("always", "hermes"),
        ),
        "allocation": _f(
            "fixed",
            "str",
            "Work per device iteration: fixed (all its samples) or hermes (sized toward the "
            "median iteration time).",
            choices=("fixed", "hermes"),
        ),
        "ordering": _f(
            "none",
            "str",
            "Example order of each local epoch: none (a seeded shuffle), rr (D-RR), id-grab, "
            "id-grab-bal, cd-grab (coordinator-balanced; docs/ordering.md).",
            choices=("none", "rr", "id-grab", "id-grab-bal", "cd-grab"),
        ),
        "plugins": _f(
            [],
            "list[str]",
            "Your own algorithm plugins, each 'module:Class' (a subclass of "
            "edgefl.algorithms.Plugin), run after the built-in ones "
            "(docs/write-your-own-algorithm.md).",
        ),
        "plugin_args": _f(
            {},
            "table",
            "Options of your own plugins: one sub-table per plugin name (e.g. "
            "[algorithm.plugin_args.my_plugin]); each plugin checks its own in check_config.",
        ),
        "residual": _f(
            "none",
            "str",
            "Worker-side residual: none or gddr (delayed, sum-preserving release; docs/gddr.md).",
            choices=("none", "gddr"),
        ),
    },
    "hermes": {
        "alpha": _f(-1.3, "float", "Z-score threshold of a major update (< 0)."),
        "window": _f(10, "int", "Losses in the window, the current one included (>= 2).", min=2),
        "lam": _f(5, "int", "Minor updates before the threshold starts relaxing.", min=0),
        "beta": _f(0.1, "float", "Relaxation per minor update beyond lam, in [0, 1).", min=0.0),
        "reset_alpha": _f(False, "bool", "Restore alpha after each major update."),
        "test": _f(
            "zscore",
            "str",
            "Significance test: zscore or percentile.",
            choices=("zscore", "percentile"),
        ),
        "percentile": _f(10.0, "float", "p of the percentile test, in percent (0, 50]."),
        "wait_for_model": _f(
            True, "bool", "After a push, wait for the new global model (only true is supported)."
        ),
        "broadcast": _f(
            "pusher",
            "str",
            "Who gets the new global model after a push: pusher, or all (every gated device "
            "adopts it at its next local iteration).",
            choices=("pusher", "all"),
        ),
        "softmax_temperature": _f(0.5, "float", "Temperature of loss-softmax aggregation."),
        "softmax_buffer": _f(4, "int", "Major updates kept by loss-softmax.", min=1),
        "holdout_fraction": _f(
            0.2,
            "float",
            "Fraction of each device's samples held out for its local loss (the GUP signal).",
            min=0.0,
            max=0.9,
            exclusive_min=True,
        ),
        "max_local_iterations": _f(
            100,
            "int",
            "A device pushes anyway after this many local iterations without a major update "
            "(0 = never).",
            min=0,
        ),
    },
    "allocation": {
        "warmup": _f(1, "int", "Measurements before a device can be re-allocated.", min=1),
        "initial_fraction": _f(
            0.3,
            "float",
            "hermes: a device's first D as a fraction of its training samples (room to grow).",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
        "smoothing": _f(0.3, "float", "EMA weight of the newest step-time estimate (0, 1]."),
        "max_change": _f(0.5, "float", "Largest relative change of D per step (0, 1]."),
        "tolerance": _f(0.1, "float", "Relative distance to T* that counts as on target."),
        "fence": _f(1.5, "float", "Tukey fence multiplier of the IQR.", min=0.0),
        "trigger": _f(
            "fences",
            "str",
            "Who is re-allocated: fences (outliers only) or always.",
            choices=("fences", "always"),
        ),
    },
    "gddr": {
        "alpha": _f(0.4, "float", "Probability a coordinate is withheld at a step [0, 1)."),
        "tau": _f(4, "int", "Most steps a value may wait (start value when adaptive).", min=1),
        "adaptive": _f(False, "bool", "Let the coordinator adapt tau within [tau_min, tau_max]."),
        "tau_min": _f(2, "int", "Lower bound of adaptive tau.", min=1),
        "tau_max": _f(8, "int", "Upper bound of adaptive tau.", min=1),
        "installments": _f(1, "int", "Installments a released residual is paid in.", min=1),
        "installment_ratio": _f(0.5, "float", "Ratio between consecutive installments (0, 1]."),
        "checkpoint_every": _f(
            5, "int", "Device steps between residual checkpoints (0 = never).", min=0
        ),
        "replay_decay": _f(0.5, "float", "Ratio between consecutive replay amounts (0, 1)."),
        "replay_steps": _f(5, "int", "Coordinator steps a dead device's replay spans.", min=1),
    },
    "ordering": {
        "sketch_dim": _f(
            0, "int", "Project each gradient to this many dimensions (0 = exact).", min=0
        ),
        "sketch_kind": _f(
            "countsketch",
            "str",
            "Projection: countsketch or gaussian.",
            choices=("countsketch", "gaussian"),
        ),
        "unit": _f(
            "example",
            "str",
            "Unit of ordering: example or microbatch.",
            choices=("example", "microbatch"),
        ),
        "microbatch": _f(1, "int", "Examples per unit when unit = microbatch.", min=1),
        "ship": _f(
            "step",
            "str",
            "When workers send their gradient rows: step (after every step, balanced as they "
            "arrive) or epoch (one message at the end; always so for microbatch units).",
            choices=("step", "epoch"),
        ),
        "save_debug": _f(
            False, "bool", "Rank 0 saves each epoch's gradients and orders (ordering/*.npz)."
        ),
    },
    "ps": {
        "sparse": _f(
            False,
            "bool",
            "Push updates as sparse, compressed messages (filters, index/value encoding, "
            "key caching; docs/parameter-server.md).",
        ),
        "filters": _f(
            [],
            "list[str]",
            "Worker-side filters of sparse pushes, in order: significant, kkt (kkt needs "
            "server.l1 > 0).",
            choices=("significant", "kkt"),
        ),
        "sig_threshold": _f(
            0.0, "float", "significant: send entries whose change exceeds this.", min=0.0
        ),
        "kkt_margin": _f(
            0.0,
            "float",
            "kkt: skip a zero weight only if lr x steps x |gradient| <= server.l1 - this "
            "(delta units; larger skips less).",
            min=0.0,
        ),
        "kkt_carry": _f(
            False,
            "bool",
            "kkt: add skipped values to the coordinate's next update instead of holding them "
            "until the final flush.",
        ),
        "pull": _f(
            "full",
            "str",
            "What rank 0 sends a worker: the full model, or only the keys its devices' data "
            "touches (working-set; logreg only, other models pull every key).",
            choices=("full", "working-set"),
        ),
        "debug_bad_working_set": _f(
            "none",
            "str",
            "Test hook: rank 1 sends its first device's working set malformed (rank 0 must "
            "reject it and pull the full model to that rank).",
            choices=("none", "unsorted", "out-of-range", "duplicate"),
        ),
        "value_dtype": _f(
            "float32",
            "str",
            "Values on the wire: float32, float16 or bfloat16.",
            choices=("float32", "float16", "bfloat16"),
        ),
        "key_cache": _f(False, "bool", "Send a hash for an index list the receiver holds."),
        "cache_entries": _f(16, "int", "Key lists cached per device (LRU).", min=1),
        "servers": _f(
            0,
            "int",
            "Server shards S: ranks 1..S each own an even key range of the model; workers "
            "push and pull the ranges there, rank 0 keeps control (0 = rank 0 serves the "
            "whole model; > 0 needs BSP FedAvg; docs/parameter-server.md).",
            min=0,
        ),
        "replicas": _f(
            1,
            "int",
            "Copies k of every shard's key range (ps.servers > 0): shard s's range is also "
            "held by the next k - 1 shards in ring order, which take it over if s dies "
            "(1 = no replication; 1 <= k <= ps.servers; docs/parameter-server.md).",
            min=1,
        ),
    },
    "robust": {
        "trim_fraction": _f(
            0.1, "float", "trimmed-mean: fraction dropped at each end of every coordinate."
        ),
        "krum_f": _f(-1, "int", "krum/multi-krum: assumed Byzantine devices f (-1 = unset)."),
        "multi_krum_m": _f(0, "int", "multi-krum: updates averaged (0 = n - f).", min=0),
        "clip_norm": _f(
            0.0, "float", "norm-clip: clip norm C (0 = the round's median norm).", min=0.0
        ),
        "norm_bound": _f(
            0.0, "float", "Update filter: absolute L2 bound on an update (0 = off).", min=0.0
        ),
        "norm_bound_relative": _f(
            0.0,
            "float",
            "Update filter: bound as a multiple (>= 1) of the round's median norm (0 = off).",
            min=0.0,
        ),
        "norm_bound_mode": _f(
            "reject",
            "str",
            "Update filter: reject or clip an update above the bound.",
            choices=("reject", "clip"),
        ),
    },
    "dp": {
        "enabled": _f(False, "bool", "Client-level DP (DP-FedAvg) on the aggregated mean."),
        "clip": _f(1.0, "float", "Per-update L2 clip norm C.", min=0.0, exclusive_min=True),
        "noise_multiplier": _f(1.0, "float", "z: noise std on the mean is z C / n.", min=0.0),
        "delta": _f(
            1e-5,
            "float",
            "delta at which epsilon is reported.",
            min=0.0,
            max=1.0,
            exclusive_min=True,
        ),
    },
    "sim": {
        "clock": _f(
            "auto",
            "str",
            "virtual (times from device profiles; deterministic), wall (real time), or auto "
            "(virtual under `edgefl simulate`, wall under `edgefl run`).",
            choices=("auto", "virtual", "wall"),
        ),
        "profiles": _f(
            "uniform",
            "str",
            "Device profiles: uniform, edge-mix, hermes-12, or a .toml / .csv file "
            "(docs/device-profiles.md).",
        ),
        "reference_s_per_sample": _f(
            1e-4,
            "float",
            "Compute cost of the reference device (speed 1.0) in seconds per training "
            "sample; 0 = measure this machine once at start (recorded in the run's config).",
            min=0.0,
        ),
        "event_log": _f(
            True, "bool", "Write events.jsonl (every event the coordinator processed)."
        ),
    },
    "comm": {
        "chunk_bytes": _f(
            1 << 30,
            "int",
            "Largest payload piece per MPI message (bytes).",
            min=1024,
            max=(1 << 31) - 1,
        ),
        "max_payload_bytes": _f(
            1 << 34, "int", "Largest payload a receiver accepts (bytes).", min=1
        ),
        "poll_max_s": _f(
            1e-3, "float", "Longest idle back-off sleep while polling (seconds).", min=0.0
        ),
        "payload_timeout_s": _f(
            30.0,
            "float",
            "Wait for a payload whose header arrived (seconds).",
            min=0.0,
            exclusive_min=True,
        ),
        "failure_timeout_s": _f(
            0.0,
            "float",
            "Declare a worker rank dead when it owes an update and was silent this long "
            "(seconds; for MPIs without ULFM; 0 = off, rely on ULFM).",
            min=0.0,
        ),
        "register_timeout_s": _f(
            120.0,
            "float",
            "Wait for all workers to register (seconds).",
            min=0.0,
            exclusive_min=True,
        ),
    },
    "output": {
        "progress": _f(
            "auto",
            "str",
            "Rank 0 output: auto (bar on a terminal, lines otherwise), bar, lines, quiet.",
            choices=("auto", "bar", "lines", "quiet"),
        ),
    },
    "debug": {
        "inject": _f(
            [],
            "list[str]",
            "Test hooks: rank 1 sends these forged messages before its first update "
            "(bad-kind, bad-length, bad-dtype, duplicate, foreign-device).",
            choices=("bad-kind", "bad-length", "bad-dtype", "duplicate", "foreign-device"),
        ),
        "delay_s": _f(
            0.0,
            "float",
            "Test hook: workers sleep a random real time up to this before each task "
            "(results must not change under the virtual clock).",
            min=0.0,
        ),
        "kill_ranks": _f(
            [],
            "list[int]",
            "Fault test hook: these ranks SIGKILL themselves: a worker rank when it starts its "
            "kill_after_tasks-th task, a server shard (ps.servers) at that apply.",
        ),
        "kill_after_tasks": _f(
            1, "int", "Fault test hook: ... when the rank starts its N-th task.", min=1
        ),
        "inject_every": _f(
            0,
            "int",
            "Test hook: repeat the debug.inject forgeries every N-th task of rank 1 (0 = once).",
            min=0,
        ),
        "byzantine": _f(
            [], "list[int]", "Test hook: these devices send corrupted updates (byzantine_mode)."
        ),
        "byzantine_mode": _f(
            "signflip",
            "str",
            "Test hook: scale (delta x byzantine_scale) or signflip (delta x -byzantine_scale).",
            choices=("scale", "signflip"),
        ),
        "byzantine_scale": _f(10.0, "float", "Test hook: factor of corrupted updates."),
        "forget_key_cache_every": _f(
            0,
            "int",
            "Test hook: rank 0 forgets its cached key lists every N model versions, forcing "
            "resends (0 = off).",
            min=0,
        ),
        "stop_after_round": _f(
            0,
            "int",
            "Stop cleanly after this round with a checkpoint, as if interrupted (0 = off).",
            min=0,
        ),
    },
}


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


__all__ = ["DEFAULT_ARGS", "Field", "SCHEMA", "defaults", "iter_fields"]
