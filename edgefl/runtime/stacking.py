"""A worker's queued tasks trained together (``train.vectorize = "auto"``).

Queued tasks with the same task spec on devices of one kind (the same number of training
examples, or the same padded width: :func:`take_group`) are trained as one stacked
computation (:func:`edgefl.training.stacked.fit_stacked`): from one model version, or
with a gate (Hermes) each device from its own local model; each then goes on exactly as
a task trained alone does (``after_train``, the gate, the update pipeline, its own
message). Each device draws its example orders from its own task generator, as the
sequential path does; the stacked arithmetic equals it within float32 rounding, not bit
for bit (docs/performance.md), so a run with ``auto`` has a model hash of its own: the
same run to run and over MPI or in one process (a device's stacked result does not
depend on which devices share its stack, which the timing of the queue decides).

What the stacked path covers, checked once per rank (:func:`why_not`): the built-in
trainer with SGD, a model whose float buffers are BatchNorm's (stacked per device:
:func:`edgefl.training.stacked.buffers_why_not`), worker plugins whose training hooks
(``before_train``, ``train``, ``after_train``, ``gate``) are declared stackable (FedProx,
SCAFFOLD, FedBN, federated evaluation, Hermes; not example ordering), no debug fault
hooks. Otherwise every task trains alone and the rank says why, once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..algorithms.hooks import overrides
from ..comm.taskflags import CONTINUE, REFRESH

if TYPE_CHECKING:  # (annotations only)
    from ..algorithms.base import TaskSpec

#: tasks trained in one stacked call at most, whatever the memory budget allows
MAX_GROUP = 4096
SCAN = 8192  # queued tasks a stack is looked for among (take_group)


def stack_limit(budget_mb: float, param_numel: int, n: int, sample_numel: int) -> int:
    """How many devices one stacked call trains at most under ``train.vectorize_mb``
    (MiB): each costs about four model copies (parameters, gradients, momentum, the next
    parameters) plus its examples and two batches' worth of activations, float32
    (``n`` examples of ``sample_numel`` elements each). At least 1, at most MAX_GROUP."""
    per_device = 4 * (4 * param_numel + 3 * max(n, 1) * max(sample_numel, 1))
    return max(1, min(MAX_GROUP, int(budget_mb * 2**20) // per_device))


_TRAINING_HOOKS = ("before_train", "train", "after_train", "gate")


def _hooked(half: type) -> list[str]:
    """The training hooks worker half ``half`` overrides."""
    return [h for h in _TRAINING_HOOKS if overrides(half, h, "worker")]


def why_not(cfg: dict, model, halves: list[type]) -> str | None:
    """Why a worker rank of this job cannot train its tasks stacked (None: it can).

    Args:
        cfg: the job's config.
        model: the job's model (``torch.nn.Module``: its buffers are looked at).
        halves: the job's worker-half classes (:class:`edgefl.algorithms.WorkerPlugin`),
            in plugin order.
    """
    tr = cfg["train"]
    if tr["client"]:
        return f"train.client = {tr['client']!r} (a user's client trains its own way)"
    if tr["optimizer"] != "sgd":
        return f"train.optimizer = {tr['optimizer']!r} (the stacked step is SGD's)"
    from ..training.stacked import buffers_why_not

    why = buffers_why_not(model)
    if why is not None:
        return why
    if tr["vectorize"] == "auto" and any(isinstance(m, torch.nn.LSTM) for m in model.modules()):
        return (  # ("on" stacks it all the same: correct, unrolled)
            "the model has an nn.LSTM, which a stack runs unrolled step by step: about 3x "
            "slower than torch's fused kernel one device at a time (train.vectorize = 'on' "
            "stacks it anyway)"
        )
    for half in halves:
        hooked = _hooked(half)
        if hooked and not half.stackable:
            why = f": {half.stack_note}" if half.stack_note else ""
            return f"plugin {half.__name__} hooks into local training ({', '.join(hooked)}){why}"
    dbg = cfg["debug"]
    if dbg["kill_ranks"] or dbg["inject"] or dbg["delay_s"]:
        return "a debug fault hook is set"
    return None


def support_markdown(classes: list[type]) -> str:
    """The support table of docs/performance.md, from the declarations: each of
    ``classes`` (the built-ins: ``edgefl.algorithms.builtin_classes()``) that has a
    worker half, the training hooks it overrides, whether its devices train stacked, and
    its ``stack_note``."""
    lines = ["| plugin | worker half | training hooks | stacked | how / why not |",
             "|---|---|---|---|---|"]  # fmt: skip
    for c in classes:
        half = getattr(c, "worker", None)
        if half is None:
            continue
        hooked = _hooked(half)
        ok = "yes" if not hooked or half.stackable else "no (trains one by one)"
        note = half.stack_note or ("works on the update after training" if not hooked else "-")
        hooks = ", ".join(f"`{h}`" for h in hooked) or "-"
        lines.append(f"| {c.name} | `{half.__name__}` | {hooks} | {ok} | {note} |")
    return "\n".join(lines) + "\n"


def probe_data(model, dataset, loss) -> str | None:
    """Why ``model`` cannot train stacked, tried on a few examples of ``dataset`` (one
    device's training set: :func:`edgefl.training.stacked.probe`); None when it can, or
    when the examples are not tensors (such devices train alone anyway)."""
    from ..training.stacked import probe
    from ..training.trainer import as_tensors

    xy = as_tensors(dataset)
    return None if xy is None else probe(model, xy[0], xy[1], loss)


def check_vectorize(cfg: dict, model, data=None) -> None:
    """``train.vectorize = "on"``: a ConfigError saying why when the job's worker ranks
    cannot train stacked (``auto`` would train every task alone); ``data``: the job's
    :class:`~edgefl.data.FederatedDataset`, whose first device's examples the model is
    tried on (:func:`probe_data`)."""
    if cfg["train"]["vectorize"] != "on":
        return
    from ..algorithms import load
    from ..errors import ConfigError
    from ..training import resolve_loss

    halves = [c.worker for c in load(cfg) if getattr(c, "worker", None) is not None]
    why = why_not(cfg, model, halves)
    if why is None and data is not None:
        loss = resolve_loss(cfg["train"]["loss"], data.info.task)
        why = probe_data(model, data.train(0), loss)
    if why is not None:
        raise ConfigError(
            f"config key 'train.vectorize' = 'on': the workers cannot train stacked because "
            f"{why} (use 'auto' to train such jobs one task at a time)"
        )


#: task flags a stacked task may carry: a gated device going on from its own local model
#: (CONTINUE), or adopting a broadcast one first (REFRESH); each device of a stack starts
#: from its own model then
STACK_FLAGS = CONTINUE | REFRESH


def take_group(
    queue: deque,
    ready: Callable[[tuple], bool],
    size_of: Callable[[int], int | None],
    torch_dev: dict[int, str],
    limit: Callable[[int], int] = lambda n: MAX_GROUP,
    width: Callable[[int, TaskSpec], object] = lambda n, spec: None,
    any_version: bool = False,
) -> list[tuple[int, int, int, TaskSpec]]:
    """Take the first task of ``queue`` ((device, task, version, spec) items) and the
    queued tasks that train together with it: same version (any, with ``any_version``:
    each device starts from its own model, a gate's) and batch size, flags within
    :data:`STACK_FLAGS`, no plugin argument, ready, the same torch device, and either the
    same number of training examples (``size_of(device)``, or the task's ``samples`` when
    fewer; None when the split is not a tensor dataset) or, when a stack pads sizes, the
    same ``width(size, spec)`` (not None: the batch width each step of theirs has); at
    most ``limit(largest size)`` tasks (the memory budget: :func:`stack_limit`), found
    among the first :data:`SCAN` queued. The others stay queued in their order; a task
    of a device passed over is not taken before it. [] when the first task cannot train
    stacked (it then trains alone); a group may be that one task: every task that can
    goes the stacked way, so which tasks happen to be queued together does not change a
    model (a device's result does not depend on the others in its stack)."""
    if not queue or not ready(queue[0]):
        return []
    d0, _, v0, s0 = queue[0]

    def examples(d: int, spec: TaskSpec) -> int | None:
        n = size_of(d)
        return spec.samples if n is not None and 0 < spec.samples < n else n

    def plain(spec: TaskSpec) -> bool:
        return not (spec.flags & ~STACK_FLAGS or spec.arg)

    if not plain(s0):
        return []
    n0 = examples(d0, s0)
    if n0 is None:
        return []
    key = width(n0, s0)
    largest = n0
    picked = [0]
    seen = {d0}  # devices taken, or passed over (their later tasks wait for those)
    for j in range(1, min(len(queue), SCAN)):
        item = queue[j]
        d, _, v, s = item
        if d in seen:
            continue
        seen.add(d)
        same = (any_version or v == v0) and s.batch == s0.batch and plain(s)
        if not same or torch_dev[d] != torch_dev[d0] or not ready(item):
            continue
        n = examples(d, s)
        if n is None or (n != n0 and (key is None or width(n, s) != key)):
            continue
        if len(picked) + 1 > limit(max(largest, n)):
            break
        largest = max(largest, n)
        picked.append(j)
    if len(picked) == 1:
        return [queue.popleft()]
    if picked[-1] == len(picked) - 1:  # (the head of the queue: as it was taken before)
        return [queue.popleft() for _ in picked]
    take = set(picked)
    out = [queue[j] for j in picked]
    rest = [item for j, item in enumerate(queue) if j not in take]
    queue.clear()
    queue.extend(rest)
    return out


def gradient_terms(jobs: list, start: np.ndarray, names: list[str], shapes: list, offsets: list):
    """What the stackable plugins' ``before_train`` added to ``jobs`` (their
    ``fit_ctx``), as :func:`edgefl.training.stacked.fit_stacked` takes it: (the proximal
    coefficient, the per-device constant terms by parameter name, ``(K, *shape)``, or
    None). ``start``: the flat parameters the stack starts from, one row for all
    (``(numel,)``) or one per job (``(K, numel)``: a gate's devices, each from its own
    model). A proximal term anchored away from a device's start (a gated device's local
    model, FedProx anchored at the global one) is the same coefficient plus the constant
    ``mu * (start - anchor)``. Raises RuntimeError naming the device when a job holds what
    the stacked step cannot run (a loss penalty, an opaque gradient hook, coefficients
    that differ between devices)."""

    from ..training.gradterms import ConstantTerm, ProximalTerm

    mus, consts = set(), []
    for i, job in enumerate(jobs):
        ctx, mu, const = job.fit_ctx, 0.0, None
        own = start if start.ndim == 1 else start[i]
        if ctx.penalties:
            raise RuntimeError(
                f"device {job.device}: a plugin declared stackable added a loss penalty, "
                "which the stacked step cannot run (train.vectorize = 'off' trains it)"
            )
        for h in ctx.grad_hooks:
            if isinstance(h, ProximalTerm):
                mu += h.mu
                anchor = h.anchor[: own.size]
                if not np.array_equal(anchor, own):
                    away = (h.mu * (own - anchor)).astype(np.float32)
                    const = away if const is None else const + away
            elif isinstance(h, ConstantTerm):
                const = h.values.copy() if const is None else const + h.values
            else:
                raise RuntimeError(
                    f"device {job.device}: a plugin declared stackable added a gradient hook "
                    f"({type(h).__name__}) that is not an edgefl.training.gradterms term"
                )
        mus.add(mu)
        consts.append(const)
    if len(mus) > 1:
        raise RuntimeError(f"devices of one stack have different proximal terms: {sorted(mus)}")
    if all(c is None for c in consts):
        return mus.pop(), None
    numel = sum(int(np.prod(s)) for s in shapes)
    flat = np.stack([np.zeros(numel, np.float32) if c is None else c[:numel] for c in consts])
    flat = torch.from_numpy(flat)
    corr = {n: flat[:, o : o + int(np.prod(s))].reshape(len(jobs), *s)
            for n, s, o in zip(names, shapes, offsets, strict=True)}  # fmt: skip
    return mus.pop(), corr


__all__ = [
    "MAX_GROUP",
    "STACK_FLAGS",
    "check_vectorize",
    "probe_data",
    "stack_limit",
    "support_markdown",
    "gradient_terms",
    "take_group",
    "why_not",
]


def stacked_deltas(got: dict, names: list[str], flat, start: np.ndarray) -> np.ndarray:
    """Every device's update of a trained stack: ``(K, numel)`` float32, row ``i`` =
    device ``i``'s trained parameters (``got``: name -> ``(K, *shape)``, laid out at
    ``flat``'s offsets) minus ``start`` (the flat model the stack started from), the same
    float32 subtraction as one device's ``flat.to_host() - start``. ``names``: the
    parameters' names, then those of the float buffers ``got`` holds (BatchNorm's, trained
    per device), in ``flat``'s order; buffers not named keep their start values (delta 0)."""
    k = int(next(iter(got.values())).shape[0])
    out = np.empty((k, start.size), np.float32)
    out[:, flat.param_numel :] = start[flat.param_numel :]
    for n, off in zip(names, flat.offsets, strict=False):
        v = got[n].detach().reshape(k, -1)
        out[:, off : off + v.shape[1]] = v.cpu().numpy()
    np.subtract(out, start, out=out)
    return out


def longest_first(counts: list[int], epochs: int, steps: int, batch_size: int) -> list[int]:
    """The order to stack devices of ``counts`` examples that train in mini-batches: those
    with the most optimizer steps first (ties in their order), so that the devices still
    training are the stack's first ones at every step, the only ones
    :func:`edgefl.training.stacked.fit_stacked` then computes. (A device's result does not
    depend on its place in the stack.)"""
    from ..training.trainer import plan_steps

    totals = [plan_steps(epochs, steps, batch_size, c)[1] for c in counts]
    return sorted(range(len(counts)), key=lambda i: -totals[i])


def packed(data: list, dev: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The examples of devices of different sizes back to back: ``(X, Y, offsets)``, ``X``
    ``(N, ...)`` of all ``N`` examples, device ``i``'s from row ``offsets[i]`` on (what
    :func:`edgefl.training.stacked.fit_stacked` takes for mini-batches: no padding, a
    copy of the examples themselves, where a padded stack is as wide as the largest
    device everywhere)."""
    xs, ys = [x for x, _ in data], [y for _, y in data]
    offsets = np.concatenate(([0], np.cumsum([len(y) for y in ys])[:-1])).tolist()
    return torch.cat(xs).to(dev), torch.cat(ys).to(dev), [int(o) for o in offsets]


def padded(data: list, dev: str, width: int = 0):
    """The examples of devices of different sizes as one stack: ``(X, Y)`` of shapes ``(K,
    n, ...)``, ``n`` the largest size (at least ``width``), device ``i``'s own in the first
    ``len`` of row ``i``, zeros after (the stacked step masks them)."""

    from torch.nn.utils.rnn import pad_sequence

    k, n = len(data), max(width, *(len(y) for _, y in data))
    xs, ys = [x for x, _ in data], [y for _, y in data]
    if all(len(y) == n for y in ys):  # (one size, the stack's width: no padding)
        return torch.stack(xs).to(dev), torch.stack(ys).to(dev)
    X, Y = pad_sequence(xs, batch_first=True), pad_sequence(ys, batch_first=True)
    if X.shape[1] < n:  # (wider than the largest: zeros after)
        X = torch.cat([X, X.new_zeros((k, n - X.shape[1], *X.shape[2:]))], 1)
        Y = torch.cat([Y, Y.new_zeros((k, n - Y.shape[1], *Y.shape[2:]))], 1)
    return X.to(dev), Y.to(dev)
