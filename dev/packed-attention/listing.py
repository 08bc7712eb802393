"""What listing the live blocks costs for packed causal attention (16 documents, one head,
D = 64): the engine's own block test (segment-id ranges and the causal mask's formula) over
every block pair, at the block sizes the planner picks, timed alone against the forward.

    python dev/packed-attention/listing.py [L ...]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._engine import _loop
from foldax._pairwise._masks import check_masking
from foldax._tools import workloads as w
from foldax._tools.bench._packed import documents


def planned_blocks(q, ids):
    """The planner's (bi, bj), read from the engine while the forward is traced."""
    seen = []
    original = _loop._live_blocks

    def spy(spec, consts, plan, ti):
        seen.append((plan.bi, plan.bj))
        return original(spec, consts, plan, ti)

    _loop._live_blocks = spy
    try:
        jax.jit(
            lambda q, s: foldax.dot_product_attention(q, q, q, is_causal=True, segment_ids=s)
        ).lower(q, ids)
    finally:
        _loop._live_blocks = original
    return seen[0]


def _listing(L, bi, bj):
    """The engine's block test over every pair of blocks: ``(steps_i, steps_j)`` booleans."""
    steps_i, steps_j = -(-L // bi), -(-L // bj)

    def listing(ids):
        masking = check_masking("listing", lambda i, j: j <= i, ids, L, L, False)
        live = masking.block_live(0)
        j0 = jnp.minimum(jnp.arange(steps_j, dtype=jnp.int32) * bj, L - bj)
        i0 = jnp.minimum(jnp.arange(steps_i, dtype=jnp.int32) * bi, L - bi)
        return jax.lax.map(lambda i: live(masking.consts, i, j0, bi, bj), i0)

    return listing


def main(lengths):
    for L in lengths:
        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, L, 1, 64), dtype=np.float32))
        ids = jnp.asarray(documents(L))[None]
        bi, bj = planned_blocks(q, ids)
        steps_i, steps_j = -(-L // bi), -(-L // bj)

        listing = _listing(L, bi, bj)

        fwd = jax.jit(
            lambda q, s: foldax.dot_product_attention(q, q, q, is_causal=True, segment_ids=s)
        )
        t_list = w.median_time(jax.jit(listing), ids[0])
        t_fwd = w.median_time(fwd, q, ids)
        n_live = int(jax.jit(listing)(ids[0]).sum())
        print(
            f"L={L}: blocks {bi}x{bj}, {n_live} of {steps_i * steps_j} live; listing "
            f"{t_list * 1e3:.2f} ms, forward {t_fwd * 1e3:.1f} ms: {t_list / t_fwd:.2%}"
        )


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (16384,))
