"""Precomputed segment logsumexp against the one-pass floor, timed in turns in one process.

50 M float32 values in 1,000 contiguous segments of unequal sizes (the bench's `precomputed`
case), standard normal times `--scale` (wider values make more segments fall back to each
tile's max). Ways: the floor `jnp.exp(x).sum()`; foldax as it runs (one read per tile,
`foldax._engine._runs`); foldax's walk (the same call with the one-read program switched off);
jax.ops' segment_max + segment_sum with sorted ids.

    python dev/lse-floor/variants.py [--n 50000000] [--scale 1] [--repeats 7]
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
    offs = np.concatenate([[0], np.cumsum(sizes)])
    x_np = rng.standard_normal(n, dtype=np.float32) * np.float32(a.scale)
    ref = np.array(
        [np.logaddexp.reduce(x_np[i:j].astype(np.float64)) for i, j in itertools.pairwise(offs)]
    )
    x, ids, sl = (
        jnp.asarray(x_np),
        jnp.asarray(np.repeat(np.arange(segments), sizes)),
        sizes.tolist(),
    )

    def jax_ops(x, ids):
        m = jax.ops.segment_max(x, ids, segments, indices_are_sorted=True)
        s = jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, segments, indices_are_sorted=True)
        return m + jnp.log(s)

    lse = lambda x, ids: foldax.segment_logsumexp(x, sizes=sl)  # noqa: E731
    compiled = {"floor": jax.jit(lambda x, ids: jnp.exp(x).sum()).lower(x, ids).compile()}
    compiled["foldax"] = jax.jit(lse).lower(x, ids).compile()
    with mock.patch.object(_fold, "runs", lambda *args: None):
        compiled["foldax walk"] = jax.jit(lse).lower(x, ids).compile()
    compiled["jax.ops"] = jax.jit(jax_ops).lower(x, ids).compile()
    for k, f in compiled.items():
        if k != "floor":
            err = np.max(np.abs(np.asarray(f(x, ids), np.float64) - ref) / np.abs(ref))
            print(f"{k:12s} max rel err {err:.1e}")
    times = {k: [] for k in compiled}
    for _ in range(a.repeats + 1):
        for k, f in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(f(x, ids))
            times[k].append(time.perf_counter() - t)
    floor = np.median(times["floor"][1:])
    for k, v in times.items():
        med = np.median(v[1:])
        print(f"{k:12s} {med * 1e3:8.1f} ms  {med / floor:5.2f}x the floor")


if __name__ == "__main__":
    main()
