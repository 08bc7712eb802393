"""The registry of the reductions under test: one entry per public reduction, with everything a
test needs to call it and to know the answer.

:data:`SEGMENT`: every ``foldax.segment_<name>``: the callable, its float64 NumPy reference and
its dense differentiable plain-``jnp`` reference (both one segment at a time), the identity of
an empty segment per dtype, and what it accepts (integer data, ``ddof``, derivatives) and gives
(one value per segment or, for a normalizer, one per row; an int32 index for ``arg*``).

:data:`PAIRWISE`: every form of ``foldax.pairwise_reduce``: the ``reduction=`` it passes, its one
float64 NumPy reference and its dense plain-``jnp`` reference (both on the dense kernel matrix,
masks included), and the identity of a row with no column.

These references (with :func:`reference`, :func:`dense`, :func:`pairwise_reference` and
:func:`pairwise_dense` over them) are the only ones in the tests; the identities here are the
only table of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special
from jax import lax

import foldax

#: Per-segment shifts of the generated data: the scales of neighbouring segments differ by 1000
#: (and a segment whose max is ~-1000 underflows ``exp`` in any dtype).
SHIFTS = (-1000.0, 0.0, 1000.0)

#: The index of "no column" in a pairwise index reduction (a masked or empty row, an unfilled
#: k-min slot).
NO_INDEX = int(np.iinfo(np.int32).max)


def _unchanged(v):
    return v


def _lowest(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else -np.inf


def _highest(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if np.issubdtype(dtype, np.integer) else np.inf


def _nan_or_highest(dtype):
    """An empty k-min slot's value: NaN (after every real value, NaN included) or iinfo.max."""
    return np.nan if jnp.issubdtype(dtype, jnp.inexact) else _highest(dtype)


# ----------------------------------------------------------------------------------------------
# Segment reductions: one segment at a time. ``seg`` is (n, *F) with n >= 1, ``rows`` its row
# numbers (for arg*); empty segments (and var / std with n <= ddof) take the identity.


def _np_lse(seg):
    return scipy.special.logsumexp(seg, axis=0)


def _np_var(seg, ddof):
    return seg.var(0, ddof=ddof)


def _dense_lse(seg):
    m = lax.stop_gradient(jnp.max(seg, axis=0))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
    s = jnp.sum(jnp.exp(seg - m[None]), axis=0)
    pos = s > 0
    return jnp.where(pos, m + jnp.log(jnp.where(pos, s, jnp.ones_like(s))), -jnp.inf)


def _dense_std(seg, ddof):
    # a one-row segment: std 0 with gradient 0 (foldax's), not sqrt's infinite slope
    return jnp.std(seg, 0, ddof=ddof) if seg.shape[0] > 1 else 0 * seg[0]


@dataclasses.dataclass(frozen=True)
class SegmentReduction:
    """``foldax.segment_<name>`` and what the tests know about it."""

    name: str
    #: float64 NumPy reference of one non-empty segment: ``(seg, rows, ddof) -> (*F)``; for a
    #: normalizer ``(n, *F)``
    np_one: Callable
    #: plain-jnp reference of one non-empty segment, differentiable: ``(seg, rows, ddof)``
    dense_one: Callable
    #: the output of an empty segment, by the dtype of the data (normalizers: of a row in no
    #: segment)
    identity: Callable
    normalizer: bool = False  # one output per row (softmax, log_softmax)
    int_ok: bool = False  # accepts integer data
    differentiable: bool = True
    ddof: bool = False  # takes ``ddof`` (var, std)
    index: bool = False  # the output is an int32 row index (argmax, argmin)
    #: the per-segment shifts its random test data may take (a product of tens of rows of
    #: magnitude 1000 overflows float32)
    shifts: tuple = SHIFTS
    #: maps values of order 1 into the reduction's well-conditioned range (a product of hundreds
    #: of values in [-1, 1] underflows float32; near 1 it does not)
    domain: Callable = _unchanged

    @property
    def public_name(self) -> str:
        return f"foldax.segment_{self.name}"

    @property
    def fn(self) -> Callable:
        return getattr(foldax, f"segment_{self.name}")

    def min_rows(self, ddof=0) -> int:
        """The fewest rows a segment needs not to be empty (var / std: more than ddof)."""
        return ddof + 1 if self.ddof else 1


