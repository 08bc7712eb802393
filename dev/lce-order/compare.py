"""The cotangent fold walked rows-outer against j-fastest (the same code with the choice
turned off), value and gradient of linear_cross_entropy, in turns in one process.

    python dev/lce-order/compare.py T V [dtype]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._engine import _loop

t, v = int(sys.argv[1]), int(sys.argv[2])
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
d = 512
k = jax.random.split(jax.random.key(0), 3)
h = jax.random.normal(k[0], (t, d), dtype)
w = (jax.random.normal(k[1], (v, d)) / np.sqrt(d)).astype(dtype)
lab = jax.random.randint(k[2], (t,), 0, v)
choice = _loop._rows_outer
fs = {}
for name, on in (("j-fastest", False), ("rows-outer", True)):
    _loop._rows_outer = choice if on else (lambda *a: False)
    f = jax.jit(jax.value_and_grad(lambda h, w, y: foldax.linear_cross_entropy(h, w, y), (0, 1)))
    t0 = time.perf_counter()
    c = f.lower(h, w, lab).compile()
    print(
        name,
        f"compile {time.perf_counter() - t0:.2f}s temp {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB",
    )
    fs[name] = c
_loop._rows_outer = choice
outs = {n: f(h, w, lab) for n, f in fs.items()}
a, b = outs.values()
for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    print("max rel diff", float(np.max(np.abs(x - y)) / np.max(np.abs(y))))
ts = {n: [] for n in fs}
for _ in range(5):
    for n, f in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(h, w, lab))
        ts[n].append(time.perf_counter() - t0)
print(
    "  ".join(f"{n} {statistics.median(x):.2f}s ({min(x):.2f}-{max(x):.2f})" for n, x in ts.items())
)
