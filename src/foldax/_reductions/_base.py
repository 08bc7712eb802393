"""The monoid contract (:class:`Monoid`) and the helpers every reduction shares: masks,
scatters into slots, identities, accumulation dtypes."""

from __future__ import annotations

import dataclasses

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


def log_of_sum(s):
    """``log(s)`` of a log-sum-exp's sum, to the platform's ``exp``'s precision: ``r = log(s)``
    then one Newton step ``r + s exp(-r) - 1``. A TPU's float32 ``log`` is off by up to 1.1e-4
    (a v5e, against float64), its ``exp`` by 5e-6 (relative): derivatives read as ``exp((x - m)
    - log(s))`` carried the logarithm's error. Where ``r`` is not finite, or the step would be
    large (a sum near the float range's ends), ``r`` as it is. (The direct programs a CPU runs
    for plain rows take XLA's own ``log``, exact there: :func:`log_of_sum_where`.)"""
    r = jnp.log(s)
    ok = jnp.isfinite(r)
    step = s * jnp.exp(-jnp.where(ok, r, jnp.zeros((), r.dtype))) - 1
    return jnp.where(ok & (jnp.abs(step) < 2**-10), r + step, r)


def log_of_sum_where(refined):
    """The logarithm a direct program (scatters and gathers of plain rows) takes of a sum:
    :func:`log_of_sum` where ``refined`` (a TPU's programs), else XLA's own ``log``, exact on
    a CPU, where XLA fuses the step's ``log`` and ``exp`` into the gathers that read the
    result per row (a segment log-sum-exp's gradient took 2x the time)."""
    return log_of_sum if refined else lambda a: jnp.log(a)  # (jnp read when called)


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


#: The index of no row or column: an empty slot's (it sorts after every real index).
NO_INDEX = int(np.iinfo(np.int32).max)


