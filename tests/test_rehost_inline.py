"""Re-hosting across algorithms, in one process (``edgefl.simulate(..., backend="inline")``:
every rank a thread over the loopback transport; ``debug.kill_ranks`` ends a worker's
thread and the loopback fabric reports it dead, as ULFM does under MPI).

Worker rank 2 of a golden config (tests/golden/configs.py) dies at its 3rd task; its devices
move to rank 1. Where no per-device state lives on the workers, the final model must be the
recorded golden one, bit for bit. Where it does (Hermes' gate and local models, GDDR
residuals, SCAFFOLD's client variates, a filter's held-back mass), the run completes with
every device trained in every round after the move. The real-MPI tests (a SIGKILL from
outside) are in tests/fault/test_rehost.py; pure parts of the protocol are tested at the
end.
"""

from __future__ import annotations

import pytest
from golden.configs import CONFIGS, expand, load_models

import edgefl
from edgefl.config.load import parse_override
from edgefl.runtime.rehost import choose_host, enabled

MODELS = load_models()
KILL = {"debug.kill_ranks": [2], "debug.kill_after_tasks": 3}
# per-device state only on rank 0 (or none): the killed run is the recorded run
STATELESS = ["fedavg_small", "asp", "ssp", "fedbuff", "churn_asp", "cdgrab_step",
             "idgrab_microbatch", "dp", "fedprox_small", "server_fedadam", "median",
             "norm_bound_filters", "bsp_participation", "ps_sparse_keycache"]  # fmt: skip
# (Hermes: gate windows and local models; GDDR: residuals; SCAFFOLD: client variates; the
# significance filter: held-back mass)
STATEFUL = ["hermes", "gddr", "scaffold_small", "hermes_gddr", "ps_significant_float16"]


def _overrides(name: str) -> dict:
    return dict(parse_override(s) for s in expand(CONFIGS[name]))


def _killed(name: str, tmp_path, **extra) -> dict:
    sets = {**_overrides(name), **KILL, **extra}
    return edgefl.simulate(overrides=sets, out=tmp_path / name, backend="inline").summary


@pytest.mark.parametrize("name", STATELESS)
def test_rehosted_run_is_the_golden_run(name, tmp_path):
    s = _killed(name, tmp_path)
    assert list(s["failed_ranks"]) == ["2"] and s["failed_devices"] == {}
    odd = [d for d in range(len(s["devices"])) if d % 2]  # rank 2 of 2 workers hosts them
    assert sorted(m["device"] for m in s["rehosted"]) == odd
    assert {m["to"] for m in s["rehosted"]} == {1}
    assert s["model_sha256"] == MODELS[name]["model_sha256"]


@pytest.mark.parametrize("name", STATEFUL)
def test_rehosted_stateful_run_completes(name, tmp_path):
    # (GDDR: a residual checkpoint every step, so the moved devices' residuals exist)
    s = _killed(name, tmp_path, **({"gddr.checkpoint_every": 1} if "gddr" in name else {}))
    assert s["stopped"] == "" and list(s["failed_ranks"]) == ["2"]
    assert s["failed_devices"] == {}
    odd = [d for d in range(len(s["devices"])) if d % 2]
    assert sorted(m["device"] for m in s["rehosted"]) == odd
    assert s["final_accuracy"] is not None
    if "gddr" in name:  # the moved devices' checkpointed residuals were folded in
        assert s["gddr"]["replay_errors"] == []
        replayed = {r["device"] for r in s["gddr"]["replays"]}
        assert replayed <= set(odd) and (replayed or "hermes" in name)  # (gated: may have
        # pushed nothing yet, so there was no residual to fold in)


def test_rehost_off_loses_the_devices(tmp_path):
    r = edgefl.simulate(overrides={**_overrides("fedavg_small"), **KILL, "fleet.rehost": "off"},
                        out=tmp_path / "off", backend="inline")  # fmt: skip
    s = r.summary
    assert sorted(s["failed_devices"], key=int) == ["1", "3"] and s["rehosted"] == []
    assert s["model_sha256"] != MODELS["fedavg_small"]["model_sha256"]


def test_choose_host_is_least_loaded_then_lowest_rank():
    assert choose_host({1: 2, 3: 2, 4: 2}, [1, 3, 4]) == 1
    assert choose_host({1: 3, 3: 2, 4: 2}, [1, 3, 4]) == 3
    assert choose_host({}, [4, 2]) == 2


@pytest.mark.parametrize(
    "mode,clock,want",
    [("auto", "virtual", True), ("auto", "wall", False), ("on", "wall", True),
     ("off", "virtual", False)],
)  # fmt: skip
def test_rehost_default_follows_the_clock(mode, clock, want):
    assert enabled({"fleet": {"rehost": mode}, "sim": {"clock": clock}}) is want
