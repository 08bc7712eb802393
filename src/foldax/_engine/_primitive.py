"""The one streamed fold, as a JAX primitive with its own rules.

A fold instance computes, over the steps of a plan (:mod:`foldax._engine._plan`)::

    for each step:  (G slots) x (T rows) tile, mask
        vals, tots, rowvals = body(consts, slots[tile's slots], rows[step's rows], mask, index)
        slot states  <- merge(monoid.reduce(vals, mask))    (or += vals: an *additive* fold)
        tot sums     += tots
        row buffers  += rowvals  (at the step's own rows)

and returns ``(slot outputs, tot sums, row buffers)``: ``monoid.outputs(states)`` per slot
(segments, rows of ``x``), sums over everything, and one value per row. The arguments are four
tuples of arrays: the plan's integer ``arrays``, ``consts`` (whole in every step), ``slots``
(leading axis = slots, gathered per tile) and ``rows`` (leading axis = rows; last axis for dense
plans).

Every rule produces another fold, so that every order of differentiation streams:

* ``jvp``: an additive fold of ``jax.jvp(body)``, turned into the outputs'
  tangents by ``monoid.tangent`` (the primal outputs' ``monoid.info`` enters as slots);
* ``transpose`` (``jax.grad`` is ``jvp`` then ``transpose``): an additive fold of
  ``jax.vjp(body)`` pulled back from the outputs' cotangents (``monoid.row_cotangent``):
  cotangents of ``consts`` are tot sums, of ``slots`` slot sums, of ``rows`` row buffers. The
  transpose of a tangent fold is its parent's cotangent fold;
* ``batch``: :class:`Batched`, which ``vmap`` s the fold's implementation after scaling its plan
  for the batch (the planner sees every enclosing ``vmap``), and derives its rules from the
  unbatched instance's.

The primitive itself (how JAX sees a fold) is in :mod:`._registration`. Nothing per step is
saved between passes: the residuals of every rule are its inputs and the
small per-slot outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters.ad import Zero

from .. import _shard
from . import _direct
from ._budget import CPU_STEP, DEFAULT_BUDGET
from ._plan import PlanSpec, make_plan
from ._registration import Primitive

# ----------------------------------------------------------------------------------------------
# The static description of an instance


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """Everything static about a fold (hashed by identity).

    ``body(consts, slots, rows, mask, index) -> (vals, tots, rowvals)``: for a monoid fold
    ``vals`` are the tile's values ``(G, T, *F)`` (a pytree for pairs of values), reduced by
    ``monoid``; for an additive fold (``monoid=None``) a tuple of per-slot partial sums
    ``(G, ...)``. ``fill``: the value of row outputs on rows that no step owns.
    ``axes``: mesh axes splitting the rows (slot states are all-reduced); ``ring``: mesh axes
    splitting rows and slots (the rows go round the devices). ``slot_psum``: psum an additive
    fold's slot sums over ``axes`` (the tangent of an all-reduced output). ``pair_mask``
    (dense plans): ``pair_mask(consts, i, j) -> bool`` of the fold's consts (a derived fold's
    begin with its parent's) and broadcasting global slot and row indices;
    pairs where it is false take no part, and a tile where it is false everywhere is skipped
    (not computed), in this fold and in every fold derived from it. ``origin``: for a tangent
    fold (``derive("jvp", shape)``), ``(parent rule, shape)``: transposed in all its tangents,
    it is the parent's cotangent fold. ``direct``: the one XLA operation the fold is, when it
    is not batched (:mod:`._direct`; its derived folds are direct too).
    """

    plan: PlanSpec
    body: Callable
    monoid: Any = None
    budget: int = DEFAULT_BUDGET
    scale: int = 1
    fill: float = 0.0
    axes: tuple = ()
    ring: tuple = ()
    slot_psum: bool = False
    name: str = "foldax"
    pair_mask: Callable | None = None
    origin: Any = None
    direct: str | None = None

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _aval(x):
    return jax.typeof(x)


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_tangent(aval):
    """The tangent of an output nothing perturbs: zeros (``float0`` for integer outputs)."""
    if _is_float(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _is_zero(t) -> bool:
    return isinstance(t, Zero)


# ----------------------------------------------------------------------------------------------
# Probing the body: output shapes and bytes per unit of work


def _probe_grid(kind, g, t):
    """``(G, T, R)``: slots, columns and rows of a probe step."""
    if kind == "dense":
        return g, t, t
    if kind == "rows":
        return g, 1, g
    return g, t, g * t


def _probe_avals(spec, avals, g, t):
    """Abstract inputs of ``body`` for a ``(g, t)`` tile grid (typed like the real ones: on a
    mesh a replayed ``fn`` needs its operands' varying axes)."""
    _, consts, slots, rows = avals
    g, t, r = _probe_grid(spec.plan.kind, g, t)
    tile_slots = tuple(_shaped(a, (g, *a.shape[1:])) for a in slots)
    chunk = tuple(_shaped(a, _with_rows(a.shape, spec.plan.row_axis, r)) for a in rows)
    consts = tuple(_shaped(a, a.shape) for a in consts)
    return consts, tile_slots, chunk, ShapedArray((g, t), jnp.bool_), ShapedArray((t,), jnp.int32)


def _with_rows(shape, row_axis, r):
    """``shape`` with its rows axis (``row_axis``: 0 or -1) of size ``r``."""
    return (*shape[:-1], r) if row_axis == -1 else (r, *shape[1:])


def _shaped(aval, shape):
    return aval.update(shape=shape) if hasattr(aval, "update") else ShapedArray(shape, aval.dtype)


def _step_fn(spec):
    """One step's computation (body, then the monoid's tile reduction and, for a dense plan,
    its merge into the block's states, as the loop does) for probing."""

    def f(consts, slots, rows, mask, index):
        vals, tots, rowvals = spec.body(consts, slots, rows, mask, index)
        if spec.monoid is not None:
            row = spec.monoid.value_aval(vals)
            vals = spec.monoid.reduce(vals, mask, *_index(spec, index))
            if spec.plan.kind == "dense":  # e.g. a k-min merges a whole tile here
                vals = spec.monoid.combine(spec.monoid.init_aval(mask.shape[0], row), vals)
        return vals, tots, rowvals

    return f


def _index(spec, index):
    return (index,) if getattr(spec.monoid, "needs_index", False) else ()


@functools.cache
def _itemsize(dtype) -> int:
    """Bytes per element, also for extended dtypes (``jax.random`` keys: their key data's)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize


def _nbytes(aval) -> int:
    if not (hasattr(aval, "shape") and hasattr(aval, "dtype")):
        return 0
    return math.prod(aval.shape) * _itemsize(aval.dtype)


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for sub in p if isinstance(p, tuple | list) else (p,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


#: Primitives XLA fuses into their consumers: their results are not counted as buffers.
_FUSED = frozenset(
    {
        *("abs", "add", "and", "broadcast_in_dim", "convert_element_type", "copy", "copy_p"),
        *("cos", "div", "eq", "exp", "exp2", "expand_dims", "ge", "gt", "imag", "integer_pow"),
        *("is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne"),
        *("neg", "not", "or", "pjit", "pow", "real", "reshape", "rsqrt", "select_n", "sign"),
        *("sin", "sqrt", "square", "squeeze", "sub", "tanh"),
    }
)


def _peak_bytes(jaxpr) -> int:
    """The most bytes a jaxpr keeps live at once (inputs excluded): a value is live from its
    equation to its last use. Elementwise results are taken as fused into their consumers (as
    XLA does), unless the jaxpr returns them."""
    is_var = lambda v: not hasattr(v, "val")  # noqa: E731
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if is_var(v):
                last[v] = i
    for v in jaxpr.outvars:
        if is_var(v):
            last[v] = len(jaxpr.eqns)
    live, peak, sizes = 0, 0, {}
    outs = {v for v in jaxpr.outvars if is_var(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((_peak_bytes(sub) for sub in _subjaxprs(eqn)), default=0)
        fused = eqn.primitive.name in _FUSED
        kept = [v for v in eqn.outvars if not fused or v in outs]
        out = sum(_nbytes(v.aval) for v in kept)
        peak = max(peak, live + out + inner)
        for v in kept:
            sizes[v] = _nbytes(v.aval)
            live += sizes[v]
        for v in [*eqn.invars, *eqn.outvars]:
            if is_var(v) and last.get(v, -1) <= i and v in sizes:
                live -= sizes.pop(v)
    return peak


def unit_bytes(spec, avals) -> float:
    """Bytes one unit of work (a row; a pair for dense plans) keeps live in a step, for one
    batch element: measured on the traced step at two sizes (so that what does not grow with
    the step is not counted)."""
    small, big = ((1, 128), (4, 128)) if spec.plan.kind == "dense" else ((1, 64), (1, 256))
    if spec.plan.kind == "rows":
        small, big = (64, 1), (256, 1)

    def measure(g, t):
        probe = _probe_avals(spec, avals, g, t)
        jaxpr = jax.make_jaxpr(_step_fn(spec))(*probe).jaxpr
        ins = sum(_nbytes(a) for a in jax.tree.leaves(probe))
        _, tt, r = _probe_grid(spec.plan.kind, g, t)
        units = g * tt if spec.plan.kind == "dense" else r
        return _peak_bytes(jaxpr) + ins, units

    (b0, u0), (b1, u1) = measure(*small), measure(*big)
    return max((b1 - b0) / (u1 - u0), 1.0)


def plan_units(spec, avals) -> int:
    """Rows (pairs for dense plans) per step: the budget over the batch and the bytes per unit,
    capped on CPU at a cache-friendly step size; a power of two."""
    if spec.plan.chunk is not None:
        return 0
    step, cap = spec.budget, math.inf
    tile = getattr(spec.monoid, "dense_tile", None)
    if jax.default_backend() == "cpu":
        step_bytes, cap = CPU_STEP["pairs" if spec.plan.kind == "dense" else "rows"]
        if spec.plan.kind == "dense" and spec.plan.row_axis == -1 and tile is not None:
            # A reduction with a preferred tile (min, argmin, k-min) takes steps of up to that
            # many pairs within the budget: XLA:CPU spreads a step that large over its
            # threads, 1.9x faster on 2 cores than an 8192-pair step, which runs on one.
            cap = max(cap, math.prod(tile))
        else:
            step = min(step, step_bytes)
    units = min(step / (unit_bytes(spec, avals) * spec.scale), cap)
    return 1 << max(0, math.floor(math.log2(max(units, 1))))


# ----------------------------------------------------------------------------------------------
# The implementation


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
    return jax.tree.map(shaped, (tuple(slot), tuple(tots), rowo))


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
    dtype = getattr(row_aval, "dtype", None)
    first = outs[0]
    if dtype is not None and jnp.issubdtype(first.dtype, jnp.floating) and first.dtype != dtype:
        first = first.astype(dtype)
    return (first, *outs[1:])


def _run(spec, units, out_avals, arrays, consts, slots, rows):
    """The loop: one ``lax.scan`` over the plan (inside a scan over devices for a ring)."""
    mon, axes = spec.monoid, spec.axes + spec.ring
    n = spec.plan.n
    first = _shard.device_index(spec.axes) * n if spec.axes else 0
    tile = getattr(mon, "dense_tile", None)  # a reduction's preferred dense block
    plan0 = make_plan(spec.plan, arrays, units, first, tile)
    if mon is not None:
        probe = _probe_avals(spec, jax.tree.map(_aval, (arrays, consts, slots, rows)), 2, 2)
        vals = jax.eval_shape(spec.body, *probe)[0]
        row_aval = mon.value_aval(vals)
        slot0 = mon.init_aval(spec.plan.num_slots, row_aval)
    else:
        slot0 = tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals[0])
    tot0 = tuple(jnp.zeros(a.shape, a.dtype) for a in out_avals[1])
    buf0 = tuple(plan0.blank(a.shape, a.dtype, spec.fill) for a in out_avals[2])

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
        return (update(plan, s, carry, block), t + 1), None

    def update(plan, s, carry, block):
        st, tot, bufs = carry
        tile_slots = plan.gather(slots, s.slots)
        vals, tots, rowvals = spec.body(consts, tile_slots, s.rows, s.mask, s.index)
        if mon is not None:
            vals = mon.reduce(vals, s.mask, *_index(spec, s.index))
        if block:
            st = mon.combine(st, vals) if mon is not None else jax.tree.map(jnp.add, st, vals)
        else:
            st = plan.merge(mon, st, s.slots, vals)
        tot = tuple(a + b for a, b in zip(tot, tots, strict=True))
        bufs = tuple(plan.store(b, s.at, v, s.own) for b, v in zip(bufs, rowvals, strict=True))
        return _shard.to_varying((st, tot, bufs), axes, skip=(1,))

    def sweep(carry, rows, first):
        # The step counter is carried (an ``xs`` of step indices would be an array as long as
        # the number of steps, which for a dense plan grows like M * N).
        plan = make_plan(spec.plan, arrays, units, first, tile)
        zero = jnp.zeros((), jnp.int32)
        if spec.plan.kind != "dense":
            body = lambda c, x: step(plan, rows, c, x)  # noqa: E731
            return lax.scan(body, (carry, zero), None, length=plan.steps)[0][0]

        def outer(c, _):  # one block of slots: its states carried through the j loop
            (st, tot, bufs), ti = c
            si = plan.block_start(ti)
            init = (plan.gather(st, si), tot, bufs)
            if spec.pair_mask is None:
                inner = lambda c2, x: step(plan, rows, c2, x, block=True)  # noqa: E731
                init = (init, ti * plan.steps_j)
                (st_b, tot, bufs), _ = lax.scan(inner, init, None, length=plan.steps_j)[0]
            else:  # only the blocks of y the mask keeps something of
                live = _live_blocks(functools.partial(spec.pair_mask, consts), plan, ti)
                order = jnp.nonzero(live, size=plan.steps_j, fill_value=0)[0].astype(jnp.int32)
                t0 = ti * plan.steps_j
                visit = lambda k, c2: step(plan, rows, (c2, t0 + order[k]), None, True)[0][0]  # noqa: E731
                st_b, tot, bufs = lax.fori_loop(0, jnp.sum(live, dtype=jnp.int32), visit, init)
            st = _shard.to_varying(plan.put(st, si, st_b), axes)
            return ((st, tot, bufs), ti + 1), None

        return lax.scan(outer, (carry, zero), None, length=plan.steps_i)[0][0]

    carry = _shard.to_varying((slot0, tot0, buf0), axes, skip=(1,))
    if not axes:  # (on a mesh the initial states keep the varying types given them above)
        carry = _not_before(carry, (consts, slots, rows))
    if axes and _shard.types_checked(axes):
        # The sums over every row (tots) are typed as the body makes them: complete on every
        # device where the body sums over devices itself (a replicated parameter's cotangent).
        block = spec.plan.kind == "dense"
        probe = (plan0.gather(carry[0], 0) if block else carry[0], *carry[1:])
        one = lambda c: step(plan0, rows, (c, jnp.zeros((), jnp.int32)), None, block)[0][0]  # noqa: E731
        typed = jax.make_jaxpr(one)(probe).out_avals
        typed = jax.tree.unflatten(jax.tree.structure(probe), typed)
        carry = (carry[0], _shard.like(carry[1], typed[1]), carry[2])
    if not spec.ring:
        st, tot, bufs = sweep(carry, rows, first)
    else:
        st, tot, bufs = _around(spec.ring, n, sweep, carry, rows)
    if mon is not None:
        st = mon.allreduce(st, spec.axes) if spec.axes else st
        st = _finish(spec, st, row_aval)
    elif spec.slot_psum and spec.axes:
        st = tuple(lax.psum(a, spec.axes) for a in st)
    return tuple(st), tot, bufs


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


def _live_blocks(pair_mask, plan, ti):
    """``(steps_j,)``: which blocks of ``y`` the mask keeps a pair of, against block ``ti`` of
    slots (one block of pairs at a time: nothing of size ``M * N`` is made)."""
    # A clamped last block overlaps the one before it: counting its overlap can only visit a
    # block more (the step masks what it does not own), never skip one.
    i = plan.cells(ti, plan.m, plan.bi)[0] + jnp.arange(plan.bi, dtype=jnp.int32)

    def live(tj):
        j = plan.first + plan.cells(tj, plan.n, plan.bj)[0] + jnp.arange(plan.bj, dtype=jnp.int32)
        return jnp.any(pair_mask(i[:, None], j[None, :]))

    # a few blocks at a time: at most ~2^20 mask cells (1 MB) live, whatever N is
    per = max(1, min(plan.steps_j, 2**20 // (plan.bi * plan.bj)))
    return lax.map(live, jnp.arange(plan.steps_j, dtype=jnp.int32), batch_size=per)


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


# ----------------------------------------------------------------------------------------------
# Derived bodies: every derivative of a fold is an additive fold


def _pick(leaves, flags):
    return [x for x, f in zip(leaves, flags, strict=True) if f]


def _fill(leaves, flags, some):
    it = iter(some)
    return [next(it) if f else x for x, f in zip(leaves, flags, strict=True)]


def _partial(f, primals, flags):
    """``f`` of the flagged leaves of ``primals`` (a tuple of three tuples), the others fixed."""
    flat, tree = jax.tree.flatten(primals)

    def g(*some):
        return f(*jax.tree.unflatten(tree, _fill(flat, flags, some)))

    return g, _pick(flat, flags)


def _rows_own(kind, mask):
    """Which rows of a step's chunk it owns, from its ``(G, T)`` mask."""
    return jnp.any(mask, axis=0) if kind == "dense" else mask.reshape(-1)


def _mask_rows(row_axis, own, a):
    """``a`` (rows on ``row_axis``) zeroed on the rows a step does not own."""
    shape = (-1,) + (1,) * (a.ndim - 1) if row_axis == 0 else (-1,)
    return jnp.where(own.reshape(shape), a, jnp.zeros((), a.dtype))


@dataclasses.dataclass(frozen=True)
class Shape:
    """How a derived fold's arguments extend its parent's: parent counts and flags."""

    nc: int  # consts
    ns: int  # slots
    ni: int  # info (per-slot arrays from the parent's outputs)
    nr: int  # rows
    nz: tuple  # flags over the parent's consts + slots + rows: differentiated
    gnz: tuple = ()  # flags over the parent's outputs (slot, tot, row): cotangent given

    def split(self, consts, slots, rows):
        c, extra_c = consts[: self.nc], consts[self.nc :]
        s, info, extra_s = (
            slots[: self.ns],
            slots[self.ns : self.ns + self.ni],
            slots[self.ns + self.ni :],
        )
        r, extra_r = rows[: self.nr], rows[self.nr :]
        return (tuple(c), tuple(s), tuple(r)), info, (extra_c, extra_s, extra_r)


def _jvp_body(parent: Spec, shape: Shape):
    """The tangent fold's body: ``jax.jvp`` of the parent's, turned into output tangents."""

    def body(consts, slots, rows, mask, index):
        primals, info, tangents = shape.split(consts, slots, rows)
        f, nz_primals = _partial(
            lambda c, s, r: parent.body(c, s, r, mask, index), primals, shape.nz
        )
        tangents = _shard.like(tuple(t for part in tangents for t in part), tuple(nz_primals))
        out, dout = jax.jvp(f, tuple(nz_primals), tangents)
        if parent.monoid is None:
            return dout
        ts = parent.monoid.tangent(out[0], dout[0], mask, info, *_index(parent, index))
        return tuple(t for t in ts if t is not None), (), ()

    return body


def _vjp_body(parent: Spec, shape: Shape, out_avals):
    """The cotangent fold's body: ``jax.vjp`` of the parent's, pulled back from the outputs'
    cotangents (gathered per tile, or read per row); returns ``(slot cts, const cts, row cts)``."""
    kind = parent.plan.kind

    def body(consts, slots, rows, mask, index):
        primals, info, given = shape.split(consts, slots, rows)
        g_tot, g_slot, g_row = given
        if parent.monoid is not None:
            f, nz_primals = _partial(
                lambda c, s, r: parent.body(c, s, r, mask, index)[0], primals, shape.nz
            )
            vals, pull = jax.vjp(f, *nz_primals)
            flags = shape.gnz[: len(out_avals[0])]
            it = iter(g_slot)
            g = tuple(next(it) if fl else None for fl in flags)
            ct = parent.monoid.row_cotangent(vals, mask, info, g, *_index(parent, index))
            ct = _shard.like(ct, vals)
        else:
            f, nz_primals = _partial(
                lambda c, s, r: parent.body(c, s, r, mask, index), primals, shape.nz
            )
            out, pull = jax.vjp(f, *nz_primals)
            own = _rows_own(kind, mask)
            axis = parent.plan.row_axis
            given_flat = iter([*g_slot, *g_tot, *(_mask_rows(axis, own, a) for a in g_row)])
            leaves, tree = jax.tree.flatten(out)
            ct = jax.tree.unflatten(
                tree,
                [
                    next(given_flat) if fl else jnp.zeros_like(x)
                    for x, fl in zip(leaves, shape.gnz, strict=True)
                ],
            )
            ct = _shard.like(ct, out)
        ct_c, ct_s, ct_r = _unflag(pull(ct), shape.nz, shape.nc, shape.ns)
        return tuple(ct_s), tuple(ct_c), tuple(ct_r)

    return body


def _unflag(picked, nz, nc, ns):
    """Flagged leaves of ``consts + slots + rows`` (``nz``: flags over all of them), split back
    into the three."""
    a = sum(nz[:nc])
    b = a + sum(nz[nc : nc + ns])
    return picked[:a], picked[a:b], picked[b:]


# ----------------------------------------------------------------------------------------------
# The primitive


class _Rules(Primitive):
    """Differentiation and batching rules shared by :class:`Fold` and :class:`Batched`: each
    rule derives another fold (``derive``) and calls it."""

    def _counts(self):
        _, consts, slots, rows = self.in_avals
        return len(consts), len(slots), len(rows)

    def _shape(self, nz, gnz=()):
        nc, ns, nr = self._counts()
        return Shape(nc, ns, self.num_info(), nr, tuple(nz), tuple(gnz))

    # -- forward mode --------------------------------------------------------------------------

    def _tangents(self, args, outs, tangents):
        arrays, consts, slots, rows = args
        flat_t = [t for part in tangents[1:] for t in part]
        flat_p = [p for part in (consts, slots, rows) for p in part]
        nz = tuple(
            not _is_zero(t) and _is_float(_aval(p)) for t, p in zip(flat_t, flat_p, strict=True)
        )
        if not any(nz):
            return jax.tree.map(_zero_tangent, self.out_aval)
        nc, ns, _ = self._counts()
        dc, ds, dr = _parts(flat_t, nz, nc, ns)
        derived = self.derive("jvp", self._shape(nz))
        t = derived(arrays, (*consts, *dc), (*slots, *self.info(outs), *ds), (*rows, *dr))
        if self.spec.monoid is None:
            return t
        it = iter(t[0])
        slot = tuple(
            next(it).astype(a.dtype) if _is_float(a) else _zero_tangent(a) for a in self.out_aval[0]
        )
        return (slot, (), ())

    def jvp(self, primals, tangents):
        outs = self(*primals)
        return outs, self._tangents(primals, outs, tangents)

    # -- reverse mode --------------------------------------------------------------------------

    def _cotangents(self, args, outs, g, nz, info=None):
        """Cotangents ``(consts, slots, rows)`` (``None`` where not wanted) from the outputs'."""
        arrays, consts, slots, rows = args
        # Integer inputs (counts, indices, keys) take no cotangent: a symbolic zero, never a
        # float0 array that a derived fold would have to add up.
        flat = (*consts, *slots, *rows)
        nz = tuple(f and _is_float(_aval(a)) for f, a in zip(nz, flat, strict=True))
        out_leaves = jax.tree.leaves(self.out_aval)
        g_leaves = jax.tree.leaves(g, is_leaf=_is_zero)
        gnz = tuple(
            not _is_zero(x) and _is_float(a) for x, a in zip(g_leaves, out_leaves, strict=True)
        )
        if not any(nz) or not any(gnz):
            return None
        no, nt = len(self.out_aval[0]), len(self.out_aval[1])
        g_slot = self.prepare_slot_cotangents(_pick(g_leaves[:no], gnz[:no]))
        g_tot = _pick(g_leaves[no : no + nt], gnz[no : no + nt])
        g_row = _pick(g_leaves[no + nt :], gnz[no + nt :])
        if info is None:
            info = self.info(outs) if self.num_info() else ()
        derived = self.derive("vjp", self._shape(nz, gnz))
        ct_s, ct_c, ct_r = derived(
            arrays, (*consts, *g_tot), (*slots, *info, *g_slot), (*rows, *g_row)
        )
        nc, ns, nr = self._counts()
        nz_c, nz_s, nz_r = nz[:nc], nz[nc : nc + ns], nz[nc + ns :]
        cts = (
            _fill([None] * nc, nz_c, ct_c),
            _fill([None] * ns, nz_s, ct_s),
            _fill([None] * nr, nz_r, ct_r),
        )
        return self.finish_cotangents(args, cts)

    def _tangent_parent(self):
        """``(parent, shape)`` if this fold is the tangent fold (``derive("jvp", shape)``) of
        ``parent``, batched like this one; else None."""
        if isinstance(self, Batched):
            got = self.inner._tangent_parent()
            if got is None:
                return None
            parent, shape = got
            a, c, s, r = self.dims
            dims = (a, c[: shape.nc], s[: shape.ns], r[: shape.nr])
            return Batched(parent, self.size, dims), shape
        return self.spec.origin

    def transpose(self, out_ct, *args):
        """Transpose in the arguments given as accumulators (``jax.grad`` is ``jvp`` then this).
        A tangent fold transposed in all of its tangents is the parent's cotangent fold; any
        other additive fold is linear in its tangent or cotangent inputs (``_transpose_linear``)."""
        got = self._tangent_parent()
        if got is None or not self._transpose_tangent_fold(*got, out_ct, args):
            self._transpose_linear(out_ct, *args)

    def _transpose_tangent_fold(self, parent, shape, out_ct, args) -> bool:
        """The parent's cotangent fold (mesh handling included), when exactly the tangent
        inputs are being transposed; False (nothing done) otherwise."""
        arrays, consts, slots, rows = args
        nc, ns, ni, nr = shape.nc, shape.ns, shape.ni, shape.nr
        tangents = [*consts[nc:], *slots[ns + ni :], *rows[nr:]]
        primals = [*consts[:nc], *slots[: ns + ni], *rows[:nr]]
        if not all(_is_accum(t) for t in tangents) or any(_is_accum(p) for p in primals):
            return False
        p_args = (arrays, tuple(consts[:nc]), tuple(slots[:ns]), tuple(rows[:nr]))
        g = out_ct if parent.spec.monoid is None else _parent_cotangent(parent, out_ct[0])
        cts = parent._cotangents(p_args, None, g, shape.nz, info=tuple(slots[ns : ns + ni]))
        if cts is not None:
            flat = [c for part in cts for c in part]
            _accumulate_flat(tangents, [c for c, f in zip(flat, shape.nz, strict=True) if f])
        return True

    def _transpose_linear(self, out_ct, *args):
        """The cotangent fold at zeros for the arguments being transposed."""
        flat = [a for part in args[1:] for a in part]
        nz = tuple(_is_accum(a) for a in flat)
        vals = [jnp.zeros(a.aval.shape, a.aval.dtype) if _is_accum(a) else a for a in flat]
        nc, ns, _ = self._counts()
        parts = (tuple(vals[:nc]), tuple(vals[nc : nc + ns]), tuple(vals[nc + ns :]))
        _accumulate(flat, self._cotangents((args[0], *parts), None, out_ct, nz))

    # -- batching ------------------------------------------------------------------------------

    def batch(self, axis_data, args, dims):
        def move(a, d):
            return a if d is None else jnp.moveaxis(a, d, 0)

        leaf = lambda x: x is None  # noqa: E731
        if all(d is None for d in jax.tree.leaves(dims, is_leaf=leaf)):
            return self(*args), jax.tree.map(lambda _: None, self.out_aval)
        args = jax.tree.map(move, args, dims, is_leaf=leaf)
        flags = jax.tree.map(lambda d: None if d is None else 0, dims, is_leaf=leaf)
        out = Batched(self, axis_data.size, flags)(*args)
        return out, jax.tree.map(lambda _: 0, self.out_aval)

    # -- hooks ---------------------------------------------------------------------------------

    def prepare_slot_cotangents(self, g_slot):
        return g_slot

    def finish_cotangents(self, args, cts):
        return cts


def _is_accum(a) -> bool:
    return hasattr(a, "accum") and hasattr(a, "freeze")


def _accumulate(accums, cts):
    if cts is not None:
        _accumulate_flat(accums, [c for part in cts for c in part])


def _accumulate_flat(accums, flat):
    for acc, ct in zip(accums, flat, strict=True):
        if ct is not None and _is_accum(acc):
            acc.accum(ct)


def _parent_cotangent(parent, slot_cts):
    """The parent's output cotangents from its tangent fold's: that fold's slot outputs are
    the parent's float slot outputs."""
    it = iter(slot_cts)
    zero = lambda a: Zero(a.to_tangent_aval())  # noqa: E731
    slot = tuple(next(it) if _is_float(a) else zero(a) for a in parent.out_aval[0])
    return (slot, *(tuple(map(zero, part)) for part in parent.out_aval[1:]))


def _parts(flat, nz, nc, ns):
    """The flagged leaves of ``consts + slots + rows``, split back into the three."""
    return _unflag(_pick(flat, nz), nz, nc, ns)


def _args(arrays, consts, slots, rows):
    return (tuple(arrays), tuple(consts), tuple(slots), tuple(rows))


class Fold(_Rules):
    """One streamed fold (see the module docstring): ``Fold(spec, avals)(arrays, consts, slots,
    rows)``, ``avals`` the four tuples' avals."""

    def __init__(self, spec: Spec, avals):
        self.in_avals = avals
        self.out_aval = _typed_out_avals(spec, avals)
        self.params = dict(spec=spec)
        super().__init__()

    def expand(self, *args):
        spec, args = self.spec, jax.tree.map(jnp.asarray, args)
        if _direct.applies(spec.direct, spec, spec.scale):
            return _direct.lower(spec.direct, self.out_aval, spec.plan.num_slots, *args)
        units = plan_units(spec, self.in_avals)
        return _run(spec, units, self.out_aval, *args)

    def scaled(self, k):
        return Fold(self.spec.replace(scale=self.spec.scale * k), self.in_avals)

    def num_info(self):
        if self.spec.monoid is None:
            return 0
        return len(jax.eval_shape(lambda o: tuple(self.spec.monoid.info(o)), self.out_aval[0]))

    def info(self, outs):
        return () if self.spec.monoid is None else tuple(self.spec.monoid.info(outs[0]))

    def derive(self, kind, shape):
        spec = self.spec
        if kind == "jvp":
            body = _jvp_body(spec, shape)
            psum = spec.monoid is not None or spec.slot_psum
        else:
            body, psum = _vjp_body(spec, shape, self.out_aval), False
        origin = (self, shape) if kind == "jvp" else None
        direct = _direct.DERIVED[spec.direct].get(kind) if spec.direct else None
        return _Derived(
            spec.replace(
                body=body, monoid=None, fill=0.0, slot_psum=psum, origin=origin, direct=direct
            )
        )

    def prepare_slot_cotangents(self, g_slot):
        if self.spec.monoid is not None and self.spec.axes:
            return [_shard.replicated_cotangent(g, self.spec.axes) for g in g_slot]
        return g_slot

    def finish_cotangents(self, args, cts):
        """On a mesh, the cotangent of an input replicated along the fold's axes is the sum of
        every device's share (where types are tracked; see :mod:`foldax._shard`)."""
        axes = self.spec.axes + self.spec.ring
        if not axes:
            return cts
        return tuple(
            [_shard.reduce_cotangent(c, a, axes) for c, a in zip(part, primals, strict=True)]
            for part, primals in zip(cts, args[1:], strict=True)
        )


class _Derived:
    """A derived fold, built when it is called (its arguments' avals are known then)."""

    def __init__(self, spec):
        self.spec = spec

    def build(self, avals):
        return Fold(self.spec, avals)

    def __call__(self, *args):
        args = _args(*args)
        return self.build(jax.tree.map(_aval, args))(*args)


class _DerivedBatched(_Derived):
    """A derived fold of a batched fold: the inner fold's derivative, batched like it."""

    def __init__(self, inner, size, dims):
        self.inner, self.size, self.dims = inner, size, dims

    def build(self, avals):
        def unmap(a, d):
            return a if d is None else _shaped(a, a.shape[1:])

        inner = self.inner.build(jax.tree.map(unmap, avals, self.dims, is_leaf=_leaf_none))
        return Batched(inner, self.size, self.dims)


def _leaf_none(x):
    return x is None


class Batched(_Rules):
    """A fold under ``vmap``: the inner fold's implementation ``vmap`` ped, its plan scaled by
    the batch size first (so that a step's working set over the whole batch stays within the
    budget). Its rules are the inner fold's, batched the same way."""

    def __init__(self, inner, size, dims):
        def unmap(a, d):
            return a if d is None else _shaped(a, (size, *a.shape))

        dims = _freeze(dims)
        self.in_avals = jax.tree.map(unmap, inner.in_avals, dims, is_leaf=_leaf_none)
        self.out_aval = jax.tree.map(lambda a: unmap(a, 0), inner.out_aval)
        self.params = dict(inner=inner, size=size, dims=dims)
        super().__init__()

    @property
    def spec(self):
        return self.inner.spec

    def expand(self, *args):
        if self.size == 0:  # an empty batch: empty outputs, nothing to plan or run
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.out_aval)
        inner = self.inner.scaled(self.size)
        vmapped = jax.vmap(inner.expand, in_axes=self.dims, out_axes=0, axis_size=self.size)
        return vmapped(*args)

    def scaled(self, k):
        return Batched(self.inner.scaled(k), self.size, self.dims)

    def num_info(self):
        return self.inner.num_info()

    def info(self, outs):
        return jax.vmap(self.inner.info)(outs)

    def derive(self, kind, shape):
        arrays_d, consts_d, slots_d, rows_d = self.dims
        nc, ns, _ = self._counts()
        if kind == "jvp":  # a tangent is batched like its primal
            extra_c, extra_s, extra_r = _parts([*consts_d, *slots_d, *rows_d], shape.nz, nc, ns)
        else:  # the outputs, and so their cotangents, are all batched
            no, nt = len(self.out_aval[0]), len(self.out_aval[1])
            extra_s = [0] * sum(shape.gnz[:no])
            extra_c = [0] * sum(shape.gnz[no : no + nt])
            extra_r = [0] * sum(shape.gnz[no + nt :])
        dims = (
            arrays_d,
            (*consts_d, *extra_c),
            (*slots_d, *([0] * shape.ni), *extra_s),
            (*rows_d, *extra_r),
        )
        return _DerivedBatched(self.inner.derive(kind, shape), self.size, _freeze(dims))

    def prepare_slot_cotangents(self, g_slot):
        return self.inner.prepare_slot_cotangents(g_slot)

    def finish_cotangents(self, args, cts):
        """The inner fold's finishing (per batch element), then the cotangents of arguments
        that are not batched here summed over the batch."""
        dims = self.dims[1:]
        cts = jax.vmap(self.inner.finish_cotangents, in_axes=(self.dims, 0))(args, cts)
        return tuple(
            [
                c if c is None or d is not None else jnp.sum(c, axis=0)
                for c, d in zip(p, pd, strict=True)
            ]
            for p, pd in zip(cts, dims, strict=True)
        )


def _freeze(dims):
    return tuple(tuple(p) for p in dims)


__all__ = ["Batched", "Fold", "Spec", "plan_units", "unit_bytes"]
