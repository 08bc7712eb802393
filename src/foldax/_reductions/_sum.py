"""Sum and mean: the additive reductions."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._base import Monoid, _accumulator, _add_at, _expand, _tile_mask


class Sum(Monoid):
    """State: the sum, in float32 for half-precision values (the engine casts the result back to
    the values' dtype)."""

    pallas = True

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
        # the count in the result's real dtype (float32 for half precision): a float64
        # mean's gradient divides in float64
        real = jnp.float64 if jnp.finfo(outputs[0].dtype).bits == 64 else jnp.float32
        return (_expand(outputs[1], outputs[0].ndim).astype(real),)

    def row_cotangent(self, v, mask, info, g):
        (count,) = info
        share = mean_share(g[0], count, v.dtype)
        ct = jnp.broadcast_to(share[:, None], v.shape)
        return jnp.where(_tile_mask(mask, v), ct, jnp.zeros((), ct.dtype))


def mean_share(g, count, dtype):
    """Each segment's share ``g / count`` of its mean's cotangent ``g`` (``count`` in the
    result's real dtype; an empty segment divides by 1), in ``dtype``."""
    dt = g.dtype if jnp.issubdtype(g.dtype, jnp.complexfloating) else count.dtype
    return (g.astype(dt) / jnp.maximum(count, 1).astype(dt)).astype(dtype)
