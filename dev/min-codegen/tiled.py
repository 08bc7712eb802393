"""The forms of turns.py inside foldax's loop structure: rows of x (``lax.map``) against tiles of
columns (``lax.scan`` carrying the running min), for three tile shapes, timed in turns (median
of 3). Run: ``python dev/min-codegen/tiled.py``."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

n, m = 20480, 30720
rng = np.random.default_rng(9)
x = jnp.asarray(rng.standard_normal((n, 3), dtype=np.float32))
y = jnp.asarray(rng.standard_normal((m, 3), dtype=np.float32))


def rarely(pred, fn, like):
    zeros = jnp.zeros_like(like)

    def body(c):
        return c[0] & False, fn().astype(like.dtype) + c[1]

    return lax.while_loop(lambda c: c[0], body, (pred, zeros))[1]


def mk(bi, bj, variant):
    def run(x, y):
        yt = y.T.reshape(3, -1, bj).transpose(1, 0, 2)  # (nb, 3, bj)

        def rows(xb):
            def step(acc, yb):
                d = sum((xb[:, c : c + 1] - yb[c][None]) ** 2 for c in range(3))
                if variant == "plain":
                    t = jnp.min(d, 1)
                elif variant == "guard":
                    t = jnp.min(jnp.where(d != d, -jnp.inf, d), 1)
                elif variant == "guard_rare":
                    t = jnp.min(jnp.where(d != d, -jnp.inf, d), 1)
                    t = t + rarely(
                        jnp.any(t == -jnp.inf),
                        lambda: jnp.where(jnp.any(jnp.isnan(d), 1), jnp.nan, 0.0),
                        t,
                    )
                elif variant == "bcast_guard":
                    a = jnp.broadcast_to(xb[:, :, None], (bi, 3, bj))
                    b = jnp.broadcast_to(yb[None], (bi, 3, bj))
                    dd = jnp.sum((a - b) ** 2, axis=1)
                    t = jnp.min(jnp.where(dd != dd, -jnp.inf, dd), 1)
                return jnp.minimum(acc, t), None

            return lax.scan(step, jnp.full((bi,), jnp.inf, jnp.float32), yt)[0]

        return lax.map(rows, x.reshape(-1, bi, 3)).reshape(-1)

    return jax.jit(run)


fns = {}
for bi, bj in ((1024, 1024), (256, 3072), (80, 30720)):
    for v in ("plain", "guard", "guard_rare", "bcast_guard"):
        if bj == 30720 and v == "bcast_guard":
            continue
        fns[(bi, bj, v)] = mk(bi, bj, v)
for f in fns.values():
    jax.block_until_ready(f(x, y))
ts = {k: [] for k in fns}
for _ in range(3):
    for k, f in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(f(x, y))
        ts[k].append(time.perf_counter() - t)
for k in ts:
    print(k, f"{np.median(ts[k]) * 1e3:.0f} ms")
