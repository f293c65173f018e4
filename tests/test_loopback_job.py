"""A whole BSP FedAvg job in one process: coordinator and workers in threads over the
loopback transport. Tests the protocol logic (registration, rounds, aggregation, stop)
without MPI; the same classes run over MPI in tests/test_job.py."""

from __future__ import annotations

import hashlib

from conftest import run_loopback_job

from edgefl.config import load_config


def test_loopback_job_runs_and_learns():
    cfg = load_config(
        overrides=[
            "fleet.devices=5",
            "run.rounds=4",
            "data.args.dim=10",
            "data.args.classes=4",
            "model.args.hidden=[8]",
            'output.progress="quiet"',
        ]
    )
    coord, statuses = run_loopback_job(cfg, ranks=3)
    assert statuses == [0, 0, 0]
    assert sorted(coord.devices) == [0, 1, 2, 3, 4]
    assert {v["rank"] for v in coord.devices.values()} == {1, 2}
    assert all(v["rounds"] == 4 for v in coord.devices.values())
    # deterministic: a second run gives the bit-identical global model
    coord2, _ = run_loopback_job(cfg, ranks=3)
    h = [hashlib.sha256(c.global_model.tobytes()).hexdigest() for c in (coord, coord2)]
    assert h[0] == h[1]
    # and does not depend on how devices are spread over ranks
    coord3, _ = run_loopback_job(cfg, ranks=4)
    assert hashlib.sha256(coord3.global_model.tobytes()).hexdigest() == h[0]
