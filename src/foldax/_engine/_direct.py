"""Folds that lower to XLA's scatters and gathers: nothing is gained by streaming them.

A sum of rows that already exist (plain data, no ``fn``) under arbitrary ``segment_ids`` needs
no working memory at all: XLA's scatter-add reads each row once and adds it into its segment
in place, and fuses the rows' producer into itself. The tile walk would add the same rows in
the same order, in steps, with a masked copy of each step: the same numbers, slower (``jax.ops``
is this scatter). Such a fold carries ``Spec.direct``; :class:`foldax._engine._primitive.Fold`
lowers it here, and its derived folds are direct too (the tangent of a scatter-add is the
scatter-add of the tangent rows, its transpose the gather of the cotangent).

Only a fold that is not batched, and lowered for CPU, is lowered directly (XLA:GPU's scatter-add
into few segments has been reported far slower than the walk; the primitive registers a CPU
lowering of its own, :mod:`._registration`). Under ``vmap`` XLA's scatter wants the
scattered axis outermost and copies the whole batch of rows to get it (``(B, N) -> (N, B)``),
where the tile walk stays within the budget and is faster too; a batched fold keeps the walk.

Kinds (the fold's arguments are ``(arrays, consts, slots, rows)``; ``arrays = (ids,)`` of a
``"rows"`` plan, int32; every id outside ``[0, S)`` is dropped):

* ``"scatter"``: outputs ``((sum of rows[0] per slot,), (), ())`` -- the primal fold;
* ``"scatter_tangent"``: the same of the tangent rows, ``rows[-1]`` (its tangent fold);
* ``"gather"``: outputs ``((), (), (cotangent per row,))`` from ``slots[-1]``, 0 on rows
  dropped (its cotangent fold);
* ``"scatter_max"`` / ``"scatter_min"``: outputs ``((extreme, count), (), ())`` per slot, the
  states of :class:`foldax._reductions.Max` / ``Min`` (a scatter-max, then a scatter-add of
  the rows that attain it; NaN wins and counts none, as the monoid's);
* ``"scatter_logsumexp"`` / ``"scatter_logmeanexp"``: the outputs of
  :class:`foldax._reductions.LogSumExp` (result, max, log of the shifted sum[, count]): a
  scatter-max, then a scatter-add of ``exp(x - max)`` -- the per-segment shift kept;
* ``"lse_gather"``: the cotangent fold of a log-sum-exp from its result's cotangent alone:
  outputs ``((), (), (g * softmax weight per row,))`` from ``slots = (m, rel, g)``;
* ``"whole"``: the fold's own step over every row at once (:func:`whole`), for the derived
  folds of the extrema and log-sum-exps: per row, its slot's states gathered, the body's tangent or cotangent,
  and for a tangent a scatter-add into the slots -- a gather and a scatter, without a loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ._budget import DEFAULT_BUDGET

#: The kind of each derived fold of a direct fold: ``DERIVED[kind][derivative]``.
_WHOLE = {"jvp": "whole", "vjp": "whole"}
DERIVED = {
    "scatter": {"jvp": "scatter_tangent", "vjp": "gather"},
    "scatter_max": _WHOLE,
    "scatter_min": _WHOLE,
    "scatter_logsumexp": _WHOLE,
    "scatter_logmeanexp": _WHOLE,
    "whole": _WHOLE,
    "scatter_tangent": {},
    "gather": {},
    "lse_gather": {},
}

_LOGSUMEXPS = ("scatter_logsumexp", "scatter_logmeanexp")


def derived(parent, derivative, shape):
    """The kind of the ``derivative`` (``"jvp"`` / ``"vjp"``) fold of a direct fold of kind
    ``parent`` with ``shape`` (:class:`foldax._engine._derived.Shape`), or ``None`` (walked).

    A log-sum-exp's gradient with respect to its rows, from its result's cotangent alone (what
    ``segment_logsumexp`` / ``segment_logmeanexp`` take), is ``"lse_gather"``: per row, the
    segment's cotangent times its softmax weight -- two gathers and an exponential."""
    if (
        parent in _LOGSUMEXPS
        and derivative == "vjp"
        and (shape.nc, shape.ns, shape.nr, tuple(shape.nz)) == (0, 0, 1, (True,))
        and tuple(shape.gnz[:1]) == (True,)
        and not any(shape.gnz[1:])
    ):
        return "lse_gather"
    return DERIVED[parent].get(derivative) if parent else None


def _segment_sum(x, ids, num_slots):
    return jax.ops.segment_sum(x, ids, num_slots, mode="drop")


def _at_rows(a, ids, num_slots):
    """``a[ids]`` per row; a row dropped reads some slot (a clamped gather: ``jnp.take``'s
    ``fill`` mode costs 2-3x as much on CPU)."""
    return jnp.take(a, jnp.clip(ids, 0, num_slots - 1), axis=0, mode="clip")


def _kept(ids, num_slots, v):
    """``v`` per row, 0 on the rows dropped."""
    keep = (ids >= 0) & (ids < num_slots)
    return jnp.where(keep.reshape(keep.shape + (1,) * (v.ndim - 1)), v, jnp.zeros((), v.dtype))


def _sum(ids, num_slots, slots, rows):
    return (_segment_sum(rows[0], ids, num_slots),), (), ()


def _sum_tangent(ids, num_slots, slots, rows):
    return (_segment_sum(rows[-1], ids, num_slots),), (), ()


