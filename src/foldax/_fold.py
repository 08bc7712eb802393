"""The streaming fold engine: map-reduce over the leading axis, one chunk at a time.

Every public reduction of foldax is a call to :func:`fold` (reduce rows into per-segment monoid
states) or :func:`map_rows` (one output per row, e.g. a segment softmax). Both walk the rows with a
:class:`Plan` inside ``lax.scan`` so that XLA never sees more than one chunk of the mapped values
at a time, and both carry a custom VJP whose backward pass is itself a streamed ``lax.scan`` that
*recomputes* each chunk: nothing per row is saved between the forward and the backward pass.

Plans
-----
A plan says how the rows are walked. It is a pytree: its integer arrays (which may be traced) are
children, its sizes are static.

* :class:`TilePlan` -- contiguous segments. Each segment is cut into tiles of ``T`` rows that
  belong to that segment only (the last tile of a segment is partial and masked), and each step
  gathers ``G`` tiles. A tile's rows reduce densely (a vectorised max / exp / sum), and only the
  ``G`` tile states are scattered into the per-segment carry: no per-row scatter.
* :class:`RowPlan` -- arbitrary (unsorted) ``segment_ids``. Each step takes ``C`` consecutive rows
  as ``C`` tiles of one row each and scatters them by id, like ``jax.ops.segment_*``.

Both plans read a chunk with a clamped start (``min(start, N - width)``) and a mask, so ``N`` need
not be a multiple of anything and the data is never padded or copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _shard
from ._monoid import _take

# ----------------------------------------------------------------------------------------------
# Plans


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["segment_ids"],
    meta_fields=["n", "num_segments", "chunk", "steps"],
)
@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Walk ``n`` rows in steps of ``chunk`` consecutive rows, each with its own segment id."""

    segment_ids: Any  # (n,) int
    n: int
    num_segments: int
    chunk: int
    steps: int

    @property
    def group(self) -> int:
        return self.chunk

    @property
    def tile(self) -> int:
        return 1

    def xs(self):
        return jnp.arange(self.steps, dtype=jnp.int32)

    def _start(self, i):
        return jnp.minimum(i * self.chunk, self.n - self.chunk)

    def load(self, data, i):
        """Rows ``(C, ...)``, their segment ids ``(C,)`` (``num_segments`` = drop) and mask ``(C, 1)``."""
        start = self._start(i)
        rows = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, self.chunk), data)
        ids = lax.dynamic_slice_in_dim(self.segment_ids, start, self.chunk).astype(jnp.int32)
        own = start + jnp.arange(self.chunk, dtype=jnp.int32) >= i * self.chunk
        seg = jnp.where((ids >= 0) & (ids < self.num_segments), ids, self.num_segments)
        return rows, seg, own[:, None]

    def blank(self, shape, dtype, fill):
        """A zero buffer for per-row results (every row is visited, so ``fill`` is unused)."""
        return jnp.zeros(shape, dtype)

    def store_add(self, buf, i, vals):
        """Add ``vals`` (``(C, ...)``, zero where not owned) into rows of ``buf`` read by step ``i``."""
        start = self._start(i)
        old = lax.dynamic_slice_in_dim(buf, start, self.chunk)
        return lax.dynamic_update_slice_in_dim(buf, old + vals, start, axis=0)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ends", "offsets", "sizes"],
    meta_fields=["n", "num_segments", "tile", "group", "steps"],
)
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Walk contiguous segments as tiles of ``tile`` rows, ``group`` tiles per step.

    Segment ``s`` covers rows ``offsets[s] : offsets[s] + sizes[s]`` and tiles
    ``ends[s] - ceil(sizes[s] / tile) : ends[s]``. The tiles of a step are computed inside the
    step from these ``(S,)`` arrays, so nothing in the loop grows with ``N``.
    """

    ends: Any
    offsets: Any
    sizes: Any
    n: int
    num_segments: int
    tile: int
    group: int
    steps: int

    def xs(self):
        return jnp.arange(self.steps, dtype=jnp.int32)

    def _schedule(self, i):
        t = i * self.group + jnp.arange(self.group, dtype=jnp.int32)
        return tile_schedule(
            jnp, self.ends, self.offsets, self.sizes, self.num_segments, self.tile, t
        )

    def _rows(self, start, ln):
        actual = jnp.minimum(start, self.n - self.tile)  # clamp: never read past the end
        r = actual[:, None] + jnp.arange(self.tile, dtype=jnp.int32)
        mask = (r >= start[:, None]) & (r < (start + ln)[:, None])
        return actual, mask

    def load(self, data, i):
        """Rows ``(G*T, ...)``, tile segments ``(G,)`` (``num_segments`` = padding), mask ``(G, T)``."""
        start, seg, ln = self._schedule(i)
        actual, mask = self._rows(start, ln)
        t = self.tile

        def gather(a):
            tiles = jax.vmap(lambda s: lax.dynamic_slice_in_dim(a, s, t))(actual)
            return tiles.reshape((self.group * t, *a.shape[1:]))

        return jax.tree.map(gather, data), seg, mask

    def blank(self, shape, dtype, fill):
        """A buffer for per-row results: 0 on rows in a segment, ``fill`` on rows in none.

        Rows outside all segments (dropped ids before the first / after the last segment of
        sorted ``segment_ids``) are in no tile and never written.
        """
        r = lax.broadcasted_iota(jnp.int32, shape, 0)
        inside = (r >= self.offsets[0]) & (r < self.offsets[-1] + self.sizes[-1])
        return jnp.where(inside, jnp.zeros((), dtype), jnp.asarray(fill, dtype))

    def store_add(self, buf, i, vals):
        start, _, ln = self._schedule(i)
        actual, _ = self._rows(start, ln)
        t = self.tile
        upd = vals.reshape((self.group, t, *vals.shape[1:]))
        dnums = lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(1, upd.ndim)),
            inserted_window_dims=(),
            scatter_dims_to_operand_dims=(0,),
        )
        return lax.scatter_add(
            buf, actual[:, None], upd, dnums, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS
        )


def tile_schedule(xp, ends, offsets, sizes, num_segments, tile, t):
    """Tiles ``t`` of contiguous segments: ``(start, segment, valid rows)`` per tile.

    ``xp`` is ``numpy`` or ``jax.numpy``. Tiles past the last one get segment ``num_segments``.
    """
    seg = xp.searchsorted(ends, t, side="right")
    segc = xp.minimum(seg, num_segments - 1)
    k = t - (ends[segc] - (sizes[segc] + (tile - 1)) // tile)
    valid = seg < num_segments
    i32 = xp.int32
    return (
        xp.where(valid, offsets[segc] + k * tile, 0).astype(i32),
        xp.where(valid, seg, num_segments).astype(i32),
        xp.where(valid, xp.clip(sizes[segc] - k * tile, 0, tile), 0).astype(i32),
    )


MAX_TILE = 2048


def choose_tile(n, sizes_static, num_segments, chunk):
    """The tile height: the largest power of two wasting at most ~4% of rows to tile padding."""
    cap = max(1, min(MAX_TILE, chunk, n))
    if sizes_static is not None:
        for t in (2**k for k in range(int(math.log2(cap)), -1, -1)):
            padded = int(np.sum(-(-sizes_static // t))) * t
            if padded <= 1.04 * n + t:
                return t
        return 1
    # Traced sizes: assume segments near the mean size; padding ~ S*T/2.
    t = 1
    while t * 2 <= cap and (t * 2) * num_segments <= 0.08 * n:
        t *= 2
    return t


def tile_layout(n, sizes_static, num_segments, chunk, tile=None, num_tiles=None):
    """``(tile, group, steps)`` of a :class:`TilePlan` over ``n`` rows.

    ``sizes_static`` (NumPy) gives the exact tile count; without it (traced sizes) the count is
    bounded by ``N/T + S``. ``tile`` and ``num_tiles`` (an upper bound) may be given instead, for
    traced sizes whose possible values are known (a device's share of static segments).
    """
    if tile is None:
        tile = choose_tile(n, sizes_static, num_segments, chunk)
    if num_tiles is None:
        if sizes_static is not None:
            num_tiles = int(np.sum(-(-np.asarray(sizes_static) // tile)))
        else:
            num_tiles = n // tile + num_segments
    group = max(1, min(chunk // tile, num_tiles))
    return tile, group, max(1, -(-num_tiles // group))


def make_tile_plan(n, sizes, offsets, num_segments, chunk, tile=None, num_tiles=None, ends=None):
    """A :class:`TilePlan` from contiguous ``sizes``/``offsets`` (NumPy = static, else traced);
    ``tile`` / ``num_tiles`` as in :func:`tile_layout`; ``ends`` (the cumulative tile counts) may
    be given when known."""
    static = isinstance(sizes, np.ndarray)
    tile, group, steps = tile_layout(
        n, sizes if static else None, num_segments, chunk, tile, num_tiles
    )
    xp = np if static else jnp
    if ends is None:
        ends = xp.cumsum((sizes + (tile - 1)) // tile)
    arrs = [jnp.asarray(a, jnp.int32) for a in (ends, offsets, sizes)]
    return TilePlan(*arrs, n=n, num_segments=num_segments, tile=tile, group=group, steps=steps)


def row_chunk(n, chunk):
    """Rows per step of a :class:`RowPlan` over ``n`` rows."""
    return max(1, min(chunk, n))


def make_row_plan(n, segment_ids, num_segments, chunk):
    chunk = row_chunk(n, chunk)
    return RowPlan(
        segment_ids=segment_ids,
        n=n,
        num_segments=num_segments,
        chunk=chunk,
        steps=-(-n // chunk),
    )


# ----------------------------------------------------------------------------------------------
# Differentiable parts of pytrees


def _is_diff(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _split(tree, flags):
    """Split the leaves of ``tree`` into (differentiable, rest) by boolean ``flags`` per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    diff = [x if f else None for x, f in zip(leaves, flags, strict=True)]
    rest = [None if f else x for x, f in zip(leaves, flags, strict=True)]
    return diff, rest, treedef


def _merge(diff, rest, treedef):
    return jax.tree.unflatten(
        treedef, [d if r is None else r for d, r in zip(diff, rest, strict=True)]
    )


def _unwrap(tree):
    """Values and per-leaf ``perturbed`` flags of a ``symbolic_zeros`` custom-VJP primal."""
    leaves, treedef = jax.tree.flatten(tree)
    vals = [getattr(x, "value", x) for x in leaves]
    flags = [
        bool(getattr(x, "perturbed", True)) and _is_diff(v)
        for x, v in zip(leaves, vals, strict=True)
    ]
    return jax.tree.unflatten(treedef, vals), flags


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["value"])
@dataclasses.dataclass(frozen=True)
class _Static:
    """Carries hashable Python values (the perturbed flags) through custom-VJP residuals."""

    value: Any