def identity(is_max, dtype):
    """The identity of a max (``is_max``) or min over ``dtype``: -inf / inf for floats, the
    integer range's ends, False / True for booleans."""
    return _lowest(dtype) if is_max else _highest(dtype)


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
    #: whether an accelerator kernel folds tiles with this monoid's own ``reduce`` / ``combine``
    #: / ``outputs`` (their code is elementwise work and reductions along a tile's columns, which
    #: Mosaic lowers; :mod:`foldax._kernels.tpu`); ``"interpreted"``: a kernel form tested in
    #: Pallas' interpret mode only, which a TPU takes when ``implementation="pallas"`` asks;
    #: ``"lanes"``: a TPU takes it unasked only where it keeps its state per lane
    #: (``lanes_in_kernel``, :mod:`foldax._reductions._lanes`)
    pallas = False

    def combine(self, a, b):  # pragma: no cover - abstract
        raise NotImplementedError

    def combine_in_kernel(self, a, b):
        """:meth:`combine` of a state and a tile's :meth:`reduce_in_kernel` as an accelerator
        kernel computes it (a monoid whose ``combine`` sorts or gathers overrides it)."""
        return self.combine(a, b)

    def only(self, state, value):
        """``combine(state, value)`` where ``state`` is the identity in every row ``value`` (a
        tile's :meth:`reduce`) has entries in: a block of rows that one step reduces over every
        column. A reduction whose ``combine`` is built for a running state overrides it with a
        cheaper direct form."""
        return self.combine(state, value)

    #: whether a dense fold of at most one :attr:`dense_tile` of pairs takes blocks of rows by
    #: every column, each block's state made by :meth:`only`, rather than ``dense_tile`` blocks
    whole_when_small = False

    def allreduce(self, state, axes):
        """``combine`` the states of all devices along ``axes``: gather them, then fold.

        The states are per output slot (``(S, ...)``), never per row, so gathering them is
        cheap. The gather is a ``psum`` of each device's state placed in its own slot, whose
        result is typed as replicated (``all_gather``'s is not). Subclasses with an associative
        collective (``psum``, ``pmax``) override this.
        """
        from .. import _shard

        count, me = _shard.device_count(axes), _shard.device_index(axes)

        def gather(a):
            slots = jnp.zeros((count, *a.shape), a.dtype)
            return lax.psum(lax.dynamic_update_index_in_dim(slots, a, me, 0), axes)

        gathered = jax.tree.map(gather, state)
        first = jax.tree.map(lambda a: a[0], gathered)
        rest = jax.tree.map(lambda a: a[1:], gathered)
        out, _ = lax.scan(lambda acc, st: (self.combine(acc, st), None), first, rest)
        return out

    def reduce_columns(self, v, mask, cols, *index):
        """``reduce(v, mask)`` for a tile whose ``mask`` (``(bi, bj)``) says only which of its
        columns are real rows of ``y``, as ``cols`` (``(bj, 1)`` bool) says too: a monoid whose
        reduction masks values of the columns (not of the pairs) reads ``cols`` instead of
        reducing ``mask`` down its columns (what an accelerator kernel's tile takes)."""
        return self.reduce(v, mask, *index)

    def reduce_in_kernel(self, v, mask, cols, *index):
        """A tile's :meth:`reduce` as an accelerator kernel computes it (``cols``: ``None``
        under a pair mask, else as :meth:`reduce_columns` takes it). A monoid whose ``reduce``
        is shaped for XLA:CPU (column numbers in float32, chunked reshapes, gathers of a
        tile's indices) overrides it with the same state of operations Mosaic lowers: integer
        iotas and reductions along the tile's columns."""
        if cols is None:
            return self.reduce(v, mask, *index)
        return self.reduce_columns(v, mask, cols, *index)

    #: A monoid whose outputs begin with this one's and say more, that a fold being
    #: differentiated is computed with so that its derivative rules can read the rest (where a
    #: max is, by index); ``None``: this one.
    for_derivatives = None

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
        """Tangents of the outputs from one tile (``dv``: the values' tangents, like ``v``; for
        a value of several arrays, a leaf that does not vary is ``None``, a symbolic zero, and
        a value none of whose leaves varies has no tangent: this is not called). The default
        holds for reductions whose result depends on each value elementwise (sum, mean,
        extrema, log-sum-exp): the Jacobian is the cotangent of a unit output,
        ``row_cotangent(.., g=1)``, times ``dv``."""
        ones = jnp.ones(dv.shape[:1] + dv.shape[2:], dv.dtype)
        w = self.row_cotangent(v, mask, info, (ones,) + (None,) * (self.n_outputs - 1), *index)
        return (jnp.sum(w * dv, axis=1),) + (None,) * (self.n_outputs - 1)

    #: how many arrays ``outputs`` returns
    n_outputs = 1

    def value_aval(self, tile_aval):
        """One value's aval from a tile's ``(G, T, *F)`` values."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), tile_aval)

    def result_dtype(self, aval):
        """The dtype of the public result for values of ``aval`` (from :meth:`value_aval`; the
        engine casts a wider state's result to it), or ``None``: as the state's."""
        return getattr(aval, "dtype", None)

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


def picked_elements(dv):
    """The tangents ``(P, S)`` of picked values, from the body's tangents ``dv`` ``(P, S, *F)``
    at each pick's pair: pick ``p`` is of output element ``p % prod(F)`` (a scalar kernel's
    picks are all of its one element)."""
    p, s = dv.shape[:2]
    f = int(np.prod(dv.shape[2:], dtype=np.int64))
    flat = dv.reshape(p, s, f)
    if f == 1:
        return flat[..., 0]
    which = (jnp.arange(p) % f)[:, None, None]
    return jnp.take_along_axis(flat, which, axis=2)[..., 0]


def instantiate(dv, v):
    """A tile's value tangents ``dv`` with zeros (like ``v``) for the leaves given as ``None``
    (symbolic zeros, :meth:`Monoid.tangent`): for a monoid whose tangent only weighs them
    elementwise, where a zero costs nothing but a multiply."""
    return jax.tree.map(
        lambda d, a: jnp.zeros(a.shape, a.dtype) if d is None else d,
        dv,
        v,
        is_leaf=lambda d: d is None,
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


class _ValuesAndIndices:
    """Mixin of the monoids whose state is their result, a pair ``(values, indices)``; the
    derivative rules read the indices."""

    n_outputs = 2

    def outputs(self, st):
        return st

    def result(self, outputs):
        return tuple(outputs)

    def info(self, outputs):
        return (outputs[1],)

    # The picks (see :mod:`foldax._engine._picks`): each value's own index.

    def picks(self, info):
        (idx,) = info
        return idx.reshape(idx.shape[0], -1).T

    def picked_tangent(self, info, dv):
        (idx,) = info
        d = picked_elements(dv).T.reshape(idx.shape)
        return (jnp.where(idx != NO_INDEX, d, jnp.zeros((), d.dtype)), None)

    def streamed_rows(self, info):
        return None
