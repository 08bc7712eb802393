"""Monoids: the reductions that the fold engine knows how to stream.

A monoid describes one reduction as a small *state* per output slot (a tuple of arrays) with

* ``init(num, feature_shape, dtype)``: the identity state, leading axis ``num``;
* ``reduce(v, mask)``: the state of each tile, ``v`` of shape ``(G, T, *F)`` reduced over ``T``
  where ``mask`` (``(G, T)`` bool) is true;
* ``combine(a, b)``: merge two states elementwise (associative, commutative);
* ``scatter(carry, seg, st)``: merge tile states ``st`` (``(G, *F)``) into the slots ``seg``
  (``(G,)`` int, in ``[0, num]``; the value ``num`` means *drop*) of ``carry`` (``(num, *F)``);
* ``allreduce(state, axes)``: ``combine`` the states of every device along the mesh ``axes``
  (inside ``shard_map``): the default gathers the (small) states with a ``psum`` of per-device
  slots and folds them with ``combine``, so every monoid distributes; sums, extrema and
  log-sum-exps use ``psum`` / ``pmax`` instead;
* ``outputs(state)``: the fold's outputs, the public result first (``finalize``), then what the
  derivatives need that the result does not say (a count, the log-sum-exp of attention);
* ``info(outputs)``: the per-slot arrays the derivative rules read, as a differentiable function of
  the outputs (so that second-order derivatives flow through them);
* ``row_cotangent(v, mask, info, g)``: the cotangent of every reduced value given the outputs'
  cotangents ``g`` (a tuple, one per output, ``None`` where there is none), gathered per tile
  (``(G, ...)``); exactly zero where ``mask`` is false;
* ``tangent(v, dv, mask, info)``: the outputs' tangents contributed by one tile (``(G, ...)`` per
  output, ``None`` for integer outputs), given the values' tangents ``dv``.

A new reduction is a new monoid; the engine in :mod:`foldax._engine` never changes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _expand(a, ndim):
    """Append singleton axes to ``a`` until it has ``ndim`` dimensions."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _tile_mask(mask, v):
    """Broadcast a ``(G, T)`` mask against values ``(G, T, *F)``."""
    return _expand(mask, v.ndim)


def _finite_or_zero(m):
    """The shift used by log-sum-exp states: the max where finite, else 0 (keeps exp NaN-free)."""
    return jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))


def _rescale(s, m_from, m_to):
    """``s * exp(shift(m_from) - shift(m_to))``, exactly 0 where ``s`` is 0.

    ``m_to >= m_from``, so the factor is at most 1 except when ``m_from`` is -inf (shift 0) and
    ``m_to`` is a very negative finite max: there ``s`` is 0 and ``0 * inf`` must not become NaN.
    """
    f = jnp.exp(_finite_or_zero(m_from) - _finite_or_zero(m_to))
    return jnp.where(s == 0, jnp.zeros((), s.dtype), s * f)


def _add_at(carry, seg, x):
    """``carry`` with rows of ``x`` added into slots ``seg`` (``seg == len(carry)``: dropped).

    Scatters update the carry in place and touch only the ``G`` slots of a step: a step costs
    ``O(G)``, not ``O(S)``, however many segments there are."""
    return carry.at[seg].add(x, mode="drop")


def _rescale_at(s, seg, m_from, m_to):
    """``s`` with the slots ``seg`` rescaled from the shift ``m_from`` to ``m_to`` (both full
    ``(S, ...)`` arrays); the other slots are unchanged (their factor is exactly 1). Duplicate
    slots in ``seg`` write the same value."""
    new = _rescale(_take(s, seg), _take(m_from, seg), _take(m_to, seg))
    return s.at[seg].set(new, mode="drop")


def _take(a, seg):
    """Gather slots ``seg`` of ``a``; a dropped index (``== len(a)``) reads a valid slot."""
    return a[jnp.minimum(seg, a.shape[0] - 1)]


def _p_extreme(m, axes, is_max):
    """``pmax`` / ``pmin`` across devices; NaN wins whatever the backend's all-reduce does."""
    best = lax.pmax(m, axes) if is_max else lax.pmin(m, axes)
    if jnp.issubdtype(m.dtype, jnp.floating):
        nan = lax.psum(jnp.isnan(m).astype(jnp.int32), axes) > 0
        best = jnp.where(nan, jnp.asarray(np.nan, m.dtype), best)
    return best


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return False
    return jnp.iinfo(dtype).min


def _highest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return np.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    return jnp.iinfo(dtype).max


