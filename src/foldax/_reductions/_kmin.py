"""The k smallest values over ``j`` and their indices: the state, and the machinery that
inserts a tile's candidates into it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _kmin_kernel as _kernel_form
from ._base import NO_INDEX, Monoid, _ValuesAndIndices


def _no_entry(take, key, idx):
    """k-min's entries ``(key, idx)`` where ``take``, elsewhere the entry that displaces
    nothing: the largest key *and* :data:`NO_INDEX`, at or after every entry in the order of
    :func:`_lex_less` (an empty slot's included), so :func:`_insert` leaves those rows as they
    are. The largest key alone is a real value's for 32- and 64-bit integers (``iinfo.max``)."""
    return jnp.where(take, key, np.iinfo(key.dtype).max), jnp.where(take, idx, NO_INDEX)


def _columns(shape):
    """Each cell's column (axis 1) as float32: tiles are far narrower than 2^24, so exact."""
    return lax.broadcasted_iota(jnp.float32, shape, 1)


def _first_index(hit, index):
    """The global index of the first true column of ``hit`` ``(G, T, *F)`` per slot; int32 max
    where there is none. A float32 min over column numbers: vectorised, unlike a variadic
    argmin or an int32 min on XLA:CPU."""
    t = hit.shape[1]
    pos = _first_column(hit)
    return jnp.where(pos < t, jnp.take(index, jnp.minimum(pos, t - 1)), NO_INDEX)


def _first_column(hit):
    """The first true column of ``hit`` ``(G, T, *F)`` per slot (``T`` where there is none)."""
    t = hit.shape[1]
    return jnp.min(jnp.where(hit, _columns(hit.shape), jnp.float32(t)), axis=1).astype(jnp.int32)


#: columns whose hits :func:`_hits` counts in one float32 number: its sums stay exact
_HITS_CHUNK = 256


def _hits(hit, poison=None):
    """Per slot of ``hit`` ``(G, T, *F)``: how many cells are true, and the sum of their
    columns (so the column of the only one, where there is one), as int32 -- in one float32
    pass; with ``poison`` (like ``hit``), also whether any cell of it is true (then the two
    numbers are meaningless).

    Each chunk of at most 256 columns sums ``1 + column / 2^15`` over its true cells: the
    count is the whole part, the sum of its columns the fraction. Every partial sum has at most
    9 + 15 significant bits, so it is exact in any order; chunks are combined in int32. A
    poisoned cell weighs 512, more than any chunk's count: a sum of non-negative numbers never
    rounds below one of them, so a chunk holding one sums to at least that."""
    g, t, f = hit.shape[0], hit.shape[1], hit.shape[2:]
    w = -(-t // -(-t // _HITS_CHUNK))  # chunks as even as they come: little padding
    pad = ((0, 0), (0, -t % w)) + ((0, 0),) * len(f)
    chunked = lambda a: jnp.pad(a, pad).reshape(g, -1, w, *f)  # noqa: E731
    hit = chunked(hit)
    col = lax.broadcasted_iota(jnp.float32, hit.shape, 2)
    weight = jnp.where(hit, 1 + col * jnp.float32(2.0**-15), jnp.float32(0))
    if poison is not None:
        weight = jnp.where(chunked(poison), jnp.float32(512), weight)
    code = jnp.sum(weight, 2)
    c = code.astype(jnp.int32)
    within = jnp.round((code - c.astype(jnp.float32)) * 2.0**15).astype(jnp.int32)
    base = (jnp.arange(hit.shape[1], dtype=jnp.int32) * w).reshape((1, -1) + (1,) * len(f))
    count = jnp.sum(c, 1, dtype=jnp.int32), jnp.sum(within + c * base, 1, dtype=jnp.int32)
    if poison is None:
        return count
    return (*count, jnp.any(code >= 512, axis=1))


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
        return key, jnp.where(r < 2 * t, jnp.take(index, r % t, mode="clip"), NO_INDEX)

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
    entries an empty one (int max, :data:`NO_INDEX`) -- exact for every dtype and every value.

    For float32 and narrower: a float32 top-k (XLA:CPU runs it as one vectorised pass, 30x
    faster than a sort) of the values below ``+inf``, and where a row has fewer than k of them
    a second of the ``+inf`` and NaN entries in their order (+inf before NaN, each by column),
    which the first cannot rank among its masked cells. Other dtypes: one sort of the row's
    keys."""
    t = v.shape[1]
    kk = min(k, t)
    col = lax.broadcasted_iota(jnp.int32, v.shape, 1)
    if v.dtype not in _TOPK_FLOATS:
        key = jnp.where(mask, _sort_key(v), jnp.iinfo(_key_dtype(v.dtype)).max)
        key, empty, col = lax.sort((key, (~mask).astype(jnp.int32), col), dimension=1, num_keys=3)
        keys, ok, pos = key[:, :kk], empty[:, :kk] == 0, col[:, :kk]
        return _no_entry(ok, keys, jnp.take(index, pos))
    w = v.astype(jnp.float32)
    w = jnp.where(w == 0, jnp.zeros_like(w), w)  # -0.0 ties with 0.0 (top_k orders them)
    low = mask & (w < jnp.inf)
    _, pos = lax.top_k(jnp.where(low, -w, -jnp.inf), kk)
    ok = jnp.take_along_axis(low, pos, axis=1)
    count = jnp.sum(ok, axis=1, dtype=jnp.int32)[:, None]  # its valid entries: a prefix

    def then_inf_and_nan(pos, ok):
        """After a row's values below +inf, its +inf and NaN entries in their order."""
        rank = jnp.where(mask & (w == jnp.inf), col, jnp.where(mask & (w != w), t + col, 3 * t))
        _, pos2 = lax.top_k(-jnp.where(low, 3 * t, rank).astype(jnp.float32), kk)
        ok2 = jnp.take_along_axis(rank, pos2, axis=1) < 2 * t
        r = lax.broadcasted_iota(jnp.int32, ok.shape, 1)
        pick = jnp.where(r < count, r, kk + r - count)
        pos = jnp.take_along_axis(jnp.concatenate([pos, pos2], 1), pick, axis=1)
        return pos, jnp.take_along_axis(jnp.concatenate([ok, ok2], 1), pick, axis=1)

    # (a second top-k only where a row has fewer than k values below +inf)
    short = jnp.any(count < kk)
    pos, ok = lax.cond(short, then_inf_and_nan, lambda pos, ok: (pos, ok), pos, ok)
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


def _each_block(n, cap, block, state):
    """``block(start, state)`` for the blocks of ``cap`` rows that ``n`` gathered rows fill
    (``start``: the first one's rank), in one ``fori_loop``: one block body to compile."""
    return lax.fori_loop(0, (n + (cap - 1)) // cap, lambda b, st: block(b * cap, st), state)


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
    (:data:`NO_INDEX`), never its value, which may be a real one (an integer distance at the
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
    #: insert entry by entry (:meth:`_drain_tile`: 4x faster at k = 64). 9 is the candidates'
    #: k of a min in high dimension (``k + EXTRA`` in ``_pairwise/_distances.py``): there, and
    #: at 20,000 x 20,000 x 3, the merge ran at the drain's speed (0.96-1.05x) and its first
    #: call took 1.8-2.6 s where the drain's took 4.6 s; from k = 10 it ran 1.1-1.3x slower.
    TOPK_UP_TO = 9
    #: rows gathered into one block whose tile top-k is taken (:meth:`_merge_many`)
    CAPACITY = 16
    #: k above TOPK_UP_TO: the few rows with several entries to insert are gathered BLOCK at a
    #: time, in a loop, while they are at most LOOPED_UP_TO; more are one block. (One block
    #: body to compile: a block of each of 16, 64, 256 rows compiled 1.5-2x slower, at
    #: 20,000 x 20,000 x 3, k = 10 to 64, and ran 0.96-1.14x this.)
    BLOCK = 32
    LOOPED_UP_TO = 256
    #: k above TOPK_UP_TO: the whole tile is drained while more than 1 / SPARSE of its rows
    #: need it
    SPARSE = 4
    #: k above TOPK_UP_TO: most candidates a row inserts in column order
    #: (:func:`_insert_columns`); beyond, value order stops sooner
    FEW = 8
    #: Preferred dense block, as :attr:`foldax._reductions._extremum._Extremum.dense_tile`: narrower than
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

    #: a problem within one :attr:`dense_tile` of pairs is one block, whose k best are one
    #: top-k (:meth:`only`): at 1,000 x 1,000, no insertion loop to compile or run
    whole_when_small = True

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, self.k), self._fill(dtype), dtype),
            jnp.full((num, self.k), NO_INDEX, jnp.int32),
        )

    def reduce(self, v, mask, index):
        return _Tile(v, mask, index)

    def combine(self, a, b):
        if isinstance(b, _Tile):
            return self._merge_tile(a, b)
        keys = jnp.concatenate([_sort_key(a[0]), _sort_key(b[0])], 1)
        keys, idx = lax.sort((keys, jnp.concatenate([a[1], b[1]], 1)), dimension=1, num_keys=2)
        return (_from_key(keys[:, : self.k], a[0].dtype), idx[:, : self.k])

    def only(self, state, value):
        """A fold of one tile: each row's k best of the tile (:func:`_tile_best`), padded with
        empty slots where the tile is narrower than k; a row without entries (a block's rows
        another block owns) keeps its state."""
        keys, idx = _tile_best(value.v, value.mask, value.index, self.k)
        pad = ((0, 0), (0, self.k - keys.shape[1]))
        keys = jnp.pad(keys, pad, constant_values=np.iinfo(keys.dtype).max)
        idx = jnp.pad(idx, pad, constant_values=NO_INDEX)
        # an empty slot keeps its state: the identity (an integer's max, not a key's) in a row
        # with entries; a row without (another block's) is all empty slots
        keep = idx == NO_INDEX
        vals = jnp.where(keep, state[0], _from_key(keys, state[0].dtype))
        return vals, jnp.where(keep, state[1], idx)

    #: its kernel form (:mod:`._kmin_kernel`): a TPU takes it unasked where it keeps its lists
    #: per lane (on a TPU v5e 7.7x faster than the XLA loop, and per row 1.2x slower)
    pallas = "lanes"

    #: its lanes' form (:class:`._kmin_kernel.KMinLanes`)
    lanes_in_kernel = True
    #: the most rows and columns of a kernel's block: Mosaic writes each vector operation once
    #: per vector register, and the lanes' form makes some 60 per chunk of 128 columns, each
    #: on ``rows / 8`` registers (a step of 128 x 512: some 4,000 operations). On a TPU v5e
    #: the 18 smallest of 10,240 x 60,000 in 784 dimensions compile in 4.5 s at 128 x 512,
    #: 12.8 s at 256 x 512, and run as fast (63 ms)
    kernel_tile = (128, 512)

    def lane_form(self, aval):
        return _kernel_form.KMinLanes(self.k, aval.dtype)

    def reduce_in_kernel(self, v, mask, cols, index):
        return _kernel_form.tile_best(self.k, v, mask, index)

    def combine_in_kernel(self, a, b):
        return _kernel_form.merge(self.k, a, b)

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
        full = ~jnp.isnan(kth) if jnp.issubdtype(v.dtype, jnp.floating) else kth_i != NO_INDEX
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

        def block(start, st):
            keys, idx = st
            at = _block_rows(need, rank, cap, start)
            a = jnp.minimum(at, rows - 1)
            kb, ib = _merge_best(keys[a], idx[a], _tile_best(v[a], mask[a], index, self.k))
            return keys.at[at].set(kb, mode="drop"), idx.at[at].set(ib, mode="drop")

        return _each_block(jnp.sum(need, dtype=jnp.int32), cap, block, (keys, idx))

    def _drain_tile(self, keys, idx, tile, bound, c, colsum):
        """Insert the candidates (:func:`_candidates` of ``bound``) of the rows with ``c``
        ``(G,)`` > 1 of them: over the whole tile in value order while more than 1 /
        ``SPARSE`` of its rows need it (a state's first tiles), then the rest gathered
        :attr:`BLOCK` rows at a time (a few rows, once a few tiles are in; one block of them
        all past :attr:`LOOPED_UP_TO`), in column order where a row has at most ``FEW`` (the
        last one from its column sum ``colsum``)."""
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
        rank = jnp.cumsum(need.astype(jnp.int32)) - 1

        def gathered(cap, start=0):
            def run(keys, idx):
                at = _block_rows(need, rank, cap, start)
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
        cap = min(self.BLOCK, max(sparse, 1))

        def looped(keys, idx):
            return _each_block(n, cap, lambda start, st: gathered(cap, start)(*st), (keys, idx))

        if sparse <= self.LOOPED_UP_TO:
            return looped(keys, idx)
        return lax.cond(n > self.LOOPED_UP_TO, gathered(sparse), looped, keys, idx)

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
