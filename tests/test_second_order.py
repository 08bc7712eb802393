"""Second order in reverse mode: ``jax.jacrev(jax.grad(f))``, ``jax.grad`` of a function of
``jax.grad(f)`` and a ``vjp`` of a ``vjp`` agree with ``jax.hessian`` of a dense plain-``jnp``
twin, for every differentiable public function. Integer outputs (counts, indices) take symbolic
zero cotangents at every order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax

SIZES = [2, 1, 4, 3]
STARTS = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
N = sum(SIZES)


def _dense_segments(op, v):
    return jnp.stack([op(v[s : s + n]) for s, n in zip(STARTS, SIZES, strict=True)])


def _dense_rows(op, v):
    return jnp.concatenate([op(v[s : s + n]) for s, n in zip(STARTS, SIZES, strict=True)])


SEGMENT = {
    "sum": (foldax.segment_sum, lambda v: _dense_segments(jnp.sum, v)),
    "mean": (foldax.segment_mean, lambda v: _dense_segments(jnp.mean, v)),
    "max": (foldax.segment_max, lambda v: _dense_segments(jnp.max, v)),
    "min": (foldax.segment_min, lambda v: _dense_segments(jnp.min, v)),
    "prod": (foldax.segment_prod, lambda v: _dense_segments(jnp.prod, v)),
    "logsumexp": (
        foldax.segment_logsumexp,
        lambda v: _dense_segments(jax.nn.logsumexp, v),
    ),
    "logmeanexp": (
        foldax.segment_logmeanexp,
        lambda v: _dense_segments(lambda s: jax.nn.logsumexp(s) - jnp.log(s.shape[0]), v),
    ),
    "var": (
        lambda v, **kw: foldax.segment_var(v, ddof=0, **kw),
        lambda v: _dense_segments(jnp.var, v),
    ),
    "std": (
        lambda v, **kw: foldax.segment_std(v, ddof=0, **kw),
        # a one-row segment: std 0, gradient 0 (not sqrt's infinite slope)
        lambda v: _dense_segments(lambda s: jnp.sqrt(jnp.var(s)) if s.size > 1 else 0 * s[0], v),
    ),
    "softmax": (foldax.segment_softmax, lambda v: _dense_rows(jax.nn.softmax, v)),
    "log_softmax": (foldax.segment_log_softmax, lambda v: _dense_rows(jax.nn.log_softmax, v)),
}


def _check_second_order(loss, dense, x):
    """Reverse over reverse three ways against the dense twin's Hessian (each jitted: one
    compilation per derivative)."""
    want = jax.hessian(dense)(x)
    scale = float(jnp.max(jnp.abs(want))) + 1.0
    u = jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32).reshape(x.shape)

    def vjp_of_vjp(t, u):  # the Hessian-vector product by pulling back twice
        _, pull = jax.vjp(lambda t: jax.vjp(loss, t)[1](jnp.float32(1))[0], t)
        return pull(u)[0]

    hess = jax.jit(jax.jacrev(jax.grad(loss)))(x)
    assert_allclose(hess, want, dtype=np.float32, scale=scale)
    hvp = want.reshape(x.size, x.size) @ u.ravel()
    gg = jax.jit(jax.grad(lambda t, u: jnp.vdot(jax.grad(loss)(t), u)))(x, u)
    assert_allclose(gg.ravel(), hvp, dtype=np.float32, scale=scale)
    assert_allclose(jax.jit(vjp_of_vjp)(x, u).ravel(), hvp, dtype=np.float32, scale=scale)


CASES = [(name, "sizes") for name in sorted(SEGMENT)] + [
    (name, "ids") for name in ("max", "prod", "logsumexp", "var", "softmax")
]


@pytest.mark.parametrize(("name", "how"), CASES)
def test_segment_reverse_over_reverse(name, how, rng):
    f, dense_f = SEGMENT[name]
    # distinct values, away from 0 (prod) and from ties (max / min)
    x = jnp.asarray(rng.permutation(N).astype(np.float32) * 0.25 + 0.5)
    w = jnp.asarray(
        rng.standard_normal(len(SIZES) if name not in ("softmax", "log_softmax") else N)
    )
    w = w.astype(jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(len(SIZES)), SIZES))
    kw = {"sizes": SIZES} if how == "sizes" else {"segment_ids": ids, "num_segments": len(SIZES)}

    def loss(v):
        return jnp.sum(jnp.sin(f(v, **kw)) * w)

    def dense(v):
        return jnp.sum(jnp.sin(dense_f(v)) * w)

    _check_second_order(loss, dense, x)


def test_segment_prod_reverse_over_reverse_under_a_linear_loss():
    # The loss is linear in the product: the first gradient's cotangent reaches only the
    # product of the non-zeros, not the result.
    x = jnp.array([0.5, 2.0, 3.0, 1.5, 0.7])

    def loss(v):
        return jnp.sum(foldax.segment_prod(v, sizes=[2, 3]) * jnp.array([1.0, 2.0]))

    def dense(v):
        return jnp.prod(v[:2]) + 2 * jnp.prod(v[2:])

    _check_second_order(loss, dense, x)


def _sq(a, b):
    return jnp.sum((a - b) ** 2)


PAIRWISE = ["sum", "logsumexp", "max", "min", "max_argmax", "min_argmin", "kmin", "softmax"]


def _dense_pairwise(reduction, xs, ys):
    d = jnp.sum((xs[:, None, :] - ys[None, :, :]) ** 2, axis=-1)
    if reduction == "sum":
        return d.sum(1)
    if reduction == "logsumexp":
        return jax.nn.logsumexp(d, axis=1)
    if reduction in ("max", "max_argmax"):
        return d.max(1)
    if reduction in ("min", "min_argmin"):
        return d.min(1)
    if reduction == "kmin":
        return -jax.lax.top_k(-d, 2)[0]
    logits = xs @ ys.T
    return jax.nn.softmax(logits, axis=1) @ ys


@pytest.mark.parametrize("reduction", PAIRWISE)
def test_pairwise_reverse_over_reverse(reduction, rng):
    xs = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))
    ys = jnp.asarray(rng.standard_normal((6, 2)).astype(np.float32))
    kernel = (lambda a, b: (jnp.dot(a, b), b)) if reduction == "softmax" else _sq
    kw = {"k": 2} if reduction == "kmin" else {}

    def loss(x):
        out = foldax.pairwise_reduce(kernel, x, ys, reduction=reduction, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(out))

    def dense(x):
        return jnp.sum(jnp.sin(_dense_pairwise(reduction, x, ys)))

    _check_second_order(loss, dense, xs)


def test_cauchy_and_vandermonde_reverse_over_reverse(rng):
    n, length = 4, 6
    v = jnp.asarray((rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64))
    w = jnp.asarray((-0.5 + 1j * rng.standard_normal(n)).astype(np.complex64))
    z = jnp.asarray(np.exp(2j * np.pi * np.arange(length) / length).astype(np.complex64))
    theta = jnp.asarray(rng.standard_normal(n).astype(np.float32))

    def cauchy(t, fold):
        wt = w + t.astype(jnp.complex64)
        k = (
            foldax.cauchy(v, z, wt)
            if fold
            else jnp.sum(v[None, :] / (z[:, None] - wt[None, :]), axis=-1)
        )
        return jnp.sum(jnp.abs(k) ** 2)

    _check_second_order(lambda t: cauchy(t, True), lambda t: cauchy(t, False), theta)

    ell = jnp.arange(length, dtype=jnp.float32).astype(jnp.complex64)

    def vander(t, fold):
        x = -0.3 + 1j * t.astype(jnp.complex64)
        k = (
            foldax.vandermonde(v, x, length)
            if fold
            else jnp.sum(v[:, None] * jnp.exp(x[:, None] * ell[None, :]), axis=0)
        )
        return jnp.sum(jnp.abs(k) ** 2)

    _check_second_order(lambda t: vander(t, True), lambda t: vander(t, False), theta)


def test_reverse_over_reverse_under_vmap_and_jit(rng):
    x = jnp.asarray(rng.standard_normal((3, N)).astype(np.float32))

    def loss(v):
        return jnp.sum(jnp.sin(foldax.segment_max(v, sizes=SIZES)))

    def dense(v):
        return jnp.sum(jnp.sin(_dense_segments(jnp.max, v)))

    got = jax.jit(jax.vmap(jax.jacrev(jax.grad(loss))))(x)
    assert_allclose(got, jax.vmap(jax.hessian(dense))(x), dtype=np.float32, scale=2.0)
