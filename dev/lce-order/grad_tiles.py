"""The LM loss's value and gradient with its cotangent folds in other tiles (the forward fold
keeps 1,024 x 1,024), against Tokamax's chunked XLA loss and the plain loss, in turns in one
process (jax >= 0.11 for Tokamax).

    python dev/lce-order/grad_tiles.py T V [D] [tiles ...]   (tiles as 1024x2048)
"""

import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._engine import _plan

t, v = int(sys.argv[1]), int(sys.argv[2])
d = int(sys.argv[3]) if len(sys.argv) > 3 else 512
tiles = [tuple(map(int, a.split("x"))) for a in sys.argv[4:]] or [(1024, 1024), (1024, 2048)]
k = jax.random.split(jax.random.key(0), 3)
h = jax.random.normal(k[0], (t, d), jnp.float32)
w = jax.random.normal(k[1], (v, d)) / np.sqrt(d)
lab = jax.random.randint(k[2], (t,), 0, v)
original = _plan.PlanSpec.for_cotangents


def vg(f, *args):
    g = jax.jit(jax.value_and_grad(f, (0, 1)))
    t0 = time.perf_counter()
    c = g.lower(*args).compile()
    return c, time.perf_counter() - t0


fs = {}
for tile in tiles:

    def cotangent_plan(self, tile=tile):
        return dataclasses.replace(self, tile=tile, grad_tile=None)

    _plan.PlanSpec.for_cotangents = cotangent_plan
    fs[f"foldax grad {tile[0]}x{tile[1]}"] = (
        vg(foldax.linear_cross_entropy, h, w, lab),
        (h, w, lab),
    )
_plan.PlanSpec.for_cotangents = original


def plain(h, w, y):
    z = h @ w.T
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, y[:, None], 1)[:, 0])


fs["plain"] = (vg(plain, h, w, lab), (h, w, lab))
try:
    import tokamax

    def tok(h, w_dv, y):
        return tokamax.linear_softmax_cross_entropy_loss(
            h, y, w_dv, reduction="mean", implementation="chunked_xla"
        )

    fs["tokamax"] = (vg(tok, h, w.T, lab), (h, w.T, lab))
except ImportError:
    pass
for n, ((c, ct), _) in fs.items():
    print(n, f"compile {ct:.2f}s temp {c.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB")
ts = {n: [] for n in fs}
for _ in range(5):
    for n, ((c, _), args) in fs.items():
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        ts[n].append(time.perf_counter() - t0)
base = ts["plain"]
print(
    "  ".join(
        f"{n} {statistics.median(x):.2f}s "
        f"({statistics.median([a / b for a, b in zip(x, base, strict=True)]):.2f}x plain)"
        for n, x in ts.items()
    )
)
