"""The two-array likelihood (seed sizes, B = 10 theta) against pad-and-scan, forward and gradient
in theta, timed in turns (median of --repeats), with XLA temp bytes.

    python dev/fused-jvp/likelihood_turns.py [--repeats 7] [--batch 10]

Run under `taskset -c 0` too for a one-core check."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._tools import workloads as w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=10)
    a = ap.parse_args()
    prob = w.seed_problem(batch=a.batch)
    lp = jnp.asarray(np.random.default_rng(1).standard_normal(prob.n).astype(np.float32))
    args = (prob.thetas, prob.x, lp)
    calls, temps = {}, {}
    for name in ("pad-and-scan", "foldax"):
        fwd, grad = w.forward_and_grad(w.WAYS[name](prob.sizes), rows=2)
        for kind, f in (("forward", fwd), ("gradient", grad)):
            jf = jax.jit(f)
            calls[(name, kind)] = lambda jf=jf: jf(*args)
            temps[(name, kind)] = foldax.memory.report(f, *args).temp_bytes
    times = w.median_times(calls, repeats=a.repeats)
    for kind in ("forward", "gradient"):
        base = times[("pad-and-scan", kind)]
        for name in ("pad-and-scan", "foldax"):
            t = times[(name, kind)]
            print(
                f"{kind:8s} {name:13s} {t * 1e3:8.1f} ms  {t / base:5.2f}x  "
                f"temp {temps[(name, kind)] / 1e6:7.1f} MB"
            )


if __name__ == "__main__":
    main()
