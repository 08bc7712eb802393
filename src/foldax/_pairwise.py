"""Pairwise reductions ``out[i] = reduce_j kernel(x[i], y[j])`` in tiles, KeOps-style.

The ``(M, N)`` matrix of kernel values is never formed: one engine fold (:mod:`foldax._engine`)
walks blocks of ``bi`` rows of ``x`` by ``bj`` rows of ``y``, folding each tile into a monoid
state per row of ``x``; every derivative is another such fold, recomputing each tile. Memory is
``O(bi * bj + M + N)``, forward, backward and forward-mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import _checks, _closure, _eager, _engine, _shard
from ._monoid import (
    LOGSUMEXP,
    MAX,
    MIN,
    SUM,
    LogSumExp,
    Monoid,
    _accumulator,
    _expand,
    _finite_or_zero,
    _p_extreme,
    _rescale,
    lse_weights,
    promote,
)

if TYPE_CHECKING:
    from jaxtyping import Array

# ----------------------------------------------------------------------------------------------
# Monoids that only pairwise reductions use (they need the column index or a pytree value).


class _ValuesAndIndices:
    """Mixin of the monoids whose state is their result, a pair ``(values, indices)``; the
    derivative rules read the indices."""

    n_outputs = 2

    def outputs(self, st):
        return st

    def result(self, outputs):
        return tuple(outputs)

    def info(self, outputs):
        return (outputs[1],)


@dataclasses.dataclass(frozen=True)
class ArgExtremum(Monoid):
    """Index of the max / min over ``j`` (first occurrence; NaN counts as the extreme, like NumPy)."""

    needs_index = True
    is_max: bool = True

    def __init__(self, is_max):
        super().__init__("argmax" if is_max else "argmin", "real")
        object.__setattr__(self, "is_max", is_max)

    def init(self, num, fshape, dtype):
        fill = -np.inf if self.is_max else np.inf
        if not jnp.issubdtype(dtype, jnp.floating):
            fill = jnp.iinfo(dtype).min if self.is_max else jnp.iinfo(dtype).max
        return (
            jnp.full((num, *fshape), fill, dtype),
            jnp.full((num, *fshape), np.iinfo(np.int32).max, jnp.int32),
        )

    def _beats(self, a, b):
        """``a`` strictly better than ``b`` (NaN beats numbers)."""
        better = a > b if self.is_max else a < b
        if jnp.issubdtype(a.dtype, jnp.floating):
            better = (better & ~jnp.isnan(b)) | (jnp.isnan(a) & ~jnp.isnan(b))
        return better

    #: Preferred dense block, as :attr:`foldax._monoid._Extremum.dense_tile`.
    dense_tile = (1024, 1024)

    def reduce(self, v, mask, index):
        # Values first (a plain vectorised min / max), then the index: the first column that
        # attains it (a second min, over column numbers). jnp.argmin's variadic (value, index)
        # reduce does not vectorise on CPU and cost 5x the value alone. XLA:CPU's vectorised
        # min / max may drop NaN, so NaN columns rank before the hits in that same min: a NaN
        # row takes its first NaN.
        fill = self.init(1, (), v.dtype)[0][0]
        m = _expand(mask, v.ndim)
        w = jnp.where(m, v, fill)
        best = jnp.max(w, axis=1) if self.is_max else jnp.min(w, axis=1)
        hit = (w == best[:, None]) & m
        if not jnp.issubdtype(v.dtype, jnp.floating):
            return (best, _first_index(hit, index))
        t = v.shape[1]
        col = _columns(v.shape)
        # NaN columns rank 0 .. T - 1, hits T .. 2T - 1, the rest 2T (masked cells are not NaN);
        # ranked in float32 (exact), which XLA:CPU reduces vectorised, unlike int32
        r = jnp.where(w != w, col, jnp.where(hit, col + t, jnp.float32(2 * t)))
        r = jnp.min(r, axis=1).astype(jnp.int32)
        nan = r < t
        best = jnp.where(nan, jnp.asarray(np.nan, v.dtype), best)
        first = jnp.where(r < 2 * t, jnp.take(index, r % t, mode="clip"), _NO_INDEX)
        return (best, first.astype(jnp.int32))

    def allreduce(self, state, axes):
        val, idx = state
        best = _p_extreme(val, axes, self.is_max)
        hit = val == best
        if jnp.issubdtype(val.dtype, jnp.floating):
            hit = hit | (jnp.isnan(val) & jnp.isnan(best))
        none = np.iinfo(np.int32).max
        return (best, lax.pmin(jnp.where(hit, idx, none), axes))

    def combine(self, a, b):
        # b comes from later columns: it wins only if strictly better (ties keep the first index)
        take_b = self._beats(b[0], a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
        return (jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1]))

    def finalize(self, st):
        return st[1]

    def tangent(self, v, dv, mask, info, index):
        return (None,)  # an index has no derivative


class ExtremumWithIndex(_ValuesAndIndices, ArgExtremum):
    """The min / max over ``j`` and its index in one pass (KeOps' ``min_argmin``): the index as
    :class:`ArgExtremum` finds it, the value differentiable (its cotangent and tangent go to the
    pair at the index)."""

    def __init__(self, is_max):
        super().__init__(is_max)
        object.__setattr__(self, "name", "max_argmax" if is_max else "min_argmin")

    @staticmethod
    def _at_index(v, mask, idx, index):
        """Where each tile cell is its slot's chosen pair ``(G, T, *F)``."""
        col = _expand(index[None, :], v.ndim)
        return (col == idx[:, None]) & _expand(mask, v.ndim)

    def row_cotangent(self, v, mask, info, g, index):
        (idx,) = info
        ct = jnp.broadcast_to(g[0][:, None].astype(v.dtype), v.shape)
        return jnp.where(self._at_index(v, mask, idx, index), ct, jnp.zeros((), v.dtype))

    def tangent(self, v, dv, mask, info, index):
        (idx,) = info
        hit = self._at_index(v, mask, idx, index)
        return (jnp.sum(jnp.where(hit, dv, jnp.zeros((), dv.dtype)), axis=1), None)


#: The index of an empty slot: a k-min slot not yet filled, the argmin / argmax of no column.
#: Every real column index is below it, so it -- not the slot's value -- tells an empty slot
#: from a real entry: an empty slot's value (NaN, the dtype's largest integer, the extreme's
#: identity) may well be a real one too (an integer distance of ``iinfo.max``, a ``+inf``).
_NO_INDEX = np.iinfo(np.int32).max


def _no_entry(take, key, idx):
    """k-min's entries ``(key, idx)`` where ``take``, elsewhere the entry that displaces
    nothing: the largest key *and* :data:`_NO_INDEX`, at or after every entry in the order of
    :func:`_lex_less` (an empty slot's included), so :func:`_insert` leaves those rows as they
    are. The largest key alone is a real value's for 32- and 64-bit integers (``iinfo.max``)."""
    return jnp.where(take, key, np.iinfo(key.dtype).max), jnp.where(take, idx, _NO_INDEX)


def _columns(shape):
    """Each cell's column (axis 1) as float32: tiles are far narrower than 2^24, so exact."""
    return lax.broadcasted_iota(jnp.float32, shape, 1)


def _first_index(hit, index):
    """The global index of the first true column of ``hit`` ``(G, T, *F)`` per slot; int32 max
    where there is none. A float32 min over column numbers: vectorised, unlike a variadic
    argmin or an int32 min on XLA:CPU."""
    t = hit.shape[1]
    pos = _first_column(hit)
    return jnp.where(pos < t, jnp.take(index, jnp.minimum(pos, t - 1)), _NO_INDEX)


def _first_column(hit):
    """The first true column of ``hit`` ``(G, T, *F)`` per slot (``T`` where there is none)."""
    t = hit.shape[1]
    return jnp.min(jnp.where(hit, _columns(hit.shape), jnp.float32(t)), axis=1).astype(jnp.int32)


#: columns whose hits :func:`_hits` counts in one float32 number: its sums stay exact
_HITS_CHUNK = 256


def _hits(hit):
    """Per row of ``hit`` ``(G, T)``: how many cells are true, and the sum of their columns
    (so the column of the only one, where there is one), as int32 -- in one float32 pass.

    Each chunk of at most 256 columns sums ``1 + column / 2^15`` over its true cells: the
    count is the whole part, the sum of its columns the fraction. Every partial sum has at most
    9 + 15 significant bits, so it is exact in any order; chunks are combined in int32."""
    g, t = hit.shape
    w = -(-t // -(-t // _HITS_CHUNK))  # chunks as even as they come: little padding
    pad = -t % w
    if pad:
        hit = jnp.pad(hit, ((0, 0), (0, pad)))
    hit = hit.reshape(g, -1, w)
    col = lax.broadcasted_iota(jnp.float32, hit.shape, 2)
    code = jnp.sum(jnp.where(hit, 1 + col * jnp.float32(2.0**-15), jnp.float32(0)), 2)
    c = code.astype(jnp.int32)
    within = jnp.round((code - c.astype(jnp.float32)) * 2.0**15).astype(jnp.int32)
    base = jnp.arange(hit.shape[1], dtype=jnp.int32) * w
    return jnp.sum(c, 1, dtype=jnp.int32), jnp.sum(within + c * base, 1, dtype=jnp.int32)


def _insert_at(keys, idx, v, index, take, col):
    """:func:`_insert` each row's entry of ``v`` ``(G, T)`` in column ``col`` ``(G,)`` (global
    index ``index[col]``) where ``take``; rows not taking keep their k best."""
    col = jnp.where(take, col, 0)
    val = jnp.take_along_axis(v, col[:, None], axis=1)[:, 0]
    return _insert(keys, idx, *_no_entry(take, _sort_key(val), jnp.take(index, col)))


def _key_dtype(dtype):
    return jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32


def _sort_key(v):
    """Signed integer keys in the order of ``lax.sort``: -0.0 equals 0.0, NaN after +inf.

    Floats: the bits of the (canonicalised) value, negatives' magnitude bits flipped; unsigned
    integers: the sign bit flipped. Exact and invertible (:func:`_from_key`) for canonical values.
    """
    kd = _key_dtype(v.dtype)
    if jnp.issubdtype(v.dtype, jnp.floating):
        fd = jnp.float64 if kd == jnp.int64 else jnp.float32
        w = v.astype(fd)
        w = jnp.where(w == 0, jnp.zeros((), fd), w)
        w = jnp.where(jnp.isnan(w), jnp.asarray(np.nan, fd), w)
        b = lax.bitcast_convert_type(w, kd)
        return b ^ ((b >> (8 * jnp.dtype(kd).itemsize - 1)) & jnp.iinfo(kd).max)
    if jnp.issubdtype(v.dtype, jnp.unsignedinteger) and jnp.dtype(v.dtype).itemsize >= 4:
        return lax.bitcast_convert_type(
            v ^ jnp.asarray(1 << (8 * v.dtype.itemsize - 1), v.dtype), kd
        )
    return v.astype(kd)


def _from_key(key, dtype):
    """The value of a :func:`_sort_key` key, in ``dtype``."""
    if jnp.issubdtype(dtype, jnp.floating):
        b = key ^ ((key >> (8 * key.dtype.itemsize - 1)) & jnp.iinfo(key.dtype).max)
        fd = jnp.float64 if key.dtype == jnp.int64 else jnp.float32
        return lax.bitcast_convert_type(b, fd).astype(dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and jnp.dtype(dtype).itemsize >= 4:
        u = lax.bitcast_convert_type(key, dtype)
        return u ^ jnp.asarray(1 << (8 * jnp.dtype(dtype).itemsize - 1), dtype)
    return key.astype(dtype)


def _next_entry(v, mask, index):
    """``after(lo, lo_i)``: each row's smallest entry of ``v`` ``(g, T)`` beyond the sort key and
    index ``(lo, lo_i)`` ``(g,)``, as ``(key, index)`` (int max / int32 max where none).

    Floats are compared as values (XLA:CPU reduces float32 vectorised, not the integer keys): a
    min over the numbers after ``lo``, and the first column holding it, or else the first NaN
    after ``lo`` -- one float min over ranked columns, as :meth:`ArgExtremum.reduce`.
    """
    j = index[None, :]
    if not jnp.issubdtype(v.dtype, jnp.floating):
        tk, big = _sort_key(v), jnp.iinfo(_key_dtype(v.dtype)).max

        def after(lo, lo_i):
            rest = mask & ((tk > lo[:, None]) | ((tk == lo[:, None]) & (j > lo_i[:, None])))
            m = jnp.min(jnp.where(rest, tk, big), axis=1)
            return m, _first_index(rest & (tk == m[:, None]), index)

        return after

    nan, t = v != v, v.shape[1]
    col = _columns(v.shape)

    def after(lo, lo_i):
        lv = _from_key(lo, v.dtype)[:, None]
        later = j > lo_i[:, None]
        # numbers after lo (a NaN or the lowest key at lo compare as the data need: nothing
        # follows a NaN, everything follows the lowest key); NaNs after lo
        num = mask & ((v > lv) | ((v == lv) & later)) & ~nan
        num = num | (mask & ~nan & (lo == jnp.iinfo(lo.dtype).min)[:, None])
        nans = mask & nan & (~(lv != lv) | later)
        m = jnp.min(jnp.where(num, v, jnp.asarray(jnp.inf, v.dtype)), axis=1)
        r = jnp.where(num & (v == m[:, None]), col, jnp.where(nans, col + t, jnp.float32(2 * t)))
        r = jnp.min(r, axis=1).astype(jnp.int32)
        key = jnp.where(r < t, _sort_key(m), _sort_key(jnp.full_like(m, jnp.nan)))
        key = jnp.where(r < 2 * t, key, jnp.iinfo(lo.dtype).max)
        return key, jnp.where(r < 2 * t, jnp.take(index, r % t, mode="clip"), _NO_INDEX)

    return after


def _lex_less(a, ai, b, bi):
    """``(a, ai) < (b, bi)``: by value, then by index."""
    return (a < b) | ((a == b) & (ai < bi))


def _insert(keys, idx, m, mi):
    """``(keys, idx)`` (``(G, k)``, sorted) with ``(m, mi)`` (``(G,)``) inserted in order and the
    last entry dropped; unchanged in rows where the new entry does not beat the last."""
    pos = jnp.sum(_lex_less(keys, idx, m[:, None], mi[:, None]), axis=1, dtype=jnp.int32)[:, None]
    r = lax.broadcasted_iota(jnp.int32, keys.shape, 1)

    def put(a, new):
        shifted = jnp.concatenate([a[:, :1], a[:, :-1]], axis=1)
        return jnp.where(r < pos, a, jnp.where(r == pos, new[:, None], shifted))

    return put(keys, m), put(idx, mi)


def _candidates(v, mask, index, bound):
    """The entries of ``v`` ``(G, T)`` (global columns ``index``) that may beat their row's k-th
    best ``bound = (value, index, full)`` ``(G,)`` each: at or below it, or below it where
    every column of the tile comes after its index (so that a tie loses) -- one comparison, a
    superset of those that beat it; every valid entry in a row not yet full (its k-th best is
    the identity, or a NaN, which any entry may displace)."""
    kth, kth_i, full = bound
    strict = jnp.min(index) > kth_i
    if jnp.issubdtype(v.dtype, jnp.floating):
        below = jnp.nextafter(kth, jnp.asarray(-jnp.inf, kth.dtype))
    else:
        below = jnp.maximum(kth, jnp.iinfo(kth.dtype).min + 1) - 1
    return mask & ((v <= jnp.where(strict, below, kth)[:, None]) | ~full[:, None])


def _insert_columns(keys, idx, v, index, hit, take, c, colsum):
    """:func:`_insert` every candidate ``hit`` ``(G, T)`` of the rows ``take``, in column order:
    a min over the columns after the last finds the next, and a row's last one is its column
    sum ``colsum`` less the others'. Order does not matter to the k best; one pass per entry
    but the last, against two for the entry next in value (:func:`_next_entry`)."""
    col = _columns(hit.shape)
    t = hit.shape[1]

    def cond(st):
        return jnp.any(st[2] > 0)

    def body(st):
        keys, idx, left, prev, seen = st
        nxt = jnp.min(jnp.where(hit & (col > prev[:, None]), col, jnp.float32(t)), axis=1)
        nxt = nxt.astype(jnp.int32)
        last = left == 1
        pos = jnp.where(last, colsum - seen, nxt)
        keys, idx = _insert_at(keys, idx, v, index, left > 0, pos)
        return (keys, idx, left - 1, nxt.astype(jnp.float32), seen + pos)

    zeros = jnp.zeros_like(c)
    start = (keys, idx, jnp.where(take, c, 0), jnp.full_like(c, -1, jnp.float32), zeros)
    return lax.while_loop(cond, body, start)[:2]


#: Value dtypes whose tile k-min takes XLA's float32 top-k (exact: they embed in float32).
_TOPK_FLOATS = (jnp.float32, jnp.float16, jnp.bfloat16)


def _tile_best(v, mask, index, k):
    """Each row's ``k`` best entries of ``v`` ``(g, T)`` (global columns ``index``) as sort keys
    and indices ``(g, k)``, ascending with ties by index, every rank after the row's valid
    entries an empty one (int max, :data:`_NO_INDEX`) -- exact for every dtype and every value.

    For float32 and narrower: two float32 top-k's (XLA:CPU runs them as one vectorised pass,
    30x faster than a sort): the values below ``+inf``, then the ``+inf`` and NaN entries in
    their order (+inf before NaN, each by column), which the first cannot rank among its
    masked cells. Other dtypes: one sort of the row's keys."""
    t = v.shape[1]
    kk = min(k, t)
    col = lax.broadcasted_iota(jnp.int32, v.shape, 1)
    if v.dtype not in _TOPK_FLOATS:
        key = jnp.where(mask, _sort_key(v), jnp.iinfo(_key_dtype(v.dtype)).max)
        key, empty, col = lax.sort((key, (~mask).astype(jnp.int32), col), dimension=1, num_keys=3)
        keys, ok, pos = key[:, :kk], empty[:, :kk] == 0, col[:, :kk]
        return _no_entry(ok, keys, jnp.take(index, pos))
    w = v.astype(jnp.float32)
    low = mask & (w < jnp.inf)
    _, pos = lax.top_k(jnp.where(low, -w, -jnp.inf), kk)
    ok = jnp.take_along_axis(low, pos, axis=1)

    # the +inf and NaN entries in their order (for rows with fewer than k values below +inf)
    rank = jnp.where(mask & (w == jnp.inf), col, jnp.where(mask & (w != w), t + col, 3 * t))
    _, pos2 = lax.top_k(-jnp.where(low, 3 * t, rank).astype(jnp.float32), kk)
    ok2 = jnp.take_along_axis(rank, pos2, axis=1) < 2 * t
    # in order: the first pass's valid entries (a prefix), then the second's
    count = jnp.sum(ok, axis=1, dtype=jnp.int32)[:, None]
    r = lax.broadcasted_iota(jnp.int32, ok.shape, 1)
    pick = jnp.where(r < count, r, kk + r - count)
    pos = jnp.take_along_axis(jnp.concatenate([pos, pos2], 1), pick, axis=1)
    ok = jnp.take_along_axis(jnp.concatenate([ok, ok2], 1), pick, axis=1)
    val = jnp.take_along_axis(v, pos, axis=1)
    return _no_entry(ok, _sort_key(val), jnp.take(index, pos))


def _merge_best(keys, idx, best):
    """The ``k`` best of a state ``(keys, idx)`` ``(g, k)`` and a tile's ``best`` (its
    :func:`_tile_best`, ``(g, k')``), both ascending: each entry's rank in the merged order is
    its own position plus the number of the other list's entries before it (entries are
    distinct: no two share an index, save empty ones, which stay last)."""
    k = keys.shape[1]
    bk, bi = best
    a_first = _lex_less(keys[:, :, None], idx[:, :, None], bk[:, None, :], bi[:, None, :])
    count = functools.partial(jnp.sum, dtype=jnp.int32)
    ar = functools.partial(jnp.arange, dtype=jnp.int32)
    pos_a = ar(k)[None, :] + count(~a_first, axis=2)  # (g, k): b entries before a
    pos_b = ar(bk.shape[1])[None, :] + count(a_first, axis=1)  # (g, k')
    r = ar(k)[None, None, :]
    at_a, at_b = pos_a[:, :, None] == r, pos_b[:, :, None] == r  # (g, k, k), (g, k', k)

    def pick(a, b):
        zero, total = jnp.zeros((), a.dtype), functools.partial(jnp.sum, axis=1, dtype=a.dtype)
        return total(jnp.where(at_a, a[:, :, None], zero)) + total(
            jnp.where(at_b, b[:, :, None], zero)
        )

    return pick(keys, bk), pick(idx, bi)


def _block_rows(need, rank, cap, start=0):
    """``(cap,)``: slot ``s`` holds the ``(start + s)``-th row that ``need`` s it (``rank``: each
    row's count of needing rows before it, itself included, less one); ``len(need)`` where
    there is none (out of range: reads are clamped, writes dropped)."""
    rows = need.shape[0]
    slot = jnp.where(need & (rank >= start), rank - start, cap)  # never negative
    at = jnp.full((cap,), rows, jnp.int32)
    return at.at[slot].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")


@jax.tree_util.register_pytree_node_class
class _Tile:
    """A tile's values as :meth:`KMin.reduce` hands them on: they are merged into the running k
    best by :meth:`KMin.combine`, which sees the k-th best and so looks only at what beats it."""

    def __init__(self, v, mask, index):
        self.v, self.mask, self.index = v, mask, index

    def tree_flatten(self):
        return (self.v, self.mask, self.index), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@dataclasses.dataclass(frozen=True)
class KMin(_ValuesAndIndices, Monoid):
    """The ``k`` smallest values over ``j`` and their indices, ascending; ties by lower index.

    NaN sorts last (like ``np.sort``). An empty slot (the identity) is ``(NaN, int32 max)``, or
    ``(iinfo(dtype).max, int32 max)`` for integers: told apart by its index
    (:data:`_NO_INDEX`), never its value, which may be a real one (an integer distance at the
    dtype's max); it sorts after every real entry, and a row with fewer than ``k`` pairs (a
    mask) returns its empty slots as they are. :meth:`combine` makes one float32 pass over a
    tile: per row, how many entries may beat its k-th best (:func:`_candidates`; any while it
    is not full) and, where there is one, which (:func:`_hits`). Once a row has seen a few tiles
    that is most rows, and they take it, vectorised. For k up to :attr:`TOPK_UP_TO`, rows with
    two do too, and rows with more merge the tile's k best (a top-k, :func:`_tile_best`) into
    theirs, gathered a few rows at a time; for larger k, rows with several insert them one pass
    each, in value order over the whole tile while many rows need it (a state's first tiles),
    then gathered into small blocks. Entries are compared by exact integer sort keys
    (:func:`_sort_key`) and index.
    """

    needs_index = True
    #: k up to which rows with several candidates merge the tile's top k (:meth:`_insert_few`:
    #: at k = 5, 20,000 x 20,000, a third of the compile time at the same speed); above, they
    #: insert entry by entry (:meth:`_drain_tile`: 4x faster at k = 64)
    TOPK_UP_TO = 8
    #: rows gathered into one block whose tile top-k is taken (:meth:`_merge_many`)
    CAPACITY = 16
    #: k above TOPK_UP_TO: sizes of the block the few rows with several entries to insert are
    #: gathered into
    CAPACITIES = (16, 64, 256)
    #: k above TOPK_UP_TO: the whole tile is drained while more than 1 / SPARSE of its rows
    #: need it
    SPARSE = 4
    #: k above TOPK_UP_TO: most candidates a row inserts in column order
    #: (:func:`_insert_columns`); beyond, value order stops sooner
    FEW = 8
    #: Preferred dense block, as :attr:`foldax._monoid._Extremum.dense_tile`: narrower than
    #: min's, as the rows with several entries to insert (slow, one pass each) are fewer in a
    #: narrow tile; at 20,000 x 20,000 on 2 cores, (2048, 256) blocks (this tile within the
    #: default budget) took 0.22 s, (1024, 1024) 0.32 s.
    dense_tile = (4096, 256)

    k: int = 1

    def __init__(self, k):
        super().__init__("kmin", "real")
        object.__setattr__(self, "k", k)

    @staticmethod
    def _fill(dtype):
        """An empty slot's value: NaN (sorts last), or the largest integer (a real value too:
        empty slots are told by their index)."""
        return np.nan if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, self.k), self._fill(dtype), dtype),
            jnp.full((num, self.k), _NO_INDEX, jnp.int32),
        )

    def reduce(self, v, mask, index):
        return _Tile(v, mask, index)

    def combine(self, a, b):
        if isinstance(b, _Tile):
            return self._merge_tile(a, b)
        keys = jnp.concatenate([_sort_key(a[0]), _sort_key(b[0])], 1)
        keys, idx = lax.sort((keys, jnp.concatenate([a[1], b[1]], 1)), dimension=1, num_keys=2)
        return (_from_key(keys[:, : self.k], a[0].dtype), idx[:, : self.k])

    def _merge_tile(self, st, tile):
        """Fold a tile into the state. One float32 pass over the tile counts, per row, the
        entries that may beat its k-th best (:func:`_candidates`) and sums their columns
        (:func:`_hits`); rows with one or two insert them vectorised and the others merge the
        tile's k best (k up to :attr:`TOPK_UP_TO`, :meth:`_insert_few`), or rows with one
        insert it and the others insert theirs entry by entry (:meth:`_drain_tile`)."""
        v, mask, index = tile.v, tile.mask, tile.index
        kth, kth_i = st[0][:, -1], st[1][:, -1]
        # a row is full once its k-th slot holds an entry: told by its index, as any value
        # (the integer fill too) may be a real one; a NaN k-th best (an empty slot's value too)
        # loses to every number, so any entry may displace it
        full = ~jnp.isnan(kth) if jnp.issubdtype(v.dtype, jnp.floating) else kth_i != _NO_INDEX
        bound = (kth, kth_i, full)
        hit = _candidates(v, mask, index, bound)
        c, colsum = _hits(hit)
        keys = _sort_key(st[0])
        if self.k <= self.TOPK_UP_TO:
            keys, idx = self._insert_few(keys, st[1], tile, hit, c, colsum)
        else:  # large k: rows with one candidate take it, the others insert theirs in turn
            keys, idx = _insert_at(keys, st[1], v, index, c == 1, colsum)
            keys, idx = self._drain_tile(keys, idx, tile, bound, c, colsum)
        return (_from_key(keys, st[0].dtype), idx)

    def _insert_few(self, keys, idx, tile, hit, c, colsum):
        """Rows with one or two candidates insert them vectorised: the first (a min over the
        tile's columns) and the other (the column sum less the first); rows with more merge
        the tile's k best (:meth:`_merge_many`). (Also vectorising rows with three, from a max
        over the columns, compiled no faster and ran slower.)"""
        v, index = tile.v, tile.index
        first = _first_column(hit)
        few = c <= 2
        keys, idx = _insert_at(keys, idx, v, index, few & (c >= 1), first)
        keys, idx = _insert_at(keys, idx, v, index, c == 2, colsum - first)
        return self._merge_many(keys, idx, tile, ~few)

    def _merge_many(self, keys, idx, tile, need):
        """Merge the tile's k best (:func:`_tile_best`) into the rows that ``need`` it, gathered
        :attr:`CAPACITY` at a time (one block once a few tiles are in; every row, block by
        block, in a state's first tiles)."""
        v, mask, index = tile.v, tile.mask, tile.index
        rows = v.shape[0]
        cap = min(self.CAPACITY, rows)
        rank = jnp.cumsum(need.astype(jnp.int32)) - 1

        def block(b, st):
            keys, idx = st
            at = _block_rows(need, rank, cap, b * cap)
            a = jnp.minimum(at, rows - 1)
            kb, ib = _merge_best(keys[a], idx[a], _tile_best(v[a], mask[a], index, self.k))
            return keys.at[at].set(kb, mode="drop"), idx.at[at].set(ib, mode="drop")

        blocks = (jnp.sum(need, dtype=jnp.int32) + (cap - 1)) // cap
        return lax.fori_loop(0, blocks, block, (keys, idx))

    def _drain_tile(self, keys, idx, tile, bound, c, colsum):
        """Insert the candidates (:func:`_candidates` of ``bound``) of the rows with ``c``
        ``(G,)`` > 1 of them: over the whole tile in value order while more than 1 /
        ``SPARSE`` of its rows need it (a state's first tiles), then the rest gathered into
        one block, the smallest of ``CAPACITIES`` that holds them (a few rows, once a few
        tiles are in), in column order where a row has at most ``FEW`` (the last one from
        its column sum ``colsum``)."""
        v, mask, index = tile.v, tile.mask, tile.index
        rows, kd = v.shape[0], keys.dtype
        # like c: on a mesh, as varying as the data (a constant carry would not be)
        lo = (jnp.full_like(c, np.iinfo(kd).min, kd), jnp.full_like(c, -1, jnp.int32))
        sparse = rows // self.SPARSE
        keys, idx, lo, need, left = lax.cond(
            jnp.sum(c > 1, dtype=jnp.int32) > sparse,
            lambda st: self._drain(v, mask, index, *st, enough=sparse),
            lambda st: st,
            (keys, idx, lo, c > 1, c),
        )
        caps = [g for g in self.CAPACITIES if g < sparse] + [max(sparse, 1)]
        rank = jnp.cumsum(need.astype(jnp.int32)) - 1

        def gathered(cap):
            def run(keys, idx):
                at = _block_rows(need, rank, cap)
                a, live = jnp.minimum(at, rows - 1), at < rows
                vb, mb, kb, ib = v[a], mask[a], keys[a], idx[a]
                # few candidates, not yet drained: each, in column order
                few = live & (c[a] == left[a]) & (c[a] <= self.FEW)
                hit = _candidates(vb, mb, index, tuple(b[a] for b in bound))
                kb, ib = _insert_columns(kb, ib, vb, index, hit, few, c[a], colsum[a])
                part = ((lo[0][a], lo[1][a]), live & ~few, left[a])
                kb, ib, *_ = self._drain(vb, mb, index, kb, ib, *part, enough=0)
                return keys.at[at].set(kb, mode="drop"), idx.at[at].set(ib, mode="drop")

            return run

        n = jnp.sum(need, dtype=jnp.int32)
        # scalar comparisons: an array constant here would be a constant captured inside
        # shard_map, which its dead-code pass does not expect (a failed assertion)
        branch = jnp.where(n > 0, 1 + sum((n > g).astype(jnp.int32) for g in caps[:-1]), 0)
        return lax.switch(branch, [lambda *st: st] + [gathered(g) for g in caps], keys, idx)

    def _drain(self, v, mask, index, keys, idx, lo, need, left, *, enough):
        """Insert, in order, the entries of rows ``v`` ``(g, T)`` past ``lo`` that beat their
        k best (sort keys ``keys``), at most ``left`` per row, while more than ``enough`` rows
        ``need`` it: one pass over the rows per entry. Returns the state, the last entries
        looked at, the rows that may still have entries to insert and how many at most."""
        after = _next_entry(v, mask, index)

        def cond(c):
            return (jnp.sum(c[4], dtype=jnp.int32) > enough) & (c[6] < self.k)

        def body(c):
            keys, idx, lo_key, lo_i, need, left, n = c
            m, mi = after(lo_key, lo_i)
            need = need & _lex_less(m, mi, keys[:, -1], idx[:, -1])
            keys, idx = _insert(keys, idx, *_no_entry(need, m, mi))
            return (keys, idx, m, mi, need & (left > 1), left - 1, n + 1)

        keys, idx, *lo, need, left, _ = lax.while_loop(cond, body, (keys, idx, *lo, need, left, 0))
        return keys, idx, tuple(lo), need, left

    def finalize(self, st):
        return st

    def row_cotangent(self, v, mask, info, g, index):
        (idx,) = info
        g_vals = g[0]
        hit = index[None, None, :] == idx[:, :, None]  # (Bi, k, Bj)
        ct = jnp.sum(jnp.where(hit, g_vals[:, :, None], jnp.zeros((), g_vals.dtype)), axis=1)
        return jnp.where(mask, ct, jnp.zeros((), ct.dtype))

    def tangent(self, v, dv, mask, info, index):
        (idx,) = info
        hit = (index[None, None, :] == idx[:, :, None]) & mask[:, None, :]  # (Bi, k, Bj)
        return (jnp.sum(jnp.where(hit, dv[:, None, :], jnp.zeros((), dv.dtype)), axis=2), None)


