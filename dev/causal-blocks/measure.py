"""dot_product_attention at L^2, D = 64, float32: a boolean causal array mask (an argument of
the jitted function; also in tiles of 512), is_causal, an all-true array and an always-true
formula, against no mask, forward and gradient, in turns (median of REPEATS ratios after
warm-up; quartiles in brackets).

    python dev/causal-blocks/measure.py [L] [REPEATS]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import foldax

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 21
k = jax.random.split(jax.random.key(0), 3)
q, kk, v = (jax.random.normal(a, (1, L, 1, 64), jnp.float32) for a in k)
causal = jnp.tril(jnp.ones((L, L), bool))[None, None]
ones = jnp.ones((L, L), bool)[None, None]
dpa = foldax.dot_product_attention
ways = {
    "none": lambda q, k, v, m: dpa(q, k, v),
    "is_causal": lambda q, k, v, m: dpa(q, k, v, is_causal=True),
    "array": lambda q, k, v, m: dpa(q, k, v, mask=m),
    "array 512": lambda q, k, v, m: dpa(q, k, v, mask=m, block_size=512),
    "ones": lambda q, k, v, m: dpa(q, k, v, mask=ones),
    "true fn": lambda q, k, v, m: dpa(q, k, v, mask=lambda i, j: i >= 0),
}
fs = {}
for name, f in ways.items():
    fs[(name, "fwd")] = jax.jit(f)
    fs[(name, "grad")] = jax.jit(jax.grad(lambda q, k, v, m, f=f: f(q, k, v, m).sum(), (0, 1, 2)))
for f in fs.values():
    jax.block_until_ready(f(q, kk, v, causal))
ts = {n: [] for n in fs}
for _ in range(REPEATS):
    for n, f in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, kk, v, causal))
        ts[n].append(time.perf_counter() - t0)
for kind in ("fwd", "grad"):
    base = ts[("none", kind)]
    parts = []
    for n in ways:
        r = [a / b for a, b in zip(ts[(n, kind)], base, strict=True)]
        qs = statistics.quantiles(r, n=4)
        parts.append(f"{n} {statistics.median(r):.2f}x [{qs[0]:.2f}-{qs[2]:.2f}]")
    print(kind, "  ".join(parts), f"(none {statistics.median(base) * 1e3:.1f} ms)")
