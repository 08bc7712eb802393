"""Memory audit of a naive S4 training step: ``foldax audit examples/audit_s4.py:naive``.

``naive(n)`` and ``with_foldax(n)`` return ``(fn, args)``: one jitted gradient step of a loss on
S4's Cauchy kernel with H channels, L nodes and n poles, for ``foldax audit`` /
``foldax.memory.scaling`` to compile at several n.
"""

import jax
import jax.numpy as jnp

import foldax

H, L = 256, 1024


def cauchy_naive(v, z, w):
    return (v[:, None, :] / (z[None, :, None] - w[:, None, :])).sum(-1)  # the (H, L, N) line


def _step(kernel):
    def loss(v, z, w):
        return jnp.sum(jnp.abs(kernel(v, z, w)) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def _args(n):
    c = lambda *s: jax.ShapeDtypeStruct(s, jnp.complex64)  # noqa: E731
    return c(H, n), c(L), c(H, n)


def naive(n):
    return _step(cauchy_naive), _args(n)


def with_foldax(n):
    return _step(foldax.cauchy), _args(n)


#: ``foldax audit``'s sizes for these targets when ``--sizes`` is not given: the naive step's
#: (H, L, N) buffers reach 1.1 GB at N = 512, and foldax's folds take several steps at each.
AUDIT_SIZES = (64, 256, 512)


if __name__ == "__main__":  # python examples/audit_s4.py [--smoke]: the scaling table, small sizes
    import sys

    from foldax.memory import scaling

    sizes = [8, 16] if "--smoke" in sys.argv else AUDIT_SIZES
    for make in (naive, with_foldax):
        print(scaling(make, sizes, name="N"))
