"""Packed causal attention (16 documents in one sequence of L tokens, one head, D = 64, float32):
the bench's three programs (foldax with segment ids + causal, jax.nn.dot_product_attention with
the same (L, L) mask, foldax causal-only), timed in turns in one process, median of repeats after
a warm-up, at any lengths (the bench runs 8,192 and 16,384).

    python dev/packed-attention/turns.py [L ...]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from foldax._tools import workloads as w
from foldax._tools.bench._packed import PEER, _programs, documents


def docs(length, count=16, seed=0):
    return jnp.asarray(documents(length, count, seed))


def main(lengths=(8192,), repeats=5):
    for length in lengths:
        rng = np.random.default_rng(1)
        q, k, v = (
            jnp.asarray(rng.standard_normal((1, length, 1, 64), dtype=np.float32)) for _ in "qkv"
        )
        args = (q, k, v, docs(length)[None])
        progs = _programs()
        grads = {
            n: jax.grad(lambda q, k, v, ids, f=f: f(q, k, v, ids).sum(), (0, 1, 2))
            for n, f in progs.items()
        }
        for label, fns in (("forward", progs), ("gradient", grads)):
            jitted = {n: jax.jit(f) for n, f in fns.items()}
            med = w.median_times(
                {n: (lambda f=f, a=args: f(*a)) for n, f in jitted.items()}, repeats
            )
            for n, t in med.items():
                print(f"L={length:6d} {label:8s} {n:30s} {t * 1e3:9.1f} ms  {t / med[PEER]:5.3f}x")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (8192,))
