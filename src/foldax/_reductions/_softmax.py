"""Softmax-weighted sums: exact attention as a monoid."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._base import (
    Monoid,
    _accumulator,
    _expand,
    _finite_or_zero,
    _rescale,
    log_of_sum,
    promote,
)


@dataclasses.dataclass(frozen=True)
class SoftmaxSum(Monoid):
    """``sum_j softmax_j(logit) * value_j``: exact attention. Value: a pair ``(logit, value)``.

    State ``(m, s, acc)``: running max logit, ``sum exp(l - shift(m))`` and the weighted values,
    in float32 for half-precision logits or values (mixed precision, e.g. float32 logits and
    bfloat16 values, is accepted: the weights meet the values in the values' dtype, summed in
    the state's). The result is in the values' dtype, cast as the fold finishes a block.
    """

    pallas = True

    shared: bool = False

    def __init__(self, shared=False):
        super().__init__("softmax", "float")
        #: values do not depend on the row of x: a tile's values are ``(bj, *Fv)``, not
        #: ``(bi, bj, *Fv)``, and the weighted sums are GEMMs (attention's ``P @ V``).
        object.__setattr__(self, "shared", shared)

    def value_aval(self, tile_aval):
        lg, val = tile_aval
        sds = jax.ShapeDtypeStruct
        # shared values are (bj, *Fv), one per row of y: not (bi, bj, *Fv)
        return (sds(lg.shape[2:], lg.dtype), sds(val.shape[1 if self.shared else 2 :], val.dtype))

    @staticmethod
    def _dtypes(lg_dtype, val_dtype):
        """``(logit state, value state)`` dtypes: float32 for half precision, and the values
        summed at least as precisely as the logits."""
        lg_acc = _accumulator(lg_dtype)
        return lg_acc, promote(_accumulator(val_dtype), lg_acc)

    def result_dtype(self, aval):
        return aval[1].dtype  # the weighted mean of values is cast to theirs as it is made

    def init_aval(self, num, aval):
        lg, val = aval
        lg_acc, val_acc = self._dtypes(lg.dtype, val.dtype)
        return (
            jnp.full((num, *lg.shape), -np.inf, lg_acc),
            jnp.zeros((num, *lg.shape), lg_acc),
            jnp.zeros((num, *val.shape), val_acc),
        )

    def reduce(self, v, mask):
        lg, val = v
        lg_acc, val_acc = self._dtypes(lg.dtype, val.dtype)
        lg = jnp.where(mask, lg.astype(lg_acc), jnp.asarray(-np.inf, lg_acc))
        m = jnp.max(lg, axis=1)
        w = jnp.exp(lg - _finite_or_zero(m)[:, None])
        # Masked columns have weight exactly 0 (their logit is -inf). Their values are real rows
        # of y (clamped reads), so they are not masked again: a where on the (bi, bj, *Fv)
        # values would materialize them, while w @ values stays one contraction.
        w_v = w.astype(val.dtype)
        if self.shared:
            flat = val.reshape(val.shape[0], -1)
            acc = jnp.matmul(w_v, flat, preferred_element_type=val_acc)
            acc = acc.reshape((w.shape[0], *val.shape[1:]))
        else:
            acc = jnp.einsum("ij,ij...->i...", w_v, val, preferred_element_type=val_acc)
        return (m, jnp.sum(w, axis=1), acc)

    def reduce_columns(self, v, mask, cols, *index):
        # a kernel's tile pads its last block of y with copies of a row: their weights are 0,
        # and so must their values be (0 * inf is NaN), one where on the (bj, *F) values
        if not self.shared:
            return self.reduce(v, mask)
        lg, val = v
        keep = cols.reshape(cols.shape[:1] + (1,) * (val.ndim - 1))
        return self.reduce((lg, jnp.where(keep, val, jnp.zeros((), val.dtype))), mask)

    @staticmethod
    def _factor(st, m):
        """The rescaling of state ``st`` to the running max ``m``; 0 where ``st`` is empty (its
        factor may overflow to inf: never multiply it)."""
        zero = jnp.zeros((), st[1].dtype)
        return jnp.where(st[1] != 0, _rescale(jnp.ones_like(st[1]), st[0], m), zero)

    def combine(self, a, b):
        m = jnp.maximum(a[0], b[0])
        fa, fb = self._factor(a, m), self._factor(b, m)
        acc = a[2] * _expand(fa, a[2].ndim) + b[2] * _expand(fb, b[2].ndim)
        return (m, a[1] * fa + b[1] * fb, acc)

    def allreduce(self, state, axes):
        m = lax.pmax(state[0], axes)
        f = self._factor(state, m)
        acc = lax.psum(state[2] * _expand(f, state[2].ndim), axes)
        return (m, lax.psum(state[1] * f, axes), acc)

    n_outputs = 2

    def finalize(self, st):
        # a row with nothing to weigh (every pair masked out) is 0, not 0 / 0; a NaN logit
        # makes its row NaN (as jax.nn's softmax)
        s = _expand(st[1], st[2].ndim)
        empty = s == 0
        return jnp.where(empty, jnp.zeros_like(st[2]), st[2] / jnp.where(empty, 1, s))

    def outputs(self, st):
        return (self.finalize(st), _finite_or_zero(st[0]) + log_of_sum(st[1]))

    def info(self, outputs):
        out, lse = outputs
        return (lse, out)

    @staticmethod
    def _weights(lg, mask, lse):
        """``softmax`` weights ``(bi, bj)`` of a tile (in the log-sum-exp's dtype); exactly 0
        where masked or empty."""
        ok = mask & (lse[:, None] != -np.inf)  # a NaN row's weights stay NaN
        z = jnp.where(ok, lg.astype(lse.dtype) - lse[:, None], jnp.asarray(-np.inf, lse.dtype))
        return jnp.exp(z), ok

    def row_cotangent(self, v, mask, info, g):
        lg, val = v
        lse, out = info
        g_out, g_lse = g
        p, ok = self._weights(lg, mask, lse)
        acc = self._dtypes(lg.dtype, val.dtype)[1]  # the values' state: products are taken there
        out = out.astype(acc)
        ct_lg = jnp.zeros_like(p)
        ct_val = jnp.zeros(val.shape, acc)
        if g_out is not None and self.shared:
            bi, bj = p.shape
            g2 = g_out.reshape(bi, -1).astype(acc)
            v2, o2 = val.reshape(bj, -1).astype(acc), out.reshape(bi, -1)
            ct_val = (p.astype(acc).T @ g2).reshape(val.shape)
            dots = g2 @ v2.T - jnp.sum(g2 * o2, axis=-1)[:, None]
            ct_lg = jnp.where(ok, p * dots.astype(p.dtype), jnp.zeros((), p.dtype))
        elif g_out is not None:
            gv = g_out[:, None].astype(acc)  # (Bi, 1, *Fv)
            ct_val = _expand(p.astype(acc), val.ndim) * gv
            diff = val.astype(acc) - out[:, None]
            diff = jnp.where(_expand(ok, val.ndim), diff, jnp.zeros((), acc))
            ct_lg = p * jnp.sum((gv * diff).reshape((*p.shape, -1)), axis=-1).astype(p.dtype)
        if g_lse is not None:
            ct_lg = ct_lg + p * g_lse[:, None].astype(p.dtype)
        return (ct_lg.astype(lg.dtype), ct_val.astype(val.dtype))

    def tangent(self, v, dv, mask, info):
        # a tangent that is None is zero (:meth:`Monoid.tangent`): its products are left out
        lg, val = v
        dlg, dval = dv
        lse, out = info
        acc = self._dtypes(lg.dtype, val.dtype)[1]
        out = out.astype(acc)
        p, _ = self._weights(lg, mask, lse)
        pd = None if dlg is None else p * dlg.astype(p.dtype)
        p, val = p.astype(acc), val.astype(acc)
        if self.shared:
            bj = p.shape[1]
            weigh = lambda w, a: (w @ a.reshape(bj, -1)).reshape(out.shape)  # noqa: E731
        else:
            weigh = lambda w, a: jnp.einsum("ij,ij...->i...", w, a)  # noqa: E731
        d_out = jnp.zeros(out.shape, acc) if dval is None else weigh(p, dval.astype(acc))
        if pd is None:
            return (d_out, jnp.zeros(lse.shape, lse.dtype))
        d_lse = jnp.sum(pd, axis=1)
        d_out = d_out + weigh(pd.astype(acc), val)
        return (d_out - _expand(d_lse.astype(acc), out.ndim) * out, d_lse)
