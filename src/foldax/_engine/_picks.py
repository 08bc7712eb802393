"""Tangents of the reductions that pick values (max, min, their arg-forms, the ``k`` smallest)
at the pairs they pick, for dense folds.

The derivative of ``max_j v_ij`` is ``dv`` at the pair that attains it. A differentiated fold
of such a monoid keeps the indices (``Monoid.for_derivatives``), so its tangent is the body's
``jax.jvp`` at those pairs alone: ``O(M)`` values gathered from the rows, not a second
streamed pass over every pair. JAX transposes that gather for reverse mode and differentiates
it again for higher orders. The rows the indices do not settle (three or more tied values:
``Monoid.streamed_rows``) take the streamed tangent fold, restricted by a pair mask to those
rows: its blocks of other rows are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._jax import Zero
from .._reductions._lanes import LANES
from ._spec import _aval, _is_float, _is_zero, _zero_tangent, take_at

#: Bytes of gathered rows evaluated at once (more rows of slots are walked in a loop).
GATHER_BYTES = 4 << 20
#: The share of the fold's memory budget its pass over rows of three-way ties takes for a step:
#: the rows are rare and the blocks without one skipped, so a step's size buys no speed, while
#: its tile is memory the gradient holds (the XLA loop's tile of 3-D differences took three
#: times the budget, 48 MiB, in a vmapped Chamfer gradient; on a TPU v5e its temp at 4 pairs
#: of 98,304 points went from 69.0 to 67.7 MiB, at the same speed).
TIE_BUDGET_SHARE = 4


def in_chunks(one, args, row_bytes):
    """``vmap(one)(args)`` over the leading axis of ``args``, at most :data:`GATHER_BYTES` of
    ``row_bytes`` per row at a time (a loop over chunks beyond that)."""
    rows = jax.tree.leaves(args)[0].shape[0]
    chunk = max(1, GATHER_BYTES // max(row_bytes, 1))
    if chunk >= rows:
        return jax.vmap(one)(args)
    return jax.lax.map(one, args, batch_size=chunk)


def applies(fold) -> bool:
    """Whether ``fold`` (unbatched, in its :meth:`for_derivatives` form) takes its tangents at
    the pairs it picks."""
    spec = fold.spec
    return (
        hasattr(spec.monoid, "picks")
        and spec.plan.kind == "dense"
        and spec.direct is None
        and not spec.axes
        and not spec.ring
    )


def values_at(spec, consts, slots, rows, idx):
    """The body's values ``(P, S, *F)`` of slot ``s`` with row ``idx[p, s]`` (clamped).

    The slots come last, in whole lanes on a TPU: there an array's last two axes are tiled by
    (8, 128), and rows gathered with their few features last are padded to 128 lanes each
    (a Chamfer gradient's 131,072 gathered 3-D points: 64 MiB, not 1.5). So rows of fewer
    features than a lane holds are gathered from their features-first copy, ``(*F, P, S)``
    (wider ones as they are), a chunk of slots at a time."""
    axis, n = spec.plan.row_axis, spec.plan.n
    sources = [_features_first(r, axis) for r in rows]
    p, s = idx.shape
    width = p * sum(_aval(r).size // max(n, 1) * _aval(r).dtype.itemsize for r in rows)

    def one(slot, picked, at):  # one slot, one pick
        picked = tuple(jnp.expand_dims(r, axis) for r in picked)
        ones = jnp.ones((1, 1), jnp.bool_)
        vals = spec.body(consts, tuple(a[None] for a in slot), picked, ones, at[None])[0]
        return jax.tree.map(lambda v: v[0, 0], vals)

    def chunk(slot, at):  # a chunk of slots: ``(C, ...)`` and their picks ``(P, C)``
        at = jnp.minimum(at, n - 1)
        picked = [
            jnp.moveaxis(jnp.take(r, at, axis=-1), (-2, -1), (0, 1)) if first else r[at]
            for r, first in sources
        ]
        return jax.vmap(jax.vmap(one), in_axes=(None, 0, 0))(slot, picked, at)

    size = max(1, GATHER_BYTES // max(width, 1))
    if size >= s:
        return chunk(slots, idx)
    count = -(-s // size)
    parts = ([_split(a, 0, count, size) for a in slots], _split(idx, 1, count, size))
    outs = jax.lax.map(lambda a: chunk(*a), parts)  # (count, P, size, *F)
    return jax.tree.map(
        lambda o: jnp.moveaxis(o, 0, 1).reshape(p, count * size, *o.shape[3:])[:, :s], outs
    )


def _features_first(rows, axis):
    """``(rows, True)`` with their features first, ``(*F, N)``, where a row has fewer features
    than a lane holds (a copy where they are last); else ``(rows, False)``, ``(N, *F)``."""
    if axis == -1:
        return rows, True
    if rows.size // max(rows.shape[0], 1) < LANES:
        return jnp.moveaxis(rows, 0, -1), True
    return rows, False


def _split(a, axis, count, size):
    """``a`` padded along ``axis`` to ``count * size`` and split there into ``count`` chunks of
    ``size``, the chunks leading."""
    pad = [(0, count * size - a.shape[axis]) if d == axis else (0, 0) for d in range(a.ndim)]
    a = jnp.pad(a, pad)
    return jnp.moveaxis(a.reshape(*a.shape[:axis], count, size, *a.shape[axis + 1 :]), axis, 0)


def _floats(fold, primals, outs, tangents_in):
    """The tangents of ``fold``'s (unbatched) slot outputs at its picks, ``None`` for the
    integer ones."""
    arrays, consts, slots, rows = primals
    spec, mon = fold.spec, fold.spec.monoid
    info = fold.info(outs)
    idx = mon.picks(info)
    flat_p = (*consts, *slots, *rows)
    flat_t = (*tangents_in[1], *tangents_in[2], *tangents_in[3])
    live = [
        k for k, (p, t) in enumerate(zip(flat_p, flat_t, strict=True))
        if not _is_zero(t) and _is_float(_aval(p))
    ]  # fmt: skip
    if not live:
        return tuple(None for _ in fold.out_aval[0])
    nc, ns = len(consts), len(slots)

    def at(*some):
        flat = list(flat_p)
        for k, v in zip(live, some, strict=True):
            flat[k] = v
        return values_at(spec, tuple(flat[:nc]), tuple(flat[nc : nc + ns]), flat[nc + ns :], idx)

    _, dv = jax.jvp(at, [flat_p[k] for k in live], [flat_t[k] for k in live])
    per_output = list(mon.picked_tangent(info, dv))
    many = mon.streamed_rows(info)
    if many is not None:
        flags = many.astype(jnp.int32)  # (a keyed const: 32 bits, as a kernel reads it)
        streamed = _restricted(fold, flags)._tangents(
            (arrays, (*consts, flags), slots, rows),
            outs,
            (tangents_in[0], (*tangents_in[1], _zero_like(flags)), *tangents_in[2:]),
        )[0]
        for o, (t, s) in enumerate(zip(per_output, streamed, strict=False)):
            if t is not None:
                where = many.reshape((-1,) + (1,) * (t.ndim - 1))
                per_output[o] = jnp.where(where, s.astype(t.dtype), t)
    return tuple(per_output)


def rule(fold, primals, outs, tangents_in):
    """``fold``'s output tangents (as :meth:`_Rules._tangents` gives them) at its picks;
    ``fold`` in its :meth:`for_derivatives` form, batched or not."""
    floats = _any_floats(fold, primals, outs, tangents_in)
    slot = tuple(
        t.astype(a.dtype) if t is not None and _is_float(a) else _zero_tangent(a)
        for t, a in zip(floats, fold.out_aval[0], strict=True)
    )
    return (slot, (), ())


def _any_floats(fold, primals, outs, tangents_in):
    if hasattr(fold, "inner"):  # a batched fold
        return _batched(fold, primals, outs, tangents_in)
    return _floats(fold, primals, outs, tangents_in)


def _batched(bfold, primals, outs, tangents_in):
    """:func:`_floats` of a batched fold: its inner fold's, ``vmap`` ped (a tangent is batched
    like its primal)."""
    flat_t = [t for part in tangents_in for t in part]
    dims = [d for part in bfold.dims for d in part]
    live_t = [t for t in flat_t if not _is_zero(t)]
    live_d = [d for t, d in zip(flat_t, dims, strict=True) if not _is_zero(t)]

    def one(primals, outs, live_t):
        it = iter(live_t)
        parts = tuple(tuple(t if _is_zero(t) else next(it) for t in part) for part in tangents_in)
        return _any_floats(bfold.inner, primals, outs, parts)

    outs_d = jax.tree.map(lambda _: 0, outs)
    return jax.vmap(one, in_axes=(bfold.dims, outs_d, live_d), out_axes=0)(primals, outs, live_t)


def _zero_like(a):
    return Zero(_aval(a).to_tangent_aval())


def _restricted(fold, rows):
    """``fold`` (unbatched) with its pairs restricted to the slots where ``rows`` (int32, one
    per slot) is not 0, an extra const after the fold's own (a derived fold's tangents follow
    it), read at each pair's slot (``Spec.keyed``: a kernel reads it block by block); the
    blocks of other slots are skipped."""
    spec = fold.spec
    at = len(fold.in_avals[1])
    mask, live = spec.pair_mask, spec.block_live

    def pair_mask(consts, i, j, **take):
        keep = take.get("take", take_at)(consts[at], i) != 0
        return keep if mask is None else keep & mask(consts, i, j, **take)

    def block_live(consts, i0, j0, bi, bj):
        some = jnp.any(jax.lax.dynamic_slice_in_dim(consts[at], i0, bi) != 0)
        live_j = jnp.ones(j0.shape, jnp.bool_) if live is None else live(consts, i0, j0, bi, bj)
        return some & live_j

    # a parent mask without a block test: the engine lists the blocks from every pair
    listed = None if mask is not None and live is None else block_live
    arrays, consts, slots, rows_avals = fold.in_avals
    avals = (arrays, (*consts, _aval(rows)), slots, rows_avals)
    keyed = (*spec.keyed, (at, 0))
    # rows that tie three ways are rare: the XLA fold skips their absent blocks for less than
    # a kernel's launch over an empty table (a TPU: 37.7 against 42.0 ms for a vmapped
    # Chamfer gradient of 4 x 16k points), unless kernels are asked for
    impl = "pallas" if spec.implementation == "pallas" else "xla"
    restricted = spec.replace(
        pair_mask=pair_mask,
        block_live=listed,
        keyed=keyed,
        implementation=impl,
        budget=spec.budget // TIE_BUDGET_SHARE,
    )
    return type(fold)(restricted, avals)