@dataclasses.dataclass(frozen=True)
class SoftmaxSum(Monoid):
    """``sum_j softmax_j(logit) * value_j``: exact attention. Value: a pair ``(logit, value)``.

    State ``(m, s, acc)``: running max logit, ``sum exp(l - shift(m))`` and the weighted values,
    in float32 for half-precision logits or values (mixed precision, e.g. float32 logits and
    bfloat16 values, is accepted: the weights meet the values in the values' dtype, summed in
    the state's). The result is in the state's dtype (:func:`pairwise` casts it to the values').
    """

    shared: bool = False

    def __init__(self, shared=False):
        super().__init__("softmax", "float")
        #: values do not depend on the row of x: a tile's values are ``(bj, *Fv)``, not
        #: ``(bi, bj, *Fv)``, and the weighted sums are GEMMs (attention's ``P @ V``).
        object.__setattr__(self, "shared", shared)

    def value_aval(self, tile_aval):
        lg, val = tile_aval
        sds = jax.ShapeDtypeStruct
        # shared values are (bj, *Fv), one per row of y: not (bi, bj, *Fv)
        return (sds(lg.shape[2:], lg.dtype), sds(val.shape[1 if self.shared else 2 :], val.dtype))

    @staticmethod
    def _dtypes(lg_dtype, val_dtype):
        """``(logit state, value state)`` dtypes: float32 for half precision, and the values
        summed at least as precisely as the logits."""
        lg_acc = _accumulator(lg_dtype)
        return lg_acc, promote(_accumulator(val_dtype), lg_acc)

    def init_aval(self, num, aval):
        lg, val = aval
        lg_acc, val_acc = self._dtypes(lg.dtype, val.dtype)
        return (
            jnp.full((num, *lg.shape), -np.inf, lg_acc),
            jnp.zeros((num, *lg.shape), lg_acc),
            jnp.zeros((num, *val.shape), val_acc),
        )

    def reduce(self, v, mask):
        lg, val = v
        lg_acc, val_acc = self._dtypes(lg.dtype, val.dtype)
        lg = jnp.where(mask, lg.astype(lg_acc), jnp.asarray(-np.inf, lg_acc))
        m = jnp.max(lg, axis=1)
        w = jnp.exp(lg - _finite_or_zero(m)[:, None])
        # Masked columns have weight exactly 0 (their logit is -inf). Their values are real rows
        # of y (clamped reads), so they are not masked again: a where on the (bi, bj, *Fv)
        # values would materialize them, while w @ values stays one contraction.
        w_v = w.astype(val.dtype)
        if self.shared:
            flat = val.reshape(val.shape[0], -1)
            acc = jnp.matmul(w_v, flat, preferred_element_type=val_acc)
            acc = acc.reshape((w.shape[0], *val.shape[1:]))
        else:
            acc = jnp.einsum("ij,ij...->i...", w_v, val, preferred_element_type=val_acc)
        return (m, jnp.sum(w, axis=1), acc)

    @staticmethod
    def _factor(st, m):
        """The rescaling of state ``st`` to the running max ``m``; 0 where ``st`` is empty (its
        factor may overflow to inf: never multiply it)."""
        zero = jnp.zeros((), st[1].dtype)
        return jnp.where(st[1] != 0, _rescale(jnp.ones_like(st[1]), st[0], m), zero)

    def combine(self, a, b):
        m = jnp.maximum(a[0], b[0])
        fa, fb = self._factor(a, m), self._factor(b, m)
        acc = a[2] * _expand(fa, a[2].ndim) + b[2] * _expand(fb, b[2].ndim)
        return (m, a[1] * fa + b[1] * fb, acc)

    def allreduce(self, state, axes):
        m = lax.pmax(state[0], axes)
        f = self._factor(state, m)
        acc = lax.psum(state[2] * _expand(f, state[2].ndim), axes)
        return (m, lax.psum(state[1] * f, axes), acc)

    n_outputs = 2

    def finalize(self, st):
        # a row with nothing to weigh (every pair masked out) is 0, not 0 / 0
        s = _expand(st[1], st[2].ndim)
        return jnp.where(
            s > 0, st[2] / jnp.where(s > 0, s, jnp.ones_like(s)), jnp.zeros_like(st[2])
        )

    def outputs(self, st):
        return (self.finalize(st), _finite_or_zero(st[0]) + jnp.log(st[1]))

    def info(self, outputs):
        out, lse = outputs
        return (lse, out)

    @staticmethod
    def _weights(lg, mask, lse):
        """``softmax`` weights ``(bi, bj)`` of a tile (in the log-sum-exp's dtype); exactly 0
        where masked or empty."""
        ok = mask & (lse[:, None] > -np.inf)
        z = jnp.where(ok, lg.astype(lse.dtype) - lse[:, None], jnp.asarray(-np.inf, lse.dtype))
        return jnp.exp(z), ok

    def row_cotangent(self, v, mask, info, g):
        lg, val = v
        lse, out = info
        g_out, g_lse = g
        p, ok = self._weights(lg, mask, lse)
        acc = out.dtype  # the values' state dtype: products are taken there
        ct_lg = jnp.zeros_like(p)
        ct_val = jnp.zeros(val.shape, acc)
        if g_out is not None and self.shared:
            bi, bj = p.shape
            g2 = g_out.reshape(bi, -1).astype(acc)
            v2, o2 = val.reshape(bj, -1).astype(acc), out.reshape(bi, -1)
            ct_val = (p.astype(acc).T @ g2).reshape(val.shape)
            dots = g2 @ v2.T - jnp.sum(g2 * o2, axis=-1)[:, None]
            ct_lg = jnp.where(ok, p * dots.astype(p.dtype), jnp.zeros((), p.dtype))
        elif g_out is not None:
            gv = g_out[:, None].astype(acc)  # (Bi, 1, *Fv)
            ct_val = _expand(p.astype(acc), val.ndim) * gv
            diff = val.astype(acc) - out[:, None]
            diff = jnp.where(_expand(ok, val.ndim), diff, jnp.zeros((), acc))
            ct_lg = p * jnp.sum((gv * diff).reshape((*p.shape, -1)), axis=-1).astype(p.dtype)
        if g_lse is not None:
            ct_lg = ct_lg + p * g_lse[:, None].astype(p.dtype)
        return (ct_lg.astype(lg.dtype), ct_val.astype(val.dtype))

    def tangent(self, v, dv, mask, info):
        lg, val = v
        dlg, dval = dv
        lse, out = info
        acc = out.dtype
        p, _ = self._weights(lg, mask, lse)
        pd = p * dlg.astype(p.dtype)
        d_lse = jnp.sum(pd, axis=1)
        p, pd, val, dval = p.astype(acc), pd.astype(acc), val.astype(acc), dval.astype(acc)
        if self.shared:
            bj = p.shape[1]
            flat = lambda a: a.reshape(bj, -1)  # noqa: E731
            d = p @ flat(dval) + pd @ flat(val)
            d_out = d.reshape(out.shape) - _expand(d_lse.astype(acc), out.ndim) * out
        else:
            d = jnp.einsum("ij,ij...->i...", p, dval) + jnp.einsum("ij,ij...->i...", pd, val)
            d_out = d - _expand(d_lse.astype(acc), out.ndim) * out
        return (d_out, d_lse)


