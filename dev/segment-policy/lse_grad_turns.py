"""A segment log-sum-exp's gradient (of ``sum(out * w)``, the weights an argument) against the
``jax.ops`` program, in turns in one process (median of 15 after a warm-up), jitted, float32:
times and temp bytes; ``hlo`` writes both optimized programs to ``/tmp/{jax.ops,foldax}.hlo``.

    .venv/bin/python dev/segment-policy/lse_grad_turns.py E,V,F [sorted] [hlo]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax


def main():
    e, v, f = map(int, sys.argv[1].split(","))
    sort = "sorted" in sys.argv[2:]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((e, f)), jnp.float32)
    raw = rng.integers(0, v, e)
    ids = jnp.asarray(np.sort(raw) if sort else raw, jnp.int32)
    w = jnp.asarray(rng.standard_normal((v, f)), jnp.float32)

    def plain(x, i):
        m = jax.lax.stop_gradient(jax.ops.segment_max(x, i, v, indices_are_sorted=sort))
        s = jax.ops.segment_sum(jnp.exp(x - m[i]), i, v, indices_are_sorted=sort)
        return m + jnp.log(s)

    def ours(x, i):
        return foldax.segment_logsumexp(x, i, v, indices_are_sorted=sort)

    def grad(fn):
        return jax.jit(jax.grad(lambda x, i, w: jnp.sum(fn(x, i) * w)))

    ways = {"jax.ops": grad(plain), "foldax": grad(ours)}
    for g in ways.values():
        g(x, ids, w).block_until_ready()
    times = {k: [] for k in ways}
    for _ in range(15):
        for k, g in ways.items():
            t = time.perf_counter()
            g(x, ids, w).block_until_ready()
            times[k].append(time.perf_counter() - t)
    for k, g in ways.items():
        compiled = g.lower(x, ids, w).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{k:8s} {np.median(times[k]) * 1e3:8.2f} ms  temp {temp:.1f} MiB")
        if "hlo" in sys.argv[2:]:
            with open(f"/tmp/{k}.hlo", "w") as fh:
                fh.write(compiled.as_text())


if __name__ == "__main__":
    main()
