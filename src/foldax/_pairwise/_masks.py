"""Which pairs take part: a mask ``mask(i, j) -> bool`` over pairs of indices and / or segment
ids of the rows of ``x`` and ``y`` (pairs within one segment), checked, and turned into the
engine's two tests: on a tile's pairs (exact), and on whole blocks (which to visit at all).

The mask is traced once on a pair of int32 indices; the arrays it closes over, and the
segment ids, are the fold's inputs (jit arguments, vmapped arrays: each batch element its own
mask), never constants of its implementation. Blocks are listed without looking at their
pairs where that can be done: from the segment ids' range in each block (``O(M + N)`` work
per block of ``x``) and from the mask's own formula (:mod:`._intervals`: exact for causal,
sliding-window, padding and block-diagonal masks) and, for a boolean array of pairs, from a
table of which cells of :data:`CELL` x :data:`CELL` pairs hold a kept one (made once per call:
``M N / CELL^2`` booleans); only a mask that reads arrays by index (``doc[i] == doc[j]``) and
comes without ``segment_ids`` is evaluated on every pair.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _closure
from .._engine._spec import take_at
from . import _band
from ._intervals import Range, block_test, evaluate


@dataclasses.dataclass(frozen=True, eq=False)
class Masking:
    """The pairs that take part. ``closed``: the user's traced mask (or ``None``), reading
    ``consts[:n_mask]``; ``ids``: whether ``consts`` continue with the segment ids of ``x``
    and of ``y``; ``live`` / ``bounded``: the mask's block test
    (:func:`._intervals.block_test`); ``pairs``: whether ``consts`` continue (after the ids)
    with a boolean ``(M, N)`` array of the pairs kept and its table of live cells
    (:func:`_cell_table`); ``rows``: whether ``consts`` end with a boolean per row of ``x``, the
    rows that take part (:func:`only_rows`); ``band``: static bounds of the pairs kept, which
    choose the tiles (:meth:`gemm_tiles`)."""

    closed: _closure.Closed | None
    consts: tuple
    n_mask: int
    ids: bool
    live: object = None
    bounded: bool = True
    pairs: bool = False
    rows: bool = False
    band: tuple | None = None

    @property
    def _at_pairs(self):
        """Where the array of pairs is in this masking's ``consts``."""
        return self.n_mask + 2 * self.ids

    def pair_mask(self, start):
        """The engine's ``pair_mask(consts, i, j)``, reading this masking's arrays from the
        fold's consts ``[start, start + len(self.consts))``."""

        def pair_mask(consts, i, j, take=take_at):
            own = tuple(consts[start : start + len(self.consts)])
            keep = True
            if self.closed is not None:
                mask = lambda a, b: self.closed(own[: self.n_mask], a, b)  # noqa: E731
                keep = jnp.vectorize(mask)(i, j)
            if self.ids:
                ids_x, ids_y = own[self.n_mask : self.n_mask + 2]
                keep = keep & (take(ids_x, i) == take(ids_y, j))
            if self.pairs:
                keep = keep & _pairs_at(own[self._at_pairs], i, j)
            if self.rows:
                keep = keep & take(own[-1], i)
            return keep

        return pair_mask

    def keyed(self, start):
        """The engine's ``keyed`` (:class:`foldax._engine.Spec`): the segment ids of ``x`` and
        of ``y``, and the rows of ``x`` that take part, read at each pair's own indices."""
        ids = ((start + self.n_mask, 0), (start + self.n_mask + 1, 1)) if self.ids else ()
        rows = ((start + len(self.consts) - 1, 0),) if self.rows else ()
        return (*ids, *rows)

    def block_live(self, start):
        """The engine's ``block_live(consts, i0, j0, bi, bj)``, or ``None`` where only the pairs
        themselves can tell (a mask the analysis cannot bound, and no segment ids)."""
        if not self.ids and not self.rows and not self.pairs and not self.bounded:
            return None

        def block_live(consts, i0, j0, bi, bj):
            own = tuple(consts[start : start + len(self.consts)])
            live = jnp.ones(j0.shape, jnp.bool_)
            if self.closed is not None:
                live = self.live(own[: self.n_mask], i0, i0 + bi - 1, j0, j0 + bj - 1)
            if self.ids:
                ids = own[self.n_mask : self.n_mask + 2]
                live = live & _ids_overlap(*ids, i0, j0, bi, bj)
            if self.pairs:
                live = live & _cells_live(own[self._at_pairs + 1], i0, j0, bi, bj)
            if self.rows:
                live = live & jnp.any(jax.lax.dynamic_slice_in_dim(own[-1], i0, bi))
            return live

        return block_live

    def gemm_tiles(self, m, n):
        """``(forward, gradient)``: the tiles a contracting kernel takes under this masking in
        its forward fold and in its gradient's (:func:`._band.gemm_tile`), from its ``band``,
        else from a mask formula of the indices alone; ``None`` for the forward: the default.
        The gradient takes :data:`._band.MASKED_GRADIENT_TILE` where nothing tells."""
        plain = not (self.consts or self.ids or self.pairs or self.rows)
        closed = self.closed if plain and self.bounded else None
        forward = _band.gemm_tile(m, n, self.band, closed)
        gradient = _band.gemm_tile(m, n, self.band, closed, _band.GRADIENT_COST)
        return forward, gradient or _band.MASKED_GRADIENT_TILE


