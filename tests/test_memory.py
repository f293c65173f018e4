"""Memory per device (issue 27): what rank 0 and the workers keep per device, without MPI."""

from __future__ import annotations

import numpy as np
import torch

from edgefl.comm.loopback import Fabric, LoopbackTransport
from edgefl.comm.wire import Validator
from edgefl.config import load_config
from edgefl.runtime.state import _clean, build_task, checkpoint_state
from edgefl.runtime.worker import Worker

JOB = ["fleet.devices=12", "fleet.ranks=2", 'output.progress="quiet"', "data.args.dim=6"]


def _worker(*sets: str) -> Worker:
    cfg = load_config(overrides=[*JOB, *sets])
    task = build_task(cfg)
    t = LoopbackTransport(Fabric(2), 1, Validator(1, model_numel=task.flat.numel))
    return Worker(cfg, t, task)


def test_a_stacking_worker_builds_its_queued_devices_data_before_any_stack():
    """train.vectorize: every queued device's data is built before the first stack trains
    (between stacks it would land among the stacks' freed temporaries, which the heap
    cannot give back), once, and it is the data the device would have built itself."""
    w = _worker('train.vectorize="auto"')
    assert w.stack and not w.data._train
    from edgefl.algorithms.base import TaskSpec

    for d in (4, 0, 7):
        w.queue.append((d, 0, 0, TaskSpec()))
    w._build_queued()
    assert sorted(w.data._train) == [0, 4, 7]
    x = w.data.train(4).tensors[0]
    w._build_queued()  # (again: nothing is rebuilt)
    assert w.data.train(4).tensors[0] is x
    fresh = build_task(w.cfg).data.train(4).tensors
    assert all(torch.equal(a, b) for a, b in zip(fresh, w.data.train(4).tensors, strict=True))


def test_the_checkpoint_does_not_copy_every_device_record():
    """A device record of plain values goes into the checkpoint state as it is (a copy of
    10,000 records was 8 MB more at the final checkpoint); numpy floats still become
    floats."""
    plain = {"rank": 1, "samples": 200, "time_s": 0.5, "torch": "cpu"}
    assert _clean(plain) is plain
    mixed = {"rank": 1, "time_s": np.float64(0.5)}
    got = _clean(mixed)
    assert got is not mixed and type(got["time_s"]) is float and got == {"rank": 1, "time_s": 0.5}
    cfg = load_config(overrides=JOB)
    task = build_task(cfg)
    st = checkpoint_state(cfg, 1, task.flat, task.flat.to_host(), {3: plain}, [], 0.0)
    assert st["devices"]["3"] is plain


def test_the_metrics_rows_are_kept_as_their_json_lines(tmp_path):
    """Rank 0 keeps every metrics row for the whole run (checkpoints, the summary), and a
    row lists every device: kept as the JSON line metrics.jsonl holds (about 70 bytes a
    device, where the row's dicts kept about 350), parsed again when read; a checkpoint
    stores the very lines."""
    import json
    import tracemalloc

    from edgefl.runtime.output import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", [{"round": 0, "x": 1.5}])

    def row(r: int) -> dict:
        devices = {str(d): {"bytes_up": 36592 + d, "msgs_up": 1, "time_s": d / 7}
                   for d in range(5000)}  # fmt: skip
        return {"round": r, "test_accuracy": 0.5 + r / 10, "devices": devices}

    lines = [json.dumps(row(r)) for r in (1, 2)]
    tracemalloc.start()
    try:
        for r in (1, 2):
            log.append(row(r))  # (the caller keeps nothing of it)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 2 * 5000 * 120, f"{kept / 10_000:.0f} bytes per device and row"
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"round": 0, "x": 1.5}',
        *lines,
    ]
    assert len(log.rows) == 3 and log.rows[2] == json.loads(lines[1])
    assert [r["round"] for r in log.rows] == [0, 1, 2] and log.rows[1:][0]["round"] == 1
    cfg = load_config(overrides=JOB)
    task = build_task(cfg)
    st = checkpoint_state(cfg, 2, task.flat, task.flat.to_host(), {}, log.rows, 0.0)
    assert st["metrics_jsonl"] == ['{"round": 0, "x": 1.5}', *lines]
    assert checkpoint_state(cfg, 2, task.flat, task.flat.to_host(), {}, [{"a": 1}], 0.0)[
        "metrics_jsonl"] == ['{"a": 1}']  # fmt: skip


def test_summary_json_is_streamed(tmp_path):
    """summary.json lists every device: written as json.dump streams it (json.dumps with an
    indent first joins a string per token: 30 MB at rank 0's end at 10,000 devices), byte
    for byte what json.dumps(indent=1) gives."""
    import json
    import tracemalloc

    from edgefl.runtime.summary import write_json

    rec = {"rank": 1, "torch": "cpu", "samples": 52, "rounds": 2, "bytes_up": 36592,
           "bytes_down": 36752, "msgs_up": 2, "msgs_down": 4, "time_s": 0.05625,
           "requests": 2, "iterations": 2, "idle_fraction": 0.25}  # fmt: skip
    doc = {"run_id": "x", "devices": {str(d): dict(rec) for d in range(5000)}, "f": np.float32(1)}
    tracemalloc.start()
    try:
        write_json(tmp_path / "summary.json", doc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.1f} MB"
    want = json.dumps(doc, indent=1, default=float) + "\n"
    assert (tmp_path / "summary.json").read_bytes() == want.encode("utf-8")


def test_an_old_model_version_waits_for_the_train_that_follows_it():
    """Rank 0 re-runs a task from an old model version by sending that version, then the
    TRAIN; the TRAIN may come in a later poll (rank 0 bundles TRAINs with
    train.vectorize). A worker that finishes a task in between keeps the version until
    a TRAIN has come, instead of dropping it and ignoring the TRAIN as "never came" (rank 0
    then waited for the task until its deadline and declared the worker dead)."""
    from edgefl.comm import Kind
    from edgefl.comm.wire import Message

    w = _worker('train.vectorize="auto"')
    model = np.zeros(w.global_model.size, np.float32)
    for v in (30, 20):  # (the newest, 30, and the re-run's old 20)
        w._on_message(Message(Kind.MODEL, 0, round=v, payload=model))
    w._forget_versions()  # (a task ended here: what no queued task needs goes)
    assert sorted(w.versions) == [20, 30]
    w._on_message(Message(Kind.TRAIN, 0, device=1, round=3, aux=(20.0, 0.0, 0.0, 0.0)))
    assert [(d, t, v) for d, t, v, _ in w.queue] == [(1, 3, 20)]
    w.queue.clear()
    w._forget_versions()  # (claimed by its TRAIN, trained: now it goes)
    assert sorted(w.versions) == [30]
