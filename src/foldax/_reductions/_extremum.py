"""Max and min (with the count of rows attaining them), and the arg-extrema: a segment's row,
a pairwise reduction's column, with or without its value."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._base import (
    NO_INDEX,
    Monoid,
    _add_at,
    _expand,
    _p_extreme,
    _take,
    _tile_mask,
    _ValuesAndIndices,
    count,
    identity,
    picked_elements,
)
from ._kmin import _columns, _first_column, _hits
from ._lanes import ArgExtremumLanes, ExtremumAndIndexLanes, ExtremumLanes
from ._products import rarely


def _tile_extreme(v, mask, is_max):
    """``(w, m, hit)`` of a tile ``(G, T, *F)``: its values with the masked cells the identity,
    their max (``is_max``) or min per slot (XLA:CPU's may drop NaN: the callers find NaN), and
    which kept cells attain it."""
    keep = _tile_mask(mask, v)
    w = jnp.where(keep, v, jnp.asarray(identity(is_max, v.dtype), v.dtype))
    m = jnp.max(w, axis=1) if is_max else jnp.min(w, axis=1)
    return w, m, (w == m[:, None]) & keep


@dataclasses.dataclass(frozen=True)
class _Extremum(Monoid):
    """Max or min, with the number of rows attaining it (so the gradient splits ties evenly)."""

    pallas = True

    is_max: bool = True

    def __init__(self, name, is_max):
        super().__init__(name, "real")
        object.__setattr__(self, "is_max", is_max)

    def _identity(self, dtype):
        return identity(self.is_max, dtype)

    #: a kernel keeps its state per lane (:mod:`._lanes`) where its blocks are whole lanes of
    #: 32-bit values (on a TPU v5e: 4x faster than a state per row)
    lanes_in_kernel = True

    def lane_form(self, aval):
        return ExtremumLanes(self.is_max)

    def _better(self, a, b):
        return jnp.maximum(a, b) if self.is_max else jnp.minimum(a, b)

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, *fshape), self._identity(dtype), dtype),
            jnp.zeros((num, *fshape), jnp.int32),
        )

    #: Preferred dense block ``(bi, bj)`` when ``y`` is walked transposed (a kernel without a
    #: dot product): 8192 pairs, their values L1-resident, ``j`` long enough to vectorise
    #: (see :func:`foldax._engine._plan.dense_block`).
    dense_tile = (1024, 1024)

    def reduce(self, v, mask):
        w, m, hit = _tile_extreme(v, mask, self.is_max)
        t = v.shape[1]
        if not jnp.issubdtype(v.dtype, jnp.floating):
            return (m, jnp.sum(hit, axis=1, dtype=jnp.int32))
        # XLA:CPU's vectorised reduce-max may drop NaN: propagate it explicitly. The NaNs are
        # counted in the same sum as the hits, weighted T + 1 (no separate any-reduce).
        if t * (t + 1) < 2**24:
            one = jnp.where(hit, jnp.float32(1), jnp.float32(0))
            c = count(jnp.where(w != w, jnp.float32(t + 1), one), axis=1)
            nan = c > t
            m = jnp.where(nan, jnp.asarray(np.nan, v.dtype), m)
            return (m, jnp.where(nan, 0, c))
        m = jnp.where(jnp.any(jnp.isnan(w), axis=1), jnp.asarray(np.nan, v.dtype), m)
        return (m, jnp.sum(hit & (w == m[:, None]), axis=1, dtype=jnp.int32))

    def combine(self, a, b):
        m = self._better(a[0], b[0])
        c = jnp.where(a[0] == m, a[1], 0) + jnp.where(b[0] == m, b[1], 0)
        return (m, c)

    def allreduce(self, state, axes):
        m, c = state
        best = _p_extreme(m, axes, self.is_max)
        return (best, lax.psum(jnp.where(m == best, c, 0), axes))

    def scatter(self, carry, seg, st):
        cm, cc = carry
        tm, tc = st
        m = cm.at[seg].max(tm, mode="drop") if self.is_max else cm.at[seg].min(tm, mode="drop")
        m_seg = _take(m, seg)
        # a slot's count survives where its extreme did (only the touched slots can change)
        kept = jnp.where(_take(cm, seg) == m_seg, _take(cc, seg), 0)
        c = cc.at[seg].set(kept, mode="drop")
        return (m, _add_at(c, seg, jnp.where(tm == m_seg, tc, 0)))

    n_outputs = 2

    def finalize(self, st):
        return st[0]

    def outputs(self, st):
        return st

    def info(self, outputs):
        return outputs

    def row_cotangent(self, v, mask, info, g):
        m, c = info
        hit = (v == m[:, None]) & _tile_mask(mask, v)
        share = g[0] / jnp.maximum(c, 1).astype(g[0].dtype)
        ct = jnp.broadcast_to(share[:, None], v.shape)
        return jnp.where(hit, ct, jnp.zeros((), ct.dtype))


class _ExtremumAndIndex(_Extremum):
    """Max or min with its count, where one or two values attain it their indices (the lower
    first; :data:`NO_INDEX` otherwise), and the runner-up (the best value strictly worse than
    the extreme; the identity where there is none): the state a differentiated max / min is
    folded with (:attr:`Monoid.for_derivatives`); its max and count are the plain fold's.

    The derivative rules recompute each value in another program than the forward fold's, and
    XLA may round it differently there (another fusion, another vector lane, a fused
    multiply-add: one unit in the last place on jax 0.12.1, tens where the kernel cancels):
    testing ``v == max`` against the recomputed values can miss the maximum and drop its
    gradient. Where one value attains the extreme (the common case), or two (a duplicated
    row), the rules find them by their indices, which no rounding moves; three or more ties
    are the recomputed values nearer the extreme than halfway to the runner-up, split evenly,
    as ``jnp.max``'s derivative does."""

    needs_index = True
    n_outputs = 5

    def __init__(self, is_max):
        super().__init__(("max" if is_max else "min") + "_for_derivatives", is_max)

    def lane_form(self, aval):
        return ExtremumAndIndexLanes(self.is_max)

    def init(self, num, fshape, dtype):
        none = jnp.full((num, *fshape), NO_INDEX, jnp.int32)
        base = super().init(num, fshape, dtype)
        return (*base, none, none, base[0])

    def _runner_up(self, m, *candidates):
        """The best of the states' runners-up and of their extremes that are not ``m``: the
        best value strictly worse than the extreme ``m``."""
        ident = jnp.asarray(self._identity(m.dtype), m.dtype)
        out = None
        for ext, up in candidates:
            c = self._better(up, jnp.where(ext == m, ident, ext))
            out = c if out is None else self._better(out, c)
        return out

    def reduce(self, v, mask, index):
        # two passes: the extreme; the count of the values attaining it with the sum of
        # their columns (and whether any is NaN), which is the column of the only one. A third
        # finds the first of two, only in the tiles that hold two (the second is the sum less
        # the first).
        w, m, hit = _tile_extreme(v, mask, self.is_max)
        t = v.shape[1]
        if jnp.issubdtype(v.dtype, jnp.floating):  # XLA:CPU's max may drop NaN: found here
            c, cols, nan = _hits(hit, w != w)
            m = jnp.where(nan, jnp.asarray(np.nan, v.dtype), m)
            c = jnp.where(nan, 0, c)
        else:
            c, cols = _hits(hit)
        two = rarely(jnp.any(c == 2), lambda: _first_column(hit), cols)
        first = jnp.where(c == 1, cols, jnp.where(c == 2, two, t))
        second = jnp.where(c == 2, cols - first, t)
        ident = jnp.asarray(self._identity(v.dtype), v.dtype)
        rest = jnp.where(hit, ident, w)  # (w: masked cells are the identity already)
        up = jnp.max(rest, axis=1) if self.is_max else jnp.min(rest, axis=1)
        return (m, c, _index_of(index, first, t), _index_of(index, second, t), up)

    def reduce_in_kernel(self, v, mask, cols, index):
        # reduce's state from integer reductions: the lowest and highest index of the values
        # attaining the extreme are its only one's, or its two's
        w, m, hit = _tile_extreme(v, mask, self.is_max)
        at = _cells_index(index, v.ndim)
        c = jnp.sum(hit, axis=1, dtype=jnp.int32)
        low = jnp.min(jnp.where(hit, at, NO_INDEX), axis=1)
        high = jnp.max(jnp.where(hit, at, -1), axis=1)
        if jnp.issubdtype(v.dtype, jnp.floating):
            nan = jnp.any(w != w, axis=1)
            m = jnp.where(nan, jnp.asarray(np.nan, v.dtype), m)
            c = jnp.where(nan, 0, c)
        first = jnp.where((c == 1) | (c == 2), low, NO_INDEX)
        second = jnp.where(c == 2, high, NO_INDEX)
        ident = jnp.asarray(self._identity(v.dtype), v.dtype)
        rest = jnp.where(hit, ident, w)
        up = jnp.max(rest, axis=1) if self.is_max else jnp.min(rest, axis=1)
        return (m, c, first, second, up)

    @staticmethod
    def _two_lowest(a, b):
        """The two lowest indices of two pairs ``(lowest, second lowest)``: the lower lowest,
        then the lower of the other lowest and the seconds."""
        (low_a, second_a), (low_b, second_b) = a, b
        second = jnp.minimum(jnp.maximum(low_a, low_b), jnp.minimum(second_a, second_b))
        return jnp.minimum(low_a, low_b), second

    @staticmethod
    def _attaining(m, state):
        """A state's indices where its extreme is ``m``, else :data:`NO_INDEX`."""
        return tuple(jnp.where(state[0] == m, x, NO_INDEX) for x in state[2:4])

    def combine(self, a, b):
        # the indices are read only where the count is 1 or 2: then every index of a value
        # attaining the extreme is one of those the states hold
        m, c = super().combine(a[:2], b[:2])
        low = self._two_lowest(self._attaining(m, a), self._attaining(m, b))
        return (m, c, *low, self._runner_up(m, (a[0], a[4]), (b[0], b[4])))

    def allreduce(self, state, axes):
        m, c = super().allreduce(state[:2], axes)
        first, second = self._attaining(m, state)
        low = lax.pmin(first, axes)
        # the second lowest of all: each device's lowest index other than the lowest of all
        second = lax.pmin(jnp.where(first == low, second, first), axes)
        up = _p_extreme(self._runner_up(m, (state[0], state[4])), axes, self.is_max)
        return (m, c, low, second, up)

    def scatter(self, carry, seg, st):
        # several tiles of a step may fold into one slot: the lowest index by a scatter-min,
        # then the second lowest as the scatter-min of each source's lowest other index
        m, c = super().scatter(carry[:2], seg, st[:2])
        m_seg = _take(m, seg)
        old = self._attaining(m_seg, tuple(_take(a, seg) for a in carry))
        new = self._attaining(m_seg, st)
        low = carry[2].at[seg].set(old[0], mode="drop").at[seg].min(new[0], mode="drop")
        low_seg = _take(low, seg)
        other = [jnp.where(f == low_seg, s, f) for f, s in (old, new)]
        second = carry[3].at[seg].set(other[0], mode="drop").at[seg].min(other[1], mode="drop")
        mine = self._runner_up(m, (carry[0], carry[4]))  # every slot's, against its new m
        theirs = self._runner_up(m_seg, (st[0], st[4]))
        up = (
            mine.at[seg].max(theirs, mode="drop")
            if self.is_max
            else mine.at[seg].min(theirs, mode="drop")
        )
        return (m, c, low, second, up)

    # The picks (see :mod:`foldax._engine._picks`): each element's first and second index;
    # the elements where three or more values tie are left to the streamed rules.

    def picks(self, info):
        # (the picks lead, the slots last: see :func:`foldax._engine._picks.values_at`)
        m, c, first, second = info[:4]
        s = m.shape[0]
        second = jnp.where(c == 2, second, first)
        return jnp.concatenate([first.reshape(s, -1).T, second.reshape(s, -1).T], axis=0)

    def picked_tangent(self, info, dv):
        m, c = info[:2]
        d = picked_elements(dv).reshape(2, -1, m.shape[0])
        c = c.reshape(m.shape[0], -1).T
        zero = jnp.zeros((), d.dtype)
        t = jnp.where(c == 1, d[0], jnp.where(c == 2, (d[0] + d[1]) / 2, zero))
        return (t.T.reshape(m.shape), None, None, None, None)

    def tangent(self, v, dv, mask, info, index):
        t = super().tangent(v, dv, mask, info, index)
        # the runner-up only tells ties apart (no derivative reads it): its tangent is zero
        return (*t[:4], jnp.zeros_like(t[0]))

    def streamed_rows(self, info):
        c = info[1]
        return jnp.any((c > 2).reshape(c.shape[0], -1), axis=1)

    def row_cotangent(self, v, mask, info, g, index):
        m, c, first, second, up = info
        cells = _expand(index if index.ndim == 2 else index[None, :], v.ndim)
        by_index = (cells == first[:, None]) | (cells == second[:, None])
        ties = _ties(v, m[:, None], up[:, None], self.is_max)
        few = c[:, None] <= 2  # (and / or, not a select of booleans: Mosaic has none)
        hit = ((few & by_index) | (~few & ties)) & _tile_mask(mask, v)
        share = g[0] / jnp.maximum(c, 1).astype(g[0].dtype)
        ct = jnp.broadcast_to(share[:, None], v.shape)
        return jnp.where(hit, ct, jnp.zeros((), ct.dtype))


def _ties(v, m, up, is_max):
    """Which recomputed values ``v`` are ties of the extreme ``m`` that the forward fold found,
    given its runner-up ``up`` (the best value strictly worse, the identity where there is
    none), both broadcast against ``v``: those nearer ``m`` than halfway to ``up``. A value
    recomputed in another program may land units in the last place away from its forward
    twin (another fusion or fused multiply-add; tens of units where the kernel cancels, as
    ``a.a + b.b - 2 a.b``): never as far as halfway to a value that is not a tie. The rule
    for three or more ties (fewer are found by their indices)."""
    if not jnp.issubdtype(v.dtype, jnp.floating):
        return v == m  # (integers are recomputed exactly)
    half = m / 2 + up / 2  # (no overflow; NaN for an infinite extreme: equality then)
    return (v == m) | ((v > half) if is_max else (v < half))


class Max(_Extremum):
    def __init__(self):
        super().__init__("max", True)

    @property
    def for_derivatives(self):
        return _ExtremumAndIndex(True)


class Min(_Extremum):
    def __init__(self):
        super().__init__("min", False)

    @property
    def for_derivatives(self):
        return _ExtremumAndIndex(False)


@dataclasses.dataclass(frozen=True)
class ArgExtremum(Monoid):
    """The index of the max / min: a segment's global row, a pairwise reduction's column. First
    of ties; NaN counts as the extreme (like ``jnp.argmax``). State: (the extreme, its first
    index; :data:`NO_INDEX` for none), which is also what an empty reduction gives (a public
    function may map it to its own convention). Reads every cell's index (``needs_index``)."""

    needs_index = True
    is_max: bool = True

    def __init__(self, is_max):
        super().__init__("argmax" if is_max else "argmin", "real")
        object.__setattr__(self, "is_max", is_max)

    #: Preferred dense block, as :attr:`foldax._reductions._extremum._Extremum.dense_tile`.
    dense_tile = (1024, 1024)

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, *fshape), identity(self.is_max, dtype), dtype),
            jnp.full((num, *fshape), NO_INDEX, jnp.int32),
        )

    def reduce(self, v, mask, index):
        # Values first (a plain vectorised min / max), then the index: the first column that
        # attains it (a second min, over column numbers). jnp.argmin's variadic (value, index)
        # reduce does not vectorise on CPU and cost 5x the value alone. XLA:CPU's vectorised
        # min / max may drop NaN, so NaN columns rank before the hits in that same min: a slot
        # with a NaN takes its first NaN.
        w, best, hit = _tile_extreme(v, mask, self.is_max)
        t = v.shape[1]
        if not jnp.issubdtype(v.dtype, jnp.floating):
            return (best, _index_of(index, _first_column(hit), t))
        col = _columns(v.shape)
        # NaN columns rank 0 .. T - 1, hits T .. 2T - 1, the rest 2T (masked cells are not NaN);
        # ranked in float32 (exact), which XLA:CPU reduces vectorised, unlike int32
        r = jnp.where(w != w, col, jnp.where(hit, col + t, jnp.float32(2 * t)))
        r = jnp.min(r, axis=1).astype(jnp.int32)
        best = jnp.where(r < t, jnp.asarray(np.nan, v.dtype), best)
        return (best, _index_of(index, jnp.where(r < 2 * t, r % t, t), t))

    #: its kernel form (:meth:`reduce_in_kernel`) finds the first index by an integer min
    pallas = True
    #: as :attr:`_Extremum.lanes_in_kernel`
    lanes_in_kernel = True

    def lane_form(self, aval):
        return ArgExtremumLanes(self.is_max)

    def reduce_in_kernel(self, v, mask, cols, index):
        # reduce's state: the first NaN's index where there is one, else the first hit's
        w, best, hit = _tile_extreme(v, mask, self.is_max)
        at = _cells_index(index, v.ndim)
        first = jnp.min(jnp.where(hit, at, NO_INDEX), axis=1)
        if jnp.issubdtype(v.dtype, jnp.floating):
            first_nan = jnp.min(jnp.where(w != w, at, NO_INDEX), axis=1)
            nan = first_nan != NO_INDEX
            best = jnp.where(nan, jnp.asarray(np.nan, v.dtype), best)
            first = jnp.where(nan, first_nan, first)
        return (best, first)

    def _same(self, a, b):
        eq = a == b
        if jnp.issubdtype(a.dtype, jnp.floating):
            eq = eq | (jnp.isnan(a) & jnp.isnan(b))
        return eq

    def _best(self, a, b):
        m = jnp.maximum(a, b) if self.is_max else jnp.minimum(a, b)
        if jnp.issubdtype(a.dtype, jnp.floating):
            m = jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.asarray(np.nan, a.dtype), m)
        return m

    def combine(self, a, b):
        m = self._best(a[0], b[0])
        ia = jnp.where(self._same(a[0], m), a[1], NO_INDEX)
        ib = jnp.where(self._same(b[0], m), b[1], NO_INDEX)
        return (m, jnp.minimum(ia, ib))

    def allreduce(self, state, axes):
        val, idx = state
        best = _p_extreme(val, axes, self.is_max)
        return (best, lax.pmin(jnp.where(self._same(val, best), idx, NO_INDEX), axes))

    def scatter(self, carry, seg, st):
        cm, ci = carry
        tm, ti = st
        # scatter-max / min propagate NaN, as _Extremum relies on
        m = cm.at[seg].max(tm, mode="drop") if self.is_max else cm.at[seg].min(tm, mode="drop")
        m_seg = _take(m, seg)
        kept = jnp.where(self._same(_take(cm, seg), m_seg), _take(ci, seg), NO_INDEX)
        i = ci.at[seg].set(kept, mode="drop")
        return (m, i.at[seg].min(jnp.where(self._same(tm, m_seg), ti, NO_INDEX), mode="drop"))

    def finalize(self, st):
        return st[1]

    def tangent(self, v, dv, mask, info, index):
        return (None,)  # an index has no derivative


def _cells_index(index, ndim):
    """The global index of each cell of a tile ``(G, T, *F)`` of ``ndim`` axes whose columns
    have the indices ``index`` ``(T,)``, broadcastable against it."""
    return _expand(index.reshape(1, -1), ndim)


def _index_of(index, pos, t):
    """The global index of column ``pos`` ``(G, *F)`` of a tile whose cells have the indices
    ``index``: ``(T,)`` (the columns of a dense block, or a probe's) or ``(G, T)`` (rows gathered
    per slot); :data:`NO_INDEX` where ``pos`` is ``t`` (no column)."""
    at = jnp.minimum(pos, t - 1)
    if index.ndim == 1:
        got = jnp.take(index, at)
    else:
        rows = jnp.broadcast_to(_expand(index, at.ndim + 1), (*at.shape[:1], t, *at.shape[1:]))
        got = jnp.take_along_axis(rows, at[:, None], axis=1)[:, 0]
    return jnp.where(pos < t, got, NO_INDEX).astype(jnp.int32)


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