class WeightedLogSumExp(LogSumExp):
    """``log sum_j w_j exp(l_j)`` (weights ``w >= 0``): KeOps' LogSumExp with weights, used in
    optimal transport and mixture likelihoods. Value: a pair ``(logit, weight)``.

    State ``(m, s)`` as for :class:`~foldax._monoid.LogSumExp`, with ``m`` the max logit among
    positive weights (a zero weight never sets the shift, so ``s`` cannot underflow to 0 when a
    weighted term is far below an unweighted one). Derivatives: ``d/dl_j = w_j e_j`` and
    ``d/dw_j = e_j`` with ``e_j = exp(l_j - out)``, finite at ``w_j = 0``.
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "name", "logsumexp (weighted)")

    def value_aval(self, tile_aval):
        lg, _ = tile_aval
        return jax.ShapeDtypeStruct(lg.shape[2:], lg.dtype)

    def init_aval(self, num, aval):
        return self.init(num, aval.shape, aval.dtype)

    def reduce(self, v, mask):
        lg, w = v
        acc = _accumulator(lg.dtype)
        lg, w = lg.astype(acc), w.astype(acc)
        live = mask & (w > 0)
        m = jnp.max(jnp.where(live, lg, jnp.asarray(-np.inf, acc)), axis=1)
        e = jnp.exp(lg - _finite_or_zero(m)[:, None])
        return (m, jnp.sum(jnp.where(live, w * e, jnp.zeros((), acc)), axis=1))

    def _e(self, lg, mask, info):
        """``exp(l - out)`` where the pair counts (0 elsewhere), in the state's dtype."""
        return lse_weights(lg, mask, *(a[:, None] for a in info))

    def row_cotangent(self, v, mask, info, g):
        lg, w = v
        e = self._e(lg, mask, info)
        gl = g[0][:, None].astype(e.dtype)
        return ((gl * w.astype(e.dtype) * e).astype(lg.dtype), (gl * e).astype(w.dtype))

    def tangent(self, v, dv, mask, info):
        (lg, w), (dl, dw) = v, dv
        e = self._e(lg, mask, info)
        t = jnp.sum(e * (w.astype(e.dtype) * dl.astype(e.dtype) + dw.astype(e.dtype)), axis=1)
        zero = jnp.zeros_like(t)
        return (t, zero, zero)


