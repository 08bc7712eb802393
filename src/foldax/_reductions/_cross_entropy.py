"""Cross-entropy against target weights: ``logsumexp_j(z_j) - sum_j q_j z_j`` in one pass."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ._base import _add_at, _tile_mask, instantiate
from ._logsumexp import LogSumExp, lse_weights


@dataclasses.dataclass(frozen=True)
class CrossEntropy(LogSumExp):
    """``logsumexp_j(z_j) - sum_j q_j z_j``: the cross-entropy of the softmax of logits ``z``
    against target weights ``q`` (a one-hot label, a smoothed one), from values ``(z, q)``.

    State ``(m, s, picked)``: :class:`LogSumExp`'s, and ``sum_j q_j z_j`` (terms with ``q_j = 0``
    left out, so a ``-inf`` logit off the target adds nothing), all in float32 for half-precision
    logits. Outputs ``(loss, m, log(s), picked)``; :meth:`result` is the pair ``(loss, lse)``.
    Both are differentiable: ``d loss / d z = p - q`` and ``d lse / d z = p`` with ``p`` the
    softmax, so the label's logit takes its gradient in the same tiles, and the same float32
    sums, as every other logit (nothing is gathered or scattered per label).
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "name", "cross-entropy")

    def value_aval(self, tile_aval):
        z, _ = tile_aval
        return jax.ShapeDtypeStruct(z.shape[2:], z.dtype)

    def init(self, num, fshape, dtype):
        m, s = super().init(num, fshape, dtype)
        return (m, s, jnp.zeros_like(s))

    def reduce(self, v, mask):
        z, q = v
        m, s = super().reduce(z, mask)
        return (m, s, jnp.sum(_picked(z, q, _tile_mask(mask, z), s.dtype), axis=1))

    def combine(self, a, b):
        return (*super().combine(a[:2], b[:2]), a[2] + b[2])

    def allreduce(self, state, axes):
        return (*super().allreduce(state[:2], axes), lax.psum(state[2], axes))

    def scatter(self, carry, seg, st):
        return (*super().scatter(carry[:2], seg, st[:2]), _add_at(carry[2], seg, st[2]))

    n_outputs = 4

    def outputs(self, st):
        lse, m, logs = super().outputs(st[:2])
        return (lse - st[2], m, logs, st[2])

    def result(self, outputs):
        return (outputs[0], outputs[0] + outputs[3])

    def info(self, outputs):
        """As :class:`LogSumExp`'s, with the log-sum-exp (the variable of second-order
        derivatives) read as ``loss + picked``."""
        loss, m, logs, picked = outputs
        return super().info((loss + picked, m, logs))

    def _weights(self, z, mask, info):
        ok = _tile_mask(mask, z)
        return ok, lse_weights(z, ok, *(a[:, None] for a in info))

    def row_cotangent(self, v, mask, info, g):
        z, q = v
        ok, p = self._weights(z, mask, info)
        g_loss, g_picked = (_per_row(g[i], p) for i in (0, 3))
        qa, za = _counted(z, q, ok, p.dtype)
        # d loss = p dz - q dz - z dq;  d picked = q dz + z dq
        # a zero cotangent pulls back to zero even where p is not a number (as LogSumExp's)
        dz = jnp.where(g_loss == 0, jnp.zeros((), p.dtype), g_loss * p) + (g_picked - g_loss) * qa
        dq = (g_picked - g_loss) * za
        return (dz.astype(z.dtype), dq.astype(q.dtype))

    def tangent(self, v, dv, mask, info):
        (z, q), (dz, dq) = v, instantiate(dv, v)
        ok, p = self._weights(z, mask, info)
        dz, dq = (jnp.where(ok, a.astype(p.dtype), jnp.zeros((), p.dtype)) for a in (dz, dq))
        qa, za = _counted(z, q, ok, p.dtype)
        t_picked = jnp.sum(qa * dz + za * dq, axis=1)
        t_loss = jnp.sum(p * dz, axis=1) - t_picked
        zero = jnp.zeros_like(t_loss)
        return (t_loss, zero, zero, t_picked)


def _picked(z, q, ok, acc):
    """``q * z`` where the pair counts and its weight is nonzero, else 0, in ``acc``."""
    keep = ok & (q != 0)
    return jnp.where(keep, q.astype(acc) * z.astype(acc), jnp.zeros((), acc))


def _counted(z, q, ok, dtype):
    """``(q, z)`` where the pair counts (``z`` where it is finite too), else 0, in ``dtype``."""
    zero = jnp.zeros((), dtype)
    return (
        jnp.where(ok, q.astype(dtype), zero),
        jnp.where(ok & jnp.isfinite(z), z.astype(dtype), zero),
    )


def _per_row(g, like):
    """A per-row cotangent ``(G, ...)`` as a column against ``like`` ``(G, T, ...)``; 0 if none."""
    if g is None:
        return jnp.zeros((), like.dtype)
    return g[:, None].astype(like.dtype)
