"""Plans: how a streamed fold walks its reduced axis, step by step.

A fold reduces *rows* (the reduced axis, length ``n``) into *slots* (the outputs: segments, or the
rows of ``x`` of a pairwise reduction). Each step sees a tile grid ``(G, T)``: ``G`` slots by ``T``
rows, a mask saying which cells count, and the rows it reads. Three kinds:

* ``"tiles"`` -- contiguous segments (:class:`TilePlan`). Each segment is cut into tiles of ``T``
  rows that belong to it alone; a step gathers ``G`` tiles. A tile reduces densely and only the
  ``G`` tile states are scattered into the slots: no per-row scatter.
* ``"rows"`` -- arbitrary ``segment_ids`` (:class:`RowPlan`): ``C`` consecutive rows as ``C``
  one-row tiles, scattered by id (what ``jax.ops.segment_*`` does, chunked).
* ``"dense"`` -- every row meets every slot (:class:`BlockPlan`): blocks of ``bi`` slots by
  ``bj`` rows, walked ``j``-fastest; the engine carries one block of slot states through the
  ``j`` loop and writes it back once.

Reads use a clamped start (``min(start, n - width)``) and a mask, so nothing is padded or copied.
The static :class:`PlanSpec` is fixed when a reduction is called; the step sizes are chosen when
the fold is lowered, after every transformation, from the memory budget (:func:`make_plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._reductions._base import _take

#: The walk's tile heights are powers of two up to this.
MAX_TILE = 2048
#: Static tilings go up to this height (:mod:`._runs` reads one tile per step).
MAX_RUN_TILE = 8192
#: Rows of y per block of a dense plan (the innermost, vectorised axis).
DENSE_BJ = 64
#: Rows of x per block of a dense plan when a block of ``DENSE_BJ`` would not fit.
SMALL_BI = 8


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What is known when a reduction is called: the kind, the sizes, explicit step sizes.

    ``tilings`` (``"tiles"`` with static segment sizes): ``((T, num_tiles), ...)``, the tile
    heights up to ``MAX_RUN_TILE`` that waste at most ~4% of rows on partial tiles, largest first, with the (exact, or
    on a mesh the largest over devices) number of tiles each gives. ``None`` for traced sizes.
    ``chunk``: explicit rows per step (``int``) or ``(bi, bj)`` (dense); ``None`` = from budget.
    ``row_axis``: the axis of the rows in the ``rows`` arrays: 0, or -1 (dense plans only: a
    pairwise reduction may walk ``y`` transposed). ``in_range`` (``"rows"`` plans): every id is
    known to lie in ``[0, num_slots)`` (static ids, or ids clipped into range), so a program
    that gathers per row needs no mask for the rows dropped; ``sorted_ids`` (``"rows"`` plans):
    the ids are known, or promised by the caller, to be sorted (XLA's scatters are told so).
    ``tile`` (dense plans): the kernel's preferred ``(bi, bj)``, ahead of the monoid's
    ``dense_tile``: :data:`GEMM_TILE` for a kernel that contracts (a matrix product per tile).
    ``grad_tile``: the cotangent folds' ``tile``, where it differs (:meth:`for_cotangents`).
    """

    kind: str
    n: int
    num_slots: int
    tilings: tuple | None = None
    chunk: Any = None
    row_axis: int = 0
    in_range: bool = False
    sorted_ids: bool = False
    tile: tuple | None = None
    grad_tile: tuple | None = None

    def for_cotangents(self) -> PlanSpec:
        """The plan of this fold's cotangent folds: ``tile`` from ``grad_tile`` where it is
        given (a masked matrix product's gradient skips more in smaller tiles at no cost per
        pair, see :mod:`foldax._pairwise._band`)."""
        if self.grad_tile is None:
            return self
        return dataclasses.replace(self, tile=self.grad_tile, grad_tile=None)


#: The dense block of a kernel that is a matrix product per tile (attention, a linear layer's
#: logits), within the budget: 1024 x 1024 pairs ran attention's gradient at 4,096 x 4,096,
#: D = 64, 2.5x faster than 256 x 64, and a vocabulary's log-sum-exp at D = 512 2.7x faster
#: (2 cores; ``GEMM`` routines need both sides long).
GEMM_TILE = (1024, 1024)