def _sum_gather(ids, num_slots, slots, rows):
    return (), (), (_kept(ids, num_slots, _at_rows(slots[-1], ids, num_slots)),)


def _extremum(is_max):
    def lower(ids, num_slots, slots, rows):
        x = rows[0]
        reduce = jax.ops.segment_max if is_max else jax.ops.segment_min
        m = reduce(x, ids, num_slots, mode="drop")
        hit = _hits(x, ids, num_slots, m).astype(jnp.int32)
        return (m, _segment_sum(hit, ids, num_slots)), (), ()

    return lower


def _logsumexp(mean):
    def lower(ids, num_slots, slots, rows):
        x = rows[0]
        m = jax.ops.segment_max(x, ids, num_slots, mode="drop")
        shift = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
        s = _segment_sum(jnp.exp(x - _at_rows(shift, ids, num_slots)), ids, num_slots)
        logs = jnp.log(s)
        out = shift + logs
        if not mean:
            return (out, m, logs), (), ()
        count = _segment_sum(jnp.ones(ids.shape, jnp.int32), ids, num_slots)
        n = count.reshape(count.shape + (1,) * (out.ndim - 1)).astype(out.dtype)
        return (out - jnp.log(n), m, logs, count), (), ()

    return lower


def _lse_gather(ids, num_slots, slots, rows):
    """Per row ``g * exp(x - logsumexp)`` of its segment (``slots``: the log-sum-exp's info
    ``(m, rel = log(sum(exp(x - m))))`` and its result's cotangent ``g``), as
    ``exp(x - m) * (g / sum)``: two gathers per row (XLA:CPU's gathers, fused into the rows'
    loop, cost more than the arithmetic). As the walk's: 0 where the cotangent is 0, on rows
    dropped, in all -inf and NaN segments and on the finite rows of a +inf segment; NaN on a
    +inf row of a +inf segment with a cotangent."""
    x = rows[0]
    m, rel, g = slots
    g = g.astype(rel.dtype)
    shift = jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)  # NaN and +inf kept: masked below
    scale = jnp.where((m > -jnp.inf) & (g != 0), g * jnp.exp(-rel), jnp.zeros_like(rel))
    scale = jnp.where((m == jnp.inf) & (g != 0), jnp.full_like(rel, jnp.nan), scale)
    shift_r, scale_r = _at_rows(shift, ids, num_slots), _at_rows(scale, ids, num_slots)
    keep = ((ids >= 0) & (ids < num_slots)).reshape(ids.shape + (1,) * (x.ndim - 1))
    a = x.astype(rel.dtype) - shift_r
    live = keep & ~jnp.isnan(shift_r) & (scale_r != 0) & (a != -jnp.inf)
    out = jnp.where(live, jnp.exp(a) * scale_r, jnp.zeros_like(a))
    return (), (), (out.astype(x.dtype),)


def _hits(x, ids, num_slots, m):
    """The rows that attain their slot's extreme ``m`` (a row dropped may read as one: the
    scatter drops it again; so the shifted exponentials of the log-sum-exp)."""
    return x == _at_rows(m, ids, num_slots)


def whole(spec):
    """``spec`` walked in one step of every row: the loop's own step (its body, the monoid's
    merge, the rows' store) on the whole arrays, which XLA runs without a loop."""
    return spec.replace(plan=dataclasses.replace(spec.plan, chunk=None))


_LOWER = {
    "scatter": _sum,
    "scatter_tangent": _sum_tangent,
    "gather": _sum_gather,
    "scatter_max": _extremum(True),
    "scatter_min": _extremum(False),
    "scatter_logsumexp": _logsumexp(False),
    "scatter_logmeanexp": _logsumexp(True),
    "lse_gather": _lse_gather,
}


def lower(kind, out_avals, num_slots, arrays, consts, slots, rows):
    """The fold's outputs ``(slot outs, tots, row outs)``, matching ``out_avals``."""
    (ids,) = arrays
    outs = _LOWER[kind](ids, num_slots, slots, rows)
    return jax.tree.map(lambda o, a: o.astype(a.dtype), outs, tuple(map(tuple, out_avals)))


#: the kinds whose program holds an intermediate per row (a gathered state, an exponential)
_PER_ROW = ("whole", "scatter_logsumexp", "scatter_logmeanexp", "lse_gather")


def applies(kind, spec, platform, row_bytes=None) -> bool:
    """Whether a fold of ``kind`` (or ``None``) lowers directly: unbatched, on one device, on
    CPU (XLA:GPU's scatter-add into few segments has been reported far slower than the walk:
    there the walk stays until a device measurement says otherwise).

    A kind that holds an intermediate per row (a gathered state, an exponential: what the
    ``jax.ops`` program holds too, or less) also needs no explicit ``chunk_size`` and, under a
    budget the user set (:func:`foldax.memory_budget`), every row's working set to fit it at
    once (``row_bytes()``: the walk's per row): rows per step and a budget asked for are
    promises the direct program keeps too."""
    plain = (
        kind is not None
        and platform == "cpu"
        and spec.scale == 1
        and not (spec.axes or spec.ring)
        and spec.pair_mask is None
        and spec.plan.kind == "rows"
    )
    if not plain or kind not in _PER_ROW:
        return plain
    if spec.plan.chunk is not None:
        return False
    return spec.budget == DEFAULT_BUDGET or row_bytes() * spec.plan.n <= spec.budget


__all__ = ["DERIVED", "applies", "derived", "lower"]
