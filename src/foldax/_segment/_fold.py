"""Segment reductions on the engine: a user's ``fn`` as a fold body, and segment softmax.

Every public segment reduction is :func:`fold` (rows into per-segment monoid results) or
:func:`normalize` (one output per row: a segment softmax / log-softmax). Both build a body for
the engine (:mod:`foldax._engine`) from the user's ``fn``, which is traced once for a block of rows
with the arrays it closes over hoisted into explicit constants (model parameters, tracers of an
enclosing ``vmap`` or ``grad``), and ``vmap`` ped over the rows of a step: the engine chooses the
step size when it is lowered, after every transformation, so the body must fit any step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _closure, _engine, _shard
from .._engine._budget import DEFAULT_BUDGET
from .._reductions import LOGMEANEXP, LOGSUMEXP, MAX, MEAN, MIN, SUM
from .._reductions._base import _accumulator as accumulator
from .._reductions._base import _finite_or_zero, log_of_sum_where

#: ``fn`` is traced for a block of this many rows; a step runs it on its rows block by block.
ROW_BLOCK = 8


def example_rows(data, size, axes=()):
    """Abstract rows of ``data`` (``size`` of them) for tracing a user's ``fn``."""
    return jax.tree.map(lambda a: _shard.example(a, (size, *jnp.shape(a)[1:]), axes), data)


