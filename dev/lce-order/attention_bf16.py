"""dot_product_attention's bfloat16 gradient walked rows-outer against j-fastest (the choice
turned off), in turns in one process: does narrowing k's and v's gradients block by block cost
time?

    python dev/lce-order/attention_bf16.py [L] [D]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import foldax
from foldax._engine import _loop

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
k = jax.random.split(jax.random.key(0), 3)
q, kk, v = (jax.random.normal(a, (1, L, 1, D), jnp.bfloat16) for a in k)


def loss(q, k, v):
    return foldax.dot_product_attention(q, k, v).astype(jnp.float32).sum()


choice = _loop._rows_outer
fs = {}
for name, on in (("j-fastest", False), ("rows-outer", True)):
    _loop._rows_outer = choice if on else (lambda *a: False)
    c = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kk, v).compile()
    print(name, f"temp {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB")
    fs[name] = c
_loop._rows_outer = choice
for f in fs.values():
    jax.block_until_ready(f(q, kk, v))
ts = {n: [] for n in fs}
for _ in range(7):
    for n, f in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(q, kk, v))
        ts[n].append(time.perf_counter() - t0)
print(
    "  ".join(
        f"{n} {statistics.median(x) * 1e3:.1f} ms ({min(x) * 1e3:.1f}-{max(x) * 1e3:.1f})"
        for n, x in ts.items()
    )
)
