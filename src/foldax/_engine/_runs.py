"""A log-sum-exp of plain values over contiguous segments in one read of the data.

The walk (:class:`._plan.TilePlan`) gathers ``G`` tiles per step into a block, then takes the
block's max and its shifted exponentials: a copy and two passes over every value. Where the
values exist already (no ``fn``: one value per row, static or traced ``sizes`` / ``offsets``,
sorted ids), there are many (``MIN_ROWS``) and the fold is not batched, on CPU, this program
reads them once: one tile of ``T`` rows per step, a dynamic slice of the data (no gather),
summed as ``sum(exp(x - c))`` with a shift ``c`` known before the tile is read -- XLA:CPU's
fast reduction of a slice to a number -- and added into its segment's sum. The loop carries
``(segment, tile)`` and the ``(S,)`` sums: nothing grows with the rows. 50 M values in 1,000
segments: 1.4-1.6x one ``jnp.exp(x).sum()`` pass, where the walk takes 2.0-2.3x
(``dev/lse-floor/``).

The shift of a segment: the largest of ``SAMPLE`` of its values spread evenly over it (one
small gather before the loop). Terms far below it underflow to 0 harmlessly (the segment's sum
holds the sampled value's own ``exp(0)``); values far above it are what could overflow. A
segment whose sum reaches ``_BOUND`` (a value more than ~61 above the shift) or is not a number
(a NaN, an infinity) is taken again, tile by tile, with each tile's own max by the log-sum-exp's
``reduce`` and ``scatter`` (the walk's arithmetic, NaN and infinities included), in a second
loop over those segments only. Where a segment's samples spread wider than ``WIDE`` (most of
its tiles would be read twice) the whole call walks instead. A segment's ``m`` is then its
shift, at most ~61 below its largest value, or the walk's max: the derivatives' weights
``exp((x - m) - log s)`` stay finite, their logarithms off by at most ``61 * 2**-24`` (the
float32 rounding of ``x - m``).

Derivatives are the walk's (a tile plan's derived folds walk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._reductions._base import _accumulator
from .._reductions._logsumexp import LogSumExp
from ._plan import MAX_RUN_TILE, _traced_tile

#: The log-sum-exp's ``(max, shifted sum)`` states (a log-mean-exp's count is its sizes).
_PAIR = LogSumExp()

#: A segment's sum of shifted exponentials must stay below this (``x - c`` is then below
#: ``log(2**88) = 61`` on every row), else the segment is taken again with each tile's max.
_BOUND = float(2**88)
#: The fewest rows the one read takes: it compiles two loops more than the walk (~0.5 s on
#: XLA:CPU) and saves ~0.3 ns per row per call (50 M rows: ~15 ms a call).
MIN_ROWS = 2**22
#: Values per segment sampled for its shift, and at most in all (fewer per segment where there
#: are many segments).
SAMPLE = 256
MAX_SAMPLED = 2**20
#: The widest spread of a segment's sampled values that the one read takes: wider values would
#: rise past the shift's margin in many tiles (a normal spread of 200 has a standard deviation
#: near 35), and the walk costs less than reading those tiles twice.
WIDE = 200.0


def reads_once(rows: int) -> bool:
    """Whether a fold over ``rows`` rows is worth the one read (at least :data:`MIN_ROWS`)."""
    return rows >= MIN_ROWS


def _tile(plan):
    """The tile height: the tallest of the static tilings; for traced sizes, one that wastes
    little on segments near the mean size."""
    if plan.tilings is not None:
        return min(plan.tilings[0][0], plan.n)
    return min(_traced_tile(plan.n, plan.num_slots, MAX_RUN_TILE), plan.n)


def _following(live):
    """``(after, first)``: for each segment, the first segment after it where ``live`` (``S`` if
    none), ``(S,)``; and the first of all, a scalar."""
    num = live.shape[0]
    at_or_after = lax.cummin(jnp.where(live, jnp.arange(num, dtype=jnp.int32), num), reverse=True)
    after = jnp.concatenate([at_or_after[1:], jnp.full((1,), num, jnp.int32)])
    return after, at_or_after[0]


def _read(x, start, length, t):
    """Tile rows ``[start, start + length)``: ``t`` rows read from a clamped start (never past
    the end; ``t <= n``), the mask of those in the tile, in the accumulation dtype."""
    at = jnp.minimum(start, x.shape[0] - t)
    rows = lax.dynamic_slice_in_dim(x, at, t).astype(_accumulator(x.dtype))
    # start - at <= r < start - at + length, as one unsigned comparison
    r = lax.iota(jnp.uint32, t) - (start - at).astype(jnp.uint32)
    return rows, r < length.astype(jnp.uint32)


def _walk(x, sizes, offsets, t, live, step, carry):
    """``carry = step(carry, seg, rows, mask)`` over every tile of ``x`` in the segments where
    ``live``, in order: ``(segment, tile)`` advanced in the loop, nothing per tile stored."""
    tiles = (sizes + (t - 1)) // t
    after, first = _following(live & (tiles > 0))

    def body(state):
        seg, k, carry = state
        start = offsets[seg] + k * t
        rows, mask = _read(x, start, jnp.minimum(sizes[seg] - k * t, t), t)
        carry = step(carry, seg, rows, mask)
        last = k + 1 >= tiles[seg]
        return jnp.where(last, after[seg], seg), jnp.where(last, 0, k + 1), carry

    state = (first, jnp.zeros((), jnp.int32), carry)
    return lax.while_loop(lambda s: s[0] < sizes.shape[0], body, state)[2]


def _shifts(x, sizes, offsets):
    """``(shift, spread)`` per segment, ``(S,)`` each: the largest of ``SAMPLE`` of its values
    (fewer where there are more than ``MAX_SAMPLED / SAMPLE`` segments) spread evenly over it
    (-inf for a segment with no rows), and how far below it the smallest finite one lies."""
    size = max(1, min(SAMPLE, MAX_SAMPLED // sizes.shape[0]))
    k = lax.iota(jnp.int32, size)[None, :]
    at = jnp.clip(offsets[:, None] + (k * sizes[:, None]) // size, 0, x.shape[0] - 1)
    v = x[at].astype(_accumulator(x.dtype))
    top = jnp.max(jnp.where(k < sizes[:, None], v, -jnp.inf), axis=1)
    low = jnp.min(jnp.where((k < sizes[:, None]) & jnp.isfinite(v), v, jnp.inf), axis=1)
    spread = jnp.where(jnp.isfinite(top) & jnp.isfinite(low), top - low, 0.0)
    return top, spread


def _shifted_sums(x, sizes, offsets, shift, t):
    """``sum(exp(x - shift))`` per segment, one read of each tile."""

    def step(ss, seg, rows, mask):
        s = jnp.sum(jnp.where(mask, jnp.exp(rows - shift[seg]), jnp.zeros((), rows.dtype)))
        return ss.at[seg].add(s)

    ss = jnp.zeros(shift.shape, shift.dtype)
    return _walk(x, sizes, offsets, t, jnp.ones(shift.shape, jnp.bool_), step, ss)


def _again_with_max(x, sizes, offsets, t, states, bad):
    """The states ``(m, s)`` of the ``bad`` segments taken again tile by tile with the
    log-sum-exp's ``reduce`` and ``scatter`` (each tile shifted by its max, as the walk's); the
    others kept."""

    def step(states, seg, rows, mask):
        return _PAIR.scatter(states, seg[None], _PAIR.reduce(rows[None], mask[None]))

    m, s = states
    states = (jnp.where(bad, -jnp.inf, m), jnp.where(bad, jnp.zeros((), s.dtype), s))
    return _walk(x, sizes, offsets, t, bad, step, states)


def lower(spec, out_avals, walk, arrays, consts, slots, rows):
    """The fold's outputs ``((result, m, log s[, count]), (), ())`` for a :class:`Spec` whose
    plan is a ``"tiles"`` one and whose rows are one array of values ``(N,)``; ``walk(arrays,
    consts, slots, rows)``: the same fold walked, taken instead when a segment's sampled values
    spread wider than ``WIDE`` (most of its tiles would be taken again)."""
    (x,) = rows
    sizes, offsets = arrays[0], arrays[1]
    shift, spread = _shifts(x, sizes, offsets)
    args = (arrays, consts, slots, rows)
    run = lambda: _one_read(spec, out_avals, x, sizes, offsets, shift)  # noqa: E731
    return lax.cond(jnp.any(spread > WIDE), lambda: walk(*args), run)


def _one_read(spec, out_avals, x, sizes, offsets, shift):
    """:func:`lower`'s outputs from one read of every tile (each segment whose sum is unsafe
    taken again)."""
    monoid = spec.monoid
    t = _tile(spec.plan)
    ss = _shifted_sums(x, sizes, offsets, shift, t)
    bad = ~(ss < _BOUND)  # a value far above the shift, an infinity or a NaN
    m, s = lax.cond(
        jnp.any(bad),
        lambda: _again_with_max(x, sizes, offsets, t, (shift, ss), bad),
        lambda: (shift, ss),
    )
    outs = monoid.outputs((m, s, sizes) if monoid.mean else (m, s))
    outs = (outs[0].astype(x.dtype), *outs[1:])
    return jax.tree.map(lambda o, a: o.astype(a.dtype), (outs, (), ()), out_avals)


__all__ = ["lower", "reads_once"]