REDUCTIONS = (
    "sum",
    "logsumexp",
    "max",
    "min",
    "argmax",
    "argmin",
    "max_argmax",
    "min_argmin",
    "kmin",
    "softmax",
)


#: hints for reduction names that are not foldax's, but whose meaning is near one of them
_REDUCTION_HINTS = {
    "kmax": " (for the k largest, reduce the negated kernel with reduction='kmin')",
    "topk": " (for the k smallest, reduction='kmin'; the k largest: of the negated kernel)",
}


def _monoid_for(name, reduction, k, n):
    """The monoid of ``reduction`` (``k``: its static argument, kmin's only), after checking
    them in that order: the name first, so that a wrong one is named as such."""
    known = ", ".join(repr(r) for r in REDUCTIONS)
    if not isinstance(reduction, str):
        raise TypeError(
            f"{name}: reduction must be a string, got {type(reduction).__name__} "
            f"{reduction!r:.40}; pass one of {known}."
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{name}: reduction={reduction!r:.40} is not a reduction foldax knows"
            f"{_REDUCTION_HINTS.get(reduction, '')}; choose one of {known}."
        )
    if reduction != "kmin":
        if k is not None:
            raise ValueError(
                f"{name}: k={k!r:.40} is only used with reduction='kmin', got "
                f"reduction={reduction!r}; drop k, or pass reduction='kmin'."
            )
        return {
            "sum": SUM,
            "logsumexp": LOGSUMEXP,
            "max": MAX,
            "min": MIN,
            "argmax": ArgExtremum(True),
            "argmin": ArgExtremum(False),
            "max_argmax": ExtremumWithIndex(True),
            "min_argmin": ExtremumWithIndex(False),
            "softmax": SoftmaxSum(),
        }[reduction]
    fix = f"pass an int with 0 < k <= N = {n} (the rows of y)"
    if k is None:
        raise ValueError(f"{name}: k is missing, and reduction='kmin' needs it; {fix}.")
    try:
        if isinstance(k, bool | np.bool_):
            raise TypeError
        k = operator.index(k)
    except TypeError:
        raise TypeError(
            f"{name}: k must be a static Python int, got {type(k).__name__} {k!r:.40}; {fix}."
        ) from None
    if not 0 < k <= n:
        fix = f"pass k <= {n}, or more rows of y" if n else "pass y with at least k rows"
        fix = "pass k >= 1" if k <= 0 else fix
        raise ValueError(
            f"{name}: k must satisfy 0 < k <= N = {n} (the rows of y), got k = {k}; {fix}."
        )
    return KMin(k)


