"""k-min nearest neighbours against pykeops' Kmin_argKmin, timed in turns (median of 7).

    python dev/kmin/turns.py [--n 20000] [--ks 5,16,32,64,128]
Run under `taskset -c 0` too: the issue is one core as well as two."""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _points import points

import foldax


def _sq(x, y):
    return jnp.sum((x - y) ** 2, axis=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--ks", default="5,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    _, _, xj, yj, d2 = points(a.n)
    for k in map(int, a.ks.split(",")):
        f = jax.jit(lambda x, y, k=k: foldax.pairwise_reduce(_sq, x, y, reduction="kmin", k=k)[1])
        t = time.perf_counter()
        got = np.asarray(f(xj, yj))
        compile_s = time.perf_counter() - t
        ref = d2.Kmin_argKmin(k, 1)[1]
        ours, theirs = [], []
        for _ in range(a.repeats):
            t = time.perf_counter()
            f(xj, yj).block_until_ready()
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            d2.Kmin_argKmin(k, 1)
            theirs.append(time.perf_counter() - t)
        o, p = statistics.median(ours), statistics.median(theirs)
        same = float(np.mean(got != ref))
        print(
            f"k={k:4d} foldax {o * 1e3:8.1f} ms  pykeops {p * 1e3:8.1f} ms  ratio {o / p:5.2f}"
            f"  compile {compile_s:5.1f} s  differing idx {same:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
