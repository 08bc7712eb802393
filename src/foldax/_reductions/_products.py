"""Sums of a pair's weight times values carried on its column: a kernel matrix times many
right-hand sides, as one matrix product per tile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ._base import _accumulator, promote
from ._sum import Sum


def rarely(pred, fn, like):
    """``fn()`` where the scalar ``pred`` holds, else zeros like ``like``: a loop of at most one
    turn, which under ``vmap`` runs only if some element needs it (a ``cond`` would become a
    select that always computes ``fn``). Not reverse-differentiable: for a fold's own states."""
    # the body's outputs take the carry's types (inside ``shard_map``: whether they vary)
    zeros = jnp.zeros_like(like)
    body = lambda c: (c[0] & False, fn().astype(like.dtype) + c[1])  # noqa: E731
    return lax.while_loop(lambda c: c[0], body, (pred, zeros))[1]


def masked_products(w, mask, values, dtype, pair_masked, differentiable=False, cols=None):
    """``sum_j [mask_ij] w_ij * values_j`` ``(bi, *F)`` in ``dtype``: one matrix product.

    A product's zeros are not a masked pair's: ``0 * inf`` is NaN. Without a pair mask
    (``pair_masked`` false: ``mask`` is the tile's rows by its columns) the columns the tile
    does not own are zeroed in ``values`` and its rows in the result, which is then exactly
    what the pairs kept give. With one, the values that are not finite (rare) are left out of
    the product and their kept terms added one by one: in a loop that runs only when a tile
    holds such a value, or (``differentiable``, for derivative rules, which JAX differentiates
    again) in a ``cond``. ``cols`` (``(bj, 1)`` bool, without a pair mask): the columns that
    are real rows of ``y``, which then are the only ones ``mask`` removes (every row is real).
    """
    bi, bj = w.shape
    operand = promote(w.dtype, values.dtype)
    flat = values.reshape(bj, -1).astype(operand)
    wm = jnp.where(mask, w.astype(operand), jnp.zeros((), operand))
    zero = jnp.zeros((), operand)
    if cols is not None:
        return jnp.matmul(wm, jnp.where(cols, flat, zero), preferred_element_type=dtype).reshape(
            (bi, *values.shape[1:])
        )
    if not pair_masked or not jnp.issubdtype(operand, jnp.inexact):
        cols, rows = jnp.any(mask, axis=0), jnp.any(mask, axis=1)
        out = jnp.matmul(wm, jnp.where(cols[:, None], flat, zero), preferred_element_type=dtype)
        out = jnp.where(rows[:, None], out, jnp.zeros((), dtype))
        return out.reshape((bi, *values.shape[1:]))
    finite = jnp.isfinite(flat)
    out = jnp.matmul(wm, jnp.where(finite, flat, zero), preferred_element_type=dtype)

    def one_by_one():  # a (bi, bj) tile per column of values, never (bi, bj, F)
        def column(col):
            v, ok = col
            return jnp.sum(jnp.where(mask & ~ok[None, :], wm * v[None, :], zero), 1, dtype=dtype)

        return lax.map(column, (flat.T, finite.T)).T

    bad = ~jnp.all(finite)
    if differentiable:
        out = out + lax.cond(bad, one_by_one, lambda: jnp.zeros(out.shape, out.dtype))
    else:
        out = out + rarely(bad, one_by_one, out)
    return out.reshape((bi, *values.shape[1:]))


@dataclasses.dataclass(frozen=True)
class SumOfProducts(Sum):
    """``sum_j w_ij * v_j`` for a tile's values ``(w (bi, bj), v (bj, *F))``: weights of the pairs
    and values of the columns (``pairwise_reduce``'s sum of a kernel ``k(a, b[0]) * b[1]``).
    State: :class:`Sum`'s, in float32 for half-precision weights or values. Its derivatives are
    matrix products too: ``g @ v.T`` for the weights, ``w.T @ g`` for the values.
    ``pair_masked``: the fold has a pair mask (see :func:`masked_products`)."""

    pair_masked: bool = False

    def __init__(self, pair_masked=False):
        super().__init__()
        object.__setattr__(self, "pair_masked", pair_masked)

    #: Preferred dense block when ``y`` is walked transposed: long enough both ways for the
    #: matrix product to run at its speed.
    dense_tile = (512, 512)

    @staticmethod
    def _dtype(w_dtype, v_dtype):
        return promote(_accumulator(w_dtype), _accumulator(v_dtype))

    def value_aval(self, tile_aval):
        w, v = tile_aval
        sds = jax.ShapeDtypeStruct
        return (sds((), w.dtype), sds(v.shape[1:], v.dtype))

    def result_dtype(self, aval):
        return promote(aval[0].dtype, aval[1].dtype)  # the kernel's: the product's dtype

    def init_aval(self, num, aval):
        w, v = aval
        return (jnp.zeros((num, *v.shape), self._dtype(w.dtype, v.dtype)),)

    def reduce(self, v, mask):
        w, val = v
        dtype = self._dtype(w.dtype, val.dtype)
        return (masked_products(w, mask, val, dtype, self.pair_masked),)

    def reduce_columns(self, v, mask, cols):
        if self.pair_masked:
            return self.reduce(v, mask)
        w, val = v
        return (masked_products(w, mask, val, self._dtype(w.dtype, val.dtype), False, cols=cols),)

    @property
    def pallas(self):  # a pair mask's non-finite values take a loop of their own
        return not self.pair_masked

    def row_cotangent(self, v, mask, info, g):
        w, val = v
        (g_out,) = g
        dtype = self._dtype(w.dtype, val.dtype)
        bi, bj = w.shape
        g2 = g_out.reshape(bi, -1).astype(dtype)
        v2 = val.reshape(bj, -1).astype(dtype)
        ct_w = jnp.where(mask, g2 @ v2.T, jnp.zeros((), dtype))
        wm = jnp.where(mask, w.astype(dtype), jnp.zeros((), dtype))
        ct_v = (wm.T @ g2).reshape(val.shape)
        return (ct_w.astype(w.dtype), ct_v.astype(val.dtype))

    def tangent(self, v, dv, mask, info):
        (w, val), (dw, dval) = v, dv
        dtype = self._dtype(w.dtype, val.dtype)
        products = lambda a, b: masked_products(a, mask, b, dtype, self.pair_masked, True)  # noqa: E731
        terms = [products(a, b) for a, b in ((w, dval), (dw, val)) if None not in (a, b)]
        return (sum(terms[1:], terms[0]),)  # (a tangent that is None is zero: left out)
