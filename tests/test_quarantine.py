"""A device whose loss or update is NaN/inf is quarantined, not fatal (issue 15): each such
update is excluded from aggregation and counted; after ``fleet.quarantine_after`` in a row
the device gets no more tasks; the job goes on. In one process (the inline backend); the
same over real mpiexec under the Hermes gate is in tests/fault/test_rehost.py."""

from __future__ import annotations

import pytest

import edgefl
from edgefl.runtime.divergence import DIVERGED

BROKEN = "nan_client:nan_on_one_device"  # tests/nan_client.py: device 3 trains to NaN


def _run(tmp_path, **sets) -> dict:
    over = {"output.progress": "quiet", "run.rounds": 8, "train.client": BROKEN, **sets}
    return edgefl.simulate(overrides=over, out=tmp_path / "run", backend="inline").summary


def test_nan_device_is_excluded_then_quarantined(tmp_path, capsys):
    s = _run(tmp_path)
    assert s["rounds_done"] == 8 and s["stopped"] == ""
    assert s["quarantined"] == {"3": {"updates": 3, "streak": 3, "excluded_at": 2}}
    assert s["devices"]["3"]["rounds"] == 0  # never aggregated
    assert all(v["rounds"] == 8 for d, v in s["devices"].items() if d != "3")
    assert s["rejected"] == 0  # not a malformed message: a quarantine
    out = capsys.readouterr().out
    rank = 1 + 3 % s["workers"]  # (device d lives on rank 1 + d mod workers)
    assert f"device 3 (rank {rank}) task 0: non-finite loss nan; excluded from aggregation" in out
    assert "device 3 quarantined: 3 non-finite updates in a row" in out
    assert s["final_accuracy"] > 0.4  # (10 classes: the others trained on)
    assert s["diverged"] is None  # 1 of 8 is below run.divergence_share (half)
    assert s["best_accuracy"] >= s["final_accuracy"]


def test_quarantine_after_zero_keeps_dispatching(tmp_path):
    s = _run(tmp_path, **{"fleet.quarantine_after": 0})
    assert s["rounds_done"] == 8
    assert s["quarantined"]["3"]["updates"] == 8 and s["quarantined"]["3"]["excluded_at"] is None


def test_nan_under_the_hermes_gate_goes_on(tmp_path):
    s = _run(tmp_path, **{"algorithm.gate": "hermes", "run.rounds": 12})
    assert s["stopped"] == "" and s["rounds_done"] == 12
    assert s["quarantined"]["3"]["updates"] == 3


# -- the divergence guard (edgefl/runtime/divergence.py) -------------------------------------
def test_a_quarantined_share_stops_the_run_as_diverged(tmp_path, capsys):
    """1 of the 8 devices quarantined is run.divergence_share = 0.125 of the fleet: the run
    stops there with exit status 4, one line naming the cause, and summary.json says so."""
    with pytest.raises(edgefl.RunFailed) as e:
        _run(tmp_path, **{"run.divergence_share": 0.125})
    assert e.value.status == DIVERGED == 4
    s = edgefl.Result(e.value.run_dir).summary
    why = "1 of 8 devices were quarantined for non-finite updates (run.divergence_share = 0.125)"
    assert s["stopped"] == f"diverged: {why}"
    assert s["diverged"] == {
        "version": 2,
        "reason": why,
        "cause": f"the client hook train.client = '{BROKEN}' produced non-finite values, "
        "or its learning rate (train.lr = 0.05) is too large",
    }
    assert s["rounds_done"] == 2 and s["best_round"] in (1, 2)
    assert s["best_accuracy"] == max(
        m["test_accuracy"] for m in edgefl.Result(e.value.run_dir).metrics
    )
    out = capsys.readouterr().out
    assert out.count("edgefl: the run diverged: ") == 1
    assert f"edgefl: the run diverged: {why}; likely cause: the client hook" in out
    assert (e.value.run_dir / "exit_status").read_text().strip() == "4"
    assert (e.value.run_dir / "checkpoints" / "ckpt-000002.h5").is_file()  # (to resume from)


def test_on_divergence_continue_goes_on_and_records_it(tmp_path, capsys):
    s = _run(tmp_path, **{"run.divergence_share": 0.125, "run.on_divergence": "continue"})
    assert s["stopped"] == "" and s["rounds_done"] == 8
    assert s["diverged"]["version"] == 2 and s["diverged"]["reason"].startswith("1 of 8 devices")
    out = capsys.readouterr().out
    assert out.count("edgefl: the run diverged: ") == 1
    assert "going on (run.on_divergence = continue)" in out