def only_rows(masking, rows):
    """``masking`` (or every pair, for ``None``) restricted to the rows of ``x`` where ``rows``
    (bool ``(M,)``) holds: a block of rows with none of them is skipped."""
    if masking is None:
        return Masking(None, (rows,), 0, False, rows=True)
    if masking.rows:
        keep = masking.consts[-1] & rows
        return dataclasses.replace(masking, consts=(*masking.consts[:-1], keep))
    return dataclasses.replace(masking, consts=(*masking.consts, rows), rows=True)


def _ids_overlap(ids_x, ids_y, i0, j0, bi, bj):
    """Whether the range of segment ids in the block of ``x`` at ``i0`` meets the range of
    each block of ``y`` at ``j0`` (sorted ids: exactly when they share an id; unsorted ids
    are still correct, with fewer blocks skipped)."""
    own_x = jax.lax.dynamic_slice_in_dim(ids_x, i0, bi)
    rows = j0[:, None] + jnp.arange(bj, dtype=jnp.int32)[None, :]
    own_y = ids_y[rows]  # (blocks, bj): one gather of N ids
    lo_y, hi_y = own_y.min(axis=1), own_y.max(axis=1)
    return (own_x.min() <= hi_y) & (lo_y <= own_x.max())


#: The side of a cell of a boolean array of pairs whose liveness is tabled: it divides every
#: tile the planner picks, so that a block's cells are exactly its own.
CELL = 128


def _pairs_at(pairs, i, j):
    """The kept pairs of a tile: rows ``i`` ``(bi, 1)`` by columns ``j`` ``(1, bj)``, each a
    run of consecutive indices (the engine's tiles, see ``pair_mask`` in
    :class:`._engine._spec.Spec`), read as ``bi`` slices of ``bj`` columns: one gather of rows,
    made once per tile. (A gather of each pair costs several times the tile's arithmetic; a
    dynamic slice, XLA:CPU fuses into each of the tile's consumers, where it doubled the time
    of a causal mask's attention at 4,096^2.) Rows past the array are padding the engine
    masks; a tile wider than the array gathers each pair."""
    (n,), bi, bj = pairs.shape[1:], i.shape[0], j.shape[-1]
    if i.shape == (bi, 1) and j.shape == (1, bj) and bj <= n:
        starts = jnp.stack([i[:, 0], jnp.broadcast_to(j[0, 0], (bi,))], axis=1)
        dims = jax.lax.GatherDimensionNumbers(
            offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1)
        )
        return jax.lax.gather(pairs, starts, dims, (1, bj), mode="clip")
    return pairs[i, j]


