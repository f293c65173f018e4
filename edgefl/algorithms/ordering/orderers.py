"""Example ordering for distributed SGD: D-RR, ID-GraB and CD-GraB (pure numpy, no MPI).

Sources: Cooper, Guo, Pham, Yuan, Ruan, Lu, De Sa, "CD-GraB: Coordinating Distributed
Example Orders for Provably Accelerated Training", NeurIPS 2023, and its predecessor GraB
(Lu, Guo, De Sa, "GraB: Finding Provably Better Data Permutations than Random Reshuffling",
NeurIPS 2022). ``m`` workers each hold their own examples (they never move between
workers); in every epoch each worker visits its examples in an order the coordinator sent,
computes one gradient per *unit* (an example, or a microbatch of consecutive example ids),
and the coordinator turns the gradients of epoch ``t`` into the orders of epoch ``t + 1``.

Rules (the paper's and the authors' code):

* ``balance(s, v)``: ``eps = +1`` if ``<s, v> <= 0`` else ``-1``; then ``s <- s + eps * v``.
  A tie (``<s, v> == 0``, e.g. the first decision of an epoch, where ``s = 0``) gives +1.
* PairBalance: for the pair of visits ``(2k, 2k+1)`` of one worker,
  ``v = g(visit 2k) - g(visit 2k+1)``; the first item of the pair gets ``eps``, the second
  ``-eps``. No stale mean is needed.
* Reorder: the next order is the +1 items in visit order followed by the -1 items in
  reverse visit order. So pair ``k``'s +1 item lands at position ``k`` and its -1 item at
  ``n - 1 - k``.
* ``cd-grab`` (CD-GraB): one running sum ``s``, reset to 0 every epoch and shared by all
  workers; decisions run pair index outer, worker inner (pair 0 of worker 0, pair 0 of
  worker 1, ..., then pair 1 of worker 0, ...).
* ``id-grab`` (ID-GraB(PairBal)): PairBalance per worker with a separate sum per worker.
* ``id-grab-bal`` (ID-GraB(Bal)): one decision per item with ``v = g - mean`` where ``mean``
  is the mean of the same worker's gradients of the previous epoch (zeros in the first
  epoch the orderer sees that worker), a separate sum per worker reset every epoch.
* ``rr`` (D-RR): every worker reshuffles its own examples every epoch with its own seed,
  ``derive_seed(seed, worker, epoch, ORDER_STREAM)``; seeds differ across workers.
  Every ordering's first epoch is this D-RR order, so a run differs from D-RR only through
  the gradients it has seen.

Odd and unequal ``n`` (defined here, the paper assumes equal even ``n``):

* A worker with ``n_w`` units has ``P_w = n_w // 2`` pairs, ``(visit 0, visit 1)``,
  ``(visit 2, visit 3)``, ...; with odd ``n_w`` the last visited unit is unpaired and keeps
  the middle position ``P_w`` of the next order (the +1 items come first, then the unpaired
  item, then the -1 items reversed). ID-GraB(Bal) has no pairs: every unit gets a sign.
* With unequal ``P_w``, CD-GraB still walks pair index outer, worker inner; at pair index
  ``k`` it visits only the workers that have a pair ``k``, so every pair is balanced against
  the one shared sum, and with equal ``n`` this is exactly the paper's rule.
* A worker whose gradients are missing (``None``) gets a D-RR order for the next epoch and
  takes no part in the balancing.

Sketching (``ordering.sketch_dim = k > 0``): every gradient is projected to ``k``
dimensions with ``x @ R``, ``R`` a random ``d x k`` matrix drawn from the run seed
(:class:`RandomSketch`: a CountSketch by default, or iid Gaussian; workers and coordinator
draw the same ``R``), so gradients travel and sit on the coordinator as ``m * n * k``
instead of ``m * n * d`` floats. The rules then run on the projections. ``k = 0`` is exact
mode: the rules run on the gradients themselves. In both modes the balancing arithmetic
is float64 (inputs are cast).

Units: with ``ordering.unit = "microbatch"`` the ordered items are microbatches of
``ordering.microbatch`` consecutive example ids (the last one may be shorter); see
:func:`count_units` and :func:`expand_units`. The orderer itself only sees units.

Herding: :func:`herding_bound` measures how well an order balances, the max over prefixes
of the infinity norm of the running sum of centred gradients (see its docstring).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.config import checks
from edgefl.errors import CheckpointError, ConfigError
from edgefl.seeding import derive_seed

ORDERINGS: tuple[str, ...] = ("rr", "id-grab", "id-grab-bal", "cd-grab")
UNITS: tuple[str, ...] = ("example", "microbatch")
SKETCH_KINDS: tuple[str, ...] = ("countsketch", "gaussian")

# random-stream purposes (last part of derive_seed's key), distinct from edgefl.seeding's
ORDER_STREAM = 0x6AB1
SKETCH_STREAM = 0x6AB2

SKETCH_BLOCK_ROWS = 4096  # rows of R drawn per seeded block (any block can be redrawn alone)
SKETCH_CACHE_BYTES = 256 << 20  # R is kept in memory when it is at most this many bytes


# --------------------------------------------------------------------------- primitives


def balance(s: np.ndarray, v: np.ndarray) -> int:
    """One greedy balancing decision: returns ``eps`` and updates ``s`` in place.

    ``eps = +1`` if ``<s, v> <= 0`` (a tie gives +1), else ``-1``; then ``s += eps * v``.
    ``s`` must be a float array that can hold ``v`` (float64 is used everywhere here).
    """
    if float(np.dot(s, v)) <= 0.0:
        s += v
        return 1
    s -= v
    return -1


class BalanceWalk:
    """A running sum ``s`` (float64, ``dim`` entries, starts at 0) fed by :func:`balance`.

    After every step ``||s||^2 <= sum of ||v||^2`` over the steps so far, because the
    chosen sign makes the cross term ``2 eps <s, v>`` non-positive.
    """

    def __init__(self, dim: int) -> None:
        self.s = np.zeros(int(dim), np.float64)

    def step(self, v: np.ndarray) -> int:
        """Balance ``v`` (``dim`` entries) against the sum; returns its sign (+1 or -1)."""
        return balance(self.s, np.asarray(v, np.float64))

    def reset(self) -> None:
        """Back to ``s = 0`` (the start of an epoch)."""
        self.s[:] = 0.0


def reorder(visit_order: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """The next order from the signs of one epoch's visits.

    ``visit_order[i]`` is the unit visited at position ``i`` and ``signs[i]`` its sign
    (+1, -1, or 0 for an unpaired unit). Returns (int32) the +1 units in visit order, then
    the 0 units in visit order, then the -1 units in reverse visit order.
    """
    visit = np.asarray(visit_order)
    sg = np.asarray(signs)
    if visit.shape != sg.shape or visit.ndim != 1:
        raise ValueError(f"reorder: visit order {visit.shape} and signs {sg.shape} differ")
    return np.concatenate([visit[sg > 0], visit[sg == 0], visit[sg < 0][::-1]]).astype(np.int32)


def pair_item_signs(pair_signs: np.ndarray, n: int) -> np.ndarray:
    """Per-visit signs (int8, ``n``) from per-pair signs: ``[e0, -e0, e1, -e1, ..., 0?]``.

    The trailing 0 is the unpaired last visit when ``n`` is odd.
    """
    ps = np.asarray(pair_signs, np.int8)
    if ps.size != n // 2:
        raise ValueError(f"pair_item_signs: {ps.size} pair signs for {n} items")
    out = np.zeros(n, np.int8)
    out[0 : 2 * ps.size : 2] = ps
    out[1 : 2 * ps.size : 2] = -ps
    return out


def herding_bound(grads_by_worker: Sequence[np.ndarray], norm: str = "inf") -> float:
    """Herding bound of one epoch: ``max_t || sum_{j <= t} sum_w (g[w][j] - gbar) ||``.

    ``grads_by_worker[w]`` holds worker ``w``'s gradients as rows in the order it visited
    them (``(n_w, d)``); position ``j`` sums over the workers that have a ``j``-th row, and
    ``gbar`` is the mean of all rows. With one worker this is GraB's herding objective; with
    ``m`` workers it is the parallel (CD-GraB) one, where position ``j`` is the ``j``-th step
    of all workers together. ``norm`` is ``"inf"`` (max absolute entry, the default, as in
    the GraB and CD-GraB bounds) or ``"2"``. Units are those of the gradients. Returns 0.0
    when there are no rows.

    Since only position sums matter, passing ``[sum over workers of g[w]]`` (one array)
    gives the same value when all workers have the same ``n``.
    """
    if norm not in ("inf", "2"):
        raise ValueError(f"herding_bound: norm must be 'inf' or '2', got {norm!r}")
    gs = [np.asarray(g, np.float64) for g in grads_by_worker]
    gs = [g.reshape(g.shape[0], -1) for g in gs if g.shape[0] > 0]
    if not gs:
        return 0.0
    length = max(g.shape[0] for g in gs)
    sums = np.zeros((length, gs[0].shape[1]), np.float64)
    counts = np.zeros(length, np.float64)
    for g in gs:
        sums[: g.shape[0]] += g
        counts[: g.shape[0]] += 1.0
    gbar = sums.sum(axis=0) / counts.sum()
    walk = np.cumsum(sums - counts[:, None] * gbar, axis=0)
    per_t = np.abs(walk).max(axis=1) if norm == "inf" else np.linalg.norm(walk, axis=1)
    return float(per_t.max())


# --------------------------------------------------------------------------- units


def count_units(n_examples: int, microbatch: int = 1) -> int:
    """Number of ordered units for ``n_examples`` examples cut into microbatches of
    ``microbatch`` consecutive example ids (``ceil(n / microbatch)``; 1 = per example)."""
    if microbatch < 1 or n_examples < 0:
        raise ValueError(f"count_units: n={n_examples}, microbatch={microbatch}")
    return -(-int(n_examples) // int(microbatch))


def expand_units(unit_order: np.ndarray, n_examples: int, microbatch: int = 1) -> np.ndarray:
    """Example order (int32) visiting unit ``u`` as examples ``u*mb .. min((u+1)*mb, n) - 1``."""
    order = np.asarray(unit_order, np.int64)
    if microbatch == 1:
        return order.astype(np.int32)
    parts = [
        np.arange(u * microbatch, min((u + 1) * microbatch, n_examples), dtype=np.int32)
        for u in order
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


# --------------------------------------------------------------------------- sketching


class RandomSketch:
    """Shared-seed random projection ``x -> x @ R`` of gradients to ``k`` dimensions.

    Two kinds of ``R`` (``d x k``), both with ``E[<xR, yR>] = <x, y>``:

    * ``"countsketch"`` (default; Charikar, Chen, Farach-Colton 2002; the sparse JL
      transform): every coordinate ``j`` goes to one bucket ``h(j)`` with a random sign
      ``sigma(j)``, so ``R[j, h(j)] = sigma(j)`` and all else is 0. Costs O(d) per gradient
      and O(d) memory; ``h`` and ``sigma`` come from ``derive_seed(seed, d, k, 0,
      SKETCH_STREAM)``.
    * ``"gaussian"``: iid ``N(0, 1/k)`` float32 entries. Costs O(d k) per gradient. Rows are
      drawn in blocks of :data:`SKETCH_BLOCK_ROWS`, block ``b`` from
      ``derive_seed(seed, d, k, b + 1, SKETCH_STREAM)``; ``R`` is cached when it takes at most
      :data:`SKETCH_CACHE_BYTES` bytes, otherwise redrawn block by block on every call.

    Every process holding the same seed draws the same ``R`` for the same ``d``. Output is
    float32; the numpy and torch paths may differ in the last bits (summation order).

    Args:
        k: sketch dimension (>= 1).
        seed: run seed (default 0).
        kind: ``"countsketch"`` (default) or ``"gaussian"``.
    """

    def __init__(self, k: int, seed: int = 0, kind: str = "countsketch") -> None:
        if k < 1:
            raise ValueError(f"RandomSketch: k must be >= 1, got {k}")
        if kind not in SKETCH_KINDS:
            raise ValueError(f"RandomSketch: kind must be one of {SKETCH_KINDS}, got {kind!r}")
        self.k = int(k)
        self.seed = int(seed)
        self.kind = kind
        self._cache: dict[int, Any] = {}
        self._torch_cache: dict[tuple[int, Any], Any] = {}

    # -- countsketch -------------------------------------------------------------------------

    def hashes(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """CountSketch buckets (int64 in ``[0, k)``) and signs (float32 +-1) of ``d`` coords."""
        if d not in self._cache:
            rng = np.random.default_rng(derive_seed(self.seed, d, self.k, 0, SKETCH_STREAM))
            bucket = rng.integers(0, self.k, size=d, dtype=np.int64)
            sign = np.where(rng.random(d) < 0.5, np.float32(-1.0), np.float32(1.0))
            self._cache[d] = (bucket, sign.astype(np.float32))
        return self._cache[d]

    def _sparse(self, d: int) -> Any:
        key = (d, "csr")
        if key not in self._torch_cache:
            from scipy import sparse

            bucket, sign = self.hashes(d)
            # R transposed, (k, d): one non-zero per column
            self._torch_cache[key] = sparse.csr_matrix(
                (sign, (bucket, np.arange(d))), shape=(self.k, d), dtype=np.float32
            )
        return self._torch_cache[key]

    # -- gaussian ----------------------------------------------------------------------------

    def block(self, d: int, b: int) -> np.ndarray:
        """Gaussian kind: rows ``b*SKETCH_BLOCK_ROWS ..`` of ``R`` for dimension ``d``."""
        rows = min(SKETCH_BLOCK_ROWS, d - b * SKETCH_BLOCK_ROWS)
        rng = np.random.default_rng(derive_seed(self.seed, d, self.k, b + 1, SKETCH_STREAM))
        r = rng.standard_normal((rows, self.k), dtype=np.float32)
        r *= np.float32(1.0 / math.sqrt(self.k))
        return r

    def matrix(self, d: int) -> np.ndarray:
        """The dense ``(d, k)`` float32 ``R`` (gaussian: cached when small enough)."""
        if self.kind == "countsketch":
            bucket, sign = self.hashes(d)
            r = np.zeros((d, self.k), np.float32)
            r[np.arange(d), bucket] = sign
            return r
        if d in self._cache:
            return self._cache[d]
        blocks = -(-d // SKETCH_BLOCK_ROWS)
        r = np.concatenate([self.block(d, b) for b in range(blocks)], axis=0)
        if r.nbytes <= SKETCH_CACHE_BYTES:
            self._cache[d] = r
        return r

    # -- projection --------------------------------------------------------------------------

    def __call__(self, grads: Any) -> Any:
        """Project rows ``(n, d)`` (numpy or torch) to ``(n, k)`` float32, same library/device."""
        if isinstance(grads, np.ndarray):
            g = np.asarray(grads, np.float32)
            g2 = g.reshape(-1, g.shape[-1]) if g.ndim > 1 else g[None, :]
            out = self._numpy(g2)
            return out if g.ndim > 1 else out[0]
        import torch

        t = grads.to(torch.float32)
        d = t.shape[-1]
        key = (d, t.device)
        if self.kind == "countsketch":
            if key not in self._torch_cache:
                bucket, sign = self.hashes(d)
                self._torch_cache[key] = (
                    torch.from_numpy(bucket).to(t.device),
                    torch.from_numpy(sign).to(t.device),
                )
            bucket_t, sign_t = self._torch_cache[key]
            t2 = t.reshape(-1, d)
            out = t2.new_zeros(t2.shape[0], self.k).index_add_(1, bucket_t, t2 * sign_t)
            return out.reshape(*t.shape[:-1], self.k)
        r = self._torch_cache.get(key)
        if r is None:
            r = torch.from_numpy(self.matrix(d)).to(t.device)
            if d * self.k * 4 <= SKETCH_CACHE_BYTES:
                self._torch_cache[key] = r
        return t @ r

    def _numpy(self, g2: np.ndarray) -> np.ndarray:
        d = g2.shape[1]
        if self.kind == "countsketch":
            return np.ascontiguousarray((self._sparse(d) @ g2.T).T, dtype=np.float32)
        if d * self.k * 4 <= SKETCH_CACHE_BYTES:
            return g2 @ self.matrix(d)
        out = np.zeros((g2.shape[0], self.k), np.float32)
        for b in range(-(-d // SKETCH_BLOCK_ROWS)):
            lo = b * SKETCH_BLOCK_ROWS
            out += g2[:, lo : lo + SKETCH_BLOCK_ROWS] @ self.block(d, b)
        return out


# --------------------------------------------------------------------------- orderers


class Orderer:
    """Decides every worker's unit order for the next epoch.

    Use: ``orders = o.initial_orders(sizes)`` for epoch 0 (or the epoch a run starts at);
    each epoch, worker ``w`` visits its units in ``orders[w]`` and reports one gradient per
    unit, rows in visit order; then ``orders = o.next_orders(grads_by_worker)`` gives the
    orders of the next epoch. Orders are int32 permutations of ``range(n_w)``.
    ``state_dict()`` / ``load_state_dict()`` carry everything needed to resume (epoch,
    current orders, ID-GraB(Bal)'s stale means); the sketch matrix is redrawn from the seed.

    Args:
        seed: run seed (default 0); D-RR shuffles and the sketch derive from it.
        sketch_dim: ``k`` of the random projection, 0 = exact mode (default 0).
        sketch_kind: ``"countsketch"`` (default) or ``"gaussian"``, see :class:`RandomSketch`.
        unit: ``"example"`` or ``"microbatch"`` (default ``"example"``); informational for
            the runtime, see :meth:`num_units` / :meth:`example_order`.
        microbatch: examples per microbatch when ``unit == "microbatch"`` (default 1).
    """

    name = "abstract"
    #: whether the coordinator needs the workers' gradients to compute the next orders
    needs_grads = True

    def __init__(
        self,
        seed: int = 0,
        sketch_dim: int = 0,
        unit: str = "example",
        microbatch: int = 1,
        sketch_kind: str = "countsketch",
    ) -> None:
        self.seed = checks.integer("seed", seed, minimum=0)
        self.sketch_dim = checks.integer("ordering.sketch_dim", sketch_dim, minimum=0)
        if sketch_kind not in SKETCH_KINDS:
            raise ConfigError(
                f"config key 'ordering.sketch_kind' = {sketch_kind!r}: expected one of "
                f"{', '.join(SKETCH_KINDS)}"
            )
        self.sketch_kind = sketch_kind
        if unit not in UNITS:
            raise ConfigError(
                f"config key 'ordering.unit' = {unit!r}: expected one of {', '.join(UNITS)}"
            )
        self.unit = unit
        self.microbatch = checks.integer("ordering.microbatch", microbatch, minimum=1)
        self.sketch = (
            RandomSketch(self.sketch_dim, self.seed, sketch_kind) if self.sketch_dim else None
        )
        self.epoch = 0
        self._orders: list[np.ndarray] = []
        #: per-visit signs (int8, visit order) decided by the last next_orders call; empty
        #: for a worker that got a D-RR order; for tests and debugging
        self.last_signs: list[np.ndarray] = []

    # -- units -----------------------------------------------------------------------------

    def num_units(self, n_examples: int) -> int:
        """Ordered units for a worker holding ``n_examples`` examples."""
        return count_units(n_examples, self.microbatch if self.unit == "microbatch" else 1)

    def example_order(self, unit_order: np.ndarray, n_examples: int) -> np.ndarray:
        """The example visiting order (int32) that a unit order stands for."""
        mb = self.microbatch if self.unit == "microbatch" else 1
        return expand_units(unit_order, n_examples, mb)

    # -- D-RR --------------------------------------------------------------------------------

    def worker_seed(self, worker: int, epoch: int) -> int:
        """D-RR seed: ``derive_seed(seed, worker, epoch, ORDER_STREAM)``."""
        return derive_seed(self.seed, worker, epoch, ORDER_STREAM)

    def shuffled(self, worker: int, n: int, epoch: int) -> np.ndarray:
        """D-RR order (int32 permutation of ``range(n)``) of ``worker`` in ``epoch``."""
        rng = np.random.default_rng(self.worker_seed(worker, epoch))
        return rng.permutation(n).astype(np.int32)

    # -- epochs ------------------------------------------------------------------------------

    @property
    def orders(self) -> list[np.ndarray]:
        """Copies of the current orders (those of epoch ``self.epoch``)."""
        return [o.copy() for o in self._orders]

    @property
    def sizes(self) -> list[int]:
        """Units per worker."""
        return [int(o.size) for o in self._orders]

    def initial_orders(self, sizes: Sequence[int], epoch: int = 0) -> list[np.ndarray]:
        """Start at ``epoch`` with D-RR orders for workers holding ``sizes[w]`` units.

        Forgets per-worker state (stale means); use :meth:`resize` to change some sizes
        mid-run instead.
        """
        sizes = [checks.integer("ordering sizes", s, minimum=0) for s in sizes]
        self.epoch = checks.integer("ordering epoch", epoch, minimum=0)
        self._orders = [self.shuffled(w, n, self.epoch) for w, n in enumerate(sizes)]
        self.last_signs = [np.zeros(0, np.int8) for _ in sizes]
        self._reset_workers(len(sizes))
        return self.orders

    def resize(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """New unit counts (e.g. after dynamic data allocation): a worker whose size changed
        (or a new worker) gets a D-RR order for the current epoch; the others keep theirs."""
        sizes = [checks.integer("ordering sizes", s, minimum=0) for s in sizes]
        old = self._orders
        self._orders = [
            old[w] if w < len(old) and old[w].size == n else self.shuffled(w, n, self.epoch)
            for w, n in enumerate(sizes)
        ]
        self._resize_workers(len(sizes))
        return self.orders

    def project(self, grads: Any) -> Any:
        """What a worker ships: its gradients projected to ``sketch_dim`` (unchanged if 0)."""
        return grads if self.sketch is None else self.sketch(grads)

    def next_orders(
        self,
        grads_by_worker: Sequence[np.ndarray | None] | None,
        orders_used: Sequence[np.ndarray] | None = None,
        *,
        sketched: bool = False,
    ) -> list[np.ndarray]:
        """Orders of epoch ``self.epoch + 1`` from the gradients of epoch ``self.epoch``.

        The whole epoch at once: the same as :meth:`begin_epoch`, one :meth:`EpochStream.add`
        per worker and :meth:`EpochStream.finish`.

        Args:
            grads_by_worker: per worker a ``(n_w, width)`` array, one row per unit in visit
                order (``None`` for a worker without gradients: it gets a D-RR order).
                Ignored by ``rr`` (may be None).
            orders_used: the orders visited this epoch (default: the current orders).
            sketched: rows are already projected by :meth:`project` (only meaningful with
                ``sketch_dim > 0``; otherwise the orderer projects them itself).

        Raises ValueError on mismatched shapes, non-permutations or non-finite gradients.
        """
        stream = self.begin_epoch(orders_used, sketched=sketched)
        if self.needs_grads:
            m = len(stream.sizes)
            if grads_by_worker is None or len(grads_by_worker) != m:
                got = None if grads_by_worker is None else len(grads_by_worker)
                raise ValueError(f"{self.name}: gradients of {got} workers, {m} orders")
            for w, g in enumerate(grads_by_worker):
                if g is None:
                    continue
                a = _as_rows(g)
                if a.shape[0] != stream.sizes[w]:
                    raise ValueError(
                        f"{self.name}: worker {w} sent {a.shape[0]} gradients for "
                        f"{stream.sizes[w]} units"
                    )
                stream.add(w, a)
        return stream.finish()

    def begin_epoch(
        self, orders_used: Sequence[np.ndarray] | None = None, *, sketched: bool = False
    ) -> EpochStream:
        """Start taking this epoch's gradients as they arrive (see :class:`EpochStream`).

        ``orders_used`` / ``sketched`` as in :meth:`next_orders`. Raises ValueError if there
        are no orders yet or one is not a permutation.
        """
        if not self._orders and orders_used is None:
            raise ValueError(f"{self.name}: call initial_orders() before next_orders()")
        used = [np.asarray(o) for o in (self._orders if orders_used is None else orders_used)]
        for w, o in enumerate(used):
            if o.ndim != 1 or not np.array_equal(np.sort(o), np.arange(o.size)):
                raise ValueError(f"{self.name}: orders_used[{w}] is not a permutation")
        self._resize_workers(len(used))
        return EpochStream(self, used, sketched)

    # -- streaming hooks (see EpochStream) ----------------------------------------------------

    def _stream_start(self, st: EpochStream) -> None:
        """Set up this ordering's per-epoch decision state on ``st``."""

    def _stream_rows(self, st: EpochStream, w: int, first: int, rows: np.ndarray) -> None:
        """Rows ``first ..`` of worker ``w`` (float64, in ``st.buf[w]`` already) arrived."""

    def _stream_advance(self, st: EpochStream, worker: int | None) -> None:
        """Make every decision the rules allow now (``worker``: the one that just sent rows;
        None: the epoch is over, every worker not in ``st.missing`` is complete)."""

    def _stream_end(self, st: EpochStream) -> None:
        """After the last decision, before the orders are built (e.g. keep means)."""

    # per-worker state hooks (only ID-GraB(Bal) keeps any)
    def _reset_workers(self, m: int) -> None:
        pass

    def _resize_workers(self, m: int) -> None:
        pass

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Resumable state as flat numpy arrays and scalars (HDF5-friendly).

        Keys: ``name``, ``seed``, ``sketch_dim``, ``sketch_kind``, ``epoch``, ``sizes`` (int64,
        units per worker), ``orders`` (int32, the current orders concatenated), ``means`` (float64
        ``(m, width)``, ID-GraB(Bal)'s stale means; ``(m, 0)`` otherwise), ``means_set``
        (bool ``(m,)``).
        """
        m = len(self._orders)
        means, means_set = self._means_state(m)
        return {
            "name": self.name,
            "seed": self.seed,
            "sketch_dim": self.sketch_dim,
            "sketch_kind": self.sketch_kind,
            "epoch": self.epoch,
            "sizes": np.array(self.sizes, np.int64),
            "orders": (
                np.concatenate(self._orders).astype(np.int32) if m else np.zeros(0, np.int32)
            ),
            "means": means,
            "means_set": means_set,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises CheckpointError if it does not fit."""
        try:
            name = str(np.asarray(state["name"]))
            seed = int(state["seed"])
            sketch_dim = int(state["sketch_dim"])
            kind = str(np.asarray(state["sketch_kind"]))
            epoch = int(state["epoch"])
            sizes = np.asarray(state["sizes"], np.int64).reshape(-1)
            flat = np.asarray(state["orders"], np.int64).reshape(-1)
            means = np.asarray(state["means"], np.float64)
            means_set = np.asarray(state["means_set"], bool).reshape(-1)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"ordering state: missing or malformed entry ({exc})") from None
        if name != self.name:
            raise CheckpointError(f"ordering state: saved by {name!r}, this run uses {self.name!r}")
        if (seed, sketch_dim, kind) != (self.seed, self.sketch_dim, self.sketch_kind):
            raise CheckpointError(
                f"ordering state: seed/sketch_dim/sketch_kind {seed}/{sketch_dim}/{kind} differ "
                f"from this run's {self.seed}/{self.sketch_dim}/{self.sketch_kind}"
            )
        if np.any(sizes < 0) or int(sizes.sum()) != flat.size:
            raise CheckpointError("ordering state: sizes do not match the saved orders")
        orders = np.split(flat, np.cumsum(sizes)[:-1]) if sizes.size else []
        for w, o in enumerate(orders):
            if not np.array_equal(np.sort(o), np.arange(o.size)):
                raise CheckpointError(f"ordering state: order of worker {w} is not a permutation")
        m = sizes.size
        if means.ndim != 2 or means.shape[0] != m or means_set.size != m:
            raise CheckpointError(f"ordering state: means shape {means.shape} for {m} workers")
        self.epoch = epoch
        self._orders = [o.astype(np.int32) for o in orders]
        self.last_signs = [np.zeros(0, np.int8) for _ in range(m)]
        self._load_means(means, means_set)

    def _means_state(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((m, 0), np.float64), np.zeros(m, bool)

    def _load_means(self, means: np.ndarray, means_set: np.ndarray) -> None:
        pass


def _as_rows(g: Any) -> np.ndarray:
    """Gradients as a 2-D ``(units, width)`` array (a 1-D input is one value per unit)."""
    a = np.asarray(g)
    if a.ndim == 1:
        return a.reshape(-1, 1)
    if a.ndim > 2:
        return a.reshape(a.shape[0], math.prod(a.shape[1:]))
    return a


class EpochStream:
    """One epoch of an :class:`Orderer`, fed with gradients as they arrive.

    Made by :meth:`Orderer.begin_epoch`. Each :meth:`add` appends rows of one worker (in
    its visit order, any number at a time) and at once makes every balancing decision the
    rules allow, so a coordinator can balance while the workers are still computing;
    :meth:`finish` makes the rest and returns the next orders. The decisions, and so the
    orders, are exactly those of :meth:`Orderer.next_orders` on the same rows (which is
    implemented with this class), however the rows are split into calls and interleaved.

    A worker that has not sent all its rows by :meth:`finish` (or was :meth:`drop`-ped) gets
    a D-RR order. Any of its pairs already balanced stay in CD-GraB's shared sum: they were
    real gradients of this epoch.

    Attributes:
        sizes: units per worker this epoch.
        count: rows received per worker.
        decisions: balancing decisions made so far.
        seconds: time spent in :meth:`add` and :meth:`finish` (wall seconds).
    """

    def __init__(self, orderer: Orderer, used: list[np.ndarray], sketched: bool) -> None:
        self.orderer = orderer
        self.epoch = orderer.epoch
        self.used = used
        self.sizes = [int(o.size) for o in used]
        self.sketched = bool(sketched)
        self.width: int | None = None
        m = len(used)
        self.buf: list[np.ndarray | None] = [None] * m  # float64 rows as received
        self.diffs: list[np.ndarray | None] = [None] * m  # pair differences (pair orderers)
        self.count = [0] * m
        self.signs = [np.zeros(n, np.int8) for n in self.sizes]
        self.missing: set[int] = set()
        self.moved: set[int] = set()  # dropped because their device changed rank mid-epoch
        self.decisions = 0
        self.seconds = 0.0
        self.finished = False
        orderer._stream_start(self)

    def pairs_ready(self, w: int) -> int:
        """Pairs of worker ``w`` whose two rows have both arrived."""
        return self.count[w] // 2

    def add_pair_differences(self, w: int, first: int, last: int) -> None:
        """PairBalance vectors of the pairs completed by rows ``first .. last - 1``."""
        k0, k1 = first // 2, last // 2
        if k1 <= k0:
            return
        if self.diffs[w] is None:
            self.diffs[w] = np.empty((self.sizes[w] // 2, self.width), np.float64)
        b = self.buf[w]
        self.diffs[w][k0:k1] = b[2 * k0 : 2 * k1 : 2] - b[2 * k0 + 1 : 2 * k1 : 2]

    def add(self, worker: int, grads: Any) -> int:
        """Rows ``(r, width)`` of ``worker``, following those it sent before; returns the
        decisions made. Raises ValueError (and keeps nothing of the call) for an unknown or
        dropped worker, more rows than units, a wrong width, or non-finite values."""
        t0 = time.perf_counter()
        o = self.orderer
        if self.finished:
            raise ValueError(f"{o.name}: epoch {self.epoch} is already finished")
        if not 0 <= worker < len(self.sizes):
            raise ValueError(f"{o.name}: no worker {worker} (this epoch has {len(self.sizes)})")
        if not o.needs_grads:
            return 0
        if worker in self.missing:
            raise ValueError(f"{o.name}: worker {worker} was dropped from epoch {self.epoch}")
        a = _as_rows(grads)
        if o.sketch is not None and not self.sketched:
            a = o.sketch(a)
        elif o.sketch is not None and a.shape[1] != o.sketch_dim:
            raise ValueError(
                f"{o.name}: worker {worker} sent sketches of width {a.shape[1]}, "
                f"sketch_dim is {o.sketch_dim}"
            )
        if self.width is not None and a.shape[1] != self.width:
            raise ValueError(f"{o.name}: worker {worker} gradient width {a.shape[1]}")
        first, n = self.count[worker], self.sizes[worker]
        if first + a.shape[0] > n:
            raise ValueError(
                f"{o.name}: worker {worker} sent {first + a.shape[0]} gradients for {n} units"
            )
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{o.name}: worker {worker} sent non-finite gradients")
        if self.width is None:
            self.width = int(a.shape[1])
        if self.buf[worker] is None:
            self.buf[worker] = np.empty((n, self.width), np.float64)
        last = first + a.shape[0]
        rows = self.buf[worker][first:last]
        rows[...] = a
        o._stream_rows(self, worker, first, rows)  # may raise: count is not advanced yet
        self.count[worker] = last
        before = self.decisions
        o._stream_advance(self, worker)
        self.seconds += time.perf_counter() - t0
        return self.decisions - before

    def drop(self, worker: int) -> None:
        """``worker`` will not complete this epoch (it died): D-RR order for it next epoch."""
        self.missing.add(worker)

    def finish(self) -> list[np.ndarray]:
        """Make the remaining decisions and return the orders of the next epoch (the
        orderer moves to it, as after :meth:`Orderer.next_orders`)."""
        t0 = time.perf_counter()
        o = self.orderer
        if self.finished:
            raise ValueError(f"{o.name}: epoch {self.epoch} is already finished")
        if o.epoch != self.epoch:
            raise ValueError(
                f"{o.name}: this stream is for epoch {self.epoch}, the orderer is at {o.epoch}"
            )
        if o.needs_grads:
            self.missing.update(w for w, n in enumerate(self.sizes) if self.count[w] != n)
            o._stream_advance(self, None)
        nxt = o.epoch + 1
        o.last_signs = [np.zeros(0, np.int8) for _ in self.used]
        new: list[np.ndarray] = []
        for w, u in enumerate(self.used):
            if not o.needs_grads or w in self.missing:
                new.append(o.shuffled(w, u.size, nxt))
            else:
                o.last_signs[w] = self.signs[w]
                new.append(reorder(u, self.signs[w]))
        o._stream_end(self)
        o.epoch = nxt
        o._orders = new
        self.finished = True
        self.seconds += time.perf_counter() - t0
        return o.orders


class RandomReshuffle(Orderer):
    """D-RR: each worker reshuffles its own units every epoch with its own seed."""

    name = "rr"
    needs_grads = False


class IndependentPairGraB(Orderer):
    """ID-GraB(PairBal): PairBalance per worker, each worker with its own running sum."""

    name = "id-grab"

    def _stream_start(self, st: EpochStream) -> None:
        st.sums = [None] * len(st.sizes)
        st.next_pair = [0] * len(st.sizes)

    def _stream_rows(self, st: EpochStream, w: int, first: int, rows: np.ndarray) -> None:
        st.add_pair_differences(w, first, first + rows.shape[0])

    def _stream_advance(self, st: EpochStream, worker: int | None) -> None:
        for w in range(len(st.sizes)) if worker is None else (worker,):
            if w in st.missing:
                continue
            done, ready = st.next_pair[w], st.pairs_ready(w)
            if done >= ready:
                continue
            if st.sums[w] is None:
                st.sums[w] = np.zeros(st.width, np.float64)
            s, diffs, signs = st.sums[w], st.diffs[w], st.signs[w]
            for k in range(done, ready):
                eps = balance(s, diffs[k])
                signs[2 * k] = eps
                signs[2 * k + 1] = -eps
            st.decisions += ready - done
            st.next_pair[w] = ready


class CDGraB(Orderer):
    """CD-GraB: PairBalance of all workers against one shared sum (pair outer, worker inner).

    Streaming: decision ``(pair k, worker w)`` is made as soon as every decision before it in
    that order is made and worker ``w``'s rows ``2k, 2k+1`` arrived, so with workers shipping
    rows as they go the balancing keeps pace with the slowest worker.
    """

    name = "cd-grab"

    def _stream_start(self, st: EpochStream) -> None:
        st.pairs = [n // 2 for n in st.sizes]
        st.most = max(st.pairs, default=0)
        st.k = 0  # the frontier: next decision is (pair st.k, worker st.wi)
        st.wi = 0
        st.sum = None

    def _stream_rows(self, st: EpochStream, w: int, first: int, rows: np.ndarray) -> None:
        st.add_pair_differences(w, first, first + rows.shape[0])

    def _stream_advance(self, st: EpochStream, worker: int | None) -> None:
        m, pairs, missing = len(st.sizes), st.pairs, st.missing
        k, wi = st.k, st.wi
        while k < st.most:
            if k < pairs[wi] and wi not in missing:
                if st.pairs_ready(wi) <= k:
                    break  # wait for worker wi's pair k (never at the end: it is complete)
                if st.sum is None:
                    st.sum = np.zeros(st.width, np.float64)
                eps = balance(st.sum, st.diffs[wi][k])
                st.signs[wi][2 * k] = eps
                st.signs[wi][2 * k + 1] = -eps
                st.decisions += 1
            wi += 1
            if wi == m:
                wi = 0
                k += 1
        st.k, st.wi = k, wi


class IndependentBalGraB(Orderer):
    """ID-GraB(Bal): per unit, ``v = g - (worker's previous-epoch mean gradient)``, a separate
    running sum per worker; the mean is zero until the orderer has seen that worker once."""

    name = "id-grab-bal"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._means: list[np.ndarray | None] = []

    def _reset_workers(self, m: int) -> None:
        self._means = [None] * m

    def _resize_workers(self, m: int) -> None:
        self._means = (self._means + [None] * m)[:m]

    def _stream_start(self, st: EpochStream) -> None:
        st.sums = [None] * len(st.sizes)
        st.next_unit = [0] * len(st.sizes)
        st.vs = [None] * len(st.sizes)

    def _stream_rows(self, st: EpochStream, w: int, first: int, rows: np.ndarray) -> None:
        mean = self._means[w]
        if mean is not None and mean.size != st.width:
            raise ValueError(
                f"{self.name}: worker {w} gradient width {st.width}, stale mean {mean.size}"
            )
        if st.vs[w] is None:
            st.vs[w] = np.empty((st.sizes[w], st.width), np.float64)
        st.vs[w][first : first + rows.shape[0]] = rows if mean is None else rows - mean

    def _stream_advance(self, st: EpochStream, worker: int | None) -> None:
        for w in range(len(st.sizes)) if worker is None else (worker,):
            if w in st.missing or st.next_unit[w] >= st.count[w]:
                continue
            if st.sums[w] is None:
                st.sums[w] = np.zeros(st.width, np.float64)
            s, vs, signs = st.sums[w], st.vs[w], st.signs[w]
            for u in range(st.next_unit[w], st.count[w]):
                signs[u] = balance(s, vs[u])
            st.decisions += st.count[w] - st.next_unit[w]
            st.next_unit[w] = st.count[w]

    def _stream_end(self, st: EpochStream) -> None:
        for w, n in enumerate(st.sizes):
            if w not in st.missing and n:
                self._means[w] = st.buf[w].mean(axis=0)

    def _means_state(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        width = max((x.size for x in self._means if x is not None), default=0)
        means = np.zeros((m, width), np.float64)
        set_ = np.zeros(m, bool)
        for w, x in enumerate(self._means[:m]):
            if x is not None:
                means[w] = x
                set_[w] = True
        return means, set_

    def _load_means(self, means: np.ndarray, means_set: np.ndarray) -> None:
        self._means = [means[w].copy() if means_set[w] else None for w in range(means.shape[0])]


ORDERERS: dict[str, type[Orderer]] = {
    c.name: c for c in (RandomReshuffle, IndependentPairGraB, IndependentBalGraB, CDGraB)
}


def make_orderer(
    name: str,
    seed: int = 0,
    sketch_dim: int = 0,
    unit: str = "example",
    microbatch: int = 1,
    sketch_kind: str = "countsketch",
) -> Orderer:
    """Orderer by config values: ``algorithm.ordering`` (rr, id-grab, id-grab-bal, cd-grab),
    the run ``seed``, ``ordering.sketch_dim`` (>= 0, 0 = exact), ``ordering.unit``
    (example, microbatch), ``ordering.microbatch`` (>= 1) and ``ordering.sketch_kind``
    (countsketch, gaussian). Bad values raise ConfigError naming the key."""
    cls = ORDERERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(
            f"config key 'algorithm.ordering' = {name!r}: expected one of {', '.join(ORDERINGS)}"
        )
    return cls(
        seed=seed,
        sketch_dim=sketch_dim,
        unit=unit,
        microbatch=microbatch,
        sketch_kind=sketch_kind,
    )


# --------------------------------------------------------------------------- debug dumps


def save_epoch_debug(
    path: str | Path,
    state_before: Mapping[str, Any],
    grads_by_worker: Sequence[np.ndarray | None],
    orders_used: Sequence[np.ndarray],
    orders_sent: Sequence[np.ndarray],
    *,
    sketched: bool = False,
) -> None:
    """Write one epoch's ordering inputs and outputs to ``path`` (``.npz``, uncompressed).

    ``state_before`` is the orderer's :meth:`Orderer.state_dict` before ``next_orders``;
    with it, :func:`replay_epoch_debug` recomputes the orders offline.
    """
    arrays: dict[str, np.ndarray] = {f"state_{k}": np.asarray(v) for k, v in state_before.items()}
    arrays["sketched"] = np.asarray(bool(sketched))
    arrays["used_sizes"] = np.array([np.asarray(o).size for o in orders_used], np.int64)
    arrays["used"] = np.concatenate([np.asarray(o, np.int32) for o in orders_used] or [[]])
    arrays["sent"] = np.concatenate([np.asarray(o, np.int32) for o in orders_sent] or [[]])
    arrays["has_grads"] = np.array([g is not None for g in grads_by_worker], bool)
    for w, g in enumerate(grads_by_worker):
        if g is not None:
            arrays[f"grads_{w}"] = np.asarray(g)
    np.savez(path, **arrays)


def replay_epoch_debug(path: str | Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Recompute a dump of :func:`save_epoch_debug`: returns (recomputed orders, sent orders)."""
    with np.load(path, allow_pickle=False) as z:
        state = {k[6:]: z[k] for k in z.files if k.startswith("state_")}
        sizes = z["used_sizes"]
        cuts = np.cumsum(sizes)[:-1]
        used = np.split(z["used"].astype(np.int32), cuts)
        sent = np.split(z["sent"].astype(np.int32), cuts)
        grads = [z[f"grads_{w}"] if h else None for w, h in enumerate(z["has_grads"])]
        sketched = bool(z["sketched"])
    o = make_orderer(
        str(state["name"]),
        int(state["seed"]),
        int(state["sketch_dim"]),
        sketch_kind=str(state["sketch_kind"]),
    )
    o.load_state_dict(state)
    return o.next_orders(grads, used, sketched=sketched), sent


def make_cfg_orderer(cfg: dict):
    """The example orderer of ``algorithm.ordering`` (None for "none")."""
    name = cfg["algorithm"]["ordering"]
    if name == "none":
        return None
    o = cfg["ordering"]
    return make_orderer(
        name, cfg["seed"], o["sketch_dim"], o["unit"], o["microbatch"], o["sketch_kind"]
    )
