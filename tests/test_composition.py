"""The composition matrix (edgefl/algorithms/compose.py, docs/composition.md): every pair of
algorithm options either runs or is refused before launch with a one-line ConfigError that
names both keys and the reason.

Every allowed pair runs in one process over the loopback transport (4 devices on 2 worker
ranks, 3 rounds, an 8-unit MLP; the sharded pairs on 5 ranks) and must end with a finite
model; it runs a second time and must end with the bit-identical model (determinism: the
virtual clock, a fixed seed and reference speed). Every pair runs twice: on this 2-core box
the whole file takes about a minute (see --durations), so no subset is needed.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import run_loopback_job

from edgefl.algorithms.compose import (
    ALTERNATIVE,
    BY_NAME,
    OPTIONS,
    RUNS,
    job_ranks,
    matrix,
    matrix_markdown,
    merged,
)

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "composition.md"
RESULTS = matrix()
ALLOWED = sorted(k for k, v in RESULTS.items() if v == RUNS)
REFUSED = sorted(k for k, v in RESULTS.items() if v not in (RUNS, ALTERNATIVE))


def _sets(pair: tuple[str, str]) -> list[str]:
    sets = merged(BY_NAME[pair[0]], BY_NAME[pair[1]])
    assert sets is not None
    return sets


def _run(sets: list[str], timeout: float = 60.0) -> tuple[str, np.ndarray, int]:
    """(model sha256, final model, versions) of a loopback job of ``sets``."""
    from edgefl.config import load_config
    from edgefl.runtime.coordinator import Coordinator
    from edgefl.runtime.state import build_task

    cfg = load_config(overrides=sets)
    ranks = job_ranks(cfg)
    # rank 0's task before the worker threads exist (their warm-up draws from torch's global
    # RNG; see tests/golden/configs.py run_loopback)
    task0 = build_task(cfg)

    def coordinator(cfg_, t, task, out_dir=None):
        return Coordinator(cfg_, t, task0, out_dir=None)

    out: dict = {}

    def go() -> None:
        try:
            out["r"] = run_loopback_job(cfg, ranks, coordinator_cls=coordinator)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["e"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"loopback job hung: {sets}"
    if "e" in out:
        raise out["e"]
    coord, statuses = out["r"]
    assert statuses == [0] * ranks, statuses
    g = coord.global_model.copy()
    return hashlib.sha256(g.tobytes()).hexdigest(), g, coord.version


def test_every_option_alone_is_allowed():
    for o in OPTIONS:
        assert o.name == "fedavg" or RESULTS[("fedavg", o.name)] == RUNS, o.name


@pytest.mark.parametrize("pair", ALLOWED, ids="+".join)
def test_allowed_pair_runs_deterministically(pair):
    sets = _sets(pair)
    sha, model, version = _run(sets)
    assert np.isfinite(model).all(), pair
    assert version >= 3  # every round (and a flush version where one applies)
    again, _, version2 = _run(sets)
    assert again == sha and version2 == version, f"{pair}: not deterministic"


@pytest.mark.parametrize("pair", REFUSED, ids="+".join)
def test_refused_pair_is_one_line_naming_both_keys(pair):
    err = RESULTS[pair]
    assert "\n" not in err and err.startswith("config key '") and " because " in err
    a, b = (BY_NAME[n] for n in pair)
    # a key of each option is named (the trigger and the key it needs)
    assert any(k in err for k in a.keys()) and any(k in err for k in b.keys()), (pair, err)


def test_alternatives_share_a_key():
    for (a, b), v in RESULTS.items():
        assert (v == ALTERNATIVE) == bool(BY_NAME[a].keys() & BY_NAME[b].keys())


def test_docs_page_is_current():
    assert DOCS_PAGE.is_file(), (
        f"{DOCS_PAGE} is missing; generate it: edgefl config matrix > docs/composition.md"
    )
    assert DOCS_PAGE.read_text(encoding="utf-8") == matrix_markdown(RESULTS), (
        "docs/composition.md is stale; regenerate: edgefl config matrix > docs/composition.md"
    )