def _entry(name, np_one, dense_one, identity, **kw):
    return SegmentReduction(name, np_one, dense_one, identity, **kw)


def _const(value):
    return lambda dtype: value


SEGMENT: dict[str, SegmentReduction] = {
    e.name: e
    for e in (
        _entry("sum", lambda s, r, d: s.sum(0), lambda s, r, d: jnp.sum(s, 0), _const(0),
               int_ok=True),
        _entry("mean", lambda s, r, d: s.mean(0), lambda s, r, d: jnp.mean(s, 0), _const(0)),
        _entry("max", lambda s, r, d: s.max(0), lambda s, r, d: jnp.max(s, 0), _lowest,
               int_ok=True),
        _entry("min", lambda s, r, d: s.min(0), lambda s, r, d: jnp.min(s, 0), _highest,
               int_ok=True),
        _entry("logsumexp", lambda s, r, d: _np_lse(s), lambda s, r, d: _dense_lse(s),
               _const(-np.inf)),
        _entry("logmeanexp", lambda s, r, d: _np_lse(s) - np.log(s.shape[0]),
               lambda s, r, d: _dense_lse(s) - np.log(s.shape[0]).astype(s.dtype),
               _const(np.nan)),
        _entry("softmax", lambda s, r, d: np.exp(s - _np_lse(s)),
               lambda s, r, d: jnp.exp(s - _dense_lse(s)[None]), _const(np.nan), normalizer=True),
        _entry("log_softmax", lambda s, r, d: s - _np_lse(s),
               lambda s, r, d: s - _dense_lse(s)[None], _const(np.nan), normalizer=True),
        _entry("prod", lambda s, r, d: s.prod(0), lambda s, r, d: jnp.prod(s, 0), _const(1),
               int_ok=True, shifts=(0.0,), domain=lambda v: 1 + v / 64),
        _entry("var", lambda s, r, d: _np_var(s, d), lambda s, r, d: jnp.var(s, 0, ddof=d),
               _const(np.nan), ddof=True),
        _entry("std", lambda s, r, d: np.sqrt(_np_var(s, d)), lambda s, r, d: _dense_std(s, d),
               _const(np.nan), ddof=True),
        _entry("argmax", lambda s, r, d: r[np.argmax(s, 0)],
               lambda s, r, d: jnp.asarray(r, jnp.int32)[jnp.argmax(s, 0)], _const(-1),
               int_ok=True, differentiable=False, index=True),
        _entry("argmin", lambda s, r, d: r[np.argmin(s, 0)],
               lambda s, r, d: jnp.asarray(r, jnp.int32)[jnp.argmin(s, 0)], _const(-1),
               int_ok=True, differentiable=False, index=True),
    )
}  # fmt: skip

#: The names, by what they are.
EVERY = tuple(SEGMENT)
NORMALIZERS = tuple(n for n, e in SEGMENT.items() if e.normalizer)
INDEX = tuple(n for n, e in SEGMENT.items() if e.index)
DIFFERENTIABLE = tuple(n for n, e in SEGMENT.items() if e.differentiable)
TAKES_DDOF = tuple(n for n, e in SEGMENT.items() if e.ddof)


def identity(name, dtype):
    """The output of ``segment_<name>`` for an empty segment of data of ``dtype``."""
    return SEGMENT[name].identity(np.dtype(dtype))


def _work_dtype(dtype):
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        return np.int64
    return np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64


