"""Lane-dense states of the extrema, as a TPU kernel keeps them.

A kernel that folds a tile ``(bi, bj)`` into one state per row reduces across the tile's lanes
at every step: the cross-lane unit's work, several times per step for an index (the extreme,
then the first column attaining it, then the first NaN). These states are kept per row *and*
lane instead, ``(bi, 128)``: each of a tile's 128-lane chunks, in column order, updates its
lane's state by comparisons and selects alone, and the lanes are reduced once, after the last
tile. Columns reach a lane in increasing order (a masked fold visits its live blocks in
order), so a value that only ties its lane's extreme comes later: the first index is kept by
not replacing on ties. On a TPU v5e, the nearest of 98,304 points among as many (3-D, one
direction): 120.7 ms for the engine's argmin kernel, 25.2 ms for a minimal per-row kernel,
14.9 ms lane by lane (a plain min: 15.5 ms; ``dev/tpu/argmin_variants.py``).

Each form is ``init(num, aval)`` (the lanes' identity), ``add(state, v, mask, index)`` (a
tile's values ``(bi, bj)``, its kept pairs and its columns' global indices ``(bj,)``) and
``finish(state)``: the state per row that the monoid's own ``reduce`` and ``combine`` give.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ._base import NO_INDEX, identity

LANES = 128


def _chunks(v, mask, index):
    """A tile's 128-lane chunks in column order: ``(values, kept, columns (1, 128))``."""
    cols = index.reshape(1, -1)
    for lo in range(0, v.shape[1], LANES):
        hi = lo + LANES
        yield v[:, lo:hi], mask[:, lo:hi], cols[:, lo:hi]


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _beats(x, m, is_max):
    """Whether ``x`` replaces a lane's extreme ``m``: strictly better, or NaN where ``m`` is
    not (NaN is the extreme, and the first one stays)."""
    if not _floating(x):
        return x > m if is_max else x < m
    not_worse = ~((x <= m) if is_max else (x >= m))  # better, or either is NaN
    return not_worse & (m == m)


def _best(a, b, is_max):
    return jnp.maximum(a, b) if is_max else jnp.minimum(a, b)


def _across(m, is_max):
    """Each row's extreme over its lanes ``(bi, 128) -> (bi,)``, NaN lanes left out, and
    whether any lane is NaN."""
    ident = jnp.asarray(identity(is_max, m.dtype), m.dtype)
    if not _floating(m):
        return (jnp.max if is_max else jnp.min)(m, axis=1), None
    nan = m != m
    best = (jnp.max if is_max else jnp.min)(jnp.where(nan, ident, m), axis=1)
    return best, jnp.any(nan, axis=1)


def _nan_to(value, nan, x):
    return x if nan is None else jnp.where(nan, jnp.asarray(value, x.dtype), x)


def _full(num, value, dtype):
    return jnp.full((num, LANES), value, dtype)


class ExtremumLanes:
    """Max / min with the count attaining it (:class:`._extremum._Extremum`'s state)."""

    def __init__(self, is_max):
        self.is_max = is_max

    def init(self, num, aval):
        return _full(num, identity(self.is_max, aval.dtype), aval.dtype), _full(num, 0, jnp.int32)

    def add(self, state, v, mask, index):
        m, c = state
        for x, keep, _ in _chunks(v, mask, index):
            better = keep & _beats(x, m, self.is_max)
            eq = keep & (x == m)
            c = jnp.where(better, 1, jnp.where(eq, c + 1, c))
            m = jnp.where(better, x, m)
        return m, c

    def finish(self, state):
        m, c = state
        best, nan = _across(m, self.is_max)
        count = jnp.sum(jnp.where(m == best[:, None], c, 0), axis=1, dtype=jnp.int32)
        return _nan_to(np.nan, nan, best), _nan_to(0, nan, count)


class ArgExtremumLanes(ExtremumLanes):
    """The max / min and its first index, the first NaN's where there is one
    (:class:`._extremum.ArgExtremum`'s state)."""

    def init(self, num, aval):
        ident = identity(self.is_max, aval.dtype)
        return _full(num, ident, aval.dtype), _full(num, NO_INDEX, jnp.int32)

    def add(self, state, v, mask, index):
        m, i = state
        for x, keep, col in _chunks(v, mask, index):
            better = keep & (_beats(x, m, self.is_max) | (i == NO_INDEX))  # (an empty lane)
            i = jnp.where(better, col, i)
            m = jnp.where(better, x, m)
        return m, i

    def finish(self, state):
        m, i = state
        best, nan = _across(m, self.is_max)
        first = jnp.min(jnp.where(m == best[:, None], i, NO_INDEX), axis=1)
        if nan is None:
            return best, first
        first_nan = jnp.min(jnp.where(m != m, i, NO_INDEX), axis=1)
        return _nan_to(np.nan, nan, best), jnp.where(nan, first_nan, first)


class ExtremumAndIndexLanes(ExtremumLanes):
    """Max / min, its count, the indices of one or two values attaining it and the runner-up
    (:class:`._extremum._ExtremumAndIndex`'s state). A lane keeps its extreme, count, first
    and second index attaining it, and its best value strictly worse."""

    def init(self, num, aval):
        ident = identity(self.is_max, aval.dtype)
        none = _full(num, NO_INDEX, jnp.int32)
        extreme = _full(num, ident, aval.dtype)
        return extreme, _full(num, 0, jnp.int32), none, none, extreme

    def add(self, state, v, mask, index):
        m, c, first, second, up = state
        for x, keep, col in _chunks(v, mask, index):
            better = keep & (_beats(x, m, self.is_max) | (c == 0))  # (an empty lane)
            eq = keep & ~better & (x == m)
            worse = keep & ~better & ~eq
            up = jnp.where(better, m, jnp.where(worse, _best(up, x, self.is_max), up))
            second = jnp.where(better, NO_INDEX, jnp.where(eq & (c == 1), col, second))
            first = jnp.where(better, col, first)
            c = jnp.where(better, 1, jnp.where(eq, c + 1, c))
            m = jnp.where(better, x, m)
        return m, c, first, second, up

    def finish(self, state):
        m, c, first, second, up = state
        best, nan = _across(m, self.is_max)
        attain = (m == best[:, None]) & (c > 0)
        count = _nan_to(0, nan, jnp.sum(jnp.where(attain, c, 0), axis=1, dtype=jnp.int32))
        low = jnp.min(jnp.where(attain, first, NO_INDEX), axis=1)
        # the second lowest: the lowest lane's second, or another attaining lane's first
        other = jnp.where(first == low[:, None], second, first)
        other = jnp.min(jnp.where(attain, other, NO_INDEX), axis=1)
        # strictly worse than the extreme: an attaining lane's runner-up, another lane's own
        ident = jnp.asarray(identity(self.is_max, m.dtype), m.dtype)
        worse = jnp.where(attain, up, jnp.where(c > 0, m, ident))
        runner_up, _ = _across(worse, self.is_max)
        one_or_two = (count == 1) | (count == 2)
        return (
            _nan_to(np.nan, nan, best),
            count,
            jnp.where(one_or_two, low, NO_INDEX),
            jnp.where(count == 2, other, NO_INDEX),
            runner_up,
        )
