"""Forward mode: jax.jvp / jacfwd / linearize of every differentiable segment reduction (the
registry, one program for all of them) against float64 references by central differences and
against the dense references, wrt fn's params and wrt the data (unsorted ids); zero (float0)
tangents of the index reductions; pairwise_reduce's reductions against float64 NumPy; cauchy /
vandermonde against complex128.

Second order (forward over reverse included) is in test_hessian.py; the memory of jacfwd in
test_transforms.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DIFFERENTIABLE,
    INDEX,
    SEGMENT,
    assert_allclose,
    check_each,
    dense,
    expect,
    jit_each,
    op,
    pairwise_reference,
    reference,
)

import foldax

# ----------------------------------------------------------------------------------------------
# float64 references by central differences


def _fd_jacobian(f, theta, h=1e-6):
    """``d f / d theta`` of a float64 NumPy function, by central differences."""
    theta = np.asarray(theta, np.float64)
    cols = []
    for k in range(theta.size):
        e = np.zeros_like(theta)
        e.flat[k] = h
        cols.append((np.asarray(f(theta + e)) - np.asarray(f(theta - e))) / (2 * h))
    return np.stack(cols, axis=-1).reshape(np.shape(f(theta)) + theta.shape)


# ----------------------------------------------------------------------------------------------
# Segment reductions


@pytest.mark.slow
def test_segment_forward_mode_matches_float64(rng):
    """jacfwd, jvp and linearize wrt the params of ``fn``, every differentiable reduction in one
    program, against central differences of the float64 reference."""
    sizes = [37, 1, 200, 64]
    ids = np.repeat(np.arange(len(sizes)), sizes)
    x = rng.standard_normal((sum(sizes), 3)).astype(np.float32)
    theta = rng.standard_normal(3).astype(np.float32)
    t = rng.standard_normal(3).astype(np.float32)

    def f(name, th):
        dom = SEGMENT[name].domain
        return op(name)(
            jnp.asarray(x), sizes=sizes, fn=lambda r: dom(jnp.sin(r @ th)), chunk_size=16
        )

    def run(name, th, t):
        fn = functools.partial(f, name)
        out, tan = jax.jvp(fn, (th,), (t,))
        _, lin = jax.linearize(fn, th)
        return jax.jacfwd(fn)(th), out, tan, lin(t)

    got = jit_each(DIFFERENTIABLE, run)(jnp.asarray(theta), jnp.asarray(t))
    t64 = t.astype(np.float64)

    def check(name):
        dom = SEGMENT[name].domain
        ref = lambda th: reference(name, dom(np.sin(x.astype(np.float64) @ th)), ids, len(sizes))  # noqa: E731
        want = _fd_jacobian(ref, theta)
        scale = float(np.max(np.abs(want))) + 1.0
        jac, out, tan, lin = got[name]
        assert_allclose(jac, want, dtype=np.float32, scale=scale)
        assert_allclose(out, ref(theta.astype(np.float64)), dtype=np.float32, scale=scale)
        assert_allclose(tan, want @ t64, dtype=np.float32, scale=scale)
        assert_allclose(lin, want @ t64, dtype=np.float32, scale=scale)

    check_each(DIFFERENTIABLE, check)


@pytest.mark.slow
def test_segment_jacfwd_wrt_data_and_unsorted_ids(rng):
    """jacfwd wrt the data, unsorted ids, every differentiable reduction in one program, against
    jacfwd of the dense reference."""
    ids = rng.integers(0, 4, 50)
    x = rng.standard_normal(50).astype(np.float32)
    xs = {n: jnp.asarray(SEGMENT[n].domain(x), jnp.float32) for n in DIFFERENTIABLE}

    def ours(n, xs):
        return jax.jacfwd(lambda x: op(n)(x, jnp.asarray(ids), 4, chunk_size=8))(xs[n])

    def theirs(n, xs):
        return jax.jacfwd(lambda x: dense(n, x, ids, 4))(xs[n])

    jac = jit_each(DIFFERENTIABLE, ours)(xs)
    want = jit_each(DIFFERENTIABLE, theirs)(xs)
    check_each(DIFFERENTIABLE, lambda n: assert_allclose(jac[n], want[n], dtype=np.float32))


@pytest.mark.slow
def test_segment_index_reductions_have_zero_tangents(rng):
    """argmax / argmin under jvp: their indices, and a float0 (symbolic zero) tangent."""
    sizes = [5, 0, 1, 14]
    ids = np.repeat(np.arange(len(sizes)), sizes)
    x = jnp.asarray(rng.standard_normal(sum(sizes)).astype(np.float32))

    def check(name):
        f = lambda x: op(name)(x, sizes=sizes, chunk_size=4)  # noqa: E731
        out, tan = jax.jvp(f, (x,), (x,))
        assert tan.dtype == jax.dtypes.float0, tan.dtype
        expect(name, out, np.asarray(x), ids, len(sizes))

    check_each(INDEX, check)


# ----------------------------------------------------------------------------------------------
# Pairwise and S4


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


PAIRWISE = ["sum", "logsumexp", "max", "min", "softmax", "kmin"]


def _expected(reduction, x, y):
    """The registry's float64 reference of the forward-mode test's kernels: the squared distance;
    its negative for logsumexp, and for softmax's logits (whose values are the rows of y)."""
    d = np.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)  # (M, N)
    if reduction == "softmax":
        return pairwise_reference("softmax", (-d, np.broadcast_to(y[None], (*d.shape, y.shape[1]))))
    if reduction == "kmin":
        return pairwise_reference("kmin", d, k=3)[0]
    return pairwise_reference(reduction, -d if reduction == "logsumexp" else d)


