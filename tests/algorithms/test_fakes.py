"""The fake contexts keep the contracts of the real ones (what the unit tests rely on)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.base import LocalJob, TaskSpec, WorkerPlugin
from edgefl.algorithms.context import CoordinatorContext, WorkerContext
from edgefl.data.holdout import holdout_size

from .fakes import (
    FakeCoordinatorContext,
    FakeWorkerContext,
    config,
    flush_upload,
    received,
    upload,
)


def test_the_fakes_implement_every_member_of_the_contexts():
    # an abstract member left out would make these raise TypeError
    c = FakeCoordinatorContext(config(), {0: 10, 1: 7})
    w = FakeWorkerContext(config(), {0: list(range(4))})
    assert isinstance(c, CoordinatorContext) and isinstance(w, WorkerContext)


def test_the_global_model_is_read_only_and_add_to_model_changes_it():
    c = FakeCoordinatorContext(config(), {0: 10}, numel=4)
    with pytest.raises(ValueError):
        c.global_model[0] = 1.0
    c.add_to_model(np.array([1, 3]), np.array([2.0, -1.0], np.float32))
    assert c.global_model.tolist() == [0.0, 2.0, 0.0, -1.0]


def test_hold_out_is_the_one_rule_and_refuses_a_second_fraction():
    c = FakeCoordinatorContext(config(), {0: 10, 1: 3})
    c.hold_out(0.25)
    assert [c.train_size(d) for d in (0, 1)] == [10 - holdout_size(10, 0.25), 3 - 1]
    c.hold_out(0.25)  # the same fraction again is fine
    with pytest.raises(ValueError, match="two hold-out fractions"):
        c.hold_out(0.5)


def test_sends_are_recorded_with_a_copy_of_the_payload():
    w = FakeWorkerContext(config(), {0: [1, 2]})
    p = np.ones(3, np.float32)
    w.send(0, 7, device=0, payload=p)
    p[:] = 5.0
    assert w.sent_kinds() == [7] and w.sent[0].payload.tolist() == [1.0, 1.0, 1.0]


class _Records(WorkerPlugin):
    """Keeps what its encode hook was handed; encodes when told to."""

    def __init__(self, ctx, name, kind=None):
        super().__init__(ctx, name)
        self.kind, self.seen = kind, []

    def encode(self, up, job):
        self.seen.append((up, job))
        if self.kind is not None:
            up.encode(self.name, self.kind, up.delta * 2, (1.0, 2.0, 3.0, 4.0))


def test_upload_builds_a_tasks_upload_as_the_worker_core_does():
    w = _Records(FakeWorkerContext(config(), {3: [1, 2, 3]}, numel=4), "rec")
    job = LocalJob(3, 8, 0, TaskSpec(), aux=(3.0, 0.5, 1.0, 2.0))
    delta = np.ones(4, np.float32)
    up = upload(w, job, delta)
    assert w.seen == [(up, job)] and up.delta is delta
    assert (up.device, up.task, up.aux, up.flush, up.by) == (3, 8, (3.0, 0.5, 1.0, 2.0), False, "")


def test_flush_upload_builds_the_end_of_training_upload_as_the_worker_core_does():
    w = _Records(FakeWorkerContext(config(), {3: [1, 2, 3]}, numel=4), "rec")
    up = flush_upload(w, 3, 6)
    assert w.seen == [(up, None)]  # no job
    assert (up.device, up.task, up.aux, up.flush) == (3, 6, (3.0, 0.0, 0.0, 0.0), True)
    assert up.delta.dtype == np.float32 and up.delta.tolist() == [0.0] * 4


def test_received_is_the_message_the_core_sends_for_an_encoded_upload():
    w = _Records(FakeWorkerContext(config(), {3: [1, 2, 3]}, numel=4), "rec", kind=77)
    up = upload(w, LocalJob(3, 8, 0, TaskSpec(), aux=(3.0, 0.5, 1.0, 2.0)), np.ones(4))
    msg = received(up, src=2)
    assert (msg.kind, msg.src, msg.device, msg.round) == (77, 2, 3, 8)
    assert msg.aux == (1.0, 2.0, 3.0, 4.0)
    assert msg.payload.tolist() == [2.0] * 4 and msg.payload is not up.payload
    with pytest.raises(AssertionError, match="nothing encoded"):
        received(flush_upload(_Records(w.ctx, "none"), 3, 0))
