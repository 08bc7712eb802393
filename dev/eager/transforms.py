"""Eager jax.grad / jax.vmap of foldax calls (no jit), median of 5 after a warm-up; run with PYTHONPATH=<a checkout>/src to compare two versions.

python dev/eager/transforms.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((1000, 8)), jnp.float32)
ids = jnp.asarray(rng.integers(0, 100, 1000), jnp.int32)
xs = jnp.stack([x] * 16)
th = jnp.ones((8,), jnp.float32)
cases = {
    "grad wrt fn params (logsumexp)": (
        lambda: jax.grad(lambda t: foldax.segment_logsumexp(x, ids, 100, fn=lambda r: r @ t).sum())(
            th
        ),
        lambda: jax.grad(lambda t: jax.nn.logsumexp(x @ t))(th),
    ),
    "vmap 16 segment_sum": (
        lambda: jax.vmap(lambda a: foldax.segment_sum(a, ids, 100))(xs),
        lambda: jax.vmap(lambda a: jax.ops.segment_sum(a, ids, 100))(xs),
    ),
    "grad segment_softmax": (
        lambda: jax.grad(lambda a: (foldax.segment_softmax(a, ids, 100) ** 2).sum())(x),
        None,
    ),
}
for nm, (f, _peer) in cases.items():
    jax.block_until_ready(f())
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t0)
    print(nm, round(statistics.median(ts) * 1e3, 2), "ms")
