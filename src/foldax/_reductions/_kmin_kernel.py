"""The k smallest as an accelerator kernel folds them (Mosaic lowers no sort, top-k or
gather): k rounds of integer reductions along the lanes, each taking out the least
``(sort key, index)`` left. The rounds are a loop, not unrolled: a kernel's code grows with
every value of a tile it writes (a ``(1024, 1024)`` tile is 1,024 vector registers), and k
unrolled rounds in 784 dimensions did not compile within 100 s on a TPU. States are
``(values, indices)`` ``(G, k)``, ascending by value then index, as
:class:`foldax._reductions._kmin.KMin`'s; an empty slot is the largest key (a NaN, or an
integer's max) with :data:`NO_INDEX`, and sorts last."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _kmin  # (its sort keys; it imports this module: read at trace time)
from ._base import NO_INDEX
from ._lanes import LANES, _chunks


def tile_best(k, v, mask, index):
    """A tile's k best ``(values, indices)`` ``(G, k)`` of its values ``v`` ``(G, T)`` where
    ``mask``, its columns numbered ``index`` ``(T,)``: per round, each row's least sort key,
    the lowest column holding it, taken out."""
    big = jnp.iinfo(_kmin._key_dtype(v.dtype)).max
    keys = jnp.where(mask, _kmin._sort_key(v), big)
    at = jnp.where(mask, jnp.broadcast_to(index.reshape(1, -1), v.shape), NO_INDEX)
    out_k, out_i, lane = _empty(k, v.shape[0], big, keys.dtype)

    def round_(r, carry):
        keys, at, out_k, out_i = carry
        m, i = _least(keys, at)
        out_k, out_i = jnp.where(lane == r, m, out_k), jnp.where(lane == r, i, out_i)
        return (*_taken_out(keys, at, m, i, True, big), out_k, out_i)

    *_, out_k, out_i = lax.fori_loop(0, k, round_, (keys, at, out_k, out_i))
    return _kmin._from_key(out_k, v.dtype), out_i


def merge(k, a, b):
    """Two states' k best (their columns apart), merged in k rounds of their heads."""
    ka, kb = _kmin._sort_key(a[0]), _kmin._sort_key(b[0])
    big = jnp.iinfo(ka.dtype).max
    ia, ib = a[1], b[1]
    out_k, out_i, lane = _empty(k, ka.shape[0], big, ka.dtype)

    def round_(r, carry):
        ka, ia, kb, ib, out_k, out_i = carry
        ma, ja = _least(ka, ia)
        mb, jb = _least(kb, ib)
        take_a = (ma < mb) | ((ma == mb) & (ja <= jb))
        m, j = jnp.where(take_a, ma, mb), jnp.where(take_a, ja, jb)
        out_k, out_i = jnp.where(lane == r, m, out_k), jnp.where(lane == r, j, out_i)
        left = _taken_out(ka, ia, ma, ja, take_a, big)
        return (*left, *_taken_out(kb, ib, mb, jb, ~take_a, big), out_k, out_i)

    carry = lax.fori_loop(0, k, round_, (ka, ia, kb, ib, out_k, out_i))
    return _kmin._from_key(carry[4], a[0].dtype), carry[5]


def _empty(k, rows, big, dtype):
    """Empty ``(rows, k)`` keys and indices, and each slot's lane number."""
    shape = (rows, k)
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    return jnp.full(shape, big, dtype), jnp.full(shape, NO_INDEX, jnp.int32), lane


def _least(keys, idx):
    """Each row's least ``(key, index)`` ``(G, 1)``."""
    m = jnp.min(keys, axis=1, keepdims=True)
    return m, jnp.min(jnp.where(keys == m, idx, NO_INDEX), axis=1, keepdims=True)


def _taken_out(keys, idx, m, j, taken, big):
    """``(keys, idx)`` without the entry ``(m, j)`` where ``taken`` (an empty slot's key and
    index in its place: it sorts last)."""
    gone = taken & (keys == m) & (idx == j)
    return jnp.where(gone, big, keys), jnp.where(gone, NO_INDEX, idx)


