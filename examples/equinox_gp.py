"""Kernel ridge regression as an ``eqx.Module``, its kernel products streamed by foldax.

The model is a Gaussian-process-style regressor with an RBF kernel
``k(a, b) = amplitude * exp(-|a - b|^2 / (2 lengthscale^2))`` whose (log) lengthscale and
amplitude are fields of an Equinox module. Its predictions at points ``x`` are
``K(x, X) alpha``, where ``alpha`` solves ``(K(X, X) + noise I) alpha = y`` on the training
points ``X`` by conjugate gradients (``jax.scipy.sparse.linalg.cg``, to a relative residual of
1e-3), differentiated implicitly (one more solve; the iterations are not stored). Every kernel
product ``K v`` is a ``foldax.pairwise_reduce`` whose kernel closes over the module's fields, so
no ``N x N`` matrix exists, forward or backward, and gradients reach the fields.

The hyper-parameters of several models (different initial lengthscales) are fitted to held-out
data at once: one ``optax.adam`` step for all of them, ``eqx.filter_vmap``-ed. The script checks
foldax against the same model with the kernel matrix materialized (plain JAX): a kernel product
in float32, and the losses and gradients in float64 with the solves run to convergence
(conjugate gradients on an RBF kernel matrix amplify the rounding of its products, float64's
too, before they converge). It then prints the XLA temp memory of the gradient
(``foldax.memory.report``; compile-only) for one model and for the ``filter_vmap``-ed batch,
foldax against dense.

    pip install -e '.[examples]'           # equinox (optax comes with flax)
    python examples/equinox_gp.py          # about 50 s on 2 CPU cores
    python examples/equinox_gp.py --smoke  # small sizes, about 15 s

Measured with ``python examples/equinox_gp.py`` (1,000 training and 250 validation points in
2-D, 4 models, at most 100 CG iterations a solve, 30 Adam steps): the kernel product
agrees with the dense one to 1.4e-7 (float32), the converged losses to 3e-14 and gradients to
3e-12 (float64); the four models' validation losses go from 0.031, 0.011, 0.021, 0.275
(lengthscales 0.1, 0.3, 1, 3) to 0.009--0.011 (lengthscales 0.27--0.76); at 20,000 training
points the gradient needs 871 KB of temp memory for one model and 3.0 MB for four
(``filter_vmap``) with foldax, against 4.9 GB and 8.2 GB with the kernel matrix.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import foldax
from foldax.memory import format_bytes, report


class KernelRidge(eqx.Module):
    """Kernel ridge regression with an RBF kernel: two trainable scalars and a fixed ridge.

    Attributes:
      log_lengthscale: ``()``, log of the kernel's lengthscale.
      log_amplitude: ``()``, log of the kernel's amplitude.
      noise: the ridge added to the kernel matrix's diagonal (not trained).
      tol: the solve's relative residual (conjugate gradients stop there, or at ``maxiter``).
      maxiter: the solve's largest number of conjugate-gradient iterations.
      dense: materialize the kernel matrix (the reference) instead of streaming it.
    """

    log_lengthscale: jax.Array
    log_amplitude: jax.Array
    noise: float = eqx.field(static=True, default=0.1)
    tol: float = eqx.field(static=True, default=1e-3)
    maxiter: int = eqx.field(static=True, default=100)
    dense: bool = eqx.field(static=True, default=False)

    def kernel(self, a, b):
        """``k(a, b)`` of one point of each set: ``(D,), (D,) -> ()``."""
        sq = jnp.sum((a - b) ** 2) * jnp.exp(-2.0 * self.log_lengthscale)
        return jnp.exp(self.log_amplitude - 0.5 * sq)

    def matvec(self, x, xs, v):
        """``K(x, xs) v``: ``(M, D), (N, D), (N,) -> (M,)``."""
        if self.dense:
            gram = jax.vmap(lambda a: jax.vmap(lambda b: self.kernel(a, b))(xs))(x)  # (M, N)
            return gram @ v
        return foldax.pairwise_reduce(lambda a, b: self.kernel(a, b[0]) * b[1], x, (xs, v))

    def fit(self, xs, ys):
        """The weights ``alpha (N,)`` solving ``(K(xs, xs) + noise I) alpha = ys``."""
        op = lambda v: self.matvec(xs, xs, v) + self.noise * v  # noqa: E731
        alpha, _ = jax.scipy.sparse.linalg.cg(op, ys, tol=self.tol, maxiter=self.maxiter)
        return alpha

    def __call__(self, x, xs, ys):
        """Predictions ``(M,)`` at ``x (M, D)`` of the model fitted to ``xs (N, D)``, ``ys (N,)``."""
        return self.matvec(x, xs, self.fit(xs, ys))


def val_loss(model: KernelRidge, data):
    """Mean squared error on the validation points of the model fitted to the training points."""
    (xs, ys), (xv, yv) = data
    return jnp.mean((model(xv, xs, ys) - yv) ** 2)


def make_models(lengthscales, dtype=jnp.float32, **static):
    """A batch of models, one per initial lengthscale (arrays with a leading model axis)."""
    make = lambda ell: KernelRidge(jnp.log(ell), jnp.zeros((), dtype), **static)  # noqa: E731
    return eqx.filter_vmap(make)(jnp.asarray(lengthscales, dtype))


def make_data(n_train, n_val, dtype=jnp.float32, seed=0):
    """A noisy 2-D regression problem: ``((xs, ys), (xv, yv))``."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2.0, 2.0, (n_train + n_val, 2))
    y = np.sin(3 * x[:, 0]) * np.cos(2 * x[:, 1]) + 0.1 * rng.standard_normal(len(x))
    x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def batch_loss_and_grad(models, data):
    """Every model's validation loss and gradient (``eqx.filter_vmap`` over the models)."""
    one = eqx.filter_value_and_grad(val_loss)
    return eqx.filter_vmap(one, in_axes=(eqx.if_array(0), None))(models, data)


