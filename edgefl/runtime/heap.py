"""Keeping Python's cyclic garbage collector off a rank's long-lived objects.

A rank holds objects that live for the whole run: rank 0 a dict of statistics per device,
the test set, the plugins' state; a worker its devices' datasets. The collector's full
collections walk every tracked object, and a round of a large fleet makes enough new
objects (messages, arrivals, events) to set one off every few rounds. At 10,000 devices
(the logistic-regression job of ``edgefl bench scale``) each full collection took 100 to
200 ms on every rank, every 3 to 4 seconds, and freed nothing: measured with
``gc.callbacks``, about 1.7 s of CPU per rank in 35 s, paused wherever the collection
happened to start (a worker in the middle of taking a bundle of TRAINs; rank 0 between two
arrivals, with the workers waiting for its next dispatch).

:class:`Settled` freezes what is alive once the rank is set up (``gc.freeze``: a
permanent generation the collector skips; moving the objects there costs nothing), and
again when the rank's long-lived objects have doubled (a worker that built its devices'
datasets in its first round). Objects made later are collected as before; the ones frozen
are freed by reference counting when they go, as always, and only a cycle among them (or
one that was already garbage when the rank was set up) waits for :meth:`Settled.__exit__`,
which unfreezes everything: the next collection takes it (an in-process run, the inline
backend's or a test's, also leaves the interpreter as it found it). The first freeze runs
no collection (a full one costs 0.1 to 1 s in a process with torch loaded, more than a
small run's collections ever do); a later one collects first, which walks only what was
made since the freeze before, so the garbage of a run's first rounds is not kept. Nothing
computed changes: only when the collector runs.
"""

from __future__ import annotations

import gc


def settle(collect: bool = False) -> None:
    """Move every object the collector tracks now out of its future collections
    (``collect``: after collecting what is garbage among those not frozen yet)."""
    if collect:
        gc.collect()
    gc.freeze()


class Settled:
    """``with Settled() as heap:`` around a rank's serving loop (see the module's doc).

    ``heap.grown(n)``: the rank's long-lived objects now number about ``n`` (in any unit
    that grows with them, e.g. datasets built); settles again when ``n`` is more than
    twice what it was at the last settle, so a run settles a handful of times at most.
    """

    def __init__(self) -> None:
        self.size = 0  # the size given at the last settle

    def __enter__(self) -> Settled:
        settle()
        return self

    def grown(self, size: int) -> None:
        if size > 2 * self.size:
            settle(collect=True)
            self.size = size

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()


__all__ = ["Settled", "settle"]