# ----------------------------------------------------------------------------------------------
# The double loop


def _num_rows(name, argname, tree):
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise TypeError(f"{name}: {argname} is empty; pass an array or a pytree of arrays.")
    sizes = [jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves]
    if any(s is None for s in sizes):
        raise ValueError(
            f"{name}: every leaf of {argname} needs a leading axis (rows), got a scalar."
        )
    if len(set(sizes)) != 1:
        raise ValueError(
            f"{name}: the leaves of {argname} must share their leading size, got {sizes}."
        )
    return _checks.concrete_rows(name, f"the leading axis of {argname}", sizes[0])


def _block_sizes(name, block_size, m, n):
    if block_size is None:
        return None
    bs = (block_size, block_size) if isinstance(block_size, int | np.integer) else block_size
    if isinstance(bs, tuple | list) and len(bs) != 2:
        raise ValueError(
            f"{name}: block_size must be an int or a pair (bi, bj), got {len(bs)} values {block_size!r}."
        )
    try:
        if isinstance(block_size, bool) or any(isinstance(b, bool) for b in bs):
            raise TypeError
        bi, bj = (operator.index(b) for b in bs)
    except TypeError:
        raise TypeError(
            f"{name}: block_size must be a static int or a pair (bi, bj) of ints, got {block_size!r}."
        ) from None
    if bi <= 0 or bj <= 0:
        raise ValueError(f"{name}: block_size must be positive, got {block_size!r}.")
    return min(bi, m), min(bj, n)