@dataclasses.dataclass(frozen=True)
class Monoid:
    """Base class; subclasses are stateless and hashable."""

    name: str = "monoid"
    #: kinds of value dtype this reduction accepts: "number" (int/float/complex), "real", "float".
    accepts: str = "number"

    def combine(self, a, b):  # pragma: no cover - abstract
        raise NotImplementedError

    def allreduce(self, state, axes):
        """``combine`` the states of all devices along ``axes``: gather them, then fold.

        The states are per output slot (``(S, ...)``), never per row, so gathering them is
        cheap. The gather is a ``psum`` of each device's state placed in its own slot, whose
        result is typed as replicated (``all_gather``'s is not). Subclasses with an associative
        collective (``psum``, ``pmax``) override this.
        """
        from . import _shard

        count, me = _shard.device_count(axes), _shard.device_index(axes)

        def gather(a):
            slots = jnp.zeros((count, *a.shape), a.dtype)
            return lax.psum(lax.dynamic_update_index_in_dim(slots, a, me, 0), axes)

        gathered = jax.tree.map(gather, state)
        first = jax.tree.map(lambda a: a[0], gathered)
        rest = jax.tree.map(lambda a: a[1:], gathered)
        out, _ = lax.scan(lambda acc, st: (self.combine(acc, st), None), first, rest)
        return out

    def outputs(self, state):
        """The fold's outputs: the public result first."""
        return (self.finalize(state),)

    def info(self, outputs):
        """Per-slot arrays for ``row_cotangent`` / ``tangent``, computed from the outputs."""
        return ()

    def result(self, outputs):
        """The public result from the outputs."""
        return outputs[0]

    def tangent(self, v, dv, mask, info, *index):
        """Tangents of the outputs from one tile. The default holds for reductions whose result
        depends on each value elementwise (sum, mean, extrema, log-sum-exp): the Jacobian is the
        cotangent of a unit output, ``row_cotangent(.., g=1)``, times ``dv``."""
        ones = jnp.ones(dv.shape[:1] + dv.shape[2:], dv.dtype)
        w = self.row_cotangent(v, mask, info, (ones,) + (None,) * (self.n_outputs - 1), *index)
        return (jnp.sum(w * dv, axis=1),) + (None,) * (self.n_outputs - 1)

    #: how many arrays ``outputs`` returns
    n_outputs = 1

    def value_aval(self, tile_aval):
        """One value's aval from a tile's ``(G, T, *F)`` values."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), tile_aval)

    def init_aval(self, num, aval):
        """The identity state for values of ``aval`` (a ``ShapeDtypeStruct`` or a pytree of them)."""
        return self.init(num, aval.shape, aval.dtype)

    def check_dtype(self, fname, argname, dtype):
        """Raise a TypeError naming ``fname`` if ``dtype`` is not a valid value dtype."""
        ok = {
            "number": jnp.issubdtype(dtype, jnp.number),
            "real": jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating),
            "float": jnp.issubdtype(dtype, jnp.floating),
            "inexact": jnp.issubdtype(dtype, jnp.inexact),
        }[self.accepts]
        if not ok:
            want = {
                "number": "a numeric dtype",
                "real": "an integer or real floating dtype",
                "float": "a real floating dtype (float16/bfloat16/float32/float64)",
                "inexact": "a floating or complex dtype",
            }[self.accepts]
            raise TypeError(
                f"{fname}: the values reduced ({argname}) have dtype {dtype}, but this reduction "
                f"needs {want}; cast with .astype(jnp.float32) first."
            )


def promote(*dtypes):
    """The dtype of a result computed from ``dtypes`` (JAX's standard lattice: float32 and
    complex64 give complex64), whatever the caller's ``jax_numpy_dtype_promotion`` setting: the
    promotion is foldax's own, explicit, never implicit."""
    with jax.numpy_dtype_promotion("standard"):
        out = dtypes[0]
        for d in dtypes[1:]:
            out = jnp.promote_types(out, d)
        return jnp.dtype(out)


def count(weights, axis):
    """Sum of small whole numbers in float32 ``weights`` along ``axis``, as int32 (exact while the
    sum stays below 2^24): XLA:CPU vectorises a float32 reduction but sums integers through a
    materialised reduce-window, 3x slower on a tile of a million cells."""
    return jnp.sum(weights, axis=axis).astype(jnp.int32)


def _accumulator(dtype):
    """The dtype states are kept in: float32 for half-precision floats (float16 overflows at
    65504 and bfloat16 stops adding 1 at 256, as ``jnp.sum`` knows), else the values' own."""
    dtype = jnp.dtype(dtype)
    return (
        jnp.dtype(jnp.float32)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
        else dtype
    )


