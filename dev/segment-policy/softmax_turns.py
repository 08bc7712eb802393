"""A segment softmax of plain data against jraph's program, in turns in one process (median of
7 after a warm-up), jitted, float32: forward and gradient times, temp bytes, max difference.

    .venv/bin/python dev/segment-policy/softmax_turns.py            # E = 1 M rows, V = 100 k
    .venv/bin/python dev/segment-policy/softmax_turns.py --batch 8  # under vmap of 8
    .venv/bin/python dev/segment-policy/softmax_turns.py --layout sizes  # contiguous segments
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._tools import workloads as w
from foldax._tools.bench._graph import _jraph_softmax as jraph_softmax
from foldax.memory import report


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--segments", type=int, default=100_000)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--batch", type=int, default=0, help="vmap over this many (0: none)")
    p.add_argument(
        "--layout", choices=("ids", "sizes"), default="ids",
        help="unsorted ids, or sizes for foldax against the same sorted ids for jraph",
    )  # fmt: skip
    a = p.parse_args()
    rng = np.random.default_rng(4)
    ids_np = rng.integers(0, a.segments, a.rows).astype(np.int32)
    if a.layout == "sizes":
        ids_np = np.sort(ids_np)
    ids = jnp.asarray(ids_np)
    sizes = np.bincount(ids_np, minlength=a.segments).tolist()
    shape = ((a.batch,) if a.batch else ()) + (a.rows, a.features)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    wgt = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    ways = {
        "jraph": functools.partial(jraph_softmax, v=a.segments, sorted_=a.layout == "sizes"),
        "foldax": lambda x, i: foldax.segment_softmax(x, i, a.segments),
    }
    if a.layout == "sizes":
        ways["foldax"] = lambda x, i: foldax.segment_softmax(x, sizes=sizes)
    if a.batch:
        ways = {k: jax.vmap(f, (0, None)) for k, f in ways.items()}
    want = np.asarray(jax.jit(ways["jraph"])(x, ids))
    got = np.asarray(jax.jit(ways["foldax"])(x, ids))
    print(f"max |foldax - jraph| = {np.abs(got - want).max():.2e}")
    for pass_ in ("forward", "gradient"):
        fns = ways
        if pass_ == "gradient":
            fns = {k: jax.grad(lambda x, i, f=f: jnp.sum(f(x, i) * wgt)) for k, f in ways.items()}
        jitted = {k: jax.jit(f) for k, f in fns.items()}
        secs = w.median_times({k: functools.partial(f, x, ids) for k, f in jitted.items()}, 7)
        for k, f in fns.items():
            temp = report(f, x, ids).temp_bytes
            ratio = secs[k] / secs["jraph"]
            print(
                f"{pass_:8s} {k:6s} {secs[k] * 1e3:8.1f} ms  {ratio:.2f}x  temp {temp / 1e6:.1f} MB"
            )


if __name__ == "__main__":
    main()