# ----------------------------------------------------------------------------------------------
# The engine


def _convert(fn, data, plan, axes=()):
    """Closure-convert ``fn`` for one chunk of rows: ``(body, consts)`` with ``body(consts, rows)``.

    Arrays that ``fn`` closes over (model parameters, batch tracers of an outer ``vmap``) become
    explicit ``consts`` so that the custom VJP can differentiate with respect to them. On a mesh
    the example rows are typed as varying along ``axes`` (as the rows ``fn`` will see are), so
    that the traced ``fn`` casts its constants to match and can be replayed inside ``shard_map``.
    """
    rows = plan.group * plan.tile
    if fn is None:
        return (lambda consts, r: r), ()
    example = jax.tree.map(lambda a: _shard.example(a, (rows, *jnp.shape(a)[1:]), axes), data)
    conv, consts = jax.closure_convert(fn, example)
    return (lambda consts, r: conv(r, *consts)), tuple(consts)


def _tiles(v, plan):
    """``(G*T, *F)`` -> ``(G, T, *F)``."""
    return v.reshape((plan.group, plan.tile, *v.shape[1:]))


def _per_row(seg, plan):
    """Tile segment ids ``(G,)`` -> row segment ids ``(G*T,)``."""
    return jnp.repeat(seg, plan.tile, total_repeat_length=plan.group * plan.tile)