class Sum(Monoid):
    """State: the sum, in float32 for half-precision values (the engine casts the result back to
    the values' dtype)."""

    def __init__(self):
        super().__init__("sum", "number")

    def init(self, num, fshape, dtype):
        return (jnp.zeros((num, *fshape), _accumulator(dtype)),)

    def reduce(self, v, mask):
        masked = jnp.where(_tile_mask(mask, v), v, jnp.zeros((), v.dtype))
        return (jnp.sum(masked, axis=1, dtype=_accumulator(v.dtype)),)

    def combine(self, a, b):
        return (a[0] + b[0],)

    def allreduce(self, state, axes):
        return (lax.psum(state[0], axes),)

    def scatter(self, carry, seg, st):
        return (_add_at(carry[0], seg, st[0]),)

    def finalize(self, st):
        return st[0]

    def row_cotangent(self, v, mask, info, g):
        ct = jnp.broadcast_to(g[0][:, None].astype(v.dtype), v.shape)
        return jnp.where(_tile_mask(mask, v), ct, jnp.zeros((), ct.dtype))


class Mean(Monoid):
    """State: (sum, count). The count is per segment (no feature axes), int32; real or complex
    values; half-precision values are summed in float32 (the engine casts the result back to the values' dtype)."""

    def __init__(self):
        super().__init__("mean", "inexact")

    def init(self, num, fshape, dtype):
        return (jnp.zeros((num, *fshape), _accumulator(dtype)), jnp.zeros((num,), jnp.int32))

    def reduce(self, v, mask):
        masked = jnp.where(_tile_mask(mask, v), v, jnp.zeros((), v.dtype))
        s = jnp.sum(masked, axis=1, dtype=_accumulator(v.dtype))
        return (s, jnp.sum(mask, axis=1, dtype=jnp.int32))

    def combine(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def allreduce(self, state, axes):
        return (lax.psum(state[0], axes), lax.psum(state[1], axes))

    def scatter(self, carry, seg, st):
        return (_add_at(carry[0], seg, st[0]), _add_at(carry[1], seg, st[1]))

    n_outputs = 2

    def finalize(self, st):
        s, c = st
        return s / _expand(c, s.ndim).astype(s.dtype)

    def outputs(self, st):
        return (self.finalize(st), st[1])

    def info(self, outputs):
        return (_expand(outputs[1], outputs[0].ndim).astype(jnp.float32),)

    def row_cotangent(self, v, mask, info, g):
        (count,) = info
        dt = g[0].dtype if jnp.issubdtype(g[0].dtype, jnp.complexfloating) else count.dtype
        share = (g[0].astype(dt) / jnp.maximum(count, 1).astype(dt)).astype(v.dtype)
        ct = jnp.broadcast_to(share[:, None], v.shape)
        return jnp.where(_tile_mask(mask, v), ct, jnp.zeros((), ct.dtype))


@dataclasses.dataclass(frozen=True)
class _Extremum(Monoid):
    """Max or min, with the number of rows attaining it (so the gradient splits ties evenly)."""

    is_max: bool = True

    def __init__(self, name, is_max):
        super().__init__(name, "real")
        object.__setattr__(self, "is_max", is_max)

    def _identity(self, dtype):
        return _lowest(dtype) if self.is_max else _highest(dtype)

    def _better(self, a, b):
        return jnp.maximum(a, b) if self.is_max else jnp.minimum(a, b)

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, *fshape), self._identity(dtype), dtype),
            jnp.zeros((num, *fshape), jnp.int32),
        )

    #: Preferred dense block ``(bi, bj)`` when ``y`` is walked transposed (a kernel without a
    #: dot product): 8192 pairs, their values L1-resident, ``j`` long enough to vectorise
    #: (see :func:`foldax._engine._plan.dense_block`).
    dense_tile = (1024, 1024)

    def reduce(self, v, mask):
        mv = _tile_mask(mask, v)
        w = jnp.where(mv, v, jnp.asarray(self._identity(v.dtype), v.dtype))
        m = jnp.max(w, axis=1) if self.is_max else jnp.min(w, axis=1)
        hit = (w == m[:, None]) & mv
        t = v.shape[1]
        if not jnp.issubdtype(v.dtype, jnp.floating):
            return (m, jnp.sum(hit, axis=1, dtype=jnp.int32))
        # XLA:CPU's vectorised reduce-max may drop NaN: propagate it explicitly. The NaNs are
        # counted in the same sum as the hits, weighted T + 1 (no separate any-reduce).
        if t * (t + 1) < 2**24:
            one = jnp.where(hit, jnp.float32(1), jnp.float32(0))
            c = count(jnp.where(w != w, jnp.float32(t + 1), one), axis=1)
            nan = c > t
            m = jnp.where(nan, jnp.asarray(np.nan, v.dtype), m)
            return (m, jnp.where(nan, 0, c))
        m = jnp.where(jnp.any(jnp.isnan(w), axis=1), jnp.asarray(np.nan, v.dtype), m)
        return (m, jnp.sum(hit & (w == m[:, None]), axis=1, dtype=jnp.int32))

    def combine(self, a, b):
        m = self._better(a[0], b[0])
        c = jnp.where(a[0] == m, a[1], 0) + jnp.where(b[0] == m, b[1], 0)
        return (m, c)

    def allreduce(self, state, axes):
        m, c = state
        best = _p_extreme(m, axes, self.is_max)
        return (best, lax.psum(jnp.where(m == best, c, 0), axes))

    def scatter(self, carry, seg, st):
        cm, cc = carry
        tm, tc = st
        m = cm.at[seg].max(tm, mode="drop") if self.is_max else cm.at[seg].min(tm, mode="drop")
        m_seg = _take(m, seg)
        # a slot's count survives where its extreme did (only the touched slots can change)
        kept = jnp.where(_take(cm, seg) == m_seg, _take(cc, seg), 0)
        c = cc.at[seg].set(kept, mode="drop")
        return (m, _add_at(c, seg, jnp.where(tm == m_seg, tc, 0)))

    n_outputs = 2

    def finalize(self, st):
        return st[0]

    def outputs(self, st):
        return st

    def info(self, outputs):
        return outputs

    def row_cotangent(self, v, mask, info, g):
        m, c = info
        hit = (v == m[:, None]) & _tile_mask(mask, v)
        share = g[0] / jnp.maximum(c, 1).astype(g[0].dtype)
        ct = jnp.broadcast_to(share[:, None], v.shape)
        return jnp.where(hit, ct, jnp.zeros((), ct.dtype))