def pairwise(name, kernel, x, y, monoid, block, axes=(), ring=(), mask=None):
    """``monoid``-reduce ``kernel(x[i], y[j])`` over ``j`` for every ``i``: one engine fold.

    The rows of ``x`` are the fold's slots, the rows of ``y`` (walked transposed, see ``tile``)
    its rows, the arrays ``kernel`` closes over its constants; ``block`` is ``(bi, bj)`` or
    ``None`` (planned from the memory budget). On a mesh, ``axes`` are the mesh axes that split
    the rows of ``y`` (inside ``shard_map``; ``x`` is the same on every device along them, the
    states are all-reduced and indices are global), ``ring`` the axes that split both: the blocks
    of ``y`` go round the devices (``ppermute``) and come home with their cotangents.
    """
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m)
    if axes and _shard.types_checked(axes):
        # x meets rows of y that differ per device: make it varying here, outside the fold, so
        # that its cotangent is accumulated locally and summed once (the cast's transpose).
        x = _shard.to_varying(x, axes)
    xi = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), x)
    yj = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), y)
    replay, consts = _shard.replayable(kernel, xi, yj)
    tile, monoid, cols = _tile_fn(lambda a, b, *c: replay(c)(a, b), tuple(consts), xi, yj, monoid)
    x_leaves, x_tree = jax.tree.flatten(x)
    y_leaves, y_tree = jax.tree.flatten(y)
    nk = len(consts)
    if mask is not None:  # the arrays the mask closes over follow the kernel's
        closed, mask_consts = mask
        mask = _pair_mask(closed, nk, len(mask_consts))
        consts = [*consts, *mask_consts]

    def body(consts, slots, rows, mask, index):
        xb, yb = jax.tree.unflatten(x_tree, slots), jax.tree.unflatten(y_tree, rows)
        return tile(consts[:nk], xb, yb), (), ()

    plan = _engine.PlanSpec("dense", n, m, None, block, row_axis=-1 if cols else 0)
    spec = _engine.Spec(
        plan,
        body,
        monoid,
        _engine.current_budget(),
        axes=axes,
        ring=ring,
        name=name,
        pair_mask=mask,
    )
    # y is walked transposed (rows last) unless the kernel contracts: one O(N) copy per call.
    rows = [jnp.moveaxis(a, 0, -1) for a in y_leaves] if cols else y_leaves
    outs, _, _ = _engine.fold(spec, (), tuple(consts), x_leaves, rows)
    return monoid.result(outs)


def _tile_fn(conv, consts, xi, yj, monoid):
    """``(tile, monoid, cols)``: ``tile(consts, xb, yb)`` the kernel values ``(bi, bj, *F)`` of a
    block of ``x`` (rows first) and one of ``y`` (rows last if ``cols``, else first).

    ``y`` holds its rows along the *last* axis (``(*f, bj)``), so the kernel's feature axes (e.g.
    ``D`` of a distance) are outer and ``j`` is the innermost, contiguous axis of every
    intermediate: XLA vectorises along ``j`` instead of along a short ``D`` (10x faster for a 3-D
    Gaussian kernel on CPU). Kernels with a dot product (attention) use the classic double
    ``vmap``, which JAX batches into one GEMM per tile; for ``reduction="softmax"``, values
    independent of ``x`` (attention's ``V``) stay ``(bj, *Fv)`` so that ``P @ V`` is a GEMM
    (the monoid is switched to its shared form).
    """
    contracts = _has_dot(jax.make_jaxpr(conv)(xi, yj, *consts).jaxpr)
    shared = False
    if isinstance(monoid, SoftmaxSum) and contracts:

        def shared_tile(c, xb, yb):
            pair = lambda a, b: conv(a, b, *c)  # noqa: E731
            return jax.vmap(jax.vmap(pair, (None, 0)), (0, None), out_axes=(0, None))(xb, yb)

        blk = lambda t, b: jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *a.shape), a.dtype), t)  # noqa: E731
        try:
            jax.eval_shape(shared_tile, consts, blk(xi, 2), blk(yj, 3))
            shared, monoid = True, SoftmaxSum(shared=True)
        except ValueError:
            pass

    def tile(c, xb, yb):
        pair = lambda a, b: conv(a, b, *c)  # noqa: E731
        if contracts:  # y's rows first: no transpose
            out_axes = (0, None) if shared else 0
            return jax.vmap(jax.vmap(pair, (None, 0)), (0, None), out_axes=out_axes)(xb, yb)
        bi, bj = jax.tree.leaves(xb)[0].shape[0], jax.tree.leaves(yb)[0].shape[-1]
        # Both operands broadcast to (bi, *f, bj), with i batched at axis 0 and j at the last
        # axis for both: JAX's batching rules keep batch axes where they are when all operands
        # agree, so every intermediate is (bi, *f, bj) and the innermost axis is j.
        xs = jax.tree.map(lambda a: jnp.broadcast_to(a[..., None], (*a.shape, bj)), xb)
        ys = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (bi, *a.shape)), yb)
        return jax.vmap(jax.vmap(pair, (-1, -1)), (0, 0))(xs, ys)

    return tile, monoid, not contracts


