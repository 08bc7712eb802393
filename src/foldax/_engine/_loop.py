"""The loop: a fold's implementation as one ``lax.scan`` over its plan (around a ring of devices
when the slots are split too), and its outputs' avals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .. import _shard
from .._jax import ShapedArray
from ._derived import widened_dtype
from ._plan import make_plan, preferred_tile
from ._probe import _probe_avals
from ._spec import _aval, _index, _with_rows


def _out_avals(spec, avals):
    """Output avals, from a probe of the body (no loop is traced)."""
    probe = _probe_avals(spec, avals, 2, 2)
    vals, tots, rowvals = jax.eval_shape(spec.body, *probe)
    sds = jax.ShapeDtypeStruct
    num, n = spec.plan.num_slots, spec.plan.n
    if spec.monoid is not None:
        row = spec.monoid.value_aval(vals)
        slot = jax.eval_shape(lambda: _finish(spec, spec.monoid.init_aval(num, row), row))
    else:
        slot = tuple(sds((num, *a.shape[1:]), a.dtype) for a in vals)
    rowo = tuple(sds(_with_rows(a.shape, spec.plan.row_axis, n), a.dtype) for a in rowvals)
    shaped = lambda a: ShapedArray(a.shape, a.dtype)  # noqa: E731
    return _narrowed(spec, jax.tree.map(shaped, (tuple(slot), tuple(tots), rowo)))


def _narrowed(spec, outs):
    """Outputs (arrays or avals) in ``spec.out_dtypes`` where it gives them."""
    if spec.out_dtypes is None:
        return outs
    cast = lambda a, d: a.update(dtype=d) if isinstance(a, ShapedArray) else a.astype(d)  # noqa: E731
    return tuple(
        tuple(cast(a, d) for a, d in zip(part, dtypes, strict=True))
        for part, dtypes in zip(outs, spec.out_dtypes, strict=True)
    )


def _sums(spec, out_avals):
    """The avals of the sums a fold keeps for ``out_avals``: as wide as its body makes them
    (:func:`._derived.widened_dtype`) where ``spec.out_dtypes`` narrows them."""
    if spec.out_dtypes is None:
        return out_avals
    return jax.tree.map(lambda a: a.update(dtype=widened_dtype(a.dtype)), out_avals)


def _typed_out_avals(spec, avals):
    """Output avals with the types the loop gives them (on a mesh: which axes each varies
    along), from tracing it once."""
    shapes = _out_avals(spec, avals)
    if not (spec.axes or spec.ring):
        return shapes
    jaxpr = jax.make_jaxpr(lambda *a: _run(spec, 1, shapes, *a))(*avals)
    return jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.out_avals)


def _finish(spec, state, row_aval):
    """A monoid fold's outputs; the result in the values' dtype (states may be wider)."""
    outs = spec.monoid.outputs(state)
    dtype = spec.monoid.result_dtype(row_aval)
    first = outs[0]
    if dtype is not None and jnp.issubdtype(first.dtype, jnp.floating) and first.dtype != dtype:
        first = first.astype(dtype)
    return (first, *outs[1:])


def _run(spec, units, out_avals, arrays, consts, slots, rows, whole=0):
    """The loop: one ``lax.scan`` over the plan (inside a scan over devices for a ring); with
    ``whole``, a dense fold in blocks of that many rows by every column, each block's state
    made from its one tile (:func:`._probe.whole_rows`)."""
    mon, axes = spec.monoid, spec.axes + spec.ring
    n = spec.plan.n
    first = _shard.device_index(spec.axes) * n if spec.axes else 0
    tile = preferred_tile(spec.plan, mon)
    plan0 = make_plan(spec.plan, arrays, units, first, tile, whole)
    sums = _sums(spec, out_avals)
    rows_outer = _rows_outer(spec, sums, out_avals, whole)
    if rows_outer:  # its row buffers are written a finished block at a time, narrowed
        sums = (*sums[:2], out_avals[2])
    row_aval, start = _initial_states(spec, plan0, sums, (arrays, consts, slots, rows))

    def step(plan, rows, carry_t, _, block=False):
        """One tile: its values folded into the slot states (all of them, or with ``block``
        the states of the dense plan's current block of slots), sums and row buffers; with a
        ``pair_mask``, its pairs masked (the tiles it removes entirely are not visited)."""
        carry, t = carry_t
        s = plan.load(rows, t)
        if spec.pair_mask is not None:
            i = s.slots + jnp.arange(s.mask.shape[0], dtype=jnp.int32)
            keep = jnp.broadcast_to(
                spec.pair_mask(consts, i[:, None], s.index[None, :]), s.mask.shape
            )
            s = dataclasses.replace(s, mask=s.mask & keep)
        carry = _update(spec, plan, s, carry, block, consts, slots)
        return (_shard.to_varying(carry, axes, skip=(1,)), t + 1), None

    def sweep(carry, rows, first):
        # The step counter is carried (an ``xs`` of step indices would be an array as long as
        # the number of steps, which for a dense plan grows like M * N).
        plan = make_plan(spec.plan, arrays, units, first, tile, whole)
        zero = jnp.zeros((), jnp.int32)
        if spec.plan.kind != "dense":
            body = lambda c, x: step(plan, rows, c, x)  # noqa: E731
            if plan.steps == 1:  # (every row in one step: no loop at all)
                return body((carry, zero), None)[0][0]
            return lax.scan(body, (carry, zero), None, length=plan.steps)[0][0]

        def outer(c, _):  # one block of slots: its states carried through the j loop
            (st, tot, bufs), ti = c
            si = plan.block_start(ti)
            init = (plan.block_of(st, si), tot, bufs)
            if spec.pair_mask is None and whole:  # one tile of every column
                (st_b, tot, bufs), _ = step(plan, rows, (init, ti), None, "only")[0]
            elif spec.pair_mask is None:
                inner = lambda c2, x: step(plan, rows, c2, x, block=True)  # noqa: E731
                init = (init, ti * plan.steps_j)
                (st_b, tot, bufs), _ = lax.scan(inner, init, None, length=plan.steps_j)[0]
            else:  # only the blocks of y the mask keeps something of
                live = _live_blocks(spec, consts, plan, ti)
                order = jnp.nonzero(live, size=plan.steps_j, fill_value=0)[0].astype(jnp.int32)
                t0 = ti * plan.steps_j
                visit = lambda k, c2: step(plan, rows, (c2, t0 + order[k]), None, True)[0][0]  # noqa: E731
                st_b, tot, bufs = lax.fori_loop(0, jnp.sum(live, dtype=jnp.int32), visit, init)
            st = _shard.to_varying(plan.put(st, si, st_b), axes)
            return ((st, tot, bufs), ti + 1), None

        if plan.steps_i == 1:
            return outer((carry, zero), None)[0][0]
        return lax.scan(outer, (carry, zero), None, length=plan.steps_i)[0][0]

    carry = _shard.to_varying(start, axes, skip=(1,))
    if not axes:  # (on a mesh the initial states keep the varying types given them above)
        carry = _not_before(carry, (consts, slots, rows))
    if rows_outer:
        st, tot, bufs = _walk_rows_outer(spec, plan0, carry, consts, slots, rows)
        return _narrowed(spec, (_final_states(spec, st, row_aval), tot, bufs))
    if axes and _shard.types_checked(axes):
        block = spec.plan.kind == "dense"
        one = lambda c: step(plan0, rows, (c, jnp.zeros((), jnp.int32)), None, block)[0][0]  # noqa: E731
        carry = _typed_tots(carry, one, plan0 if block else None)
    if not spec.ring:
        st, tot, bufs = sweep(carry, rows, first)
    else:
        st, tot, bufs = _around(spec.ring, n, sweep, carry, rows)
    return _narrowed(spec, (_final_states(spec, st, row_aval), tot, bufs))


def _rows_outer(spec, sums, out_avals, whole) -> bool:
    """Whether a fold walks its rows outermost (:func:`_walk_rows_outer`): an additive dense
    fold, on one device and unmasked, whose row outputs are narrower than the sums it keeps of
    them (a half-precision ``y``'s cotangent)."""
    if spec.monoid is not None or spec.plan.kind != "dense" or whole:
        return False
    if spec.axes or spec.ring or spec.pair_mask is not None:
        return False
    return any(s.dtype != o.dtype for s, o in zip(sums[2], out_avals[2], strict=True))


def _walk_rows_outer(spec, plan, carry, consts, slots, rows):
    """An additive dense fold walked one block of rows at a time, every block of slots inside
    (``i`` fastest): each block's row sums are complete when its inner loop ends and are
    narrowed to the row outputs' dtype then (``carry``'s row buffers are narrow already). The
    ``j``-fastest walk holds every row's sum, as wide as the body makes it, until the end: for a
    half-precision ``y`` of ``n`` rows a float32 ``(n, ...)`` buffer; here the wide sums are the
    slots' (``(m, ...)``) and one block of rows."""
    ax = plan.row_axis

    def inner(c, _):
        (st, tot, block), t = c
        s = plan.load(rows, t)
        vals, tots, rowvals = spec.body(
            consts, plan.gather(slots, s.slots), s.rows, s.mask, s.index
        )
        st = plan.put(st, s.slots, jax.tree.map(jnp.add, plan.block_of(st, s.slots), vals))
        tot = tuple(a + b for a, b in zip(tot, tots, strict=True))
        block = tuple(a + b for a, b in zip(block, rowvals, strict=True))
        return ((st, tot, block), t + plan.steps_j), None

    def outer(c, _):
        # last block first: the clamped last block overlaps the one before it, which is
        # written after it, over the overlap (a block's rows are written, never read back)
        (st, tot, bufs), tj = c
        sj = plan.cells(tj, plan.n, plan.bj)[0]
        block = tuple(jnp.zeros(_with_rows(b.shape, ax, plan.bj), sum_dtype(b)) for b in bufs)
        (st, tot, block), _ = lax.scan(inner, ((st, tot, block), tj), None, length=plan.steps_i)[0]
        bufs = tuple(
            lax.dynamic_update_slice_in_dim(b, k.astype(b.dtype), sj, ax % b.ndim)
            for b, k in zip(bufs, block, strict=True)
        )
        return ((st, tot, bufs), tj - 1), None

    sum_dtype = lambda b: widened_dtype(b.dtype)  # noqa: E731
    last = jnp.asarray(plan.steps_j - 1, jnp.int32)
    return lax.scan(outer, (carry, last), None, length=plan.steps_j)[0][0]


def _update(spec, plan, s, carry, block, consts, slots):
    """``carry`` (slot states, sums, row buffers) after step ``s``: its values folded into
    every slot state, or with ``block`` into the states of the dense plan's current block of
    slots (``"only"``: the block's one step, its states the identity where it has pairs)."""
    mon, (st, tot, bufs) = spec.monoid, carry
    tile_slots = plan.gather(slots, s.slots)
    vals, tots, rowvals = spec.body(consts, tile_slots, s.rows, s.mask, s.index)
    if mon is not None:
        vals = mon.reduce(vals, s.mask, *_index(spec, s.index))
    if block and mon is None:
        st = jax.tree.map(jnp.add, st, vals)
    elif block:
        st = (mon.only if block == "only" else mon.combine)(st, vals)
    else:
        st = plan.merge(mon, st, s.slots, vals)
    tot = tuple(a + b for a, b in zip(tot, tots, strict=True))
    bufs = tuple(plan.store(b, s.at, v, s.own) for b, v in zip(bufs, rowvals, strict=True))
    return st, tot, bufs


def _initial_states(spec, plan0, out_avals, args):
    """``(row_aval, (slot states, tot sums, row buffers))`` a fold starts from: the monoid's
    identity for the values the body makes (``row_aval``; ``None`` for an additive fold), zeros,
    and row buffers blank as ``plan0`` leaves them."""
    mon, row_aval = spec.monoid, None
    if mon is not None:
        probe = _probe_avals(spec, jax.tree.map(_aval, args), 2, 2)
        row_aval = mon.value_aval(jax.eval_shape(spec.body, *probe)[0])
        slot0 = mon.init_aval(spec.plan.num_slots, row_aval)
    else:
        slot0 = tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals[0])
    tot0 = tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals[1])
    buf0 = tuple(plan0.blank(a.shape, a.dtype, spec.fill) for a in out_avals[2])
    return row_aval, (slot0, tot0, buf0)


