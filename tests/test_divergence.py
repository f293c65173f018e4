"""The divergence guard's decisions (edgefl/runtime/divergence.py) on a stand-in
coordinator: which signs count, the likely cause it names, stop or continue. End to end
(a run that stops with exit status 4): tests/test_quarantine.py and tests/fault/test_stops.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgefl.config import load_config
from edgefl.runtime import divergence


def core(*sets: str, devices: int = 4) -> SimpleNamespace:
    cfg = load_config(None, [f"fleet.devices={devices}", *sets])
    return SimpleNamespace(cfg=cfg, stopped="", exit_status=0, diverged=None, version=7,
                           quarantine={}, devices={d: {} for d in range(devices)})  # fmt: skip


def test_a_nonfinite_test_loss_stops_the_run(capsys):
    c = core()
    divergence.check_row(c, {"round": 7, "test_loss": 1e30})  # large, but finite: no sign
    assert c.diverged is None and not c.stopped
    divergence.check_row(c, {"round": 7, "test_loss": float("inf")})
    assert c.exit_status == divergence.DIVERGED and c.stopped.startswith("diverged: ")
    assert c.diverged["reason"] == "the global test loss is inf at version 7"
    assert "likely cause: local steps too large for this model (train.lr = 0.05)" in (
        capsys.readouterr().out
    )


def test_only_nonfinite_quarantines_count_towards_the_share():
    c = core()
    c.quarantine = {0: {"updates": 3, "streak": 3, "excluded_at": 2},
                    1: {"updates": 0, "streak": 0, "excluded_at": 2, "reason": "task 4 hung"},
                    2: {"updates": 2, "streak": 2, "excluded_at": None}}  # fmt: skip
    divergence.check_quarantine(c)  # 1 of 4 (the hang is not a divergence)
    assert c.diverged is None
    c.quarantine[2]["excluded_at"] = 5
    divergence.check_quarantine(c)  # 2 of 4: half
    assert c.diverged["reason"].startswith("2 of 4 devices were quarantined")
    assert c.exit_status == 4


def test_continue_records_the_first_sign_once_and_goes_on(capsys):
    c = core("run.on_divergence='continue'")
    divergence.check_row(c, {"round": 3, "test_loss": float("nan")})
    c.version = 9
    divergence.check_row(c, {"round": 9, "test_loss": float("nan")})
    assert not c.stopped and c.exit_status == 0 and c.diverged["version"] == 7
    assert capsys.readouterr().out.count("the run diverged") == 1
    divergence.model_nonfinite(c)  # a non-finite model stops in any case
    assert c.exit_status == 4 and "model became non-finite" in c.stopped


@pytest.mark.parametrize(
    "sets, cause",
    [
        ((), "local steps too large for this model (train.lr = 0.05): lower train.lr"),
        (("train.momentum=0.9",), "(train.lr = 0.05 with train.momentum = 0.9)"),
        (("train.optimizer='adam'",), "with train.optimizer = 'adam'"),
        (("server.optimizer='fedadam'",), "or the server step (server.optimizer = 'fedadam'"),
        (("server.lr=2.0",), "server.lr = 2)"),
    ],
)
def test_the_likely_cause_names_the_settings(sets, cause):
    assert cause in divergence.likely_cause(load_config(None, list(sets)))
