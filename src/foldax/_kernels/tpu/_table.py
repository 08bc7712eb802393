"""The blocks a masked fold visits: a table made on the host side of the kernel (in XLA) from
the fold's ``block_live`` and read by the kernel's index maps through scalar prefetch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def live_blocks(spec, consts, b, gi, gj):
    """``(gi, gj)`` bool: which blocks of ``y`` each block of ``x`` may keep a pair of.
    ``block_live`` takes blocks within the arrays: each padded block is asked as the block of
    the same size ending at the array's end, which holds its real part."""
    m, n = spec.plan.num_slots, spec.plan.n
    bi, bj = min(b.rows, m), min(b.cols, n)
    j0 = jnp.minimum(jnp.arange(gj, dtype=jnp.int32) * b.cols, n - bj)

    def one(ti):
        live = spec.block_live(consts, jnp.minimum(ti * b.rows, m - bi), j0, bi, bj)
        return jnp.broadcast_to(live, (gj,))

    return jax.vmap(one)(jnp.arange(gi, dtype=jnp.int32))


def visits(live):
    """``(counts (g,), order (g * h,))`` of a ``(g, h)`` table: how many inner blocks each
    outer block visits, and which (the live ones first, in order; the rest repeat the last
    live one, so that their steps load nothing new)."""
    h = live.shape[1]
    counts = jnp.sum(live, axis=1, dtype=jnp.int32)
    order = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=1)
    k = jnp.arange(h, dtype=jnp.int32)[None, :]
    return counts, jnp.where(k < counts[:, None], order, last).reshape(-1)