def _streamed_vjp(plan, body, consts, data, flags_c, flags_d, row_ct, axes=()):
    """The shared backward pass: recompute every chunk and pull back its row cotangents.

    ``row_ct(x, v, seg, mask)`` returns the cotangent ``(G*T, *F)`` of the chunk's values ``v``
    (zero where ``mask`` is false). Returns cotangents for ``consts`` and ``data`` with ``None``
    for leaves that were not perturbed. On a mesh (``axes``) see :mod:`foldax._shard` for how
    the cotangents of replicated inputs are summed over the devices.
    """
    dc, rc, tc = _split(consts, flags_c)
    dd, _, td = _split(data, flags_d)
    want_c = [x for x in dc if x is not None]
    want_d = [x for x in dd if x is not None]

    def step(carry, x):
        acc_c, bufs = carry
        rows, seg, mask = plan.load(data, x)
        rows_d, rows_r, _ = _split(rows, flags_d)

        def f(cs, ds):
            it_c, it_d = iter(cs), iter(ds)
            full_c = _merge([next(it_c) if d is not None else None for d in dc], rc, tc)
            full_d = _merge([next(it_d) if d is not None else None for d in rows_d], rows_r, td)
            return body(full_c, full_d, _per_row(seg, plan))

        v, pull = jax.vjp(f, want_c, [r for r in rows_d if r is not None])
        ct = _shard.to_varying(row_ct(x, v, seg, mask), axes)  # typed like v
        g_c, g_d = pull(ct)
        acc_c = [a + g for a, g in zip(acc_c, g_c, strict=True)]
        row_mask = mask.reshape(-1)
        bufs = [
            plan.store_add(b, x, jnp.where(row_mask.reshape((-1,) + (1,) * (g.ndim - 1)), g, 0))
            for b, g in zip(bufs, g_d, strict=True)
        ]
        return (acc_c, _shard.to_varying(bufs, axes)), None

    # A cotangent has its primal's type: the consts' are complete on every device where the
    # consts are replicated (the traced fn casts them to varying; JAX transposes that cast into
    # a psum), so only the row buffers are varying.
    init = ([jnp.zeros_like(c) for c in want_c], [jnp.zeros_like(d) for d in want_d])
    (acc_c, bufs), _ = lax.scan(step, (init[0], _shard.to_varying(init[1], axes)), plan.xs())
    bufs = [_shard.reduce_cotangent(b, d, axes) for b, d in zip(bufs, want_d, strict=True)]
    it_c, it_d = iter(acc_c), iter(bufs)
    ct_c = jax.tree.unflatten(tc, [next(it_c) if d is not None else None for d in dc])
    ct_d = jax.tree.unflatten(td, [next(it_d) if d is not None else None for d in dd])
    return ct_c, ct_d


