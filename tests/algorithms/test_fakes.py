"""The fake contexts keep the contracts of the real ones (what the unit tests rely on)."""

from __future__ import annotations

import numpy as np
import pytest

from edgefl.algorithms.context import CoordinatorContext, WorkerContext
from edgefl.data.holdout import holdout_size

from .fakes import FakeCoordinatorContext, FakeWorkerContext, config


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
