"""Precomputed segment logsumexp against the one-pass floor, timed in turns in one process.

50 M float32 values in 1,000 contiguous segments of unequal sizes (the bench's `precomputed`
case), standard normal times `--scale` (wider values make more segments fall back to each
tile's max, or the whole call to the walk). Ways: the floor `jnp.exp(x).sum()`; foldax as it
runs (one read per tile, `foldax._engine._runs`); foldax's walk (the same call with the
one-read program switched off). jax.ops' way is in `foldax bench --only precomputed` (~13-25x).

    python dev/lse-floor/variants.py [--n 50000000] [--scale 1] [--repeats 7]

(A process that also held the 200 MB of jax.ops' ids and a float64 reference timed every way,
the floor included, ~1.6x slower and all alike: memory-bound. Keep this one lean.)
"""

import argparse
import itertools
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._segment import _fold


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=50_000_000)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    n, segments = a.n, 1000
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 2 * n // segments, segments)
    sizes = (sizes * (n / sizes.sum())).astype(np.int64)
    sizes[-1] += n - sizes.sum()
    x = jnp.asarray(rng.standard_normal(n, dtype=np.float32) * np.float32(a.scale))
    sl = sizes.tolist()

    def lse(x):
        return foldax.segment_logsumexp(x, sizes=sl)

    ways = {"floor": jax.jit(lambda x: jnp.exp(x).sum()), "foldax": jax.jit(lse)}
    ways["foldax"].lower(x).compile()
    with mock.patch.object(_fold, "runs", lambda *args: None):
        # a function of its own: JAX caches a traced function, and would reuse foldax's trace
        ways["foldax walk"] = jax.jit(lambda x: lse(x)).lower(x).compile()
    outs = {k: jax.block_until_ready(f(x)) for k, f in ways.items()}
    times = {k: [] for k in ways}
    for _ in range(a.repeats):
        for k, f in ways.items():
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            times[k].append(time.perf_counter() - t)
    floor = np.median(times["floor"])
    for k, v in times.items():
        print(f"{k:12s} {np.median(v) * 1e3:8.1f} ms  {np.median(v) / floor:5.2f}x the floor")
    x64 = np.asarray(x, np.float64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.array([np.logaddexp.reduce(x64[i:j]) for i, j in itertools.pairwise(offs)])
    for k in ("foldax", "foldax walk"):
        err = np.max(np.abs(np.asarray(outs[k], np.float64) - ref) / np.abs(ref))
        print(f"{k:12s} max rel err {err:.1e}")


if __name__ == "__main__":
    main()
