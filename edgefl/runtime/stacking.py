"""A worker's queued tasks trained together (``train.vectorize = "auto"``).

The tasks at the head of a worker's queue that start from one model version with the same
task spec, on devices with the same number of training examples, are trained as one
stacked computation (:func:`edgefl.training.stacked.fit_stacked`); each then goes on
exactly as a task trained alone does (``after_train``, the update pipeline, its own
update message). Each device draws its example orders from its own task generator, as
the sequential path does; the stacked arithmetic equals it within float32 rounding, not
bit for bit (docs/performance.md), so a run with ``auto`` has a model hash of its own:
the same run to run and over MPI or in one process (a device's stacked result does not
depend on which devices share its stack, which the timing of the queue decides).

What the stacked path covers today, checked once per rank (:func:`why_not`): the built-in
trainer with SGD, no gate, a model without buffers, no worker plugin that hooks into a
task's training (``before_train``, ``train``, ``after_train``, ``gate``: FedProx,
SCAFFOLD, FedBN, federated evaluation, example ordering, Hermes), no debug fault hooks.
Otherwise every task trains alone and the rank says why, once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..algorithms.hooks import overrides

if TYPE_CHECKING:  # (annotations only)
    from ..algorithms.base import TaskSpec
    from .worker import Worker

#: tasks trained in one stacked call at most (the stack holds this many model copies)
MAX_GROUP = 512
_TRAINING_HOOKS = ("before_train", "train", "after_train", "gate")


def why_not(w: Worker) -> str | None:
    """Why rank ``w`` cannot train its tasks stacked (None: it can)."""
    cfg, tr = w.cfg, w.cfg["train"]
    if w.gated:
        return (
            f"algorithm.gate = {cfg['algorithm']['gate']!r} (devices train locally between pushes)"
        )
    if tr["client"]:
        return f"train.client = {tr['client']!r} (a user's client trains its own way)"
    if tr["optimizer"] != "sgd":
        return f"train.optimizer = {tr['optimizer']!r} (the stacked step is SGD's)"
    if w.task.flat.param_numel != w.task.flat.numel:
        return "the model has float buffers (BatchNorm running statistics)"
    for p in w.plugins:
        hooked = [h for h in _TRAINING_HOOKS if overrides(type(p), h, "worker")]
        if hooked and not p.stackable:
            return f"plugin '{p.name}' hooks into local training ({', '.join(hooked)})"
    dbg = cfg["debug"]
    if dbg["kill_ranks"] or dbg["inject"] or dbg["delay_s"]:
        return "a debug fault hook is set"
    return None


def take_group(
    queue: deque,
    ready: Callable[[tuple], bool],
    size_of: Callable[[int], int | None],
    torch_dev: dict[int, str],
) -> list[tuple[int, int, int, TaskSpec]]:
    """Pop the tasks at the head of ``queue`` ((device, task, version, spec) items) that
    train together with the first one: same version and spec with plain flags, ready,
    the same torch device and the same training split size (``size_of(device)``: None
    when the split is not a tensor dataset). [] when the first task cannot train stacked
    (it then trains alone); a group may be that one task: every task that can goes the
    stacked way, so which tasks happen to be queued together does not change a model
    (a device's result does not depend on the others in its stack)."""
    if not queue or not ready(queue[0]):
        return []
    d0, _, v0, s0 = queue[0]
    if s0.flags or s0.samples or s0.arg:
        return []
    n0 = size_of(d0)
    if n0 is None:
        return []
    group = 1
    while group < min(len(queue), MAX_GROUP):
        item = queue[group]
        d, _, v, s = item
        same = (v, s.batch, s.flags, s.samples, s.arg) == (v0, s0.batch, 0, 0, 0)
        if not same or torch_dev[d] != torch_dev[d0] or size_of(d) != n0 or not ready(item):
            break
        group += 1
    return [queue.popleft() for _ in range(group)]


__all__ = ["MAX_GROUP", "take_group", "why_not"]