def _cell_table(pairs):
    """``(ceil(M / CELL), ceil(N / CELL))`` booleans: whether each cell of ``CELL`` x ``CELL``
    pairs keeps one (an OR-reduce of the array read once, no copy). A mask known when the call
    is compiled is still read at run time: XLA would fold this reduce of a constant one pair at
    a time, for seconds."""
    m, n = pairs.shape
    pairs = jax.lax.optimization_barrier(pairs)
    if m % CELL == 0 and n % CELL == 0:
        return _cell_table_by_words(pairs)
    pad = [(0, -m % CELL), (0, -n % CELL)]
    return jax.lax.reduce_window(pairs, False, jax.lax.bitwise_or, (CELL, CELL), (CELL, CELL), pad)


def _cell_table_by_words(pairs):
    """:func:`_cell_table` of an array of whole cells, read as 32-bit words of 4 booleans: the
    largest word of each row of a cell, then of its rows (half the time of a window reduce of
    the booleans on XLA:CPU: 0.76 against 1.5 ms at 4,096^2)."""
    m, n = pairs.shape
    bytes_ = pairs.astype(jnp.uint8).reshape(m, n // 4, 4)
    words = jax.lax.bitcast_convert_type(bytes_, jnp.uint32)
    per_row = jnp.max(words.reshape(m, n // CELL, CELL // 4), axis=2)
    return jnp.max(per_row.reshape(m // CELL, CELL, n // CELL), axis=1) != 0


def _cells_live(table, i0, j0, bi, bj):
    """Whether the block of pairs at rows ``[i0, i0 + bi)`` and each block of columns at
    ``[j0, j0 + bj)`` (``j0`` an array of starts) meets a cell with a kept pair: exact where
    the blocks start on cells, else the cells they overlap."""
    rows, valid_rows = _cells(table.shape[0], i0, bi)
    own = jnp.any(table[rows] & valid_rows[:, None], axis=0)  # (cells of y,)
    cols, valid = jax.vmap(lambda j: _cells(table.shape[1], j, bj))(j0)
    return jnp.any(own[cols] & valid, axis=1)


def _cells(count, start, size):
    """The cells a run of ``size`` indices from ``start`` overlaps: ``(cells, valid)`` of a
    static length (the most it can overlap), the extra ones past the run marked invalid."""
    first, last = start // CELL, (start + size - 1) // CELL
    span = jnp.arange(-(-size // CELL) + 1, dtype=jnp.int32)
    return jnp.minimum(first + span, count - 1), span <= last - first


def check_masking(name, mask, segment_ids, m, n, on_mesh, pairs=None, band=None):
    """``Masking`` for the public function ``name`` (``None`` when every pair takes part);
    ``pairs``: a boolean ``(M, N)`` array of the pairs kept, besides ``mask``; ``band``:
    static ``(left, right)`` bounds (or ``None`` each) of the pairs ``mask`` keeps,
    ``i - left <= j <= i + right`` (see :meth:`Masking.gemm_tiles`)."""
    if mask is None and segment_ids is None and pairs is None:
        return None
    if on_mesh:
        raise ValueError(
            f"{name}: mask and segment_ids are not supported with sharded x / y or axis_name "
            f"yet; call it on one device, or fold the mask into the kernel (a -inf logit, a 0 "
            f"weight)."
        )
    closed, consts, live, bounded = None, [], None, True
    if mask is not None:
        closed, consts = _check_mask(name, mask)
        if always_true(closed, m, n):  # it removes nothing: left out (it reads no array)
            closed = None
            if segment_ids is None and pairs is None:
                return None
        else:
            live, bounded = block_test(closed)
    ids = _check_segment_ids(name, segment_ids, m, n)
    table = () if pairs is None else (pairs, _cell_table(pairs))
    held = (*consts, *ids, *table)
    return Masking(closed, held, len(consts), bool(ids), live, bounded, bool(table), band=band)


def always_true(closed, m, n) -> bool:
    """Whether a mask of the indices alone (it reads no array) keeps every pair of ``m`` rows
    of ``x`` by ``n`` of ``y``: bounded over the whole ranges of ``i`` and ``j``
    (:mod:`._intervals`), its formula cannot be false (``i >= 0``; ``j < n`` with that ``n``).
    Such a mask is left out."""
    jaxpr = closed.jaxpr
    if jaxpr.constvars or not m or not n:
        return False
    with jax.ensure_compile_time_eval():
        rows, cols = (Range(jnp.int32(0), jnp.int32(size - 1)) for size in (m, n))
        return not bool(evaluate(jaxpr, [], [rows, cols])[0].false)


def _check_mask(name, mask):
    """``mask`` traced on one pair of int32 indices: ``(Closed, consts)``."""
    if not callable(mask):
        raise TypeError(f"{name}: mask must be a callable mask(i, j) -> bool, got {mask!r:.60}.")
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


def _check_segment_ids(name, segment_ids, m, n):
    """``(ids_x, ids_y)`` as integer arrays of shapes ``(M,)`` and ``(N,)`` of one dtype, or
    ``()``. Only which ids are equal (and their order, for skipping blocks) matters: ids keep
    their width, and host ids too wide for the integers JAX holds are relabelled in order."""
    if segment_ids is None:
        return ()
    pair = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids, segment_ids)
    if len(pair) != 2:
        raise ValueError(
            f"{name}: segment_ids must be one array (the same ids for x and y) or a pair "
            f"(ids of the rows of x, ids of the rows of y), got {len(pair)} values."
        )
    out = []
    for which, ids, rows in (("x", pair[0], m), ("y", pair[1], n)):
        if not isinstance(ids, jax.Array | np.ndarray):
            ids = np.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer) or np.shape(ids) != (rows,):
            raise ValueError(
                f"{name}: segment_ids for the rows of {which} must be integers of shape "
                f"({rows},), got {ids.dtype} of shape {np.shape(ids)}."
            )
        out.append(ids)
    return _common_ids(name, *out)


def _common_ids(name, ids_x, ids_y):
    """Both id arrays in one integer dtype that holds every id exactly."""
    common = np.promote_types(ids_x.dtype, ids_y.dtype)  # (int64 with uint64: no integer)
    held = jax.dtypes.canonicalize_dtype(common if common.kind in "iu" else np.int64)
    if all(_holds(a, held) for a in (ids_x, ids_y)):
        return jnp.asarray(ids_x, held), jnp.asarray(ids_y, held)
    if all(isinstance(a, np.ndarray) for a in (ids_x, ids_y)):
        # host ids wider than JAX's integers (64-bit without jax_enable_x64): relabel, in order
        _, labels = np.unique(np.concatenate([ids_x, ids_y]), return_inverse=True)
        labels = labels.reshape(-1).astype(np.int32)
        return jnp.asarray(labels[: len(ids_x)]), jnp.asarray(labels[len(ids_x) :])
    raise ValueError(
        f"{name}: segment_ids of x ({ids_x.dtype}) and of y ({ids_y.dtype}) have no common "
        f"integer type that JAX holds exactly (without jax_enable_x64); pass both with one dtype."
    )


def _holds(ids, dtype):
    """Whether every id converts to ``dtype`` exactly (host ids by value, JAX's by type)."""
    if isinstance(ids, np.ndarray):
        info = np.iinfo(dtype)
        return not ids.size or (info.min <= ids.min() and ids.max() <= info.max)
    return np.can_cast(ids.dtype, dtype, "safe")
