"""The ragged logsumexp under an outer vmap: temp memory for a batch of 10, 100, 1000 parameters.

The workload of ``foldax demo`` (N = 1,159,351 rows in 123 unequal segments, per segment
``logsumexp(f(theta, x)) - log(size)``) ``vmap``-ed over B parameter vectors, as an outside library
(numpyro) does. foldax plans its steps after every transformation, so the temp memory of the
forward pass and of the gradient stays within the budget whatever B is. Compile-only: run
``python examples/seed_vmap_memory.py`` (about 7 s on 2 CPU cores; ``--smoke``, about 15 s).
"""

import argparse

import jax
import jax.numpy as jnp

import foldax
from foldax import workloads as w
from foldax.memory import format_bytes, report


def temps(sizes, batch):
    fwd, grad = w.forward_and_grad(w.way_foldax(sizes))
    x = jax.ShapeDtypeStruct((sum(sizes), w.FEATURES), jnp.float32)
    thetas = jax.ShapeDtypeStruct((batch, w.FEATURES), jnp.float32)
    return report(fwd, thetas, x).temp_bytes, report(grad, thetas, x).temp_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a 1/100 workload, about 15 s")
    args = parser.parse_args(argv)
    sizes = w.seed_sizes()
    if args.smoke:
        sizes = [max(1, s // 100) for s in sizes]
    print(f"N = {sum(sizes):,} rows, {len(sizes)} segments; XLA temp memory, forward / gradient:")
    for batch in (10, 100, 1000):
        f, g = temps(sizes, batch)
        print(f"  B = {batch:4d}: {format_bytes(f):>9s} / {format_bytes(g):>9s}")
    with foldax.memory_budget(8_000_000):
        f, g = temps(sizes, 1000)
    print(f"  B = 1000 with foldax.memory_budget(8_000_000): {format_bytes(f)} / {format_bytes(g)}")


if __name__ == "__main__":
    main()