class KMinLanes:
    """The k smallest kept per row and lane (as :mod:`._lanes` keeps the extrema): each lane
    holds its k best sort keys and indices, ascending, as ``k`` arrays ``(G, 128)`` each. A
    tile's 128-lane chunk is inserted into every lane's list at once: a slot takes the new
    entry where it is the first slot the entry beats, its predecessor where an earlier slot
    was beaten (the lists are sorted, so that is one comparison and two selects per slot, no
    loop). Columns reach a lane in increasing order, so an entry that ties a slot's key goes
    after it: ties keep the lower index. After the last tile, k rounds take each row's least
    ``(key, index)`` among its lanes' heads and pop it (a loop)."""

    def __init__(self, k, dtype):
        self.k, self.dtype = k, dtype

    def init(self, num, aval):
        key = _kmin._key_dtype(aval.dtype)
        big = jnp.full((num, LANES), jnp.iinfo(key).max, key)
        none = jnp.full((num, LANES), NO_INDEX, jnp.int32)
        return (big,) * self.k, (none,) * self.k

    def add(self, state, v, mask, index):
        keys, idx = state
        big = jnp.iinfo(keys[0].dtype).max
        floats = jnp.issubdtype(v.dtype, jnp.floating)
        for chunk, keep, cols in _chunks(v, mask, index):
            x = jnp.where(keep, _kmin._sort_key(chunk), big)
            at = jnp.where(keep, jnp.broadcast_to(cols, x.shape), NO_INDEX)
            keys, idx = _insert(keys, idx, x, at, ties_to_empty=not floats)
        return keys, idx

    def finish(self, state):
        keys, idx = state
        rows = keys[0].shape[0]
        big = jnp.iinfo(keys[0].dtype).max
        out_k, out_i, lane = _empty(self.k, rows, big, keys[0].dtype)

        def round_(r, carry):
            keys, idx, out_k, out_i = carry
            m, j = _least(keys[0], idx[0])
            out_k, out_i = jnp.where(lane == r, m, out_k), jnp.where(lane == r, j, out_i)
            popped = (keys[0] == m) & (idx[0] == j)
            keys = _popped(keys, popped, big)
            return keys, _popped(idx, popped, NO_INDEX), out_k, out_i

        *_, out_k, out_i = lax.fori_loop(0, self.k, round_, (keys, idx, out_k, out_i))
        return _kmin._from_key(out_k, self.dtype), out_i


def _insert(keys, idx, x, at, ties_to_empty):
    """Lists ``keys`` / ``idx`` (k arrays, each lane ascending) with entry ``(x, at)`` put in
    each lane's place (the last entry falls off). ``ties_to_empty``: an entry whose key equals
    an empty slot's (an integer's largest value) goes into it (its index is lower)."""
    new_k, new_i, beat_before = [], [], None
    for r in range(len(keys)):
        beat = x < keys[r]
        if ties_to_empty:
            beat = beat | ((x == keys[r]) & (idx[r] == NO_INDEX))
        if beat_before is None:
            new_k.append(jnp.where(beat, x, keys[r]))
            new_i.append(jnp.where(beat, at, idx[r]))
        else:
            new_k.append(jnp.where(beat, jnp.where(beat_before, keys[r - 1], x), keys[r]))
            new_i.append(jnp.where(beat, jnp.where(beat_before, idx[r - 1], at), idx[r]))
        beat_before = beat
    return tuple(new_k), tuple(new_i)


def _popped(slots, popped, empty):
    """Each lane's list without its head where ``popped`` (the rest moved up one slot)."""
    nxt = (*slots[1:], jnp.full_like(slots[0], empty))
    return tuple(jnp.where(popped, b, a) for a, b in zip(slots, nxt, strict=True))