def _fold_states(monoid, body, consts, data, plan, fshape, dtype, axes=()):
    """The forward fold: ``monoid`` states ``(num_segments, *fshape)`` of ``body`` over the plan.

    On a mesh (``axes``: the rows are split over these axes), each device folds its rows and the
    partial states are combined across devices with ``monoid.allreduce``.
    """

    def step(carry, x):
        v, seg, mask = _values(plan, body, consts, data, x)
        new = monoid.scatter(carry, seg, monoid.reduce(_tiles(v, plan), mask))
        return _shard.to_varying(new, axes), None

    init = _shard.to_varying(monoid.init(plan.num_segments, fshape, dtype), axes)
    state, _ = lax.scan(step, init, plan.xs())
    return monoid.allreduce(state, axes) if axes else state


def _values(plan, body, consts, data, x):
    rows, seg, mask = plan.load(data, x)
    return body(consts, rows, _per_row(seg, plan)), seg, mask


def fold(monoid, fn, data, plan, axes=()):
    """Reduce ``fn(rows)`` (or the rows themselves) into ``plan.num_segments`` monoid results.

    Returns ``monoid.finalize(state)`` of shape ``(num_segments, *F)``. Custom VJP: the residuals
    are the inputs and ``monoid.grad_info`` per segment; the backward pass is a second streamed
    fold that recomputes ``fn`` chunk by chunk. Inside ``shard_map`` with the rows split over
    mesh ``axes``, ``plan`` walks this device's rows and the states are all-reduced.
    """
    inner, consts = _convert(fn, data, plan, axes)

    def body(c, r, segr):
        return inner(c, r)

    v_aval = jax.eval_shape(lambda c, d: _values(plan, body, c, d, _first_x(plan))[0], consts, data)
    fshape = v_aval.shape[1:]

    def forward(consts, data, plan):
        return _fold_states(monoid, body, consts, data, plan, fshape, v_aval.dtype, axes)

    def finalize(state):
        return _as_values_dtype(monoid.finalize(state), v_aval.dtype)

    @jax.custom_vjp
    def run(consts, data, plan):
        return finalize(forward(consts, data, plan))

    def run_fwd(consts, data, plan):
        consts, flags_c = _unwrap(consts)
        data, flags_d = _unwrap(data)
        plan, _ = _unwrap(plan)
        state = forward(consts, data, plan)
        res = (
            consts,
            data,
            plan,
            monoid.grad_info(state),
            _Static((tuple(flags_c), tuple(flags_d))),
        )
        return finalize(state), res

    def run_bwd(res, g):
        consts, data, plan, info, flags = res
        flags_c, flags_d = flags.value
        if isinstance(g, SymbolicZero) or not (any(flags_c) or any(flags_d)):
            return (_nones(consts), _nones(data), _nones(plan))
        g = _shard.replicated_cotangent(jnp.asarray(g), axes)

        def row_ct(x, v, seg, mask):
            mask = mask & (seg < plan.num_segments)[:, None]  # dropped rows get no gradient
            info_t = tuple(_take(a, seg) for a in info)
            ct = monoid.row_cotangent(_tiles(v, plan), mask, info_t, _take(g, seg))
            return ct.reshape(v.shape)

        ct_c, ct_d = _streamed_vjp(plan, body, consts, data, flags_c, flags_d, row_ct, axes)
        return (ct_c, ct_d, _nones(plan))

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run(consts, data, plan)


