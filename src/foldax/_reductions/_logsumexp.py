"""Log-sum-exp (and log-mean-exp), and its weighted form."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._base import (
    Monoid,
    _accumulator,
    _add_at,
    _expand,
    _finite_or_zero,
    _rescale,
    _rescale_at,
    _take,
    _tile_mask,
    instantiate,
    log_of_sum,
)


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

    pallas = True

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
        m, logs = st[0], log_of_sum(st[1])
        out = _finite_or_zero(m) + logs
        if self.mean:
            out = out - log_of_sum(_expand(st[2], out.ndim).astype(out.dtype))
            return (out, m, logs, st[2])
        return (out, m, logs)

    def info(self, outputs):
        """``(shift, rel)`` with ``exp((x - shift) - rel) = exp(x - logsumexp)``: numerically
        ``shift(m)`` and ``log(s)``; as a function, ``rel`` follows the log-sum-exp (the result,
        plus the log-count for ``mean``), so second-order derivatives flow through it."""
        out, m, logs = outputs[:3]
        if self.mean:
            out = out + log_of_sum(_expand(outputs[3], out.ndim).astype(out.dtype))
        rel = lax.stop_gradient(logs) + (out - lax.stop_gradient(out)).astype(logs.dtype)
        return (lax.stop_gradient(m), rel)

    def row_cotangent(self, v, mask, info, g):
        # A zero cotangent pulls back to zero, even where the weight is not a number (a +inf
        # row of a +inf segment): a softmax's rows of such a segment take no gradient.
        w = lse_weights(v, _tile_mask(mask, v), *(a[:, None] for a in info))
        g = g[0][:, None].astype(w.dtype)
        return jnp.where(g == 0, jnp.zeros((), w.dtype), g * w).astype(v.dtype)

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


class WeightedLogSumExp(LogSumExp):
    """``log sum_j w_j exp(l_j)``: KeOps' LogSumExp with weights, used in optimal transport and
    mixture likelihoods. Value: a pair ``(logit, weight)``. As ``jax.nn.logsumexp(l, b=w)``: a
    zero weight drops its term, a NaN weight makes the result NaN, and a negative total (some
    weights may be negative) has no logarithm: NaN.

    State ``(m, s)`` as for :class:`LogSumExp`, with ``m`` the max logit among
    nonzero weights (a zero weight never sets the shift, so ``s`` cannot underflow to 0 when a
    weighted term is far below an unweighted one). Derivatives: ``d/dl_j = w_j e_j`` and
    ``d/dw_j = e_j`` with ``e_j = exp(l_j - out)``, finite at ``w_j = 0``.
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "name", "logsumexp (weighted)")

    def value_aval(self, tile_aval):
        lg, _ = tile_aval
        return jax.ShapeDtypeStruct(lg.shape[2:], lg.dtype)

    def init_aval(self, num, aval):
        return self.init(num, aval.shape, aval.dtype)

    def reduce(self, v, mask):
        lg, w = v
        acc = _accumulator(lg.dtype)
        lg, w = lg.astype(acc), w.astype(acc)
        live = mask & (w != 0)  # NaN and negative weights count (as in jax.nn.logsumexp)
        m = jnp.max(jnp.where(live, lg, jnp.asarray(-np.inf, acc)), axis=1)
        e = jnp.exp(lg - _finite_or_zero(m)[:, None])
        return (m, jnp.sum(jnp.where(live, w * e, jnp.zeros((), acc)), axis=1))

    def _e(self, lg, mask, info):
        """``exp(l - out)`` where the pair counts (0 elsewhere), in the state's dtype."""
        return lse_weights(lg, mask, *(a[:, None] for a in info))

    def row_cotangent(self, v, mask, info, g):
        lg, w = v
        e = self._e(lg, mask, info)
        gl = g[0][:, None].astype(e.dtype)
        return ((gl * w.astype(e.dtype) * e).astype(lg.dtype), (gl * e).astype(w.dtype))

    def tangent(self, v, dv, mask, info):
        (lg, w), (dl, dw) = v, instantiate(dv, v)
        e = self._e(lg, mask, info)
        t = jnp.sum(e * (w.astype(e.dtype) * dl.astype(e.dtype) + dw.astype(e.dtype)), axis=1)
        zero = jnp.zeros_like(t)
        return (t, zero, zero)
