"""foldax's plain-data segment reductions against the program a user writes with jax.ops, on a
graph's shapes: E messages reduced to V nodes by unsorted ids, jitted, forward and gradient,
timed in turns in one process (median of 3 x 3 calls after a warm-up).

    python dev/direct-scatter/graph_turns.py E V F segment_max,segment_softmax,...

Run it with ``PYTHONPATH=<a checkout>/src`` to compare two versions of foldax on one machine.
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax


def jraph_softmax(logits, ids, n):
    """jraph's segment_softmax: max, gather, exp, sum, gather, divide."""
    maxs = jax.ops.segment_max(logits, ids, n)
    e = jnp.exp(logits - jax.lax.stop_gradient(maxs[ids]))
    return e / jax.ops.segment_sum(e, ids, n)[ids]


def plain_lse(x, ids, n):
    """The stable log-sum-exp with jax.ops: max, gather, exp, sum, log."""
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, n))
    return m + jnp.log(jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, n))


def plain_mean(x, ids, n):
    """A mean with jax.ops: two sums (the count of each segment at least 1)."""
    count = jax.ops.segment_sum(jnp.ones(x.shape[:1], x.dtype), ids, n)
    return jax.ops.segment_sum(x, ids, n) / jnp.maximum(count, 1)[:, None]


PEERS = {
    "segment_sum": jax.ops.segment_sum,
    "segment_mean": plain_mean,
    "segment_max": jax.ops.segment_max,
    "segment_min": jax.ops.segment_min,
    "segment_logsumexp": plain_lse,
    "segment_softmax": jraph_softmax,
}


def calls(f, x, ids, v, rng):
    fwd = jax.jit(lambda x, i: f(x, i, v))
    w = jnp.asarray(rng.standard_normal(jax.eval_shape(fwd, x, ids).shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda x, i, w: jnp.sum(f(x, i, v) * w)))
    return (lambda: fwd(x, ids)), (lambda: grad(x, ids, w))


def median(fn, reps=3):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    e, v, feat = (int(a) for a in sys.argv[1:4])
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, v, e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((e, feat)), jnp.float32)
    for name in sys.argv[4].split(","):
        ours = calls(getattr(foldax, name), x, ids, v, rng)
        peer = calls(PEERS[name], x, ids, v, rng)
        for p, i in (("fwd", 0), ("grad", 1)):
            jax.block_until_ready(ours[i]())
            jax.block_until_ready(peer[i]())
            a, b = [], []
            for _ in range(3):
                a.append(median(ours[i]))
                b.append(median(peer[i]))
            a, b = statistics.median(a), statistics.median(b)
            print(
                f"{name} F={feat} {p}: foldax {a * 1e3:.1f} ms, peer {b * 1e3:.1f} ms, {a / b:.2f}x"
            )


if __name__ == "__main__":
    main()
