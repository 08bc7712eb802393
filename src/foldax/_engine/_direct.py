"""Folds that lower to XLA's scatters and gathers: nothing is gained by streaming them.

A sum of rows that already exist (plain data, no ``fn``) under arbitrary ``segment_ids`` needs
no working memory at all: XLA's scatter-add reads each row once and adds it into its segment
in place, and fuses the rows' producer into itself. The tile walk would add the same rows in
the same order, in steps, with a masked copy of each step: the same numbers, slower (``jax.ops``
is this scatter). Such a fold carries ``Spec.direct``; :class:`foldax._engine._primitive.Fold`
lowers it here, and its derived folds are direct too (the tangent of a scatter-add is the
scatter-add of the tangent rows, its transpose the gather of the cotangent).

Only a fold that is not batched, and lowered for CPU (or for a TPU, the kinds that are
``jax.ops``' own program), is lowered directly (XLA:GPU's scatter-add into few segments has been
reported far slower than the walk; the primitive registers a CPU and a TPU lowering of its own,
:mod:`._registration`). Under ``vmap`` XLA's scatter wants the
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
* ``"scatter_mean"``: outputs ``((sum / count, count), (), ())`` per slot, those of
  :class:`foldax._reductions.Mean`: two scatter-adds;
* ``"scatter_logsumexp"`` / ``"scatter_logmeanexp"``: the outputs of
  :class:`foldax._reductions.LogSumExp` (result, max, log of the shifted sum[, count]): a
  scatter-max, then a scatter-add of ``exp(x - max)`` -- the per-segment shift kept;
* ``"lse_gather"``: the cotangent fold of a log-sum-exp from its result's cotangent alone:
  outputs ``((), (), (g * softmax weight per row,))`` from ``slots = (m, rel, g)``;
* ``"mean_gather"``: the cotangent fold of a mean from its result's cotangent alone: outputs
  ``((), (), ((g / count)[ids],))`` from ``slots = (count, g)``, divided per slot;
* ``"runs_logsumexp"`` / ``"runs_logmeanexp"``: a log-sum-exp of one value per row over
  contiguous segments (a ``"tiles"`` plan) in one read of the data (:mod:`._runs`); their
  derived folds walk;
* ``"whole"``: the fold's own step over every row at once (:func:`whole`), for the derived
  folds of the extrema and log-sum-exps: per row, its slot's states gathered, the body's tangent or cotangent,
  and for a tangent a scatter-add into the slots -- a gather and a scatter, without a loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._reductions._base import _finite_or_zero, log_of_sum_where
from .._reductions._sum import mean_share
from ._budget import DEFAULT_BUDGET

#: The kind of each derived fold of a direct fold: ``DERIVED[kind][derivative]``.
_WHOLE = {"jvp": "whole", "vjp": "whole"}
DERIVED = {
    "scatter": {"jvp": "scatter_tangent", "vjp": "gather"},
    "scatter_max": _WHOLE,
    "scatter_min": _WHOLE,
    "scatter_mean": _WHOLE,
    "scatter_logsumexp": _WHOLE,
    "scatter_logmeanexp": _WHOLE,
    "whole": _WHOLE,
    "scatter_tangent": {},
    "gather": {},
    "lse_gather": {},
    "mean_gather": _WHOLE,
    "runs_logsumexp": {},
    "runs_logmeanexp": {},
}

#: The kinds over contiguous segments (a ``"tiles"`` plan), lowered by :mod:`._runs`.
RUNS = ("runs_logsumexp", "runs_logmeanexp")

_LOGSUMEXPS = ("scatter_logsumexp", "scatter_logmeanexp")


def derived(parent, derivative, shape):
    """The kind of the ``derivative`` (``"jvp"`` / ``"vjp"``) fold of a direct fold of kind
    ``parent`` with ``shape`` (:class:`foldax._engine._derived.Shape`), or ``None`` (walked).

    A log-sum-exp's gradient with respect to its rows, from its result's cotangent alone (what
    ``segment_logsumexp`` / ``segment_logmeanexp`` take), is ``"lse_gather"``: per row, the
    segment's cotangent times its softmax weight -- two gathers and an exponential. A mean's is
    ``"mean_gather"``: the cotangent divided by the count per segment, then gathered (one
    gather, as ``jax.ops``' own gradient; the rows' own division gathered the counts too and
    took twice its time on a TPU)."""
    result_only = (
        derivative == "vjp"
        and (shape.nc, shape.ns, shape.nr, tuple(shape.nz)) == (0, 0, 1, (True,))
        and tuple(shape.gnz[:1]) == (True,)
        and not any(shape.gnz[1:])
    )
    if result_only and parent in _LOGSUMEXPS:
        return "lse_gather"
    if result_only and parent == "scatter_mean":
        return "mean_gather"
    return DERIVED[parent].get(derivative) if parent else None


@dataclasses.dataclass(frozen=True)
class _Index:
    """A ``"rows"`` plan's ids ``(N,)`` into ``num_slots`` slots; ``in_range``: all known to lie
    in ``[0, num_slots)``, so no row is dropped; ``sorted``: known or promised to be sorted
    (:class:`foldax._engine.PlanSpec`)."""

    ids: jax.Array
    num_slots: int
    in_range: bool
    sorted: bool = False

    @property
    def _mode(self):
        return "promise_in_bounds" if self.in_range else "drop"

    def sum(self, x):
        """Rows ``x`` summed per slot, the rows dropped left out."""
        return jax.ops.segment_sum(
            x, self.ids, self.num_slots, indices_are_sorted=self.sorted, mode=self._mode
        )

    def extreme(self, x, is_max):
        """The max (``is_max``) or min of rows ``x`` per slot."""
        reduce = jax.ops.segment_max if is_max else jax.ops.segment_min
        return reduce(x, self.ids, self.num_slots, indices_are_sorted=self.sorted, mode=self._mode)

    def at_rows(self, a):
        """``a[ids]`` per row; a row dropped reads some slot (a clamped gather: ``jnp.take``'s
        ``fill`` mode costs 2-3x as much on CPU)."""
        if self.in_range:
            return a.at[self.ids].get(mode="promise_in_bounds", indices_are_sorted=self.sorted)
        ids = jnp.clip(self.ids, 0, self.num_slots - 1)
        return jnp.take(a, ids, axis=0, mode="clip", indices_are_sorted=self.sorted)

    def keep(self, ndim):
        """Whether each row is kept, broadcastable against values of ``ndim`` dimensions."""
        keep = (self.ids >= 0) & (self.ids < self.num_slots)
        return keep.reshape(keep.shape + (1,) * (ndim - 1))

    def kept(self, v):
        """``v`` per row, 0 on the rows dropped (a select per value, unless none is dropped)."""
        if self.in_range:
            return v
        return jnp.where(self.keep(v.ndim), v, jnp.zeros((), v.dtype))


def _sum(ix, slots, rows):
    return (ix.sum(rows[0]),), (), ()


def _sum_tangent(ix, slots, rows):
    return (ix.sum(rows[-1]),), (), ()


def _sum_gather(ix, slots, rows):
    return (), (), (ix.kept(ix.at_rows(slots[-1])),)


def _extremum(is_max):
    def lower(ix, slots, rows):
        x = rows[0]
        m = ix.extreme(x, is_max)
        hit = _hits(x, ix, m).astype(jnp.int32)
        return (m, ix.sum(hit)), (), ()

    return lower


def _mean(ix, slots, rows):
    """The mean's outputs ``(sum / count, count)`` (0 / 0 is NaN: the segment's ``empty``
    fills it later), from two scatter-adds."""
    s = ix.sum(rows[0])
    count = ix.sum(jnp.ones(ix.ids.shape, jnp.int32))
    return (s / count.reshape(count.shape + (1,) * (s.ndim - 1)).astype(s.dtype), count), (), ()


def _logsumexp(mean, refined):
    """The lowering of a (mean) log-sum-exp; ``refined``: its logarithms refined by a Newton
    step, as a TPU needs (:func:`foldax._reductions._base.log_of_sum_where`)."""
    log = log_of_sum_where(refined)

    def lower(ix, slots, rows):
        x = rows[0]
        m = ix.extreme(x, True)
        # the shift taken per row from the gathered max (not gathered from a shift per slot,
        # which XLA may keep as one more buffer of slots); _lse_gather makes the same
        s = ix.sum(jnp.exp(x - _finite_or_zero(ix.at_rows(m))))
        logs = log(s)
        out = _finite_or_zero(m) + logs
        if not mean:
            return (out, m, logs), (), ()
        count = ix.sum(jnp.ones(ix.ids.shape, jnp.int32))
        n = count.reshape(count.shape + (1,) * (out.ndim - 1)).astype(out.dtype)
        return (out - log(n), m, logs, count), (), ()

    return lower


def _lse_gather(ix, slots, rows):
    """Per row ``g * exp(x - logsumexp)`` of its segment (``slots``: the log-sum-exp's info
    ``(m, rel = log(sum(exp(x - m))))`` and its result's cotangent ``g``), as ``jax.ops``'
    program reads it: ``exp(x - m) * (g / sum)``, the exponentials and their sums made again
    exactly as the forward makes them (:func:`_logsumexp`), so that in one program XLA makes
    them once (and with jax 0.12 keeps the exponentials in the output's buffer), and the
    scale per segment is a division, which XLA:CPU evaluates once per row where it fuses it
    into the gather (``g exp(-rel)`` cost a logarithm and two exponentials there, per row
    and feature: 1.5-4.5x ``jax.ops``' time). Computed alone (the forward in another
    program), the exponentials and their sums are made again. The walk's values, NaN for
    NaN: ``g`` times the row's weight, which is 0 on rows dropped and in an all -inf or a NaN
    segment (a NaN or infinite ``g`` makes NaN there), and NaN in a +inf one unless ``g`` is
    0."""
    x = rows[0]
    m, _, g = slots
    e = jnp.exp(x - _finite_or_zero(ix.at_rows(m)))  # (as the forward's, for XLA to make it once)
    s = ix.sum(e)
    g = g.astype(s.dtype)
    # The segments told apart by their sums, not their max (then XLA frees the max for the
    # sums, as in jax.ops' program): a finite max makes a sum in [1, rows]. Elsewhere a row's
    # gradient is g times the weight, 0 or NaN, whatever its e: q = g * 0 or NaN, and where q
    # is 0 so is the row (a finite max makes every e finite), where it is NaN, e * q is too.
    finite = (s > 0) & (s < jnp.inf)
    other = jnp.where((s == jnp.inf) & (g != 0), jnp.full_like(s, jnp.nan), g * 0)
    q = ix.at_rows(jnp.where(finite, g / s, other))
    out = jnp.where(q == 0, jnp.zeros_like(e), e * q)
    return (), (), (ix.kept(out).astype(x.dtype),)


def _lse_gather_on_tpu(ix, slots, rows):
    """:func:`_lse_gather` as a TPU takes it: the max gathered as the forward gathers it, which
    XLA:TPU then gathers once for both passes (4 M rows of 128 features into 400,000 segments:
    110.5 ms, as ``jax.ops``' 110.1 ms and with its temp, against 136 ms for two gathers of
    their own and 127 ms, with 1.7 GiB more temp, for the side-by-side one)."""
    x = rows[0]
    m, rel, g = slots
    m_r, scale_r = ix.at_rows(m), ix.at_rows(_lse_scale(m, rel, g))
    shift_r = jnp.where(m_r == -jnp.inf, jnp.zeros_like(m_r), m_r).astype(rel.dtype)
    return _lse_rows(ix, x, shift_r, scale_r)


def _lse_scale(m, rel, g):
    """Per segment, ``g / sum``: 0 where the cotangent is 0 and in all -inf segments, NaN in a
    +inf one with a cotangent."""
    g = g.astype(rel.dtype)
    scale = jnp.where((m > -jnp.inf) & (g != 0), g * jnp.exp(-rel), jnp.zeros_like(rel))
    return jnp.where((m == jnp.inf) & (g != 0), jnp.full_like(rel, jnp.nan), scale)


def _lse_rows(ix, x, shift_r, scale_r):
    a = x.astype(scale_r.dtype) - shift_r
    live = ~jnp.isnan(shift_r) & (scale_r != 0) & (a != -jnp.inf)
    live = live if ix.in_range else live & ix.keep(x.ndim)
    out = jnp.where(live, jnp.exp(a) * scale_r, jnp.zeros_like(a))
    return (), (), (out.astype(x.dtype),)


def _mean_gather(ix, slots, rows):
    """Per row ``g / count`` of its segment (``slots``: the mean's info ``(count,)``, the
    count in the result's real dtype, and its result's cotangent ``g``), divided per segment
    and gathered once; 0 on rows dropped. As :meth:`foldax._reductions.Mean.row_cotangent`."""
    share = mean_share(slots[-1], slots[0], rows[0].dtype)
    return (), (), (ix.kept(ix.at_rows(share)),)


def _hits(x, ix, m):
    """The rows that attain their slot's extreme ``m`` (a row dropped may read as one: the
    scatter drops it again; so the shifted exponentials of the log-sum-exp)."""
    return x == ix.at_rows(m)


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
    "scatter_mean": _mean,
    "scatter_logsumexp": _logsumexp(False, refined=False),
    "scatter_logmeanexp": _logsumexp(True, refined=False),
    "lse_gather": _lse_gather,
    "mean_gather": _mean_gather,
}


#: the kinds a TPU lowers its own way
_LOWER_ON_TPU = {
    "lse_gather": _lse_gather_on_tpu,
    "scatter_logsumexp": _logsumexp(False, refined=True),
    "scatter_logmeanexp": _logsumexp(True, refined=True),
}


def lower(kind, out_avals, plan, arrays, consts, slots, rows, platform=None):
    """The fold's outputs ``(slot outs, tots, row outs)``, matching ``out_avals``; ``plan``: the
    fold's ``"rows"`` :class:`foldax._engine.PlanSpec`."""
    (ids,) = arrays
    how = _LOWER_ON_TPU.get(kind, _LOWER[kind]) if platform == "tpu" else _LOWER[kind]
    outs = how(_Index(ids, plan.num_slots, plan.in_range, plan.sorted_ids), slots, rows)
    return jax.tree.map(lambda o, a: o.astype(a.dtype), outs, tuple(map(tuple, out_avals)))


#: the kinds whose program holds an intermediate per row (a gathered state, an exponential)
_PER_ROW = ("whole", "scatter_logsumexp", "scatter_logmeanexp", "lse_gather")


#: the kinds lowered directly on a TPU too: ``jax.ops``' own programs (a scatter, its tangent
#: and its transpose, a scatter-max or -min, a mean's two scatter-adds) and the gathers and
#: scatters of the extrema's and log-sum-exps' derivatives, which XLA:TPU fuses into the rows'
#: elementwise work (the walk of plain rows took 5x ``jax.ops``' time there, 38x with sorted ids)
_ON_TPU = (
    "scatter",
    "scatter_tangent",
    "gather",
    "scatter_max",
    "scatter_min",
    "scatter_mean",
    "whole",
    "scatter_logsumexp",
    "scatter_logmeanexp",
    "lse_gather",
    "mean_gather",
)


def applies(kind, spec, platform, row_bytes=None) -> bool:
    """Whether a fold of ``kind`` (or ``None``) lowers directly: unbatched, on one device, on
    CPU, or on a TPU for the kinds measured there (``_ON_TPU``; XLA:GPU's scatter-add into
    few segments has been reported far slower than the walk: there the walk stays until a
    device measurement says otherwise).

    A kind that holds an intermediate per row (a gathered state, an exponential: what the
    ``jax.ops`` program holds too, or less) also needs no explicit ``chunk_size`` and, under a
    budget the user set (:func:`foldax.memory_budget`), every row's working set to fit it at
    once (``row_bytes()``: the walk's per row): rows per step and a budget asked for are
    promises the direct program keeps too."""
    plain = (
        kind is not None
        and (platform == "cpu" or (platform == "tpu" and kind in _ON_TPU))
        and spec.scale == 1
        and not (spec.axes or spec.ring)
        and spec.pair_mask is None
        and spec.plan.kind == ("tiles" if kind in RUNS else "rows")
    )
    if plain and kind in RUNS:  # one tile at a time, whatever the budget
        return spec.plan.chunk is None
    if not plain or kind not in _PER_ROW:
        return plain
    if spec.plan.chunk is not None:
        return False
    return spec.budget == DEFAULT_BUDGET or row_bytes() * spec.plan.n <= spec.budget


__all__ = ["DERIVED", "RUNS", "applies", "derived", "lower"]