def _row_avals(tree):
    """Shape/dtype of one row of every leaf (the leading axis dropped)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), tree)


def _has_dot(jaxpr) -> bool:
    """Whether a jaxpr (or one nested in it) contracts with ``dot_general``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            return True
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if hasattr(sub, "eqns") and _has_dot(sub):
                return True
    return False


def _is_pair(aval) -> bool:
    return isinstance(aval, tuple | list) and len(aval) == 2


def _kernel_aval(name, kernel, x, y):
    """What ``kernel`` returns for one row of ``x`` and one of ``y`` (traced once, abstractly)."""
    xi, yj = _row_avals(x), _row_avals(y)
    try:
        return jax.eval_shape(kernel, xi, yj)
    except Exception as e:  # the user's kernel failed on one (x[i], y[j]) pair
        raise TypeError(
            f"{name}: kernel(xi, yj) failed on one row of x and one row of y "
            f"(shapes {jax.tree.map(lambda a: a.shape, xi)}, {jax.tree.map(lambda a: a.shape, yj)}): {e}"
        ) from e


def _check_kernel_output(name, monoid, aval):
    if isinstance(monoid, WeightedLogSumExp):
        if any(jnp.shape(a) != jnp.shape(aval[0]) for a in aval):
            raise TypeError(
                f"{name}: a weighted logsumexp kernel returns (logit, weight) of one shape, "
                f"got {aval}."
            )
        for part, what in zip(aval, ("logit", "weight"), strict=True):
            monoid.check_dtype(name, f"the kernel's {what}", part.dtype)
        return
    if isinstance(monoid, SoftmaxSum):
        if not _is_pair(aval) or jnp.shape(aval[0]) != ():
            raise TypeError(
                f"{name}: with reduction='softmax' the kernel must return a pair (logit, value) "
                f"with a scalar logit, got {aval}."
            )
        monoid.check_dtype(name, "the kernel's logit", aval[0].dtype)
        for leaf in jax.tree.leaves(aval[1]):
            monoid.check_dtype(name, "the kernel's value", leaf.dtype)
        return
    if not isinstance(aval, jax.ShapeDtypeStruct):
        raise TypeError(f"{name}: kernel must return one array (scalar or small), got {aval}.")
    if isinstance(monoid, KMin) and aval.shape != ():
        raise ValueError(
            f"{name}: reduction='kmin' needs a scalar kernel, but kernel returned shape {aval.shape}."
        )
    monoid.check_dtype(name, "the kernel's output", aval.dtype)


def _kernel_examples(arguments):
    """What ``kernel`` is traced on: one row of ``x`` and one of ``y`` (pytrees of arrays)."""
    rows = [arguments["x"], arguments["y"]]
    if not all(isinstance(a, jax.Array | np.ndarray) and a.ndim for a in jax.tree.leaves(rows)):
        raise TypeError("not pytrees of arrays")  # the uncached call explains
    return tuple(_row_avals(r) for r in rows)


def _mask_examples(arguments):
    """What ``mask`` is traced on: one slot index and one row index."""
    return (jax.ShapeDtypeStruct((), jnp.int32),) * 2


#: Eager calls run one cached executable (:mod:`foldax._eager`): ``x``, ``y`` and the arrays
#: ``kernel`` / ``mask`` close over are its inputs; every other argument is static.
_eager_call = _eager.cached(
    dynamic=("x", "y"),
    hoist={
        "kernel": _eager.Hoist(_kernel_examples),
        "mask": _eager.Hoist(_mask_examples),
    },
)


