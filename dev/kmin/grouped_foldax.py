"""Two-pass k-min with foldax's own fold for pass 1: the k best groups of w columns (a k-min
over group minima, the kernel of a group being the min of its members'), then pass 2 in plain
JAX (gather the groups, recompute, one exact top-k per row). Timed in turns against pykeops
and foldax's one-pass k-min.

    python dev/kmin/grouped_foldax.py [--n 20000] [--ks 16,64,128] [--w 32]"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _points import points
from jax import lax

import foldax


def _sq(a, b):
    return jnp.sum((a - b) ** 2, axis=-1)


def _group_kernel(xi, g):
    yg, ok = g  # (w, D), (w,)
    v = jax.vmap(lambda yj: _sq(xi, yj))(yg)
    keep = ok & ~jnp.isnan(v)
    m = jnp.min(jnp.where(keep, v, jnp.inf))
    return jnp.where(jnp.any(keep), m, jnp.nan)


@functools.partial(jax.jit, static_argnames=("k", "w", "rows"))
def two_pass(x, y, *, k, w, rows=512):
    n = y.shape[0]
    g = -(-n // w)
    yp = jnp.pad(y, ((0, g * w - n), (0, 0)))
    ok = (jnp.arange(g * w) < n).reshape(g, w)
    yg = yp.reshape(g, w, -1)
    _, gid = foldax.pairwise_reduce(_group_kernel, x, (yg, ok), reduction="kmin", k=k)
    gid = jnp.sort(gid, axis=1)
    m = x.shape[0]
    nb = -(-m // rows)
    xb = jnp.pad(x, ((0, nb * rows - m), (0, 0))).reshape(nb, rows, -1)
    gb = jnp.pad(gid, ((0, nb * rows - m), (0, 0))).reshape(nb, rows, k)

    def block(a):
        xs, gs = a
        cols = (gs[:, :, None] * w + jnp.arange(w)).reshape(rows, k * w)
        v = jax.vmap(lambda xi, c: _sq(xi[None], yp[c]))(xs, cols)
        v = jnp.where(cols < n, v, jnp.nan)
        v = jnp.where(jnp.isnan(v), jnp.nan, jnp.where(v == 0, 0.0, v))
        _, pos = lax.top_k(-v, k)
        return jnp.take_along_axis(cols, pos, axis=1)

    idx = lax.map(block, (xb, gb)).reshape(-1, k)[:m]
    idx = lax.stop_gradient(idx)
    return jax.vmap(lambda xi, c: _sq(xi[None], y[c]))(x, idx), idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--ks", default="16,64,128")
    ap.add_argument("--w", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-old", action="store_true")
    a = ap.parse_args()
    _, _, xj, yj, d2 = points(a.n)
    for k in map(int, a.ks.split(",")):
        fs = {"two-pass": functools.partial(two_pass, k=k, w=a.w)}
        if not a.no_old:
            fs["one-pass"] = jax.jit(
                lambda x, y, k=k: foldax.pairwise_reduce(_sq, x, y, reduction="kmin", k=k)
            )
        ref = d2.Kmin_argKmin(k, 1)[1]
        times = {name: [] for name in [*fs, "pykeops"]}
        for name, f in fs.items():
            t = time.perf_counter()
            got = np.asarray(f(xj, yj)[1])
            print(
                f"k={k} {name}: compile+run {time.perf_counter() - t:.1f} s, "
                f"differing idx {np.mean(got != ref):.1e}",
                flush=True,
            )
        for _ in range(a.repeats):
            for name, f in fs.items():
                t = time.perf_counter()
                jax.block_until_ready(f(xj, yj))
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            d2.Kmin_argKmin(k, 1)
            times["pykeops"].append(time.perf_counter() - t)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"k={k} " + "  ".join(f"{n} {v * 1e3:.0f} ms" for n, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