class Max(_Extremum):
    def __init__(self):
        super().__init__("max", True)


class Min(_Extremum):
    def __init__(self):
        super().__init__("min", False)


@dataclasses.dataclass(frozen=True)
class LogSumExp(Monoid):
    """State ``(m, s)``: the running max and ``sum(exp(x - shift(m)))``, ``shift(m) = m`` if finite
    else 0, in float32 for half-precision values. With ``mean=True`` a row count is carried too and
    the result is ``log(mean(exp(x)))``.

    Outputs: the result, then the max ``m`` and ``log(s)`` kept apart (float32 for half values),
    then the count for ``mean``. Derivatives read ``exp((x - m) - log(s))``: ``x - m`` is exact
    where ``x`` is near the max, so the weights keep float32's relative precision for logits of any
    size (``exp(x - result)`` with a result rounded near ``|x| ~ 1e5`` is off by ``~1e-3``). ``m``
    and ``log(s)`` enter the derivatives as constants, the result as the variable (see ``info``),
    so they carry no tangent of their own (zero) and take no cotangent.
    """

    mean: bool = False

    def __init__(self, mean=False):
        super().__init__("logmeanexp" if mean else "logsumexp", "float")
        object.__setattr__(self, "mean", mean)

    def init(self, num, fshape, dtype):
        acc = _accumulator(dtype)
        st = (jnp.full((num, *fshape), -np.inf, acc), jnp.zeros((num, *fshape), acc))
        return (*st, jnp.zeros((num,), jnp.int32)) if self.mean else st

    def reduce(self, v, mask):
        v = v.astype(_accumulator(v.dtype))
        w = jnp.where(_tile_mask(mask, v), v, jnp.asarray(-np.inf, v.dtype))
        m = jnp.max(w, axis=1)
        s = jnp.sum(jnp.exp(w - _finite_or_zero(m)[:, None]), axis=1)
        if self.mean:
            return (m, s, jnp.sum(mask, axis=1, dtype=jnp.int32))
        return (m, s)

    def combine(self, a, b):
        m = jnp.maximum(a[0], b[0])
        s = _rescale(a[1], a[0], m) + _rescale(b[1], b[0], m)
        return (m, s, a[2] + b[2]) if self.mean else (m, s)

    def allreduce(self, state, axes):
        # A NaN anywhere makes that slot's sum NaN, whatever pmax does with it.
        m = lax.pmax(state[0], axes)
        s = lax.psum(_rescale(state[1], state[0], m), axes)
        return (m, s, lax.psum(state[2], axes)) if self.mean else (m, s)

    def scatter(self, carry, seg, st):
        cm, cs = carry[0], carry[1]
        tm, ts = st[0], st[1]
        m = cm.at[seg].max(tm, mode="drop")
        s = _add_at(_rescale_at(cs, seg, cm, m), seg, _rescale(ts, tm, _take(m, seg)))
        if self.mean:
            return (m, s, _add_at(carry[2], seg, st[2]))
        return (m, s)

    def finalize(self, st):
        return self.outputs(st)[0]

    @property
    def n_outputs(self):
        return 4 if self.mean else 3

    def outputs(self, st):
        m, logs = st[0], jnp.log(st[1])
        out = _finite_or_zero(m) + logs
        if self.mean:
            out = out - jnp.log(_expand(st[2], out.ndim).astype(out.dtype))
            return (out, m, logs, st[2])
        return (out, m, logs)

    def info(self, outputs):
        """``(shift, rel)`` with ``exp((x - shift) - rel) = exp(x - logsumexp)``: numerically
        ``shift(m)`` and ``log(s)``; as a function, ``rel`` follows the log-sum-exp (the result,
        plus the log-count for ``mean``), so second-order derivatives flow through it."""
        out, m, logs = outputs[:3]
        if self.mean:
            out = out + jnp.log(_expand(outputs[3], out.ndim).astype(out.dtype))
        rel = lax.stop_gradient(logs) + (out - lax.stop_gradient(out)).astype(logs.dtype)
        return (lax.stop_gradient(m), rel)

    def row_cotangent(self, v, mask, info, g):
        w = lse_weights(v, _tile_mask(mask, v), *(a[:, None] for a in info))
        return (g[0][:, None].astype(w.dtype) * w).astype(v.dtype)

    def tangent(self, v, dv, mask, info):
        w = lse_weights(v, _tile_mask(mask, v), *(a[:, None] for a in info))
        t = jnp.sum(w * dv.astype(w.dtype), axis=1)
        zero = jnp.zeros_like(t)
        return (t, zero, zero, *((None,) if self.mean else ()))