def _rows_of(a, seg, plan):
    """Per-slot values ``a`` ``(S, *F)`` read for every row of a step: ``(G*T, *F)``."""
    t = _take(a, seg)
    full = (plan.group, plan.tile, *t.shape[1:])
    return jnp.broadcast_to(t[:, None], full).reshape((plan.group * plan.tile, *t.shape[1:]))


def _row_mask(mask, v):
    return mask.reshape((-1,) + (1,) * (v.ndim - 1))


def normalize(fn, data, plan, log, axes=()):
    """Per-row ``fn(rows) - logsumexp_segment`` (``log``) or its ``exp`` (a segment softmax).

    Forward: a log-sum-exp fold, then a streamed pass writing the ``(N, *F)`` result; rows in no
    segment get NaN. Custom VJP: the residuals are the inputs and the ``(S, *F)`` log-sum-exps;
    the backward pass folds the per-segment sum of ``g`` (log-softmax) or ``g * y`` (softmax),
    then pulls the row cotangents ``g - y * sum`` / ``y * (g - sum)`` back through a recomputed
    ``fn``, chunk by chunk. Only one ``(N, ...)`` buffer per differentiated input is written.
    On a mesh (``axes``) the two per-segment folds are all-reduced; the rows stay local.
    """
    from ._monoid import LOGSUMEXP, SUM

    inner, consts = _convert(fn, data, plan, axes)
    num = plan.num_segments

    def body(c, r, segr):
        return inner(c, r)

    v_aval = jax.eval_shape(lambda c, d: _values(plan, body, c, d, _first_x(plan))[0], consts, data)

    def reduce(monoid, body, consts, data, plan, fshape, dtype):
        return monoid.finalize(_fold_states(monoid, body, consts, data, plan, fshape, dtype, axes))

    def probs(v, lse_r, segr, take_log):
        z = v - lse_r
        z = z if take_log else jnp.exp(z)
        bad = _row_mask(segr >= num, z)
        return jnp.where(bad, jnp.asarray(np.nan, z.dtype), z)

    def forward(consts, data, plan):
        lse = reduce(LOGSUMEXP, body, consts, data, plan, v_aval.shape[1:], v_aval.dtype)

        def step(buf, x):
            v, seg, mask = _values(plan, body, consts, data, x)
            out = probs(v, _rows_of(lse, seg, plan), _per_row(seg, plan), log)
            buf = plan.store_add(buf, x, jnp.where(_row_mask(mask.reshape(-1), out), out, 0))
            return _shard.to_varying(buf, axes), None

        init = plan.blank((plan.n, *v_aval.shape[1:]), v_aval.dtype, np.nan)
        buf, _ = lax.scan(step, _shard.to_varying(init, axes), plan.xs())
        return buf, lse

    @jax.custom_vjp
    def run(consts, data, plan):
        return forward(consts, data, plan)[0]

    def run_fwd(consts, data, plan):
        consts, flags_c = _unwrap(consts)
        data, flags_d = _unwrap(data)
        plan, _ = _unwrap(plan)
        out, lse = forward(consts, data, plan)
        return out, (consts, data, plan, lse, _Static((tuple(flags_c), tuple(flags_d))))

    def run_bwd(res, g):
        consts, data, plan, lse, flags = res
        flags_c, flags_d = flags.value
        if isinstance(g, SymbolicZero) or not (any(flags_c) or any(flags_d)):
            return (_nones(consts), _nones(data), _nones(plan))
        g = jnp.asarray(g)

        def weighted(c, r_and_g, segr):
            r, gr = r_and_g
            if log:
                return gr
            v = body(c[0], r, segr)
            y = probs(v, c[1][jnp.minimum(segr, num - 1)], segr, False)
            return gr * jnp.where(jnp.isnan(y), jnp.zeros((), y.dtype), y)

        tot = reduce(SUM, weighted, (consts, lse), (data, g), plan, v_aval.shape[1:], g.dtype)

        def row_ct(x, v, seg, mask):
            (gr,), _, _ = plan.load((g,), x)
            segr = _per_row(seg, plan)
            y = probs(v, _rows_of(lse, seg, plan), segr, False)
            ok = _row_mask(mask.reshape(-1), v) & ~jnp.isnan(y)
            t = _rows_of(tot, seg, plan)
            ct = gr - y * t if log else y * (gr - t)
            return jnp.where(ok, ct, jnp.zeros((), ct.dtype))

        ct_c, ct_d = _streamed_vjp(plan, body, consts, data, flags_c, flags_d, row_ct, axes)
        return (ct_c, ct_d, _nones(plan))

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run(consts, data, plan)


def _as_values_dtype(out, dtype):
    """A floating result in the values' dtype (monoids may accumulate in a wider one)."""
    if jnp.issubdtype(out.dtype, jnp.floating) and out.dtype != dtype:
        return out.astype(dtype)
    return out


def _first_x(plan):
    return jax.tree.map(lambda a: a[0], plan.xs())


def _nones(tree):
    return jax.tree.map(lambda _: None, tree)


__all__ = ["RowPlan", "TilePlan", "fold", "make_row_plan", "make_tile_plan", "normalize"]