def train(models, data, steps, learning_rate=0.05):
    """``steps`` Adam steps on every model at once; returns the models and the losses."""
    opt = optax.adam(learning_rate)
    states = eqx.filter_vmap(lambda m: opt.init(eqx.filter(m, eqx.is_array)))(models)

    @eqx.filter_jit
    def step(models, states):
        losses, grads = batch_loss_and_grad(models, data)
        updates, states = eqx.filter_vmap(opt.update)(grads, states)
        return eqx.apply_updates(models, updates), states, losses

    history = []
    for _ in range(steps):
        models, states, losses = step(models, states)
        history.append(np.asarray(losses))
    return models, np.asarray(history)


def rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def check(lengthscales, n_train, n_val):
    """foldax against the dense kernel matrix: one kernel product in float32, then the models'
    losses and gradients in float64 with the solves run to convergence. (Conjugate gradients on
    an RBF kernel matrix amplify any rounding of its products, even float64's, to ~1e-3 in the
    iterates before they converge; the converged solution is well defined.)"""
    (xs, ys), _ = make_data(n_train, n_val)
    model = jax.tree.map(lambda a: a[0], make_models(lengthscales[:1]))
    dense = dataclasses.replace(model, dense=True)
    ek = rel_err(model.matvec(xs, xs, ys), dense.matvec(xs, xs, ys))
    with jax.enable_x64(True):
        data = make_data(n_train, n_val, jnp.float64)
        models = make_models(lengthscales, jnp.float64, tol=1e-12, maxiter=10 * n_train)
        run = eqx.filter_jit(batch_loss_and_grad)
        loss, grads = run(models, data)
        ref, ref_grads = run(dataclasses.replace(models, dense=True), data)
        ev, eg = rel_err(loss, ref), rel_err(grads, ref_grads)
    ok = ek < 1e-5 and ev < 1e-8 and eg < 1e-6
    print(
        f"foldax vs dense: kernel product (float32) rel. error {ek:.1e}; converged losses "
        f"(float64) {ev:.1e}, gradients {eg:.1e}"
    )
    print(f"agreement check: {'passed' if ok else 'FAILED'}")
    return ok


def gradient_memory(n_train, n_val, n_models, maxiter, *, single=True):
    """XLA temp bytes of the validation loss's gradient, for ``n_models`` (``filter_vmap``) and,
    if ``single``, for one model: printed, and returned as ``{(way, models): bytes}`` with way
    ``"foldax"`` or ``"dense"``."""
    pts = lambda n: (  # noqa: E731
        jax.ShapeDtypeStruct((n, 2), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    data = (pts(n_train), pts(n_val))
    print(
        f"XLA temp memory of the validation loss's gradient, {n_train:,} training and "
        f"{n_val:,} validation points (compile-only):"
    )
    figures = {}
    for dense in (False, True):
        way = "dense" if dense else "foldax"
        models = make_models(np.ones(n_models), maxiter=maxiter, dense=dense)
        line = "dense kernel matrix" if dense else "foldax.pairwise_reduce"
        line = f"  {line:24s}"
        if single:
            one = jax.tree.map(lambda a: a[0], models)
            temp = figures[way, 1] = report(eqx.filter_grad(val_loss), one, data).temp_bytes
            line += f" 1 model {format_bytes(temp):>9s},"
        batch = figures[way, n_models] = report(batch_loss_and_grad, models, data).temp_bytes
        print(f"{line} {n_models} models (filter_vmap) {format_bytes(batch):>9s}")
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="small sizes, about 15 s")
    parser.add_argument("--train", type=int, default=1_000, help="training points")
    parser.add_argument("--val", type=int, default=250, help="validation points")
    parser.add_argument("--steps", type=int, default=30, help="Adam steps")
    parser.add_argument("--maxiter", type=int, default=100, help="most CG iterations a solve")
    parser.add_argument(
        "--memory-train", type=int, default=20_000, help="training points, memory report"
    )
    args = parser.parse_args(argv)
    n_train, n_val, steps, maxiter = args.train, args.val, args.steps, args.maxiter
    mem_train = args.memory_train
    if args.smoke:
        n_train, n_val, steps, maxiter, mem_train = 200, 50, 3, 50, 1_000
    lengthscales = [0.1, 0.3, 1.0, 3.0]
    print(
        f"{len(lengthscales)} kernel ridge models, {n_train:,} training and {n_val:,} "
        f"validation points, at most {maxiter} CG iterations a solve"
    )
    ok = check(lengthscales, n_train, n_val)
    data = make_data(n_train, n_val)
    models = make_models(lengthscales, maxiter=maxiter)
    models, history = train(models, data, steps)
    print(f"{steps} Adam steps, all models at once (eqx.filter_vmap):")
    learned = np.exp(np.asarray(models.log_lengthscale))
    for i, ell in enumerate(lengthscales):
        print(
            f"  lengthscale {ell:4.1f} -> {learned[i]:.3f}: validation loss "
            f"{history[0, i]:.4f} -> {history[-1, i]:.4f}"
        )
    gradient_memory(mem_train, n_val, len(lengthscales), maxiter, single=not args.smoke)
    if not ok:
        sys.exit("foldax's kernel products disagree with the dense ones")


if __name__ == "__main__":
    main()
