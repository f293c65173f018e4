"""The composition matrix: which pairs of algorithm options run together (pure; no MPI).

Each :data:`OPTIONS` entry is one named algorithm option, a small set of config overrides
(``--set`` syntax). :func:`check_pair` merges two options' overrides on :data:`BASE` (a tiny
job) and runs the pre-launch check ``edgefl simulate`` runs
(:func:`edgefl.runtime.policies.check_policies`, and
:func:`~edgefl.runtime.policies.check_shards` with the job's MPI ranks): the pair either
``runs`` or is refused with the check's one-line ConfigError, which names both keys and the
reason. Two options that set a common key are alternatives of one axis (e.g. two
aggregation rules), not a pair. ``edgefl config matrix`` prints :func:`matrix_markdown`
(``docs/composition.md``, kept current by a test); ``tests/test_composition.py`` runs every
allowed pair for a few rounds and checks it is deterministic.

The refusals themselves are declared as data where they belong
(:class:`~edgefl.algorithms.base.Requirement`: ``Plugin.requires`` of every plugin,
:data:`edgefl.runtime.policies.CORE_NEEDS` and :data:`~edgefl.runtime.policies.SHARD_NEEDS`);
this module only enumerates pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

RUNS = "runs"
ALTERNATIVE = "alternative"


@dataclass(frozen=True)
class Option:
    """One named algorithm option.

    Args:
        name: short name (the matrix's row and column label).
        sets: its config overrides, ``key=value`` with TOML values, as ``--set`` takes them.
        doc: what it is, in a few words.
    """

    name: str
    sets: tuple[str, ...]
    doc: str

    def keys(self) -> set[str]:
        return {s.split("=", 1)[0] for s in self.sets}


# the tiny job every pair is checked (and, in tests/test_composition.py, run) on: 4 devices
# on 2 worker ranks, 3 rounds, an 8-unit MLP on a 10-feature 4-class synthetic task, with
# the deterministic timing of tests/golden (virtual clock, fixed reference speed, cpu)
BASE: tuple[str, ...] = (
    "fleet.devices=4",
    "fleet.ranks=3",
    "run.rounds=3",
    "run.checkpoint_every=0",
    "data.args.dim=10",
    "data.args.classes=4",
    "model.args.hidden=[8]",
    'sim.clock="virtual"',
    "sim.reference_s_per_sample=0.0001",
    'fleet.device="cpu"',
    'output.progress="quiet"',
)

_CLICKS = (
    'data.source="clicks"',
    'model.name="logreg"',
    "data.args={features=300, samples_per_device=60, nnz_per_example=5, base_logit=0.0}",
    "model.args={}",
    "train.lr=0.5",
)


def _o(name: str, doc: str, *sets: str) -> Option:
    return Option(name, tuple(sets), doc)


OPTIONS: tuple[Option, ...] = (
    _o("fedavg", "FedAvg: BSP, sample-weighted mean, SGD server step (the defaults)"),
    _o("mean", "plain mean", 'algorithm.aggregation="mean"'),
    _o("median", "coordinate-wise median", 'algorithm.aggregation="median"'),
    _o("trimmed-mean", "coordinate-wise trimmed mean", 'algorithm.aggregation="trimmed-mean"',
       "robust.trim_fraction=0.25"),
    _o("krum", "Krum (f = 0)", 'algorithm.aggregation="krum"', "robust.krum_f=0"),
    _o("norm-clip", "norm clipping to the round's median norm",
       'algorithm.aggregation="norm-clip"'),
    _o("norm-bound", "norm bound filter (clip above 0.25)", "robust.norm_bound=0.25",
       'robust.norm_bound_mode="clip"'),
    _o("dp", "DP-FedAvg", "dp.enabled=true", "dp.clip=0.5", "dp.noise_multiplier=0.8"),
    _o("fedavgm", "server momentum", 'server.optimizer="fedavgm"'),
    _o("fedadam", "FedAdam", 'server.optimizer="fedadam"', "server.lr=0.05"),
    _o("fedyogi", "FedYogi", 'server.optimizer="fedyogi"', "server.lr=0.05"),
    _o("fedadagrad", "FedAdagrad", 'server.optimizer="fedadagrad"', "server.lr=0.05"),
    _o("l1-prox", "L1 proximal server step", "server.l1=0.002"),
    _o("ssp", "stale-synchronous (s = 2)", 'algorithm.consistency="ssp"',
       "algorithm.staleness=2"),
    _o("asp", "asynchronous", 'algorithm.consistency="asp"'),
    _o("fedbuff", "FedBuff (K = 2)", 'algorithm.consistency="fedbuff"', "algorithm.buffer_k=2"),
    _o("fedasync", "FedAsync", 'algorithm.consistency="fedasync"'),
    _o("hermes-gate", "Hermes significance gate", 'algorithm.gate="hermes"',
       "hermes.max_local_iterations=4"),
    _o("hermes-allocation", "Hermes dynamic allocation", 'algorithm.allocation="hermes"',
       'allocation.trigger="always"'),
    _o("loss-weighted", "Hermes loss-weighted aggregation",
       'algorithm.aggregation="loss-weighted"'),
    _o("loss-softmax", "Hermes loss-softmax aggregation", 'algorithm.aggregation="loss-softmax"'),
    _o("gddr", "GDDR residuals", 'algorithm.residual="gddr"', "gddr.alpha=0.4", "gddr.tau=4"),
    _o("gddr-adaptive", "GDDR with adaptive tau", 'algorithm.residual="gddr"', "gddr.alpha=0.4",
       "gddr.tau=4", "gddr.adaptive=true", "gddr.tau_min=2", "gddr.tau_max=6"),
    _o("cd-grab", "CD-GraB example ordering (8-dim sketches)", 'algorithm.ordering="cd-grab"',
       "ordering.sketch_dim=8"),
    _o("ps-sparse", "sparse pushes with the significance filter", "ps.sparse=true",
       'ps.filters=["significant"]', "ps.sig_threshold=0.01"),
    _o("ps-working-set", "working-set pulls (clicks data, logreg)", *_CLICKS,
       'ps.pull="working-set"'),
    _o("sharded", "sharded server group (2 shards, 5 ranks)", "ps.servers=2", "fleet.ranks=5"),
    _o("fed-eval", "federated evaluation of every version", "evaluation.every=1"),
    _o("adam-cosine", "local Adam, cosine learning-rate schedule", 'train.optimizer="adam"',
       "train.lr=0.01", 'train.lr_schedule="cosine"'),
    _o("fedprox", "FedProx (mu = 0.1)", "fedprox.enabled=true", "fedprox.mu=0.1"),
    _o("scaffold", "SCAFFOLD control variates", "scaffold.enabled=true"),
)  # fmt: skip

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def pairs() -> list[tuple[Option, Option]]:
    """Every unordered pair of options, in :data:`OPTIONS` order."""
    return list(combinations(OPTIONS, 2))


def merged(a: Option, b: Option) -> list[str] | None:
    """:data:`BASE` with ``a``'s then ``b``'s overrides; None when the two are alternatives
    (they set a common key)."""
    if a.keys() & b.keys():
        return None
    return [*BASE, *a.sets, *b.sets]


def job_ranks(cfg: dict) -> int:
    """MPI ranks of the job, as ``edgefl simulate`` computes them (no idle worker rank)."""
    from ..config.ranks import rank_count

    return rank_count(cfg)


def check_sets(sets: list[str]) -> str:
    """:data:`RUNS`, or the one-line ConfigError the pre-launch check raises for ``sets``."""
    from ..config import load_config
    from ..errors import ConfigError
    from ..runtime.policies import check_policies, check_shards

    try:
        cfg = load_config(overrides=sets)
        check_policies(cfg)
        check_shards(cfg, job_ranks(cfg))
    except ConfigError as e:
        return str(e)
    return RUNS


def check_pair(a: Option, b: Option) -> str:
    """:data:`RUNS`, :data:`ALTERNATIVE`, or the pair's one-line ConfigError."""
    sets = merged(a, b)
    return ALTERNATIVE if sets is None else check_sets(sets)


def matrix() -> dict[tuple[str, str], str]:
    """(name, name) -> :func:`check_pair` for every unordered pair (in :func:`pairs`
    order)."""
    return {(a.name, b.name): check_pair(a, b) for a, b in pairs()}


# -- the page -------------------------------------------------------------------------------
HEADER = """# Composition matrix

Generated by `edgefl config matrix` from what every plugin, the core axes and the sharded
server group declare they need (`Requirement` declarations: `Plugin.requires` in
`edgefl/algorithms/*/__init__.py`, `CORE_NEEDS` and `SHARD_NEEDS` in
`edgefl/runtime/policies.py`); a test fails when this page is stale. For every pair of the
options below, their overrides are merged on a tiny job and put through the check `edgefl
simulate` runs before the job starts (in rank 0, while the other ranks wait). A pair either
**runs** (`tests/test_composition.py` runs every such pair for 3 rounds, twice, and checks
the two final models are bit-identical and finite) or is **refused** with a one-line
`ConfigError` that names both keys and the reason. Two options that set a common key (two
aggregation rules, two consistency policies) are alternatives, not a pair.

The tiny job: `{base}`.
"""


def _cell_text(text: str) -> str:
    """Text for a Markdown table cell (a ``|`` would end the cell)."""
    return text.replace("|", "\\|")


def _cell(result: str, refusal: int | None) -> str:
    if result == RUNS:
        return "✓"
    if result == ALTERNATIVE:
        return "·"
    return f"✗{refusal}"


def matrix_markdown(results: dict[tuple[str, str], str] | None = None) -> str:
    """The docs/composition.md page: the options, the grid, every refused pair with its
    error, and every declared requirement with its reason."""
    from ..config import load_config
    from ..runtime.policies import requirements

    res = matrix() if results is None else results
    out = [HEADER.format(base=" ".join(BASE))]
    out.append("## Options\n")
    out.append("| option | what | overrides |")
    out.append("|---|---|---|")
    for o in OPTIONS:
        sets = "<br>".join(f"`{s}`" for s in o.sets) or "(none)"
        out.append(f"| `{o.name}` | {o.doc} | {sets} |")
    refused = [(k, v) for k, v in res.items() if v not in (RUNS, ALTERNATIVE)]
    number = {k: i + 1 for i, (k, _v) in enumerate(refused)}
    runs = sum(v == RUNS for v in res.values())
    alt = sum(v == ALTERNATIVE for v in res.values())
    out.append("\n## The matrix\n")
    out.append(
        f"{len(res)} pairs of {len(OPTIONS)} options: {runs} run, {len(refused)} are refused, "
        f"{alt} are alternatives. ✓ runs, ✗n refused (n: the list below), · alternatives "
        "(a common key).\n"
    )
    names = [o.name for o in OPTIONS]
    out.append("| | " + " | ".join(f"`{n}`" for n in names) + " |")
    out.append("|---|" + "---|" * len(names))
    for a in names:
        cells = []
        for b in names:
            if a == b:
                cells.append("")
                continue
            key = (a, b) if (a, b) in res else (b, a)
            cells.append(_cell(res[key], number.get(key)))
        out.append(f"| `{a}` | " + " | ".join(cells) + " |")
    out.append("\n## Refused pairs\n")
    out.append("The error the pre-launch check gives for each refused pair (one line each).\n")
    for (a, b), err in refused:
        out.append(f"{number[(a, b)]}. `{a}` + `{b}`: {err}")
    out.append("\n## Why: every declared requirement\n")
    out.append(
        "A requirement applies while its trigger key takes one of the listed values; then "
        "the other key must take an allowed value, for the reason given. The sharded "
        "server group's list is what remains refused with `ps.servers > 0`: everything "
        "elementwise (the weighted means, median, trimmed mean, every built-in server "
        "optimizer and the L1 prox, example ordering, allocation) runs on the shards, "
        "bit-identical to the unsharded run.\n"
    )
    out.append("| declared by | when | needs | because |")
    out.append("|---|---|---|---|")
    for owner, r in requirements(load_config(overrides=list(BASE))):
        when = f"`{r.when}` {r.active.say()}"
        need = f"`{r.key}` {r.allowed.say()}"
        out.append(f"| {owner} | {when} | {need} | {_cell_text(r.because)} |")
    return "\n".join(out) + "\n"


__all__ = [
    "ALTERNATIVE",
    "BASE",
    "BY_NAME",
    "OPTIONS",
    "RUNS",
    "Option",
    "check_pair",
    "check_sets",
    "job_ranks",
    "matrix",
    "matrix_markdown",
    "merged",
    "pairs",
]