def preferred_tile(spec: PlanSpec, monoid):
    """The dense block a fold asks for: the kernel's, else the monoid's where ``y`` is walked
    transposed (:attr:`~foldax._reductions.Monoid.dense_tile`), else ``None``."""
    if spec.tile is not None:
        return spec.tile
    return getattr(monoid, "dense_tile", None) if spec.row_axis == -1 else None


def static_tilings(n, shares) -> tuple:
    """``PlanSpec.tilings`` for static segment sizes ``shares`` (``(S,)`` or one row per device).

    The walk's heights (up to ``MAX_TILE``) waste at most ~4% of the rows; the taller ones, read
    one tile per step by :mod:`._runs`, up to ~12%: the rows a segment's last tile reads past
    its end are the next segment's, read again from cache."""
    shares = np.atleast_2d(np.asarray(shares, np.int64))
    out = []
    for t in (2**k for k in range(int(math.log2(max(1, min(MAX_RUN_TILE, n)))), -1, -1)):
        counts = np.sum(-(-shares // t), axis=1)
        waste = 1.04 if t <= MAX_TILE else 1.12
        if t == 1 or np.all(counts * t <= waste * n + t):
            out.append((t, int(counts.max())))
    return tuple(out)


def static_table(table) -> jax.Array:
    """A plan's static integer table (NumPy ``(S,)``: segment sizes, offsets or ids; values in
    int32) as an int32 array that XLA does not constant-fold.

    The tables enter the fold as arrays, and the fold computes on them (a device's share of the
    segments, cumulative tile counts); on constants, XLA would evaluate that when it compiles,
    element by element: tens of seconds for ~1e6 segments. So a table is built from an iota when
    it is an arithmetic progression (one-row or equal segments, their offsets: no constant at
    all) and is otherwise a constant behind an optimization barrier. What performance needs
    stays static in :class:`PlanSpec` (the tile counts, ``tilings``) or is computed in NumPy
    (:func:`static_ends`).
    """
    table = np.asarray(table)
    d = np.diff(table)
    if table.ndim == 1 and table.size > 2 and np.all(d == d[0]):
        out = int(table[0]) + int(d[0]) * lax.iota(jnp.int32, table.size)
    else:
        out = jnp.asarray(table, jnp.int32)
    return lax.optimization_barrier(out)


def static_ends(sizes, tilings) -> tuple:
    """The cumulative tile counts (``TilePlan.ends``) of static segment ``sizes`` ``(S,)`` for
    every tile height of ``tilings``, as :func:`static_table` s: the extra arrays of a static
    tile plan, so that :func:`make_plan` takes the table of the height it chooses instead of
    summing when the fold runs (XLA:CPU takes ~10 ms for 1e6 segments). A height is a candidate
    only where it wastes under ~4% of the ``n`` rows, so there are few tables where ``S`` is
    large (one for one-row segments: an iota); those not chosen are dead code."""
    sizes = np.asarray(sizes, np.int64)
    return tuple(static_table(np.cumsum(-(-sizes // t))) for t, _ in tilings)


def _traced_tile(n, num_segments, rows) -> int:
    """Tile height for traced sizes: assume segments near the mean size (padding ~ S*T/2)."""
    t = 1
    while t * 2 <= min(MAX_TILE, rows, n) and (t * 2) * num_segments <= 0.08 * n:
        t *= 2
    return t


def make_plan(spec: PlanSpec, arrays, units: int, first=0, tile=None, whole=0):
    """The plan for ``units`` rows (tiles, rows) or pairs (dense) per step.

    ``arrays``: the plan's integer arrays (``(sizes, offsets)``, ``(segment_ids,)`` or ``()``;
    a static tile plan may add :func:`static_ends`: ``(sizes, offsets, *ends)``);
    ``first``: the global index of row 0 (a device's offset on a mesh); ``tile``: the fold's
    preferred dense block (:func:`preferred_tile`) or ``None``;
    ``whole``: a dense plan of blocks of ``whole`` rows by every column (0: by ``units``;
    :func:`._probe.whole_rows`).
    """
    if spec.kind == "tiles":
        rows = spec.chunk or units
        sizes, offsets, *known = arrays  # known: static_ends, one table per tiling
        if spec.tilings is not None:
            k = next((i for i, (t, _) in enumerate(spec.tilings) if t <= min(rows, MAX_TILE)), -1)
            tile, count = spec.tilings[k]
        else:
            tile = _traced_tile(spec.n, spec.num_slots, rows)
            count = spec.n // tile + spec.num_slots
        group = max(1, min(rows // tile, count))
        ends = known[k] if known else jnp.cumsum((sizes + (tile - 1)) // tile).astype(jnp.int32)
        steps = -(-count // group)
        return TilePlan(ends, offsets, sizes, spec.n, spec.num_slots, tile, group, steps, first)
    if spec.kind == "rows":
        chunk = max(1, min(spec.chunk or units, spec.n))
        return RowPlan(arrays[0], spec.n, spec.num_slots, chunk, -(-spec.n // chunk), first)
    if spec.chunk is not None:
        bi, bj = spec.chunk
    else:
        bi, bj = dense_block(units, spec.num_slots, spec.n, tile, whole)
    bi, bj = min(bi, spec.num_slots), min(bj, spec.n)
    return BlockPlan(spec.num_slots, spec.n, bi, bj, first, spec.row_axis)


def dense_block(units, m, n, tile=None, whole=0) -> tuple[int, int]:
    """``(bi, bj)`` for ``units`` pairs: ``bj = 64`` rows of ``y`` (the vectorised axis) and as many
    rows of ``x`` as fit, except that ``bi`` is kept out of ``9 ... 63`` (it becomes 8): XLA:CPU
    fuses a sum over that many rows of ``x`` (a gradient's cotangent of ``y``) into its consumer
    as a slow inner loop, where 8 or fewer rows unroll and 64 or more are summed in vectorised
    windows; measured on S4's Cauchy kernel under ``vmap``, 2.5x slower gradients.

    ``tile``: a reduction's preferred ``(bi, bj)`` (``None``: the above). Its ``bj`` is taken
    when ``units`` allows it, and ``bi`` up to ``units // bj`` and to as many pairs as ``tile``
    has; min / max and their arg-forms ask for ``(8, 1024)``: 8192 values (32 KiB of float32,
    L1-resident) in long vectorised rows, 1.6x faster than ``(256, 64)`` at 20,000 x 20,000.
    """
    if whole:  # blocks of every column (:func:`._probe.whole_rows`)
        return min(whole, m), n
    if tile is not None and units >= min(n, tile[1]):
        bj = min(n, tile[1])
        bi = max(1, min(units // bj, m, max(tile[0], tile[0] * tile[1] // bj)))
    else:
        bj = min(n, DENSE_BJ)
        bi = max(1, min(units // bj, m))
        if bi == m and units >= 2 * m * bj and units > 2**14:
            bj = min(n, units // m)  # (every row: a large step widens; a CPU's stays 64)
    if SMALL_BI < bi < DENSE_BJ and bi < m:
        bi = SMALL_BI
    return bi, bj


@dataclasses.dataclass(frozen=True)
class Step:
    """What one step reads: ``rows`` (the chunk), where its slots are (``slots``), the ``(G, T)``
    ``mask`` of cells that count, where its rows are (``at``) and which of them it owns
    (``own``, ``(R,)``), and the global index of its rows: ``(T,)`` for the columns of a dense
    plan, ``(G, T)`` for every cell of a tile / row plan (``first`` + the device's row)."""

    rows: Any
    slots: Any
    mask: Any
    at: Any
    own: Any
    index: Any


class TilePlan:
    """Contiguous segments as tiles of ``tile`` rows, ``group`` tiles per step.

    Segment ``s`` covers rows ``offsets[s] : offsets[s] + sizes[s]`` and tiles
    ``ends[s] - ceil(sizes[s] / tile) : ends[s]``; a step's tiles are computed from these ``(S,)``
    arrays, so nothing in the loop grows with ``n``.
    """

    row_axis = 0

    def __init__(self, ends, offsets, sizes, n, num_segments, tile, group, steps, first=0):
        self.ends, self.offsets, self.sizes, self.first = ends, offsets, sizes, first
        self.n, self.num_segments, self.tile, self.group, self.steps = (
            n, num_segments, tile, group, steps,
        )  # fmt: skip

    def _schedule(self, i):
        t = i * self.group + jnp.arange(self.group, dtype=jnp.int32)
        seg = jnp.searchsorted(self.ends, t, side="right").astype(jnp.int32)
        segc = jnp.minimum(seg, self.num_segments - 1)
        k = t - (self.ends[segc] - (self.sizes[segc] + (self.tile - 1)) // self.tile)
        valid = seg < self.num_segments
        start = jnp.where(valid, self.offsets[segc] + k * self.tile, 0).astype(jnp.int32)
        ln = jnp.where(valid, jnp.clip(self.sizes[segc] - k * self.tile, 0, self.tile), 0)
        actual = jnp.minimum(start, self.n - self.tile)  # clamp: never read past the end
        r = actual[:, None] + jnp.arange(self.tile, dtype=jnp.int32)[None, :]
        mask = (r >= start[:, None]) & (r < (start + ln)[:, None])
        return actual, jnp.where(valid, seg, self.num_segments), mask

    def load(self, rows, i):
        actual, seg, mask = self._schedule(i)
        t = self.tile

        def gather(a):
            tiles = jax.vmap(lambda s: lax.dynamic_slice_in_dim(a, s, t))(actual)
            return tiles.reshape((self.group * t, *a.shape[1:]))

        index = self.first + actual[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # global
        return Step(jax.tree.map(gather, rows), seg, mask, actual, mask.reshape(-1), index)

    def gather(self, slots, seg):
        return jax.tree.map(lambda a: _take(a, seg), slots)

    def merge(self, monoid, carry, seg, st):
        if monoid is not None:
            return monoid.scatter(carry, seg, st)
        return jax.tree.map(lambda c, s: c.at[seg].add(s, mode="drop"), carry, st)

    def store(self, buf, actual, vals, own):
        t = self.tile
        vals = jnp.where(_rows_mask(own, vals, 0), vals, jnp.zeros((), vals.dtype))
        upd = vals.reshape((self.group, t, *vals.shape[1:]))
        dnums = lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(1, upd.ndim)),
            inserted_window_dims=(),
            scatter_dims_to_operand_dims=(0,),
        )
        return lax.scatter_add(
            buf, actual[:, None], upd, dnums, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS
        )

    def blank(self, shape, dtype, fill):
        """0 on rows in a segment, ``fill`` on rows in none (never written)."""
        r = lax.broadcasted_iota(jnp.int32, shape, 0)
        inside = (r >= self.offsets[0]) & (r < self.offsets[-1] + self.sizes[-1])
        return jnp.where(inside, jnp.zeros((), dtype), jnp.asarray(fill, dtype))


class RowPlan:
    """``n`` rows with their own ``segment_ids``, ``chunk`` consecutive rows per step."""

    row_axis = 0
    tile = 1

    def __init__(self, segment_ids, n, num_segments, chunk, steps, first=0):
        self.segment_ids, self.n, self.num_segments = segment_ids, n, num_segments
        self.first = first
        self.group, self.steps = chunk, steps

    def _start(self, i):
        return jnp.minimum(i * self.group, self.n - self.group)

    def _valid(self, ids):
        return (ids >= 0) & (ids < self.num_segments)

    def load(self, rows, i):
        start = self._start(i)
        rows = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, self.group), rows)
        ids = lax.dynamic_slice_in_dim(self.segment_ids, start, self.group).astype(jnp.int32)
        own = start + jnp.arange(self.group, dtype=jnp.int32) >= i * self.group
        own = own & self._valid(ids)  # rows with dropped ids take no part
        seg = jnp.where(self._valid(ids), ids, self.num_segments)
        index = self.first + start + jnp.arange(self.group, dtype=jnp.int32)[:, None]
        return Step(rows, seg, own[:, None], start, own, index)

    gather = TilePlan.gather
    merge = TilePlan.merge

    def store(self, buf, start, vals, own):
        vals = jnp.where(_rows_mask(own, vals, 0), vals, jnp.zeros((), vals.dtype))
        old = lax.dynamic_slice_in_dim(buf, start, self.group)
        return lax.dynamic_update_slice_in_dim(buf, old + vals, start, axis=0)

    def blank(self, shape, dtype, fill):
        inside = _rows_mask(self._valid(self.segment_ids), jnp.zeros(shape, jnp.bool_), 0)
        return jnp.broadcast_to(
            jnp.where(inside, jnp.zeros((), dtype), jnp.asarray(fill, dtype)), shape
        )


class BlockPlan:
    """Every row meets every slot: blocks of ``bi`` slots by ``bj`` rows, ``j`` fastest.

    The rows are read along ``row_axis`` (0, or -1 when a pairwise reduction walks ``y``
    transposed, see :mod:`foldax._pairwise._tiles`); ``first`` is the global index of row 0 (a device's
    offset).
    """

    def __init__(self, m, n, bi, bj, first=0, row_axis=-1):
        self.m, self.n, self.bi, self.bj, self.first = m, n, bi, bj, first
        self.row_axis = row_axis
        self.steps_i, self.steps_j = -(-m // bi), -(-n // bj)
        self.steps = self.steps_i * self.steps_j
        self.group, self.tile = bi, bj

    @staticmethod
    def _block(t, size, width):
        start = jnp.minimum(t * width, size - width)
        return start, start + jnp.arange(width, dtype=jnp.int32) >= t * width

    #: ``cells(t, size, width)``: block ``t``'s clamped start and which of its ``width`` rows it
    #: owns (the last block overlaps the one before it).
    cells = _block

    def load(self, rows, t):
        si, own_i = self._block(t // self.steps_j, self.m, self.bi)
        sj, own_j = self._block(t % self.steps_j, self.n, self.bj)
        rows = jax.tree.map(lambda a: _slice_input(a, sj, self.bj, self.row_axis % a.ndim), rows)
        index = self.first + sj + jnp.arange(self.bj, dtype=jnp.int32)
        return Step(rows, si, own_i[:, None] & own_j[None, :], sj, own_j, index)

    def gather(self, slots, si):
        """Block ``si`` of the slots' inputs."""
        return jax.tree.map(lambda a: _slice_input(a, si, self.bi, 0), slots)

    def block_of(self, states, si):
        """Block ``si`` of the slots' states (a carry, updated in place by :meth:`put`)."""
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, si, self.bi), states)

    def block_start(self, ti):
        """The first slot of block ``ti`` (the engine carries one block's states at a time)."""
        return self._block(ti, self.m, self.bi)[0]

    def put(self, carry, si, block):
        """Write a block's states back into the slots' carry."""
        return jax.tree.map(lambda c, b: lax.dynamic_update_slice_in_dim(c, b, si, 0), carry, block)

    def store(self, buf, sj, vals, own):
        ax = self.row_axis % buf.ndim
        vals = jnp.where(_rows_mask(own, vals, ax), vals, jnp.zeros((), vals.dtype))
        old = lax.dynamic_slice_in_dim(buf, sj, self.bj, ax)
        return lax.dynamic_update_slice_in_dim(buf, old + vals, sj, ax)

    def blank(self, shape, dtype, fill):
        return jnp.zeros(shape, dtype)


#: jax < 0.11: XLA:CPU has no bfloat16 slice; it slices a float32 copy of the whole array, made
#: before the loop (its bfloat16 normalization widens the operand, then the copy is
#: loop-invariant and hoisted): for a walk over a bfloat16 ``y``, a float32 copy of all of it.
_WIDENS_WHOLE = jax.__version_info__ < (0, 11)


def _slice_input(a, start, size, axis):
    """``size`` entries of a fold's input ``a`` from ``start`` along ``axis``. On jax < 0.11 a
    bfloat16 input passes through one optimization barrier with the (loop-variant) start: no
    longer loop-invariant, its widened copy is not hoisted, and the widening fuses into the
    slice of the tile (only inputs, never a buffer updated in place: a barrier there would copy
    the buffer)."""
    if _WIDENS_WHOLE and a.dtype == jnp.bfloat16:
        start, a = lax.optimization_barrier((start, a))
    return lax.dynamic_slice_in_dim(a, start, size, axis)


def _rows_mask(own, like, axis):
    """Broadcast a per-row mask ``(R,)`` against ``like`` whose rows are on ``axis``."""
    return own.reshape((-1,) + (1,) * (like.ndim - 1 - axis))


__all__ = [
    "BlockPlan",
    "PlanSpec",
    "RowPlan",
    "Step",
    "TilePlan",
    "make_plan",
    "static_ends",
    "static_table",
    "static_tilings",
]
