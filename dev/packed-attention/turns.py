"""Packed causal attention (16 documents in one sequence of L tokens, one head, D = 64, float32):
foldax (segment ids + causal) against jax.nn.dot_product_attention with the same mask (an
(L, L) boolean array built in the jitted function from the ids) and against foldax causal-only.
Timed in turns in one process, median of repeats after a warm-up.

    python dev/packed-attention/turns.py [L ...]
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax


def docs(L, n_docs, seed=0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, L), n_docs - 1, replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(L), side="right"), jnp.int32)


def programs():
    def fold_packed(q, k, v, ids):
        return foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids)

    def fold_causal(q, k, v, ids):
        return foldax.dot_product_attention(q, k, v, is_causal=True)

    def xla_packed(q, k, v, ids):
        same = ids[0][:, None] == ids[0][None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=same[None, None], is_causal=True)

    return {"foldax packed": fold_packed, "foldax causal only": fold_causal, "jax.nn packed": xla_packed}


def main(lengths=(8192,), repeats=5):
    for L in lengths:
        rng = np.random.default_rng(1)
        q, k, v = (jnp.asarray(rng.standard_normal((1, L, 1, 64), dtype=np.float32)) for _ in range(3))
        ids = docs(L, 16)[None]
        fwd = {n: jax.jit(f) for n, f in programs().items()}
        grad = {
            n: jax.jit(jax.grad(lambda q, k, v, ids, f=f: f(q, k, v, ids).sum(), (0, 1, 2)))
            for n, f in programs().items()
        }
        for label, fns in (("forward", fwd), ("gradient", grad)):
            for f in fns.values():
                jax.block_until_ready(f(q, k, v, ids))
            times = {n: [] for n in fns}
            for _ in range(repeats):
                for n, f in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(f(q, k, v, ids))
                    times[n].append(time.perf_counter() - t)
            med = {n: float(np.median(t)) for n, t in times.items()}
            base = med["jax.nn packed"]
            for n, t in med.items():
                print(f"L={L:6d} {label:8s} {n:20s} {t*1e3:9.1f} ms  {t/base:5.3f}x jax.nn")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (8192,))
