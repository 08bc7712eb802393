"""Product, exact around zeros."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ._base import Monoid, _accumulator, _add_at, _tile_mask


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