def reference(name, values, ids, num_segments, out_dtype=None, ddof=0):
    """float64 NumPy reference of ``segment_<name>`` of ``values`` ``(N, ...)`` by row ``ids``
    (out-of-range ids dropped).

    Floating values are computed in float64 (complex ones in complex128); integer values keep
    ``out_dtype`` (by default their own); indices are int64.
    """
    entry = SEGMENT[name]
    values = np.asarray(values)
    ids = np.asarray(ids)
    is_int = np.issubdtype(values.dtype, np.integer)
    work = values.astype(_work_dtype(values.dtype))
    feat = values.shape[1:]
    if entry.normalizer:
        out = np.full(values.shape, np.nan)
        for s in range(num_segments):
            idx = ids == s
            if idx.any():
                with np.errstate(all="ignore"):
                    out[idx] = entry.np_one(work[idx], np.flatnonzero(idx), ddof)
        return out
    if entry.index:
        out_dtype = np.int64
    out_dtype = out_dtype or (values.dtype if is_int else work.dtype)
    out = np.empty((num_segments, *feat), dtype=out_dtype)
    for s in range(num_segments):
        rows = np.flatnonzero(ids == s)
        if rows.size >= entry.min_rows(ddof):
            with np.errstate(all="ignore"):
                out[s] = entry.np_one(work[rows], rows, ddof)
        else:
            out[s] = entry.identity(np.dtype(out_dtype))
    return out


def dense(name, values, ids, num_segments, ddof=0):
    """Plain-jnp ``segment_<name>`` of ``values`` (a jnp array, may be traced) by static ``ids``:
    differentiable (empty segments are constants: the identity)."""
    entry = SEGMENT[name]
    ids = np.asarray(ids)
    feat = values.shape[1:]
    if entry.normalizer:
        out = jnp.full(values.shape, jnp.nan, values.dtype)
        for s in range(num_segments):
            rows = np.flatnonzero(ids == s)
            if rows.size:
                out = out.at[rows].set(entry.dense_one(values[rows], rows, ddof))
        return out
    dtype = jnp.int32 if entry.index else values.dtype
    parts = []
    for s in range(num_segments):
        rows = np.flatnonzero(ids == s)
        if rows.size >= entry.min_rows(ddof):
            parts.append(entry.dense_one(values[rows], rows, ddof))
        else:
            parts.append(jnp.full(feat, entry.identity(np.dtype(values.dtype)), dtype))
    if not parts:
        return jnp.zeros((0, *feat), dtype)
    return jnp.stack(parts)


# ----------------------------------------------------------------------------------------------
# Pairwise reductions, on the dense kernel matrix ``d`` (M, N, *F) (softmax: a pair (logits
# (M, N), values (M, N, *V)); weighted log-sum-exp: (logits (M, N), weights (M, N) or (N,))),
# reduced over axis 1. ``valid`` (M, N): the pairs a mask keeps (None: all).


def _valid(valid, d):
    """``valid`` broadcast to the shape of ``d`` (None: all pairs)."""
    if valid is None:
        return np.ones(d.shape, bool)
    valid = np.asarray(valid, bool)
    return np.broadcast_to(valid.reshape(valid.shape + (1,) * (d.ndim - valid.ndim)), d.shape)


def _np_extreme(d, valid, is_max):
    """The first column of each row's extreme among the valid ones (NaN is the extreme, like
    NumPy's argmax), and its value; (the identity, NO_INDEX) where there is none. Over axis 1,
    for any trailing axes."""
    d = np.asarray(d)
    valid = np.moveaxis(_valid(valid, d), 1, -1)
    d = np.moveaxis(d, 1, -1)
    floating = np.issubdtype(d.dtype, np.floating)
    nan = np.isnan(d) if floating else np.zeros(d.shape, bool)
    rank = np.unique(np.where(nan, np.zeros((), d.dtype), d), return_inverse=True)[1]
    rank = rank.reshape(d.shape)
    j = np.broadcast_to(np.arange(d.shape[-1]), d.shape)
    first = np.lexsort((j, -rank if is_max else rank, ~nan, ~valid), axis=-1)[..., :1]
    ok = np.take_along_axis(valid, first, -1)[..., 0]
    none = np.asarray((_lowest if is_max else _highest)(d.dtype), d.dtype)
    vals = np.where(ok, np.take_along_axis(d, first, -1)[..., 0], none)
    return vals, np.where(ok, first[..., 0], NO_INDEX)


