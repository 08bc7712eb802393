"""The ragged logsumexp under an outer vmap: temp memory for a batch of 10, 100, 1000 parameters.

The workload of ``foldax demo`` (N = 1,159,351 rows in 123 unequal segments, per segment
``logsumexp(f(theta, x)) - log(size)``) ``vmap``-ed over B parameter vectors, as an outside library
(numpyro) does. foldax plans its steps after every transformation, so the temp memory of the
forward pass and of the gradient stays within the budget whatever B is; a smaller
``foldax.memory_budget`` takes smaller steps and less memory. Compile-only: run
``python examples/seed_vmap_memory.py`` (about 6 s on 2 CPU cores; ``--smoke``, about 3 s).
"""

import argparse

import jax
import jax.numpy as jnp

import foldax
from foldax import workloads as w
from foldax.memory import format_bytes, report


def temps(sizes, batch, forward=True):
    """XLA temp bytes of the forward pass (None unless ``forward``) and of the gradient."""
    fwd, grad = w.forward_and_grad(w.way_foldax(sizes))
    x = jax.ShapeDtypeStruct((sum(sizes), w.FEATURES), jnp.float32)
    thetas = jax.ShapeDtypeStruct((batch, w.FEATURES), jnp.float32)
    f = report(fwd, thetas, x).temp_bytes if forward else None
    return f, report(grad, thetas, x).temp_bytes


#: The budget of the last line: smaller than the default's steps, so the steps shrink with it.
BUDGET = "2MB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="B = 1000, the gradient only, about 3 s"
    )
    args = parser.parse_args(argv)
    # compiling is the whole cost, whatever the rows: a smoke run compiles fewer programs
    sizes, batches, forward = w.seed_sizes(), (10, 100, 1000), not args.smoke
    if args.smoke:
        sizes, batches = [max(1, s // 100) for s in sizes[:16]], (1000,)
    show = lambda f, g: f"{format_bytes(f) if forward else '-':>9s} / {format_bytes(g):>9s}"  # noqa: E731
    print(f"N = {sum(sizes):,} rows, {len(sizes)} segments; XLA temp memory, forward / gradient:")
    for batch in batches:
        print(f"  B = {batch:4d}: {show(*temps(sizes, batch, forward))}")
    with foldax.memory_budget(BUDGET):
        figures = temps(sizes, 1000, forward)
    print(f"  B = 1000 with foldax.memory_budget({BUDGET!r}): {show(*figures)} (smaller steps)")


if __name__ == "__main__":
    main()
