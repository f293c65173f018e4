"""Keys, key ranges and working sets over a flat parameter vector (pure numpy, no MPI).

Parameter-server vocabulary (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014), mapped onto edgefl's one flat float32 buffer
(:class:`edgefl.models.flat.FlatParams`):

* a **key** is a flat element index ``0 .. numel - 1`` (int64 here; int32 on the wire, see
  :mod:`edgefl.algorithms.ps.compress`);
* a **key range** is a half-open interval ``[start, stop)`` of keys: a whole parameter tensor,
  one shard of the model, or any slice;
* a **row** of a parameter of shape ``(R, C, ...)`` is the ``prod(C, ...)`` consecutive keys of
  ``param[r]`` (an embedding row); a 1-D parameter has rows of one key;
* a device's **working set** is the sorted set of keys its data can touch, e.g. the nonzero
  feature columns of its sparse design matrix for a linear model. A device needs (pulls) only
  those values and its update is zero everywhere else, so it pushes only those keys.

Key arrays handed to :func:`gather` / :func:`scatter` / :func:`scatter_add` must be sorted,
unique and inside the vector (checked by :func:`check_keys`); then every operation is a
vectorised fancy-index with no duplicates, so results do not depend on the order of keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

KEY_DTYPE = np.dtype(np.int64)


def check_keys(keys: Any, space: int, what: str = "keys") -> np.ndarray:
    """Return ``keys`` as a 1-D int64 array after checking it is sorted, unique, in range.

    Args:
        keys: integer keys (any integer array-like).
        space: size of the key space (number of elements of the flat vector); keys must lie
            in ``0 .. space - 1``.
        what: name used in the error message.

    Raises:
        ValueError: not 1-D integers, out of range, unsorted or duplicated.
    """
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise ValueError(f"{what}: must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, KEY_DTYPE)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: must be integers, got dtype {arr.dtype}")
    arr = arr.astype(KEY_DTYPE, copy=False)
    if int(arr[0]) < 0 or int(arr[-1]) >= space:
        lo, hi = int(arr.min()), int(arr.max())
        raise ValueError(f"{what}: keys {lo}..{hi} outside the key space 0..{space - 1}")
    if arr.size > 1 and not bool(np.all(arr[1:] > arr[:-1])):
        raise ValueError(f"{what}: must be sorted ascending with no duplicates")
    return arr


@dataclass(frozen=True)
class KeyRange:
    """The half-open key interval ``[start, stop)``.

    Args:
        start: first key (>= 0).
        stop: one past the last key (>= start).
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if int(self.start) < 0 or int(self.stop) < int(self.start):
            raise ValueError(f"KeyRange({self.start}, {self.stop}): need 0 <= start <= stop")
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "stop", int(self.stop))

    @property
    def size(self) -> int:
        """Number of keys in the range."""
        return self.stop - self.start

    def keys(self) -> np.ndarray:
        """All keys of the range, int64, ascending."""
        return np.arange(self.start, self.stop, dtype=KEY_DTYPE)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``keys`` fall in the range."""
        k = np.asarray(keys)
        return (k >= self.start) & (k < self.stop)

    def select(self, keys: np.ndarray) -> np.ndarray:
        """The keys of a sorted key array that fall in the range (a view, no copy)."""
        k = np.asarray(keys)
        lo, hi = np.searchsorted(k, [self.start, self.stop])
        return k[lo:hi]

    def intersect(self, other: KeyRange) -> KeyRange:
        """The overlap of two ranges (an empty range at ``max(start)`` when disjoint)."""
        lo = max(self.start, other.start)
        return KeyRange(lo, max(lo, min(self.stop, other.stop)))

    def split(self, parts: int) -> list[KeyRange]:
        """``parts`` contiguous ranges covering this one, sizes differing by at most 1."""
        if parts < 1:
            raise ValueError(f"KeyRange.split: parts must be >= 1, got {parts}")
        q, r = divmod(self.size, parts)
        out, lo = [], self.start
        for i in range(parts):
            hi = lo + q + (1 if i < r else 0)
            out.append(KeyRange(lo, hi))
            lo = hi
        return out


def even_ranges(numel: int, parts: int) -> list[KeyRange]:
    """Split keys ``0 .. numel - 1`` into ``parts`` contiguous near-equal ranges (shards)."""
    return KeyRange(0, numel).split(parts)


class _FlatLike(Protocol):
    names: Sequence[str]
    shapes: Sequence[Sequence[int]]
    offsets: Sequence[int]
    numel: int


@dataclass(frozen=True)
class ParamLayout:
    """Where each named parameter lives in the flat vector.

    Build it with :meth:`from_flat` (from a :class:`~edgefl.models.flat.FlatParams`) or
    :meth:`from_shapes`. Attributes: ``names``, ``shapes``, ``offsets`` (first key of each
    parameter), ``numel`` (total keys).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def from_flat(cls, flat: _FlatLike) -> ParamLayout:
        """The layout of a ``FlatParams`` (anything with names, shapes, offsets, numel)."""
        return cls(
            tuple(flat.names),
            tuple(tuple(int(d) for d in s) for s in flat.shapes),
            tuple(int(o) for o in flat.offsets),
            int(flat.numel),
        )

    @classmethod
    def from_shapes(cls, names: Iterable[str], shapes: Iterable[Sequence[int]]) -> ParamLayout:
        """Layout of parameters stored back to back in the given order (as FlatParams does)."""
        names_t = tuple(str(n) for n in names)
        shapes_t = tuple(tuple(int(d) for d in s) for s in shapes)
        if len(names_t) != len(shapes_t):
            raise ValueError(f"{len(names_t)} names but {len(shapes_t)} shapes")
        if len(set(names_t)) != len(names_t):
            raise ValueError(f"duplicate parameter names in {names_t}")
        offsets, total = [], 0
        for s in shapes_t:
            offsets.append(total)
            total += math.prod(s)
        return cls(names_t, shapes_t, tuple(offsets), total)

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"no parameter {name!r} (have: {', '.join(self.names)})") from None

    def range_of(self, name: str) -> KeyRange:
        """The key range holding parameter ``name``."""
        i = self._index(name)
        return KeyRange(self.offsets[i], self.offsets[i] + math.prod(self.shapes[i]))

    def ranges(self) -> dict[str, KeyRange]:
        """Key range of every parameter, in layout order."""
        return {n: self.range_of(n) for n in self.names}

    def num_rows(self, name: str) -> int:
        """Rows of parameter ``name`` (its first dimension; 1 for a scalar)."""
        s = self.shapes[self._index(name)]
        return s[0] if s else 1

    def row_size(self, name: str) -> int:
        """Keys per row of parameter ``name`` (product of the trailing dimensions)."""
        s = self.shapes[self._index(name)]
        return math.prod(s[1:]) if len(s) > 1 else 1

    def row_keys(self, name: str, rows: Any) -> np.ndarray:
        """Flat keys of rows ``rows`` (sorted unique) of parameter ``name``, int64 ascending.

        For a ``(V, d)`` embedding, row ``r`` is keys ``offset + r*d .. offset + r*d + d - 1``.
        """
        r = check_keys(rows, self.num_rows(name), f"rows of {name!r}")
        size = self.row_size(name)
        base = self.range_of(name).start + r * size
        return (base[:, None] + np.arange(size, dtype=KEY_DTYPE)[None, :]).reshape(-1)

    def column_keys(self, name: str, cols: Any) -> np.ndarray:
        """Flat keys of columns ``cols`` (sorted unique) of a 2-D parameter, int64 ascending.

        For a linear layer's ``(out, in)`` weight, input feature ``j`` is column ``j``: the
        keys ``offset + o*in + j`` for every output ``o``. A 1-D parameter's columns are
        its elements.
        """
        s = self.shapes[self._index(name)]
        if len(s) > 2:
            raise ValueError(f"column_keys: {name!r} has shape {s}; need 1-D or 2-D")
        n_in = s[-1] if s else 1
        c = check_keys(cols, n_in, f"columns of {name!r}")
        n_out = s[0] if len(s) == 2 else 1
        base = self.range_of(name).start + np.arange(n_out, dtype=KEY_DTYPE)[:, None] * n_in
        return (base + c[None, :]).reshape(-1)

    def rows_of_keys(self, name: str, keys: Any) -> np.ndarray:
        """Rows of parameter ``name`` touched by sorted unique ``keys`` (sorted, unique)."""
        rng = self.range_of(name)
        k = rng.select(check_keys(keys, self.numel))
        return np.unique((k - rng.start) // self.row_size(name))


@dataclass(frozen=True)
class WorkingSet:
    """The keys one device reads and writes.

    Args:
        keys: sorted unique int64 keys (checked).
        space: size of the key space (model ``numel``).
    """

    keys: np.ndarray
    space: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", check_keys(self.keys, self.space, "working set"))

    @property
    def size(self) -> int:
        """Number of keys."""
        return int(self.keys.size)

    @property
    def fraction(self) -> float:
        """Share of the model in the working set (0..1)."""
        return self.size / self.space if self.space else 0.0

    def union(self, other: WorkingSet) -> WorkingSet:
        """Keys in either working set (same key space)."""
        if other.space != self.space:
            raise ValueError(f"key spaces differ: {self.space} vs {other.space}")
        return WorkingSet(np.union1d(self.keys, other.keys), self.space)

    def split(self, ranges: Sequence[KeyRange]) -> list[np.ndarray]:
        """The working set's keys falling in each of ``ranges`` (e.g. per server shard)."""
        return [r.select(self.keys) for r in ranges]


def csr_columns(csr: Any) -> np.ndarray:
    """Sorted unique column ids with at least one stored nonzero in a scipy sparse matrix.

    These are the features a device's examples reference: a sparse linear model's working
    set (before mapping to flat keys with :meth:`ParamLayout.column_keys`). Explicitly stored
    zeros are ignored.
    """
    m = csr.tocsr()
    cols = m.indices[m.data != 0]
    return np.unique(cols).astype(KEY_DTYPE)


def linear_working_set(
    layout: ParamLayout,
    weight: str,
    columns: Any,
    dense: Sequence[str] = (),
) -> WorkingSet:
    """Working set of a linear model whose ``weight`` columns are input features.

    Args:
        layout: the model's flat layout.
        weight: name of the weight (``(out, in)`` or ``(in,)``) indexed by feature.
        columns: sorted unique feature ids the device's data references (e.g.
            :func:`csr_columns`).
        dense: names of parameters every device touches in full (biases); default none.
    """
    parts = [layout.column_keys(weight, columns)]
    parts += [layout.range_of(n).keys() for n in dense]
    return WorkingSet(np.unique(np.concatenate(parts)), layout.numel)


def _check_values(flat: np.ndarray, keys: np.ndarray, values: np.ndarray | None) -> None:
    if flat.ndim != 1:
        raise ValueError(f"flat vector must be 1-D, got shape {flat.shape}")
    if values is not None and values.shape != keys.shape:
        raise ValueError(f"{keys.size} keys but values of shape {values.shape}")


def gather(flat: np.ndarray, keys: Any) -> np.ndarray:
    """Pull: a copy of ``flat`` at sorted unique ``keys`` (flat's dtype, same order as keys)."""
    k = check_keys(keys, flat.size)
    _check_values(flat, k, None)
    return flat[k]


def scatter(flat: np.ndarray, keys: Any, values: np.ndarray) -> np.ndarray:
    """Set ``flat[keys] = values`` in place (a worker installing pulled values); returns flat."""
    k = check_keys(keys, flat.size)
    v = np.asarray(values)
    _check_values(flat, k, v)
    flat[k] = v
    return flat


def scatter_add(flat: np.ndarray, keys: Any, values: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``flat[keys] += scale * values`` in place (the server accumulating a push); returns flat.

    Keys are unique, so the result equals the dense ``flat += scale * dense(values)`` element
    by element (same rounding), whatever the order of pushes of other keys.
    """
    k = check_keys(keys, flat.size)
    v = np.asarray(values)
    _check_values(flat, k, v)
    if scale == 1.0:
        flat[k] += v
    else:
        flat[k] += scale * v.astype(flat.dtype, copy=False)
    return flat


def densify(keys: Any, values: np.ndarray, space: int, dtype: Any = np.float32) -> np.ndarray:
    """A dense vector of ``space`` elements, zero except ``values`` at sorted unique ``keys``."""
    out = np.zeros(space, dtype)
    return scatter(out, keys, values)


def sparsify(dense: np.ndarray, keys: Any | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values)`` of the nonzero entries of ``dense`` (optionally only within ``keys``).

    Returns int64 keys ascending and the values (dense's dtype).
    """
    d = np.asarray(dense)
    if keys is None:
        k = np.flatnonzero(d).astype(KEY_DTYPE)
        return k, d[k]
    k = check_keys(keys, d.size)
    v = d[k]
    nz = v != 0
    return k[nz], v[nz]


def rows_pull(flat: np.ndarray, layout: ParamLayout, name: str, rows: Any) -> np.ndarray:
    """Row-sparse pull: rows ``rows`` of parameter ``name`` as ``(len(rows), row_size)``."""
    keys = layout.row_keys(name, rows)
    return gather(flat, keys).reshape(-1, layout.row_size(name))


def rows_push_add(
    flat: np.ndarray, layout: ParamLayout, name: str, rows: Any, values: np.ndarray, scale=1.0
) -> np.ndarray:
    """Row-sparse push: ``param[rows] += scale * values`` in the flat vector; returns flat."""
    keys = layout.row_keys(name, rows)
    return scatter_add(flat, keys, np.asarray(values).reshape(-1), scale)


def key_digest(keys: Any) -> int:
    """A 48-bit BLAKE2b digest of a key list (its int64 little-endian bytes), exact as a
    float64: the runtime puts it in a message header so a receiver can check it holds the
    same key list as the sender before scattering values to those keys."""
    import hashlib

    raw = np.ascontiguousarray(np.asarray(keys, dtype="<i8")).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=6).digest(), "little")
