"""The k-min experiments' problem: two clouds of ``n`` points in 3-D (float32, seed 3), as NumPy
and JAX arrays, and pykeops' lazy squared-distance matrix of them."""

import jax.numpy as jnp
import numpy as np


def points(n):
    """``(x, y, xj, yj, d2)``: NumPy points, the same as JAX arrays, pykeops' ``|x_i - y_j|^2``."""
    from pykeops.numpy import LazyTensor

    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = rng.standard_normal((n, 3)).astype(np.float32)
    d2 = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
    return x, y, jnp.asarray(x), jnp.asarray(y), d2
