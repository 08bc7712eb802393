"""Memory audit of the ragged logsumexp: ``foldax audit examples/audit_segment.py:global_max``.

``global_max(n)`` / ``with_foldax(n)`` return ``(fn, args)``: the gradient, vmapped over 10 theta,
of the per-segment log-mean-exp of the model over ``n`` rows in the demo's 123 unequal
segment sizes (tiled to ``n`` rows), for ``foldax audit`` / ``foldax.memory.scaling``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from foldax import workloads as w


def _sizes(n):
    seed = np.asarray(w.seed_sizes())
    reps = -(-n // int(seed.sum()))
    sizes = np.tile(seed, reps)
    cut = np.searchsorted(np.cumsum(sizes), n)
    sizes = sizes[: cut + 1].copy()
    sizes[-1] -= int(sizes.sum()) - n
    return sizes.tolist()


def _make(way, n):
    sizes = _sizes(n)
    _, grad = w.forward_and_grad(way(sizes))
    x = jax.ShapeDtypeStruct((n, w.FEATURES), jnp.float32)
    thetas = jax.ShapeDtypeStruct((10, w.FEATURES), jnp.float32)
    return grad, (thetas, x)


def global_max(n):
    return _make(w.way_global_max, n)


def with_foldax(n):
    return _make(w.way_foldax, n)


if (
    __name__ == "__main__"
):  # python examples/audit_segment.py [--smoke]: the scaling table, small sizes
    import sys

    from foldax.memory import scaling

    sizes = [3000, 6000] if "--smoke" in sys.argv else [300000, 600000, 1200000]
    for make in (global_max, with_foldax):
        print(scaling(make, sizes, name="N"))