def _typed_tots(carry, one_step, dense_plan):
    """``carry`` with its sums over every row (tots) typed as the body makes them: complete on
    every device where the body sums over devices itself (a replicated parameter's cotangent).
    ``one_step(carry)``: one step (of the first block of slots of ``dense_plan``, if any)."""
    probe = (dense_plan.block_of(carry[0], 0) if dense_plan else carry[0], *carry[1:])
    typed = jax.make_jaxpr(one_step)(probe).out_avals
    typed = jax.tree.unflatten(jax.tree.structure(probe), typed)
    return (carry[0], _shard.like(carry[1], typed[1]), carry[2])


def _final_states(spec, st, row_aval):
    """The slot outputs from the states after the loop: all-reduced over the mesh axes that
    split the rows, then the monoid's outputs (an additive fold's sums, psummed if asked)."""
    if spec.monoid is not None:
        st = spec.monoid.allreduce(st, spec.axes) if spec.axes else st
        return tuple(_finish(spec, st, row_aval))
    if spec.slot_psum and spec.axes:
        st = tuple(lax.psum(a, spec.axes) for a in st)
    return tuple(st)


def _not_before(carry, inputs):
    """``carry`` made to depend on ``inputs`` (its values unchanged: ``x + 0.0 == x`` for the
    states a fold starts from, and an empty segment's sum stays ``+0.0`` whether or not XLA
    drops the addition).

    A fold's initial states are constants; XLA:CPU's scheduler makes such buffers at the start
    of the program, so the accumulators of every fold in a gradient (each as large as its
    inputs) would be live at once, through everything computed before them. Adding a zero
    whose sign XLA cannot know (it depends on the inputs' first elements) keeps each one from
    being made before its fold's inputs exist."""
    firsts = [
        jnp.ravel(a)[0].real.astype(jnp.float32)
        for a in jax.tree.leaves(inputs)
        if a.size and jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    if not firsts:
        return carry
    unknown = jnp.isnan(sum(firsts))

    def zero_after(a):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            return a
        return a + jnp.where(unknown, -jnp.zeros((), a.dtype), jnp.zeros((), a.dtype))

    return jax.tree.map(zero_after, carry)


def _live_blocks(spec, consts, plan, ti):
    """``(steps_j,)``: which blocks of ``y`` the mask keeps a pair of, against block ``ti`` of
    slots: from ``spec.block_live`` where the fold has one (no pair is looked at), else from
    the mask on every pair, one block of pairs at a time (nothing of size ``M * N`` is made)."""
    # A clamped last block overlaps the one before it: counting its overlap can only visit a
    # block more (the step masks what it does not own), never skip one.
    i0 = plan.cells(ti, plan.m, plan.bi)[0]
    tj = jnp.arange(plan.steps_j, dtype=jnp.int32)
    if spec.block_live is not None:
        j0 = plan.first + jnp.minimum(tj * plan.bj, plan.n - plan.bj)  # the blocks' starts
        return spec.block_live(consts, i0, j0, plan.bi, plan.bj)
    i = i0 + jnp.arange(plan.bi, dtype=jnp.int32)

    def live(tj):
        j = plan.first + plan.cells(tj, plan.n, plan.bj)[0] + jnp.arange(plan.bj, dtype=jnp.int32)
        return jnp.any(spec.pair_mask(consts, i[:, None], j[None, :]))

    # a few blocks at a time: at most ~2^20 mask cells (1 MB) live, whatever N is
    per = max(1, min(plan.steps_j, 2**20 // (plan.bi * plan.bj)))
    return lax.map(live, tj, batch_size=per)


def _around(ring, n, sweep, carry, rows):
    """``sweep`` every device's rows along ``ring``: the rows and their row buffers go round
    the devices (``ppermute``); after a full turn each is home with what was added to it."""
    count, me = _shard.device_count(ring), _shard.device_index(ring)
    perm = [(i, (i + 1) % count) for i in range(count)]
    axis = ring if len(ring) > 1 else ring[0]

    def turn(c, r):
        (st, tot, bufs), rows = c
        st, tot, bufs = sweep((st, tot, bufs), rows, ((me - r) % count) * n)
        bufs, rows = jax.tree.map(lambda a: lax.ppermute(a, axis, perm), (bufs, rows))
        return ((st, tot, bufs), rows), None

    return lax.scan(turn, (carry, rows), jnp.arange(count))[0][0]