def lse_weights(v, ok, m, rel):
    """``exp((v - shift(m)) - rel)`` where ``ok`` and the max ``m`` is above -inf, else 0: the
    weights ``exp(v - logsumexp)`` in the accumulation dtype, from a log-sum-exp kept as its max
    and ``rel = log(sum(exp(v - shift(m))))`` (see :class:`LogSumExp`)."""
    v = v.astype(rel.dtype)
    ok = ok & (m > -np.inf)
    z = jnp.where(ok, (v - _finite_or_zero(m)) - rel, jnp.asarray(-np.inf, rel.dtype))
    return jnp.exp(z)


class Prod(Monoid):
    """State: (the product of the non-zero values, the number of zeros), both per element; half
    precision multiplies in float32. The result is 0 where a zero was seen, else the product.

    Outputs: the result ``R``, the product of the non-zeros ``P``, ``Q``: the sum over the zeros
    ``k`` of the product of the others (``P`` with exactly one zero, else 0), and the zero count.
    The derivatives in ``x_i`` (no division by 0): at a non-zero, ``(R, P, Q) / x_i``; at a zero,
    ``Q - x_i P`` for ``R`` (the ``x_i P`` with exactly two zeros: numerically 0), 0 for ``P``,
    and ``P`` for ``Q`` with exactly two zeros, else 0. These hold as functions of the outputs
    (the zeros held where they are), which have their own tangents: second derivatives are exact,
    and third ones with at most two zeros in a segment.
    """

    def __init__(self):
        super().__init__("prod", "number")

    def init(self, num, fshape, dtype):
        acc = _accumulator(dtype)
        return (jnp.ones((num, *fshape), acc), jnp.zeros((num, *fshape), jnp.int32))

    def reduce(self, v, mask):
        m = _tile_mask(mask, v)
        nz = jnp.where(m & (v != 0), v, jnp.ones((), v.dtype))
        p = jnp.prod(nz.astype(_accumulator(v.dtype)), axis=1)
        return (p, jnp.sum(m & (v == 0), axis=1, dtype=jnp.int32))

    def combine(self, a, b):
        return (a[0] * b[0], a[1] + b[1])

    def scatter(self, carry, seg, st):
        return (carry[0].at[seg].multiply(st[0], mode="drop"), _add_at(carry[1], seg, st[1]))

    n_outputs = 4

    def finalize(self, st):
        # a zero times a finite product is 0; times NaN or inf (0 * inf) it is NaN, as jnp.prod
        p = st[0]
        if not jnp.issubdtype(p.dtype, jnp.inexact):
            return jnp.where(st[1] > 0, jnp.zeros((), p.dtype), p)
        hit = jnp.where(jnp.isfinite(p), jnp.zeros((), p.dtype), jnp.asarray(np.nan, p.dtype))
        return jnp.where(st[1] > 0, hit, p)

    def outputs(self, st):
        p, zeros = st
        q = jnp.where(zeros == 1, p, jnp.zeros((), p.dtype))
        return (self.finalize(st), p, q, zeros)

    def info(self, outputs):
        # the zero count as float32: an integer slot of a derivative fold would take a float0
        # cotangent (the engine sums slot cotangents)
        return (*outputs[:3], outputs[3].astype(jnp.float32))

    def _weights(self, v, mask, info):
        """``(d R / dv, d P / dv, d Q / dv)`` per value ``(G, T, *F)``: functions of ``info``
        (``R``, ``P``, ``Q``), so that their own derivatives follow the outputs' tangents."""
        r, p, q = (a[:, None].astype(v.dtype) for a in info[:3])
        zeros = info[3][:, None]
        m = _tile_mask(mask, v)
        zero = jnp.zeros((), v.dtype)
        is0 = v == 0
        nz, at0 = m & ~is0, m & is0
        x = jnp.where(is0, jnp.ones((), v.dtype), v)
        two = zeros == 2
        dres = jnp.where(nz, r / x, jnp.where(at0, q - jnp.where(two, v * p, zero), zero))
        dp = jnp.where(nz, p / x, zero)
        dq = jnp.where(nz, q / x, jnp.where(at0 & two, p, zero))
        return dres, dp, dq

    def row_cotangent(self, v, mask, info, g):
        return _output_cotangent(v, g, self._weights(v, mask, info))

    def tangent(self, v, dv, mask, info):
        dres, dp, dq = self._weights(v, mask, info)
        t = lambda w, a: jnp.sum(w * dv, axis=1).astype(a.dtype)  # noqa: E731
        return (t(dres, info[0]), t(dp, info[1]), t(dq, info[2]), None)


