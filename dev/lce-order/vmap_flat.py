"""A vmap over sequences sharing w: one fold over every sequence's tokens against the vmapped
loop (the same code with the flattening turned off), forward and gradient, in turns.

    python dev/lce-order/vmap_flat.py B T V [dtype]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._engine import _flat

b, t, v = (int(a) for a in sys.argv[1:4])
dtype = jnp.dtype(sys.argv[4] if len(sys.argv) > 4 else "float32")
d = 512
k = jax.random.split(jax.random.key(0), 3)
h = jax.random.normal(k[0], (b, t, d), dtype)
w = (jax.random.normal(k[1], (v, d)) / np.sqrt(d)).astype(dtype)
lab = jax.random.randint(k[2], (b, t), 0, v)
batched = jax.vmap(foldax.linear_cross_entropy, (0, None, 0))
choice = _flat.flattenable
fs = {}
for name, on in (("vmapped loop", False), ("one fold", True)):
    _flat.flattenable = choice if on else (lambda *a: False)
    for kind, f in (
        ("fwd", lambda h, w: batched(h, w, lab).sum()),
        ("grad", jax.value_and_grad(lambda h, w: batched(h, w, lab).sum(), (0, 1))),
    ):
        c = jax.jit(f).lower(h, w).compile()
        print(name, kind, f"temp {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB")
        fs[(name, kind)] = c
_flat.flattenable = choice
for f in fs.values():
    jax.block_until_ready(f(h, w))
ts = {n: [] for n in fs}
for _ in range(5):
    for n, f in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(h, w))
        ts[n].append(time.perf_counter() - t0)
for n, x in ts.items():
    print(n, f"{statistics.median(x):.3f}s ({min(x):.3f}-{max(x):.3f})")