def _np_kmin(d, valid, k):
    """The k smallest of each row by (NaN last, value, column), like a stable argsort; where a
    row has fewer than k valid columns, empty slots (NaN or iinfo.max, NO_INDEX)."""
    d = np.asarray(d)
    valid = _valid(valid, d)
    nan = np.isnan(d) if np.issubdtype(d.dtype, np.floating) else np.zeros(d.shape, bool)
    j = np.broadcast_to(np.arange(d.shape[1]), d.shape)
    key = np.where(nan, np.zeros((), d.dtype), d)
    order = np.lexsort((j, key, nan, ~valid), axis=1)[:, :k]
    empty = ~np.take_along_axis(valid, order, 1)
    fill = np.asarray(_nan_or_highest(d.dtype), d.dtype)
    vals = np.where(empty, fill, np.take_along_axis(d, order, 1))
    return vals, np.where(empty, NO_INDEX, order)


def _np_sum(d, valid, k):
    return np.where(_valid(valid, d), d, np.zeros((), d.dtype)).sum(1)


def _np_logsumexp(d, valid, k):
    return scipy.special.logsumexp(np.where(_valid(valid, d), d, -np.inf), axis=1)


def _np_weighted_logsumexp(d, valid, k):
    """``log sum_j w_j exp(l_ij)`` with weights ``w >= 0`` (a zero weight: no term)."""
    logits, w = (np.asarray(a, np.float64) for a in d)
    w = np.broadcast_to(w, logits.shape)
    keep = _valid(valid, logits)
    m = np.max(np.where(keep & (w > 0), logits, -np.inf), axis=1, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    s = np.where(keep, w * np.exp(logits - shift), 0.0).sum(1, keepdims=True)
    return (shift + np.log(s))[:, 0]


def _np_softmax(d, valid, k):
    """``sum_j softmax_j(logits) values_j``; a row with no valid column: 0."""
    logits, vals = (np.asarray(a) for a in d)
    keep = _valid(valid, logits)
    logits = np.where(keep, logits, -np.inf)
    m = np.max(logits, axis=1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    s = p.sum(1, keepdims=True)
    p = p / np.where(s > 0, s, 1.0)
    return np.einsum("ij,ij...->i...", p, vals)


def _np_max(d, valid, k):
    return np.where(_valid(valid, d), d, np.asarray(_lowest(d.dtype), d.dtype)).max(1)


def _np_min(d, valid, k):
    return np.where(_valid(valid, d), d, np.asarray(_highest(d.dtype), d.dtype)).min(1)


# Dense plain-jnp references on a jnp kernel matrix ``v`` (differentiable; float outputs only).


def _jnp_valid(valid, v):
    if valid is None:
        return None
    valid = jnp.asarray(valid, bool)
    return jnp.broadcast_to(valid.reshape(valid.shape + (1,) * (v.ndim - valid.ndim)), v.shape)


def _dense_masked(v, valid, fill):
    keep = _jnp_valid(valid, v)
    return v if keep is None else jnp.where(keep, v, jnp.asarray(fill, v.dtype))


def _dense_kmin(v, valid, k):
    vals, idx = lax.top_k(-_dense_masked(v, valid, jnp.inf), k)  # ties: lower index first
    return -vals, idx


def _dense_softmax(v, valid, k):
    logits, vals = v
    if valid is None:
        return jnp.einsum("ij,ij...->i...", jax.nn.softmax(logits, axis=1), vals)
    keep = _jnp_valid(valid, logits)
    logits = jnp.where(keep, logits, -jnp.inf)
    w = jnp.where(keep, jnp.exp(logits - jnp.max(logits, 1, keepdims=True)), 0.0)
    s = jnp.sum(w, 1)
    out = jnp.einsum("ij,ij...->i...", w / jnp.where(s > 0, s, 1.0)[:, None], vals)
    return jnp.where((s > 0).reshape((-1,) + (1,) * (out.ndim - 1)), out, 0.0)


def _dense_weighted_logsumexp(v, valid, k):
    logits, w = v
    w = jnp.broadcast_to(w, logits.shape)
    return jax.nn.logsumexp(_dense_masked(logits, valid, -jnp.inf), axis=1, b=w)


@dataclasses.dataclass(frozen=True)
class PairwiseReduction:
    """A form of ``foldax.pairwise_reduce`` and what the tests know about it."""

    name: str
    reduction: str  # what ``reduction=`` it passes
    #: float64 NumPy reference on the dense matrix: ``(d, valid, k) -> output``
    np_ref: Callable
    #: plain-jnp reference on a jnp matrix, differentiable (None: an index output)
    dense_ref: Callable | None
    #: the output of a row with no (unmasked) column, by the kernel's dtype (index outputs:
    #: their value, NO_INDEX their index)
    identity: Callable
    index: bool = False  # the output is (or holds) int32 column indices
    takes_k: bool = False
    pair_kernel: bool = False  # the kernel returns a pair (softmax, weighted log-sum-exp)

    @property
    def differentiable(self) -> bool:
        return self.dense_ref is not None


PAIRWISE: dict[str, PairwiseReduction] = {
    e.name: e
    for e in (
        PairwiseReduction("sum", "sum", _np_sum, lambda v, m, k: jnp.sum(_dense_masked(v, m, 0), 1),
                          _const(0)),
        PairwiseReduction("logsumexp", "logsumexp", _np_logsumexp,
                          lambda v, m, k: jax.nn.logsumexp(_dense_masked(v, m, -jnp.inf), 1),
                          _const(-np.inf)),
        PairwiseReduction("weighted_logsumexp", "logsumexp", _np_weighted_logsumexp,
                          _dense_weighted_logsumexp, _const(-np.inf), pair_kernel=True),
        PairwiseReduction("max", "max", _np_max,
                          lambda v, m, k: jnp.max(_dense_masked(v, m, -jnp.inf), 1), _lowest),
        PairwiseReduction("min", "min", _np_min,
                          lambda v, m, k: jnp.min(_dense_masked(v, m, jnp.inf), 1), _highest),
        PairwiseReduction("argmax", "argmax", lambda d, m, k: _np_extreme(d, m, True)[1], None,
                          _const(NO_INDEX), index=True),
        PairwiseReduction("argmin", "argmin", lambda d, m, k: _np_extreme(d, m, False)[1], None,
                          _const(NO_INDEX), index=True),
        PairwiseReduction("max_argmax", "max_argmax", lambda d, m, k: _np_extreme(d, m, True),
                          lambda v, m, k: jnp.max(_dense_masked(v, m, -jnp.inf), 1), _lowest,
                          index=True),
        PairwiseReduction("min_argmin", "min_argmin", lambda d, m, k: _np_extreme(d, m, False),
                          lambda v, m, k: jnp.min(_dense_masked(v, m, jnp.inf), 1), _highest,
                          index=True),
        PairwiseReduction("kmin", "kmin", lambda d, m, k: _np_kmin(d, m, k), _dense_kmin,
                          _nan_or_highest, index=True, takes_k=True),
        PairwiseReduction("softmax", "softmax", _np_softmax, _dense_softmax, _const(0),
                          pair_kernel=True),
    )
}  # fmt: skip


def pairwise_reference(name, d, *, k=None, valid=None):
    """float64 NumPy reference of the pairwise reduction ``name`` over axis 1 of the dense
    kernel matrix ``d`` (see :data:`PAIRWISE`); ``valid`` (M, N): the pairs a mask keeps.

    Index reductions: the indices (``max_argmax`` / ``min_argmin`` / ``kmin``: ``(values,
    indices)``), with NaN as the extreme (first NaN wins) and sorted last by k-min.
    """
    with np.errstate(all="ignore"):
        return PAIRWISE[name].np_ref(d, valid, k)


def pairwise_dense(name, v, *, k=None, valid=None):
    """Plain-jnp reference of ``name`` on the jnp kernel matrix ``v`` (differentiable; k-min:
    ``(values, indices)``; max_argmax / min_argmin: the values)."""
    return PAIRWISE[name].dense_ref(v, valid, k)


def dense_matrix(kernel, x, y):
    """The ``(M, N, ...)`` kernel matrix of pytrees ``x`` and ``y`` in plain jnp
    (differentiable)."""
    return jax.vmap(lambda xi: jax.vmap(lambda yj: kernel(xi, yj))(y))(x)
