"""LCE tiles on an accelerator: value-and-grad time and temp per block_size (dev only)."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import report

T, V, D = (int(a) for a in sys.argv[1:4])
r = np.random.default_rng(0)
h = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
w = jnp.asarray(r.standard_normal((V, D)) / np.sqrt(D), jnp.float32)
lab = jnp.asarray(r.integers(0, V, T), jnp.int32)


def plain(h, w, labels):
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
    label_z = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - label_z)


ways = {"plain": plain}
for b in [None, (1024, 1024), (1024, 4096), (2048, 2048), (4096, 4096), (512, 8192)]:
    ways[str(b)] = lambda h, w, y, b=b: foldax.linear_cross_entropy(h, w, y, block_size=b)
for name, f in ways.items():
    for mode, g in (("fwd", f), ("grad", jax.value_and_grad(f, (0, 1)))):
        c = jax.jit(g)
        jax.block_until_ready(c(h, w, lab))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(c(h, w, lab))
            ts.append(time.perf_counter() - t0)
        temp = report(g, h, w, lab).temp_bytes
        print(
            f"{name:>14} {mode:4} {np.median(ts) * 1e3:8.2f} ms temp {temp / 1e6:8.1f} MB",
            flush=True,
        )