def _output_cotangent(v, g, ds):
    """The values' cotangent from the outputs' ``g`` (``None`` where there is none) and the
    per-value derivatives ``ds`` of each output (``(G, T, *F)``)."""
    pairs = zip(g[: len(ds)], ds, strict=True)
    parts = [gi[:, None].astype(v.dtype) * d for gi, d in pairs if gi is not None]
    return sum(parts[1:], parts[0]) if parts else jnp.zeros_like(ds[0])


@dataclasses.dataclass(frozen=True)
class Var(Monoid):
    """Variance (``std``: its square root) with ``ddof``, from the mergeable state
    ``(count, mean, M2)`` (Chan et al.): a tile's mean and sum of squared deviations are exact
    two-pass sums, and states merge with ``M2 = M2_a + M2_b + d^2 n_a n_b / n``; never
    ``E[x^2] - E[x]^2``. Half precision accumulates in float32. The count is per segment.

    Nothing overflows that the variance does not: a tile sums its values scaled (exactly) by a
    power of two, so that ``T`` finite values cannot overflow; the merge term is computed as
    ``(d n_a n_b / n) d``; a merge's mean shift weighs deviations by their share of the count;
    and a merge with an empty state keeps the other state exactly. The mean of finite values
    stays finite (clipped where means of opposite signs past half the float range merge, whose
    ``M2`` is ``inf``); ``M2`` is ``inf`` where it overflows and NaN only for non-finite values.
    Equal values give exactly 0 where their mean is exact (one value, an exact tile sum, merged
    equal means); otherwise the square of the mean's rounding error, which in float32 overflows
    to ``inf`` for ``|x| > ~3e26``, as NumPy's float32 ``var`` does.

    Outputs: the result, the mean and the count. The derivative of the variance in ``x_i`` is
    ``2 (x_i - mean) / (n - ddof)``; the mean is an output with its own tangent, so second
    derivatives flow. Segments with ``n <= ddof`` give NaN and a zero gradient."""

    ddof: int = 0
    std: bool = False

    def __init__(self, ddof=0, std=False):
        super().__init__(f"{'std' if std else 'var'}(ddof={ddof})", "float")
        object.__setattr__(self, "ddof", ddof)
        object.__setattr__(self, "std", std)

    def init(self, num, fshape, dtype):
        acc = _accumulator(dtype)
        z = jnp.zeros((num, *fshape), acc)
        return (jnp.zeros((num,), jnp.int32), z, z)

    def reduce(self, v, mask):
        m = _tile_mask(mask, v)
        w = jnp.where(m, v, jnp.zeros((), v.dtype)).astype(_accumulator(v.dtype))
        n = jnp.sum(mask, axis=1, dtype=jnp.int32)
        t = v.shape[1]
        if t == 1:  # one-row tiles (rows scattered by id): the value is the mean, M2 0 (NaN
            # for +-inf, as x - mean)
            nan = jnp.asarray(np.nan, w.dtype)
            return (n, w[:, 0], jnp.where(jnp.isfinite(w[:, 0]), jnp.zeros((), w.dtype), nan))
        # summed scaled by 2^-k < 1 / (2 T), exactly (a power of two): the sum of T finite
        # values cannot overflow, and their mean is finite
        scale = 2.0 ** -(1 + math.ceil(math.log2(t)))
        ws = jnp.where(m, v.astype(w.dtype) * jnp.asarray(scale, w.dtype), jnp.zeros((), w.dtype))
        count = _expand(jnp.maximum(n, 1), w.ndim - 1).astype(w.dtype)
        mean = (jnp.sum(ws, axis=1) / count) * jnp.asarray(1 / scale, w.dtype)
        d = jnp.where(m, w - mean[:, None], jnp.zeros((), w.dtype))
        return (n, mean, jnp.sum(d * d, axis=1))

    def combine(self, a, b):
        (na, ma, qa), (nb, mb, qb) = a, b
        n = na + nb
        f = lambda c: _expand(c, ma.ndim).astype(ma.dtype)  # noqa: E731
        d = mb - ma
        share = f(nb) / f(jnp.maximum(n, 1))
        mean = _finite_mean(ma + d * share)
        q = qa + qb + (d * (f(na) * share)) * d
        a_empty, b_empty = _expand(na == 0, ma.ndim), _expand(nb == 0, ma.ndim)
        mean = jnp.where(a_empty, mb, jnp.where(b_empty, ma, mean))
        return (n, mean, jnp.where(a_empty, qb, jnp.where(b_empty, qa, q)))

    def scatter(self, carry, seg, st):
        """Merge the tile states into their slots; duplicate slots (a segment's several tiles in
        one step, repeated ids) merge exactly: scatter-adds about the slot's old mean of the
        tiles' mean deviations weighted by their share of the new count (the mean's shift), then
        of the squared deviations about the new mean. Empty slots and tiles add none."""
        cn, cm, cq = carry
        tn, tm, tq = st
        f = lambda c: _expand(c, tm.ndim).astype(tm.dtype)  # noqa: E731
        zero = jnp.zeros((), tm.dtype)
        n_old, m_old = _take(cn, seg), _take(cm, seg)
        n = _add_at(cn, seg, tn)
        n_new = _take(n, seg)
        had, has = _expand(n_old > 0, tm.ndim), _expand(tn > 0, tm.ndim)
        dev = jnp.where(has, (f(tn) / f(jnp.maximum(n_new, 1))) * (tm - m_old), zero)
        shift = _add_at(cm.at[seg].set(jnp.zeros_like(m_old), mode="drop"), seg, dev)
        mean = _finite_mean(m_old + _take(shift, seg))
        q_old = _take(cq, seg) + jnp.where(had, f(n_old) * (m_old - mean) ** 2, zero)
        q = cq.at[seg].set(q_old, mode="drop")
        q = _add_at(q, seg, tq + jnp.where(has, f(tn) * (tm - mean) ** 2, zero))
        return (n, shift.at[seg].set(mean, mode="drop"), q)

    n_outputs = 3

    def finalize(self, st):
        n, _, q = st
        dof = _expand(n, q.ndim).astype(q.dtype) - self.ddof
        var = jnp.where(dof > 0, q / jnp.where(dof > 0, dof, 1), jnp.asarray(np.nan, q.dtype))
        return jnp.sqrt(var) if self.std else var

    def outputs(self, st):
        return (self.finalize(st), st[1], st[0])

    def info(self, outputs):
        return (*outputs[:2], outputs[2].astype(jnp.float32))  # float count (see Prod.info)

    def _weights(self, v, mask, info):
        """``(d result / dv, d mean / dv)`` per value ``(G, T, *F)``."""
        res, mean, n = (a[:, None] for a in info)
        n = _expand(n, mean.ndim).astype(mean.dtype)
        m = _tile_mask(mask, v)
        dof = n - self.ddof
        ok = m & (dof > 0)
        w = 2 * (v.astype(mean.dtype) - mean) / jnp.where(dof > 0, dof, 1)
        if self.std:
            w = jnp.where(res > 0, w / (2 * jnp.where(res > 0, res, 1)), jnp.zeros((), w.dtype))
        dres = jnp.where(ok, w, jnp.zeros((), w.dtype)).astype(v.dtype)
        dmean = jnp.where(m, 1 / jnp.maximum(n, 1), jnp.zeros((), n.dtype)).astype(v.dtype)
        return dres, dmean

    def row_cotangent(self, v, mask, info, g):
        return _output_cotangent(v, g, self._weights(v, mask, info))

    def tangent(self, v, dv, mask, info):
        dres, dmean = self._weights(v, mask, info)
        tm = jnp.sum(dmean * dv, axis=1).astype(info[1].dtype)
        return (jnp.sum(dres * dv, axis=1), tm, None)


