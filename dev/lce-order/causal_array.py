"""dot_product_attention at L^2, D = 64, float32: a boolean causal array mask (as an argument
of the jitted function) in tiles of 1024 and 512, against no mask and is_causal, forward and
gradient, in turns.

    python dev/lce-order/causal_array.py [L]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import foldax

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
k = jax.random.split(jax.random.key(0), 3)
q, kk, v = (jax.random.normal(a, (1, L, 1, 64), jnp.float32) for a in k)
causal = jnp.tril(jnp.ones((L, L), bool))[None, None]
ways = {
    "none": lambda q, k, v, m: foldax.dot_product_attention(q, k, v),
    "is_causal": lambda q, k, v, m: foldax.dot_product_attention(q, k, v, is_causal=True),
    "array": lambda q, k, v, m: foldax.dot_product_attention(q, k, v, mask=m),
    "array 512": lambda q, k, v, m: foldax.dot_product_attention(q, k, v, mask=m, block_size=512),
}
fs = {}
for name, f in ways.items():
    fs[(name, "fwd")] = jax.jit(f)
    fs[(name, "grad")] = jax.jit(jax.grad(lambda q, k, v, m, f=f: f(q, k, v, m).sum(), (0, 1, 2)))
for f in fs.values():
    jax.block_until_ready(f(q, kk, v, causal))
ts = {n: [] for n in fs}
for _ in range(7):
    for n, f in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, kk, v, causal))
        ts[n].append(time.perf_counter() - t0)
for kind in ("fwd", "grad"):
    base = statistics.median(ts[("none", kind)])
    print(
        kind,
        "  ".join(f"{n} {statistics.median(ts[(n, kind)]) / base:.2f}x" for n in ways),
        f"(none {base * 1e3:.1f} ms)",
    )
