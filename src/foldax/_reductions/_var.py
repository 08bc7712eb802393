"""Variance and standard deviation from a mergeable state."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ._base import Monoid, _accumulator, _add_at, _expand, _take, _tile_mask
from ._prod import _output_cotangent


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
