"""Prototype: k-min seeded with an upper bound tau (k-th smallest of 2k column-group minima)."""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import foldax
from foldax._pairwise._tiles import pairwise
from foldax._reductions._base import NO_INDEX
from foldax._reductions._kmin import KMin, _Tile


class SeededKMin(KMin):
    def value_aval(self, tile_aval):
        return super().value_aval(tile_aval[0])

    def init_aval(self, num, aval):
        return super().init_aval(num, aval)

    def reduce(self, v, mask, index):
        vals, tau = v
        return (_Tile(vals, mask, index), tau[:, 0])

    def combine(self, a, b):
        if isinstance(b, tuple) and isinstance(b[0], _Tile):
            tile, tau = b
            ph = a[1] == NO_INDEX
            a = (jnp.where(ph, tau[:, None].astype(a[0].dtype), a[0]), a[1])
            return self._merge_tile(a, tile)
        return super().combine(a, b)


def sq(a, b):
    return jnp.sum((a - b) ** 2, -1)


def seeded_kmin(x, y, k, groups_per_k=2):
    n = y.shape[0]
    g = min(groups_per_k * k, n)
    per = n // g
    yg = y[: g * per].reshape(per, g, *y.shape[1:])
    gm = pairwise(
        "p",
        lambda a, b: jax.vmap(lambda bb: sq(a, bb))(b),
        x,
        yg,
        foldax._reductions.BY_NAME["min"],
        None,
    )
    tau = lax.stop_gradient(jnp.sort(gm, axis=1)[:, k - 1])
    out = pairwise("p", lambda a, b: (sq(a[0], b), a[1]), (x, tau), y, SeededKMin(k), None)
    return out


if __name__ == "__main__":
    n = 20000
    ks = [int(a) for a in sys.argv[1].split(",")]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((n, 3)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((n, 3)).astype(np.float32))
    for k in ks:
        fs = {
            "foldax": jax.jit(
                lambda x, y, k=k: foldax.pairwise_reduce(sq, x, y, reduction="kmin", k=k)
            ),
            "seeded4": jax.jit(lambda x, y, k=k: seeded_kmin(x, y, k, 4)),
        }
        outs = {}
        for nm, f in fs.items():
            t0 = time.perf_counter()
            outs[nm] = jax.block_until_ready(f(x, y))
            c = time.perf_counter() - t0
            print(nm, "compile+run", round(c, 2), flush=True)
        for nm in fs:
            assert (np.asarray(outs[nm][1]) == np.asarray(outs["foldax"][1])).all(), nm
            assert (np.asarray(outs[nm][0]) == np.asarray(outs["foldax"][0])).all(), nm
        t = {nm: [] for nm in fs}
        for _ in range(5):
            for nm, f in fs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, y))
                t[nm].append(time.perf_counter() - t0)
        print(k, {nm: round(statistics.median(v) * 1e3, 1) for nm, v in t.items()}, flush=True)