@pytest.mark.parametrize(
    "reduction",
    [pytest.param(r, marks=pytest.mark.slow) if r in ("softmax", "kmin") else r for r in PAIRWISE],
)
def test_pairwise_forward_mode_matches_float64(reduction, rng):
    x = rng.standard_normal((6, 2)).astype(np.float32)
    y = rng.standard_normal((23, 2)).astype(np.float32)

    def f(x):
        if reduction == "softmax":
            k = lambda a, b: (-_sqdist(a, b), b)  # noqa: E731
        elif reduction == "logsumexp":
            k = lambda a, b: -_sqdist(a, b)  # noqa: E731
        else:
            k = _sqdist
        out = foldax.pairwise_reduce(
            k, x, jnp.asarray(y), reduction=reduction, k=3 if reduction == "kmin" else None,
            block_size=(4, 8),
        )  # fmt: skip
        return out[0] if reduction == "kmin" else out

    ref = lambda xx: _expected(reduction, xx.reshape(6, 2), y.astype(np.float64))  # noqa: E731
    want = _fd_jacobian(ref, x.astype(np.float64).ravel()).reshape(
        (*np.shape(ref(x.ravel())), 6, 2)
    )
    scale = float(np.max(np.abs(want))) + 1.0
    assert_allclose(jax.jacfwd(f)(jnp.asarray(x)), want, dtype=np.float32, scale=scale)


def test_pairwise_argmin_has_zero_tangent(rng):
    x = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))
    out, tan = jax.jvp(
        lambda x: foldax.pairwise_reduce(_sqdist, x, x, reduction="argmin"), (x,), (x,)
    )
    assert out.dtype == jnp.int32 and tan.dtype == jax.dtypes.float0


@pytest.mark.slow
def test_cauchy_and_vandermonde_jvp_match_complex128(rng):
    c = lambda *s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex64)  # noqa: E731
    v, w, dv, dw = c(3, 7), c(3, 7) - 2, c(3, 7), c(3, 7)
    z, dz = c(11), c(11)
    out, tan = jax.jvp(foldax.cauchy, (v, z, w), (dv, dz, dw))
    v64, z64, w64 = (a.astype(np.complex128) for a in (v, z, w))
    r = 1 / (z64[None, :, None] - w64[:, None, :])  # (H, L, N)
    want = np.sum(
        dv[:, None, :] * r + v64[:, None, :] * r**2 * (dw[:, None, :] - dz[None, :, None]), -1
    )
    assert_allclose(out, np.sum(v64[:, None, :] * r, -1), dtype=np.float32, scale=10)
    assert_allclose(tan, want, dtype=np.float32, scale=float(np.max(np.abs(want))))

    x, dx = c(2, 5) * 0.1 - 0.5, c(2, 5)
    out, tan = jax.jvp(lambda v, x: foldax.vandermonde(v, x, 9), (v[:2, :5], x), (dv[:2, :5], dx))
    ls = np.arange(9)[:, None]
    e = np.exp(x.astype(np.complex128)[:, None, :] * ls)  # (H, L, N)
    want = np.sum(dv[:2, None, :5] * e + v[:2, None, :5] * ls * e * dx[:, None, :], -1)
    assert_allclose(tan, want, dtype=np.float32, scale=float(np.max(np.abs(want))))