def _finite_mean(m):
    """A merged mean, finite for finite values: it overflows only merging means of opposite
    signs past half the float range (whose ``M2`` is then ``inf``); NaN stays NaN."""
    big = jnp.finfo(m.dtype).max
    return jnp.clip(m, -big, big)


_NO_ROW = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class SegmentArgExtremum(Monoid):
    """The global row of the max / min of each segment: first of ties, NaN counts as the extreme
    (like ``jnp.argmax``). State: (the extreme, its first row; int32 max for none). Reads the
    global row index of every cell (``needs_index``). An empty segment gives -1."""

    needs_index = True
    is_max: bool = True

    def __init__(self, is_max):
        super().__init__("argmax" if is_max else "argmin", "real")
        object.__setattr__(self, "is_max", is_max)

    def _fill(self, dtype):
        return _lowest(dtype) if self.is_max else _highest(dtype)

    def init(self, num, fshape, dtype):
        return (
            jnp.full((num, *fshape), self._fill(dtype), dtype),
            jnp.full((num, *fshape), _NO_ROW, jnp.int32),
        )

    def reduce(self, v, mask, index):
        m = _tile_mask(mask, v)
        w = jnp.where(m, v, jnp.asarray(self._fill(v.dtype), v.dtype))
        best = jnp.max(w, axis=1) if self.is_max else jnp.min(w, axis=1)
        hit = (w == best[:, None]) & m
        if jnp.issubdtype(v.dtype, jnp.floating):
            nan = jnp.isnan(w) & m
            any_nan = jnp.any(nan, axis=1)
            hit = jnp.where(any_nan[:, None], nan, hit)
            best = jnp.where(any_nan, jnp.asarray(np.nan, v.dtype), best)
        rows = index if index.ndim == 2 else index[None, :]  # (G, T) global rows (probe: (T,))
        rows = _expand(jnp.broadcast_to(rows, mask.shape), v.ndim)
        return (best, jnp.min(jnp.where(hit, rows, _NO_ROW), axis=1).astype(jnp.int32))

    def _same(self, a, b):
        eq = a == b
        if jnp.issubdtype(a.dtype, jnp.floating):
            eq = eq | (jnp.isnan(a) & jnp.isnan(b))
        return eq

    def _best(self, a, b):
        m = jnp.maximum(a, b) if self.is_max else jnp.minimum(a, b)
        if jnp.issubdtype(a.dtype, jnp.floating):
            m = jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.asarray(np.nan, a.dtype), m)
        return m

    def combine(self, a, b):
        m = self._best(a[0], b[0])
        ia = jnp.where(self._same(a[0], m), a[1], _NO_ROW)
        ib = jnp.where(self._same(b[0], m), b[1], _NO_ROW)
        return (m, jnp.minimum(ia, ib))

    def allreduce(self, state, axes):
        val, idx = state
        best = _p_extreme(val, axes, self.is_max)
        return (best, lax.pmin(jnp.where(self._same(val, best), idx, _NO_ROW), axes))

    def scatter(self, carry, seg, st):
        cm, ci = carry
        tm, ti = st
        # scatter-max / min propagate NaN, as _Extremum relies on
        m = cm.at[seg].max(tm, mode="drop") if self.is_max else cm.at[seg].min(tm, mode="drop")
        m_seg = _take(m, seg)
        kept = jnp.where(self._same(_take(cm, seg), m_seg), _take(ci, seg), _NO_ROW)
        i = ci.at[seg].set(kept, mode="drop")
        return (m, i.at[seg].min(jnp.where(self._same(tm, m_seg), ti, _NO_ROW), mode="drop"))

    def finalize(self, st):
        return jnp.where(st[1] == _NO_ROW, -1, st[1])

    def tangent(self, v, dv, mask, info, index):
        return (None,)  # an index has no derivative


SUM = Sum()
MEAN = Mean()
MAX = Max()
MIN = Min()
LOGSUMEXP = LogSumExp()
LOGMEANEXP = LogSumExp(mean=True)
PROD = Prod()
ARGMAX = SegmentArgExtremum(True)
ARGMIN = SegmentArgExtremum(False)

__all__ = [
    "ARGMAX",
    "ARGMIN",
    "LOGMEANEXP",
    "LOGSUMEXP",
    "MAX",
    "MEAN",
    "MIN",
    "PROD",
    "SUM",
    "Monoid",
    "Var",
]
