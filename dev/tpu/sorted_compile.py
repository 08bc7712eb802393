# ruff: noqa: B023
"""On a TPU: what the sorted-ids hint costs to compile and saves at run time, op by op. A
segment sum's gradient is a gather of the cotangent by the ids; with ``indices_are_sorted``
XLA's TPU compiler takes seconds to minutes on it, growing with the rows.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/sorted_compile.py [E ...]

Prints, per op and row count: compile seconds, then the median of 5 calls (after one).
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(f, *args):
    """``{"compile_s", "ms"}``: ``f`` jitted, compiled, then the median of 5 calls (after one)."""
    t = time.perf_counter()
    c = jax.jit(f).lower(*args).compile()
    comp = time.perf_counter() - t
    jax.block_until_ready(c(*args))
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(c(*args))
        runs.append(1e3 * (time.perf_counter() - t))
    return {"compile_s": comp, "ms": statistics.median(runs)}


def show(name, f, *args):
    r = timed(f, *args)
    print(f"{name}: compile {r['compile_s']:.1f} s, {r['ms']:.2f} ms", flush=True)


def ops(e: int, feat: int = 128):
    v = e // 10
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((e, feat)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((v, feat)), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, v, e)), jnp.int32)
    for hint in (True, False):
        show(
            f"E={e} scatter-add, sorted hint {hint}",
            lambda x, i: jax.ops.segment_sum(x, i, v, indices_are_sorted=hint),
            x,
            ids,
        )
        show(
            f"E={e} gather (fill), sorted hint {hint}",
            lambda g, i: jnp.take(g, i, axis=0, mode="fill", fill_value=0, indices_are_sorted=hint),
            g,
            ids,
        )
        show(
            f"E={e} gather (clip), sorted hint {hint}",
            lambda g, i: jnp.take(g, i, axis=0, mode="clip", indices_are_sorted=hint),
            g,
            ids,
        )
        show(
            f"E={e} scatter-max, sorted hint {hint}",
            lambda x, i: jax.ops.segment_max(x, i, v, indices_are_sorted=hint),
            x,
            ids,
        )


if __name__ == "__main__":
    for e in [int(a) for a in sys.argv[1:]] or [400_000, 4_000_000]:
        ops(e)