@_eager_call
def pairwise_reduce(
    kernel: Callable[[Any, Any], Any],
    x: Any,
    y: Any,
    *,
    reduction: str = "sum",
    k: int | None = None,
    block_size: int | tuple[int, int] | None = None,
    mask: Callable[[Any, Any], Any] | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array | tuple[Array, Array]:
    """Reduce ``kernel(x[i], y[j])`` over ``j`` for every ``i``, without the ``(M, N)`` matrix.

    .. math:: \\mathrm{out}_i = \\bigoplus_{j<N} \\kappa(x_i, y_j)

    Args:
      kernel: ``kernel(xi, yj)`` of one row of ``x`` and one row of ``y`` (pytrees allowed; real
        or complex), returning a scalar or a small array ``F``; for ``reduction="softmax"`` a
        pair ``(logit, value)`` with a scalar real logit (``value`` any pytree of arrays, of
        any float dtypes: mixed precision is fine); for ``reduction="logsumexp"`` it may return
        a pair ``(logit, weight)`` (weights ``>= 0``): ``log sum_j w_ij exp(logit_ij)``. It may
        close over arrays; gradients flow to them. A random draw needs its own key per pair
        (fold both row indices in, passing ``jnp.arange`` with ``x`` and ``y``).
      x: array or pytree of arrays with leading axis ``M`` (the rows that are kept).
      y: array or pytree of arrays with leading axis ``N`` (the rows reduced over).
      reduction: ``"sum"``, ``"logsumexp"``, ``"max"``, ``"min"``, ``"argmax"``, ``"argmin"``,
        ``"max_argmax"`` / ``"min_argmin"`` (value and index in one pass), ``"kmin"`` (the
        ``k`` smallest) or ``"softmax"`` (softmax-weighted sum of values: exact attention).
        Static.
      k: static int, ``0 < k <= N``, for ``"kmin"`` only.
      mask: optional ``mask(i, j) -> bool`` of the global row indices of ``x`` and ``y``: one
        boolean for one pair of int32 indices, written elementwise with ``jnp`` operations
        (e.g. ``lambda i, j: j <= i`` for causal attention, ``lambda i, j: (j <= i) & (j > i -
        256)`` for a sliding window, ``lambda i, j: doc[i] == doc[j]`` for packed sequences);
        it is applied to whole tiles of indices. It may close over any arrays, also traced ones
        (arguments of a ``jax.jit``, ``vmap`` ped arrays: each batch element its own mask). Pairs where it is false
        take no part, and a tile where it is false everywhere is skipped, forward and
        backward, so a sparse mask costs what it keeps. A row of ``x`` with every pair masked
        gives the reduction's identity (0 for sum and softmax, -inf for logsumexp, +inf / -inf
        for min / max) with zero gradients. Not with sharded inputs or ``axis_name``.
      block_size: static int or pair ``(bi, bj)``: rows of ``x`` and ``y`` per tile, per
        element of an enclosing ``vmap`` (default: chosen when the computation is compiled, from
        the memory budget and the batch of every enclosing ``vmap``; see
        :func:`foldax.memory_budget`).
      axis_name: inside ``jax.shard_map`` only: the mesh axis (or tuple) over which the rows of
        ``y`` are split; ``y`` is this device's share, ``x`` must be the same on every device
        along it, and the states are all-reduced (indices are global). Under ``jax.jit``,
        sharded ``x`` and ``y`` are distributed without it: over different mesh axes, or over
        the same ones as a ring (the blocks of ``y`` go round the devices).

    Returns:
      ``(M, *F)`` for sum / logsumexp / max / min / softmax (``F`` of the value); ``(M, *F)``
      int32 indices for argmax / argmin (first occurrence, NaN counts as extreme, like NumPy;
      ``2**31 - 1`` when ``N = 0``); a pair ``(values, indices)`` for max_argmax / min_argmin;
      for ``"kmin"`` a pair ``(values (M, k), indices (M, k) int32)``, ascending, ties by the
      lower index, NaN last (like ``np.argsort(kind="stable")``).

    Memory: ``O(bi * bj + M + N)`` temp, forward and backward. Derivatives (``jax.grad``,
    ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) are streamed folds too: they save the inputs and
    an ``(M, ...)`` summary (e.g. the log-sum-exp) and recompute every tile; they reach ``x``,
    ``y`` and the arrays ``kernel`` closes over.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([[0.0], [1.0]]); y = jnp.array([[0.0], [2.0], [3.0]])
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="min")
      Array([0., 1.], dtype=float32)
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="argmin")
      Array([0, 0], dtype=int32)
    """
    name = "foldax.pairwise_reduce"
    if not callable(kernel):
        raise TypeError(f"{name}: kernel must be callable, got {type(kernel).__name__}.")
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    monoid = _monoid_for(name, reduction, k, n)
    aval = _kernel_aval(name, kernel, x, y)
    if reduction == "logsumexp" and _is_pair(aval):
        monoid = WeightedLogSumExp()
    _check_kernel_output(name, monoid, aval)
    unpack = None
    if isinstance(monoid, SoftmaxSum):
        kernel, unpack = _packed_values(kernel, aval[1])
    axes = _shard.axis_tuple(name, axis_name)
    split = None if axes else _mesh_split(name, x, y, m, n)
    if mask is not None:
        mask = _check_mask(name, mask, split is not None or bool(axes))
    if split is None:
        out = _local(name, kernel, x, y, monoid, block_size, m, n, axes, mask=mask)
    else:
        out = _on_mesh(name, kernel, x, y, monoid, block_size, *split)
    return out if unpack is None else unpack(out)


def _check_mask(name, mask, on_mesh):
    """``mask`` traced on one pair of indices: ``(Closed, consts)`` (see :func:`_pair_mask`)."""
    if not callable(mask):
        raise TypeError(f"{name}: mask must be a callable mask(i, j) -> bool, got {mask!r:.60}.")
    if on_mesh:
        raise ValueError(
            f"{name}: mask is not supported with sharded x / y or axis_name yet; call it on "
            f"one device, or fold the mask into the kernel (a -inf logit, a 0 weight)."
        )
    index = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        closed, consts = _closure.trace(mask, index, index)
    except Exception as e:
        raise TypeError(
            f"{name}: mask(i, j) failed on a pair of int32 indices (write it elementwise with "
            f"jnp operations, e.g. lambda i, j: j <= i): {e}"
        ) from e
    out = closed.jaxpr.outvars
    if len(out) != 1 or out[0].aval.dtype != jnp.bool_ or out[0].aval.shape != ():
        got = ", ".join(v.aval.str_short() for v in out) or "nothing"
        raise TypeError(
            f"{name}: mask(i, j) must return one boolean per pair of indices, got {got} for "
            f"int32 scalars i, j (compare them, e.g. lambda i, j: j <= i)."
        )
    return closed, consts


def _pair_mask(closed, start, count):
    """The engine's ``pair_mask(consts, i, j)``: the user's mask (traced on one pair of
    indices), on broadcasting index arrays, reading the arrays it closes over from the fold's
    consts ``[start, start + count)``: whatever they are (jit arguments, vmapped arrays), they
    are the fold's inputs, never constants of its implementation."""

    def pair_mask(consts, i, j):
        own = tuple(consts[start : start + count])
        return jnp.vectorize(lambda a, b: closed(own, a, b))(i, j)

    return pair_mask


def _packed_values(kernel, val):
    """A softmax kernel whose values (``val``: their avals, any pytree, any float dtypes) come
    packed as one vector, and the function that turns the ``(M, F)`` result back into the values'
    tree and dtypes."""
    leaves, tree = jax.tree.flatten(val)
    if isinstance(val, jax.ShapeDtypeStruct):  # one array: only the result's dtype to restore
        return kernel, lambda out: out.astype(val.dtype)
    dtype = promote(*(leaf.dtype for leaf in leaves))
    ends = np.cumsum([math.prod(leaf.shape) for leaf in leaves])[:-1]

    def packed(a, b):
        logit, v = kernel(a, b)
        return logit, jnp.concatenate([jnp.ravel(t).astype(dtype) for t in jax.tree.leaves(v)])

    def unpack(out):
        parts = jnp.split(out, ends, axis=-1)
        shaped = [
            p.reshape((*out.shape[:-1], *leaf.shape)).astype(leaf.dtype)
            for p, leaf in zip(parts, leaves, strict=True)
        ]
        return jax.tree.unflatten(tree, shaped)

    return packed, unpack


def _local(name, kernel, x, y, monoid, block_size, m, n, axes, ring=(), mask=None):
    """On one device, or inside ``shard_map`` with the rows of ``y`` split over ``axes`` (its
    states all-reduced) or over ``ring`` (axes that split ``x`` too: its blocks go round)."""
    block = _block_sizes(name, block_size, m, n)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m)
    if axes and _shard.types_checked(axes):
        split_x = [ax for ax in axes if any(ax in _shard.varying(a) for a in jax.tree.leaves(x))]
        if split_x:
            raise ValueError(
                f"{name}: x varies along axis_name {tuple(split_x)}, but axis_name splits the "
                f"rows of y (the reduced axis) and every device must hold the same rows of x; "
                f"replicate x along it (in_specs P() for x), or split x over another mesh axis."
            )
    return pairwise(name, kernel, x, y, monoid, block, axes, ring, mask)


def _mesh_split(name, x, y, m, n):
    """``(mesh, x_axes, y_axes)`` when ``x`` / ``y`` live on a mesh, else ``None``.

    Explicit axes: the axes that split each one's rows. Auto axes: the rows of ``x`` are split
    over them (no communication; the result is split the same way).
    """
    xs = _shard.row_axes(jax.tree.leaves(x), m, auto=True)
    ys = _shard.row_axes(jax.tree.leaves(y), n, auto=False)
    if xs is None and ys is None:
        # Replicated on a mesh: run there (unsplit) rather than mix mesh types.
        mesh = _shard.on_explicit_mesh(jax.tree.leaves((x, y)))
        return None if mesh is None else (mesh, (), ())
    mesh = (xs or ys)[0]
    x_axes, y_axes = (xs[1] if xs else ()), (ys[1] if ys else ())
    both = set(x_axes) & set(y_axes)
    if both and not set(y_axes) <= set(x_axes):
        raise ValueError(
            f"{name}: y's rows are split over mesh axes {y_axes}, of which x's rows are split "
            f"over {tuple(sorted(both))} too but not over all: split y over axes that x is split "
            f"over (its blocks then go round them), or over axes that x is not split over."
        )
    return mesh, x_axes, y_axes


def _on_mesh(name, kernel, x, y, monoid, block_size, mesh, x_axes, y_axes):
    """Under ``jit``: ``shard_map`` over the mesh, rows of ``x`` split over ``x_axes`` (no
    communication), rows of ``y`` over ``y_axes`` (states all-reduced). The kernel is traced
    once for a pair of rows and replayed inside with its closed-over arrays passed in (the
    ``shard_map`` runs with ``check_vma=False``; see :func:`foldax._segment._on_mesh`)."""
    dx = math.prod(mesh.shape[a] for a in x_axes)
    dy = math.prod(mesh.shape[a] for a in y_axes)
    m, n = _num_rows(name, "x", x) // dx, _num_rows(name, "y", y) // dy
    replay, consts = _shard.replayable(kernel, _row_avals(x), _row_avals(y))

    def body(x, y, consts):
        k = replay(consts)
        if y_axes and set(y_axes) <= set(x_axes):  # y's blocks go round the devices that split x
            return _local(name, k, x, y, monoid, block_size, m, n, (), y_axes)
        return _local(name, k, x, y, monoid, block_size, m, n, y_axes)

    x = _shard.place(x, mesh, _shard.rows_spec(x_axes))
    y = _shard.place(y, mesh, _shard.rows_spec(y_axes))
    consts = _shard.place(consts, mesh, lambda a: P())
    out = P(x_axes or None)
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            jax.tree.map(_shard.rows_spec(x_axes), x),
            jax.tree.map(_shard.rows_spec(y_axes), y),
            [P() for _ in consts],
        ),
        out_specs=(out, out) if isinstance(monoid, KMin | ExtremumWithIndex) else out,
        axis_names=_shard.manual_axes(mesh, x_axes + y_axes),
        check_vma=False,
    )
    return run(x, y, consts)


def _empty(monoid, kernel, x, y, m):
    """No rows of ``x`` or of ``y``: the reduction's identity for each row of ``x`` (0 for sums,
    -inf for a log-sum-exp, the dtype's lowest / highest for extrema, index ``2**31 - 1``; see
    :func:`pairwise_reduce`), in the kernel's dtype, from the states the engine would start from."""
    aval = jax.eval_shape(kernel, _row_avals(x), _row_avals(y))
    row = monoid.value_aval(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, 1, *a.shape), a.dtype), aval)
    )
    outs = monoid.outputs(monoid.init_aval(m, row))
    first, dtype = outs[0], getattr(row, "dtype", None)
    if dtype is not None and jnp.issubdtype(first.dtype, jnp.floating) and first.dtype != dtype:
        first = first.astype(dtype)
    return monoid.result((first, *outs[1:]))
