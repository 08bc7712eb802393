"""How XLA:CPU compiles a streamed min of squared distances, by the form it is written in.

Every variant computes ``min_j |x_i - y_j|^2`` for 20,000 x 30,000 points in 3-D (float32)
and is timed in turns (median of 5 after a warm-up). Run: ``python dev/min-codegen/turns.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax

ROWS = 80  # rows of x per step of the hand-written loops (every column at once)


def sq(a, b):
    return jnp.sum((a - b) ** 2)


def sq_unrolled(a, b):
    return (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2 + (a[2] - b[2]) ** 2


def by_rows(step):
    """``lax.map`` of ``step(distances (ROWS, M)) -> (ROWS,)`` over blocks of rows of x, y
    transposed once so that the columns are innermost."""

    def run(x, y):
        yt = y.T

        def body(xb):
            d = sum((xb[:, c : c + 1] - yt[c]) ** 2 for c in range(3))
            return step(d)

        return jax.lax.map(body, x.reshape(-1, ROWS, 3)).reshape(-1)

    return run


def guarded_min(d):
    """NaN mapped to -inf before the min: XLA's min need not propagate it."""
    return jnp.min(jnp.where(d != d, -jnp.inf, d), axis=1)


def guarded_min_and_nan(d):
    return jnp.where(jnp.any(d != d, 1), jnp.nan, guarded_min(d))


def reduce_over_d(x, y):
    """The distance as ``vmap`` of ``jnp.sum`` over D writes it: a reduce over the middle axis."""

    def body(xb):
        return jnp.min(jnp.sum((xb[:, :, None] - y.T[None]) ** 2, axis=1), axis=1)

    return jax.lax.map(body, x.reshape(-1, ROWS, 3)).reshape(-1)


VARIANTS = {
    "foldax, jnp.sum((a - b) ** 2)": lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction="min"),
    "foldax, unrolled over D": lambda x, y: foldax.pairwise_reduce(
        sq_unrolled, x, y, reduction="min"
    ),
    "rows, jnp.min fused": by_rows(lambda d: jnp.min(d, axis=1)),
    "rows, NaN-guarded min fused": by_rows(guarded_min),
    "rows, NaN-guarded min + any(NaN)": by_rows(guarded_min_and_nan),
    "rows, materialized then guarded min": by_rows(
        lambda d: guarded_min(jax.lax.optimization_barrier(d))
    ),
    "rows, reduce over D": reduce_over_d,
}


def materialized():
    """A min over an array already in memory (4,000 x 30,000), plain and NaN-guarded."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((4000, 30000), dtype=np.float32))
    fns = {
        "in memory, jnp.min": jax.jit(lambda a: jnp.min(a, 1)),
        "in memory, NaN-guarded min": jax.jit(guarded_min),
    }
    b = a.at[3, 5].set(jnp.nan)
    nan_kept = {k: bool(jnp.isnan(f(b)[3])) for k, f in fns.items()}
    return fns, (a,), nan_kept


def in_turns(fns, args, repeats=5):
    for f in fns.values():
        jax.block_until_ready(f(*args))
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((20000, 3), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((30000, 3), dtype=np.float32))
    fns = {k: jax.jit(f) for k, f in VARIANTS.items()}
    ref = np.asarray(fns["rows, jnp.min fused"](x, y))
    for k, f in fns.items():
        np.testing.assert_allclose(np.asarray(f(x, y)), ref, rtol=1e-5, err_msg=k)
    print(f"jax {jax.__version__}: min over 20,000 x 30,000 pairs, D = 3")
    for k, t in in_turns(fns, (x, y)).items():
        print(f"  {k:40s} {t * 1e3:7.0f} ms")
    mfns, margs, nan_kept = materialized()
    for k, t in in_turns(mfns, margs).items():
        print(f"  {k:40s} {t * 1e3:7.1f} ms  (a NaN in a row gives NaN: {nan_kept[k]})")


if __name__ == "__main__":
    main()