def in_blocks(run, rows):
    """``run`` (of blocks of :data:`ROW_BLOCK` rows: a tuple of leaves) on ``R`` rows, ``vmap`` ped
    over the blocks; when ``R`` is not a multiple of the block, the last block is completed with
    copies of the last row (computed, then dropped)."""
    r = rows[0].shape[0]
    pad = -r % ROW_BLOCK
    if pad:
        rows = [jnp.concatenate([a, jnp.broadcast_to(a[-1:], (pad, *a.shape[1:]))]) for a in rows]
    blocks = [a.reshape(((r + pad) // ROW_BLOCK, ROW_BLOCK, *a.shape[1:])) for a in rows]
    out = jax.vmap(run)(*blocks)
    return jax.tree.map(lambda o: o.reshape((r + pad, *o.shape[2:]))[:r], out)


def row_fn(fn, data, axes=()):
    """``(f, consts)``: ``f(consts, rows)`` maps a step's rows (a tuple of the leaves of
    ``data``, leading axis ``R``) to values ``(R, *F)``.

    The engine chooses the step size when it lowers the fold, after every transformation, so
    ``fn`` (row-wise by contract) is traced here once, for a block of :data:`ROW_BLOCK` rows,
    every array it closes over (parameters, tracers of enclosing transformations) hoisted into
    ``consts`` (the engine differentiates with respect to them); a step ``vmap`` s the trace over
    its blocks of rows (:func:`in_blocks`). Blocks, not single rows: XLA:CPU vectorises a
    ``(R / 8, 8, F)`` computation as well as ``(R, F)``, but an ``(R, 1, F)`` one several times
    slower. On a mesh the example rows are typed as varying along ``axes`` like the rows ``fn``
    will meet, so that the trace records the casts its constants need.
    """
    if fn is None:
        return (lambda consts, rows: rows[0]), ()
    tree = jax.tree.structure(data)
    closed, consts = _closure.trace(fn, example_rows(data, ROW_BLOCK, axes))

    def f(consts, rows):
        return in_blocks(lambda *block: closed(consts, jax.tree.unflatten(tree, block)), rows)

    return f, tuple(jnp.asarray(c) for c in consts)


def replay_rows(closed, consts):
    """``fn`` again, from its trace on a block of rows (see :func:`foldax._closure.trace`) and
    the arrays it closed over: a row-wise function of any number of rows."""
    tree = closed.in_tree.children()[0]

    def fn(rows):
        run = lambda *block: closed(consts, jax.tree.unflatten(tree, block))  # noqa: E731
        return in_blocks(run, jax.tree.leaves(rows))

    return fn


def _tiles(v, mask):
    """Values ``(G*T, *F)`` -> ``(G, T, *F)`` for a ``(G, T)`` step."""
    return v.reshape((*mask.shape, *v.shape[1:]))


def fold(name, monoid, fn, data, plan, arrays, axes=(), all_outputs=False, scatter=True):
    """Reduce ``fn(rows)`` (or the rows) into ``plan.num_slots`` monoid results ``(S, *F)`` (with
    ``all_outputs``, every output of the monoid, the result first).

    ``plan``: a :class:`foldax._engine.PlanSpec` over this device's rows, ``arrays`` its integer
    arrays. Inside ``shard_map`` with the rows split over ``axes``, the states are all-reduced.
    The engine's rules stream every derivative (see :mod:`foldax._engine._primitive`).
    ``scatter``: whether plain data may take XLA's scatters (:func:`scatters`) when unbatched.
    """
    f, consts = row_fn(fn, data, axes)

    def body(consts, slots, rows, mask, index):
        return _tiles(f(consts, rows), mask), (), ()

    plain = scatter and plan.kind == "rows"
    direct = scatters(fn, jnp.result_type(data), monoid, axes) if plain else None
    if scatter and plan.kind == "tiles":
        direct = runs(fn, data, monoid, axes)
    budget = _engine.current_budget()
    spec = _engine.Spec(plan, body, monoid, budget, axes=axes, name=name, direct=direct)
    outs, _, _ = _engine.fold(spec, arrays, consts, (), jax.tree.leaves(data))
    return outs if all_outputs else outs[0]


def scatters(fn, dtype, monoid, axes) -> str | None:
    """The scatter a fold under per-row ids is when it is not batched (a kind of
    :mod:`foldax._engine._direct`), or ``None``: plain data (no ``fn``) on one device, reduced
    by a max / min (a scatter-max and the count of rows attaining it), or, in a dtype that
    accumulates in itself, by a sum (``jax.ops.segment_sum``'s program and numbers) or a
    log-sum-exp (a scatter-max, then a scatter-add of the shifted exponentials), sorted ids or
    not. Half-precision sums keep the walk (it accumulates in float32 without a float32 copy of
    the data); contiguous segments scatter or walk as :mod:`._policy` says."""
    if fn is not None or axes:
        return None
    if monoid in (MAX, MIN):
        return f"scatter_{monoid.name}"
    if accumulator(dtype) != dtype:
        return None
    return _SCATTERS.get(monoid)


def runs(fn, data, monoid, axes) -> str | None:
    """The program a fold over contiguous segments is when it is not batched (a kind of
    :mod:`foldax._engine._direct`), or ``None`` (the walk): a log-sum-exp (or log-mean-exp) of
    plain data, one value per row, enough rows to be worth it (:func:`._engine.reads_once`), on
    one device, read once (:mod:`foldax._engine._runs`)."""
    if fn is not None or axes or not hasattr(data, "ndim") or data.ndim != 1:
        return None
    return _RUNS.get(monoid) if _engine.reads_once(data.shape[0]) else None


_RUNS = {LOGSUMEXP: "runs_logsumexp", LOGMEANEXP: "runs_logmeanexp"}

#: the scatter of each additive reduction, in a dtype that accumulates in itself
_SCATTERS = {
    SUM: "scatter",
    MEAN: "scatter_mean",
    LOGSUMEXP: "scatter_logsumexp",
    LOGMEANEXP: "scatter_logmeanexp",
}


def _per_row(a, t):
    """Per-slot ``a`` ``(G, *F)`` repeated for each of a step's ``t`` rows ``(G * t, *F)``."""
    if t == 1:
        return a
    return jnp.broadcast_to(a[:, None], (a.shape[0], t, *a.shape[1:])).reshape(-1, *a.shape[1:])


def normalize(name, fn, data, plan, arrays, log, axes=()):
    """Per-row ``fn(rows) - logsumexp_segment`` (``log``) or its ``exp`` (a segment softmax).

    Two folds: a log-sum-exp per segment, then an additive fold that writes the ``(N, *F)`` rows
    from it (rows in no segment, and rows of a segment whose log-sum-exp is -inf, are NaN). Their
    derivatives compose: the per-row fold's cotangent fold gives the log-sum-exps' cotangents
    (``-sum g * y`` per segment), which the first fold's pulls back through ``fn``.

    The log-sum-exp enters as its max and log-sum apart (``(x - max) - log(sum)``, in float32 for
    half-precision values), so the rows keep float32's relative precision for logits of any size.
    """
    # (plain data on one CPU takes jraph's program instead: normalize_rows; a user's fn, a mesh
    # and half precision walk here)
    outs = fold(name, LOGSUMEXP, fn, data, plan, arrays, axes, all_outputs=True, scatter=False)
    f, consts = row_fn(fn, data, axes)

    def body(consts, slots, rows, mask, index):
        v = f(consts, rows)
        m_r, rel_r = (_per_row(a, mask.shape[1]) for a in slots)
        z = (v.astype(rel_r.dtype) - _finite_or_zero(m_r)) - rel_r
        # NaN rows (an all -inf segment, +inf or NaN values) and rows read but not owned by this
        # step (read against another segment's log-sum-exp) get no gradient: the cotangent of
        # the branch not taken is exactly 0.
        own = mask.reshape((-1,) + (1,) * (z.ndim - 1))
        bad = jnp.isnan(z) | (m_r == -np.inf) | (m_r == np.inf) | ~own
        z = jnp.where(bad, jnp.zeros((), z.dtype), z)
        z = z if log else jnp.exp(z)
        return (), (), (jnp.where(bad, jnp.asarray(np.nan, z.dtype), z).astype(v.dtype),)

    spec = _engine.Spec(
        plan, body, None, _engine.current_budget(), fill=np.nan, axes=axes, name=name
    )
    slots = LOGSUMEXP.info(outs)
    _, _, (out,) = _engine.fold(spec, arrays, consts, slots, jax.tree.leaves(data))
    return out


def extremum_by_scatters(monoid, dtype, chunk, n, features) -> bool:
    """Whether a fold that :func:`scatters` takes :func:`extremum_rows`: a max or min of
    floating values (integer and bool ones have no derivative to change), no explicit
    ``chunk_size``, and its derivative's ``(N, *F)`` intermediates within a budget the user set
    (else the derivative walks, in steps)."""
    if monoid not in (MAX, MIN) or not jnp.issubdtype(dtype, jnp.floating) or chunk is not None:
        return False
    return _fits_budget(n, features, dtype)


def _fits_budget(n, features, dtype) -> bool:
    """Whether two ``(N, *F)`` intermediates at once keep to the memory budget: the default one
    bounds the streamed folds only (rows that exist take the jax.ops program), one the user
    set binds."""
    budget = _engine.current_budget()
    needed = 2 * n * int(np.prod(features, dtype=np.int64)) * np.dtype(dtype).itemsize
    return budget == DEFAULT_BUDGET or needed <= budget


def extremum_rows(name, monoid, data, plan, arrays):
    """A segment max / min of plain floating ``data`` ``(N, *F)`` under per-row ids (a
    ``"rows"`` plan), the fold (a scatter-max / -min on one CPU) with the derivative of the
    ``jax.ops`` program: ``dy = sum(where(x == y[ids], dx, 0)) / count`` per segment, ``count``
    the rows attaining its extreme (the fold's second output; NaN attains none), so ties share
    evenly, and rows dropped or in an empty or NaN segment take none. Reverse mode keeps the
    ``(N, *F)`` booleans ``x == y[ids]`` and the counts, not the rows: as a drop-in on rows
    computed in the same jit (messages), its gradient holds less than the ``jax.ops`` one
    (the fold's own derivative kept the rows and a gathered state beside them)."""
    num = plan.num_slots

    # The ids are an argument of the custom_jvp, not a closure: an array closed over (a tracer
    # of an enclosing jit) would leak into the derivative's trace as a constant.
    @jax.custom_jvp
    def extremum(x, ids):
        return fold(name, monoid, None, x, plan, (ids,))

    @extremum.defjvp
    def _(primals, tangents):
        (x, ids), (t, _) = primals, tangents
        y, count = fold(name, monoid, None, x, plan, (ids,), all_outputs=True)
        # a clamped gather: a dropped row's hit is dropped again by the sum
        hit = x == jnp.take(y, jnp.clip(ids, 0, num - 1), axis=0, mode="clip")
        total = fold(name, SUM, None, jnp.where(hit, t, jnp.zeros((), t.dtype)), plan, (ids,))
        return y, total / jnp.maximum(count, 1).astype(total.dtype)

    return extremum(data, *arrays)


def normalizes_by_scatters(fn, dtype, axes, chunk, n, features) -> bool:
    """Whether a segment softmax or log-softmax of plain data (no ``fn``) on one device takes
    :func:`normalize_rows`: values that accumulate in their own dtype (half precision keeps the
    walk, which accumulates in float32 without a float32 copy of the data), no explicit
    ``chunk_size``, and its two ``(N, *F)`` intermediates within a budget the user set."""
    if fn is not None or axes or chunk is not None or accumulator(dtype) != dtype:
        return False
    return _fits_budget(n, features, dtype)


@dataclasses.dataclass(frozen=True)
class _Table:
    """The slots of :func:`normalize_rows`' unsorted ids: segment ``s`` in slot ``s``, one
    extra slot ``S`` read by every row in no segment (an id of ``S`` scatters there, other ids
    out of range are dropped; the gathers wrap -1 to it and clamp larger ids to it)."""

    num: int

    @property
    def slots(self) -> int:
        return self.num + 1

    def slot(self, ids):
        return ids

    def extra(self, slot):
        return slot == self.num

    def reader(self, ids):
        index = jnp.maximum(ids, -1)
        return lambda a: a[index]


@dataclasses.dataclass(frozen=True)
class _SortedTable(_Table):
    """The slots of sorted ids: segment ``s`` in slot ``s + 1`` between two extra slots, so that
    the slots read and written stay in the ids' order and every gather and scatter keeps the
    sorted hint (their transposes too). Without it, a TPU compiles each gradient's scatter-add
    for 12-18 s and runs it in 60 ms where the sorted one takes 1 s and 34 ms (4 M rows of 128
    features into 400,000 segments, ``python dev/tpu/sorted_compile.py``)."""

    @property
    def slots(self) -> int:
        return self.num + 2

    def slot(self, ids):
        """Every id out of range in an extra slot (clamped before the shift: in order, and no
        id overflows), whose sums and max are read by its own rows only (all NaN)."""
        return jnp.clip(ids, -1, self.num) + 1

    def extra(self, slot):
        return (slot == 0) | (slot == self.num + 1)

    def reader(self, ids):
        index = self.slot(ids)
        return lambda a: a.at[index].get(mode="promise_in_bounds", indices_are_sorted=True)


def normalize_rows(name, data, plan, arrays, log=False, platform="cpu"):
    """A segment softmax (``log``: log-softmax) of plain ``data`` ``(N, *F)`` under per-row ids
    (a ``"rows"`` plan): jraph's program -- the segments' max, the shifted exponentials summed,
    each row divided by its sum (``log``: less the log of its sum): a scatter-max, the engine's
    sum folds and XLA's gathers, so it costs what that program costs, derivatives included.

    Numerics: each segment is shifted by its own max, ``exp(x - max) / sum`` (within 2 ulp of
    the softmax; ``log``: ``(x - max) - log(sum)``); as :func:`normalize`'s, rows in no segment,
    and every row of a segment that is all -inf or holds a +inf or NaN, are NaN and take no
    gradient. The derivative is the softmax's (``dy = p * (dx - sum(p * dx))`` per segment,
    ``p`` the softmax; the log-softmax's ``dy = dx - sum(p * dx)``): a scatter and a gather,
    and the saved output. ``platform``: the backend it runs on (on ``"tpu"`` sorted ids keep
    the sorted hint in every gather and scatter, their transposes included)."""
    num = plan.num_slots
    # Rows in no segment go to an extra slot whose max is NaN, so every row of theirs is NaN:
    # the folds have a slot more (an id of S goes there, negative ones are dropped) and the
    # gathers read it for any id out of range (-1 wraps to it, S and above clamp to it). The
    # NaN is the max's initial value: no (N,) or (N, *F) mask is made, and nothing stands
    # between the scatter and its gathers (XLA:CPU fuses any such op into the gather, evaluated
    # per row: a select there, or an update of the one slot, made the whole softmax 1.4-1.7x
    # slower than jraph's). On a TPU sorted ids keep their order instead (see _SortedTable;
    # on a CPU its shifted ids made the forward 1.0-1.2x jraph's, from 0.9x, and held them).
    table = _SortedTable(num) if plan.sorted_ids and platform == "tpu" else _Table(num)
    log_sum = log_of_sum_where(platform == "tpu")  # (the log-softmax's)
    plan = dataclasses.replace(plan, num_slots=table.slots)
    dims = lax.ScatterDimensionNumbers(tuple(range(1, data.ndim)), (0,), (0,))

    def run(x, ids):
        """``(output, softmax, at_rows, sums)``. A +inf or NaN max is kept (every row of its
        segment is NaN, as jax.nn.softmax's), so is -inf (x - max is NaN on every row of an all
        -inf segment). Built from ``ids`` passed in: the custom_jvp below closes over no array
        (a tracer of an enclosing jit closed over leaks into the derivative's trace)."""
        slot = table.slot(ids)
        at_rows = table.reader(ids)
        sums = lambda v: fold(name, SUM, None, v, plan, (slot,))  # noqa: E731
        # The max is a shift only (the derivative below is the softmax's own): a scatter-max,
        # as jraph's, into a table whose extra slots start at NaN (a NaN max stays NaN), made
        # from an iota (XLA does not fold that into a constant as large as the table). It
        # scatters by the ids themselves, those out of the table dropped: a table of clamped
        # ids would be one more (N,) array live beside the exponentials.
        extra = table.extra(lax.broadcasted_iota(jnp.int32, (table.slots, *x.shape[1:]), 0))
        init = jnp.where(extra, jnp.asarray(np.nan, x.dtype), jnp.asarray(-np.inf, x.dtype))
        drop = lax.GatherScatterMode.FILL_OR_DROP
        top = lax.scatter_max(
            init, slot[:, None], x, dims, indices_are_sorted=plan.sorted_ids, mode=drop
        )
        d = x - at_rows(top)
        e = jnp.exp(d)
        total = sums(e)
        # One (N, *F) intermediate, the exponentials, read by the sum and by the division (as
        # jraph's). A quotient of two correctly rounded numbers: within 2 ulp of the softmax,
        # where exp(x - max - log(sum)) loses |x - max| ulp.
        total_r = at_rows(total)
        p = e / total_r
        if log:  # NaN where the softmax is (0 / 0 in an all -inf segment)
            return d - at_rows(log_sum(total)), p, at_rows, sums
        # for the derivative: -0 on the bad rows, tested on the quotient's operands so that
        # XLA makes both in one loop (one array of rows fewer in the gradient)
        bad = jnp.isnan(e) | jnp.isnan(total_r)
        return p, jnp.where(bad, jnp.asarray(-0.0, p.dtype), p), at_rows, sums

    @jax.custom_jvp
    def normalized(x, ids):
        return run(x, ids)[0]

    @normalized.defjvp
    def _(primals, tangents):
        (x, ids), (t, _) = primals, tangents
        y, p, at_rows, sums = run(x, ids)
        # The softmax, -0 on the bad rows, which take no gradient: p alone is what reverse mode
        # keeps, its sign bit the mask (a softmax is +0 where it underflows). Masked after the
        # product, so that a NaN or infinite dx makes NaN where p is 0 on a row that is not
        # bad, as the walk's p * dx (a bad row only meets the sums of segments whose rows are
        # all bad: a +inf or NaN, all -inf, the extra slot).
        if log:  # dy = dx - sum(p * dx), dx masked first: reverse mode sums the cotangent
            # itself (as the jax.ops program does: no masked copy of it) and masks last
            p = jnp.where(jnp.isnan(p), jnp.asarray(-0.0, p.dtype), p)
            t = jnp.where(jnp.signbit(p), jnp.zeros((), t.dtype), t)
            return y, t - at_rows(sums(p * t))
        bad = jnp.signbit(p)
        by_p = lambda v: jnp.where(bad, jnp.zeros((), v.dtype), p * v)  # noqa: E731
        v = by_p(t)
        return y, v - by_p(at_rows(sums(v)))

    return normalized(data, *arrays)


__all__ = [
    "example_rows",
    "extremum_by_scatters",
    "extremum_rows",
    "fold",
    "in_blocks",
    "normalize",
    "normalize_rows",
    "normalizes_by_scatters",
    "replay_rows",
    "row_fn",
    "scatters",
]
