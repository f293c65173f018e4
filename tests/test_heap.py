"""edgefl.runtime.heap: a rank's long-lived objects are frozen out of the garbage
collector's scans, and the interpreter is left as it was found: what was frozen is
collectable again after the run."""

from __future__ import annotations

import gc
import weakref

from edgefl.runtime.heap import Settled


class _Node:
    def __init__(self) -> None:
        self.me = self  # (a reference cycle: only the collector frees it)


def test_settling_freezes_and_leaves_nothing_frozen_and_its_garbage_collectable():
    before = gc.get_freeze_count()
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    kept = _Node()
    with Settled():
        assert gc.get_freeze_count() > before
        gc.collect()
        assert gone() is not None  # (frozen with the rest: the collector skips it)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # (taken by the first collection after the run)
    assert kept.me is kept


def test_it_settles_again_only_when_what_it_holds_has_doubled():
    with Settled() as heap:
        counts, alive = [], []
        for size in (10, 15, 20, 21, 30, 42, 43):
            alive.append(_Node())  # (something new to freeze each time)
            before = gc.get_freeze_count()
            heap.grown(size)
            counts.append(gc.get_freeze_count() > before)
    assert counts == [True, False, False, True, False, False, True]
    assert gc.get_freeze_count() == 0


def test_a_later_settle_collects_the_garbage_made_since_the_first():
    with Settled() as heap:
        garbage = _Node()
        gone = weakref.ref(garbage)
        del garbage
        heap.grown(10)
        assert gone() is None  # (collected, not frozen)


def test_a_cycle_frozen_while_alive_is_collected_once_the_run_is_over():
    with Settled():
        pass
    node = _Node()
    gone = weakref.ref(node)
    with Settled():
        del node
        gc.collect()
        assert gone() is not None  # (frozen: the collector skips it)
    gc.collect()
    assert gone() is None


def test_a_run_in_this_process_leaves_nothing_frozen(tmp_path):
    """The coordinator and the workers of an in-process run settle and unfreeze."""
    from golden.configs import SMALL, run_loopback_dir

    run_loopback_dir(SMALL, tmp_path / "run")
    assert gc.get_freeze_count() == 0
