"""Kernels that are matrix products in disguise: a kernel matrix times many right-hand sides
(values carried on ``y``), a softmax whose values are rows of ``y``, the derivatives of
min / max / k-min at the pairs they pick, and nearest neighbours by squared distance in high
dimension (a matrix product per tile, re-ranked by the user's own formula).

Each fast path against its dense float64 twin, with its edges: partial blocks, masks, ties,
non-finite values, half precision, complex values, ``vmap``, forward and reverse derivatives up
to second order; and memory that does not grow with ``N``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose
from jax.test_util import check_grads

import foldax
from foldax._engine._budget import DEFAULT_BUDGET
from foldax.memory import report

F32, F64 = np.float32, np.float64
M, N = 37, 53  # multiples of no block size
BLOCKS = (8, 16)


def gauss_values(a, b):
    """A Gaussian kernel times the values riding on ``y``: ``k(a, b[0]) * b[1]``."""
    return jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1]


def gauss_matrix(x, y):
    x, y = np.asarray(x, F64), np.asarray(y, F64)
    return np.exp(-((x[:, None] - y[None]) ** 2).sum(-1))


def sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def sqdist_matrix(x, y):
    x, y = np.asarray(x, F64), np.asarray(y, F64)
    return ((x[:, None] - y[None]) ** 2).sum(-1)


def _uses_dot(fn, *args):
    """Whether the compiled program of ``fn`` multiplies matrices (a ``dot`` in its HLO)."""
    return " dot(" in jax.jit(fn).lower(*args).compile().as_text()


# ----------------------------------------------------------------------------------------------
# Many right-hand sides: one matrix product per tile


@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_values_on_y_match_float64_with_derivatives(rng, shape):
    """``k(a, b[0]) * b[1]`` with values of shape ``(N, *R)``: the kernel matrix times them,
    forward, reverse and forward-mode, against float64, with partial blocks."""
    with jax.enable_x64(True):
        x, y = rng.normal(size=(M, 3)), rng.normal(size=(N, 3))
        v = rng.normal(size=(N, *shape))

        def f(x, y, v):
            return foldax.pairwise_reduce(gauss_values, x, (y, v), block_size=BLOCKS)

        want = np.tensordot(gauss_matrix(x, y), v, axes=(1, 0))
        assert_allclose(f(x, y, v), want, dtype=F64)
        assert _uses_dot(f, x, y, v)
        check_grads(jax.jit(f), (x, y, v), order=2 if shape == (5,) else 1, modes=("fwd", "rev"))


def test_values_on_y_in_float32_half_and_complex(rng):
    """float32 (against float64), bfloat16 values with float32 weights (accumulated in
    float32), a bfloat16 kernel (its result bfloat16, summed in float32) and complex values:
    each as the dense products give it."""
    x, y = rng.normal(size=(M, 3)).astype(F32), rng.normal(size=(N, 3)).astype(F32)
    v = rng.normal(size=(N, 4)).astype(F32)
    want = gauss_matrix(x, y) @ v.astype(F64)
    got = foldax.pairwise_reduce(gauss_values, x, (y, v), block_size=BLOCKS)
    assert_allclose(got, want, dtype=F32)
    vb = jnp.asarray(v, jnp.bfloat16)

    def half(a, b):  # the user's own cast: float32 weights times bfloat16 values
        return jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1].astype(F32)

    got = foldax.pairwise_reduce(half, x, (y, vb), block_size=BLOCKS)
    assert got.dtype == F32
    assert_allclose(got, gauss_matrix(x, y) @ np.asarray(vb, F64), dtype=F32)
    xb, yb = (jnp.asarray(a, jnp.bfloat16) for a in (x, y))
    got = foldax.pairwise_reduce(gauss_values, xb, (yb, vb), block_size=BLOCKS)
    assert got.dtype == jnp.bfloat16  # the kernel's dtype, summed in float32
    want = gauss_matrix(np.asarray(xb, F64), np.asarray(yb, F64)) @ np.asarray(vb, F64)
    assert_allclose(got, want, dtype=jnp.bfloat16, scale=float(np.abs(want).max()))
    vc = (v + 1j * rng.normal(size=v.shape)).astype(np.complex64)

    def cplx(a, b):
        return jnp.exp(-jnp.sum((a - b[0]) ** 2)).astype(np.complex64) * b[1]

    got = foldax.pairwise_reduce(cplx, x, (y, vc), block_size=BLOCKS)
    assert_allclose(got, gauss_matrix(x, y) @ vc.astype(np.complex128), dtype=F32)


def test_values_on_y_non_finite_and_masked(rng):
    """A product's zero is not a masked pair's: ``0 * inf`` is NaN. Values with inf and NaN
    under a mask and segment ids give what the kept pairs give, as the elementwise sum does;
    under ``vmap`` too."""
    x, y = rng.normal(size=(M, 3)).astype(F32), rng.normal(size=(N, 3)).astype(F32)
    v = rng.normal(size=(N, 3)).astype(F32)
    v[5, 0], v[40, 1], v[20, 2] = np.inf, -np.inf, np.nan
    ids = (np.arange(M) // 7, np.arange(N) // 9)

    def f(x, v):
        mask = lambda i, j: j <= i + 3  # noqa: E731
        return foldax.pairwise_reduce(
            gauss_values, x, (y, v), block_size=BLOCKS, mask=mask, segment_ids=ids
        )

    keep = (np.arange(N)[None] <= np.arange(M)[:, None] + 3) & (ids[0][:, None] == ids[1][None])
    kmat = gauss_matrix(x, y)
    with np.errstate(invalid="ignore"):
        terms = np.where(keep[..., None], kmat[..., None] * v[None].astype(F64), 0.0)
    want = terms.sum(1)
    assert np.isinf(want).any() and np.isnan(want).any()
    assert_allclose(f(x, v), want, dtype=F32)
    both = jax.vmap(f)(np.stack([x, x[::-1]]), np.stack([v, v]))
    assert_allclose(both[0], want, dtype=F32)


def test_values_on_y_memory_flat_in_n_and_batch():
    """Temp memory of the sum and its gradient grows with N (8,192 -> 32,768 rows of ``y``
    with 32 values each) by no more than copies of ``y`` and its values (walked transposed);
    under ``vmap`` (16 -> 64 problems) by no more than the per-example arrays, the forward
    pass within the memory budget."""
    c = jax.ShapeDtypeStruct

    def f(x, y, v):
        return foldax.pairwise_reduce(gauss_values, x, (y, v))

    def g(x, y, v):
        return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(x, y, v)

    def temp(n):
        x, y, v = c((512, 3), F32), c((n, 3), F32), c((n, 32), F32)
        return report(f, x, y, v).temp_bytes, report(g, x, y, v).temp_bytes

    small, big = temp(8192), temp(32768)
    # one copy of y and its values, walked transposed (jax 0.12's XLA keeps a second one)
    copy = 2 * (32768 - 8192) * (3 + 32) * 4
    for what, s, b in zip(("forward", "gradient"), small, big, strict=True):
        assert b <= 1.1 * s + copy + 2**20, (what, small, big)

    def batched(b):
        x, y, v = c((b, 512, 3), F32), c((8192, 3), F32), c((8192, 32), F32)
        grad_x = lambda *a: jax.grad(lambda *a: jnp.sum(f(*a) ** 2))(*a)  # noqa: E731
        return [report(jax.vmap(h, (0, None, None)), x, y, v).temp_bytes for h in (f, grad_x)]

    (f16, g16), (f64, g64) = batched(16), batched(64)
    assert f64 <= 1.1 * f16 + 2**20 and f64 <= 1.25 * DEFAULT_BUDGET, (f16, f64)
    # per example: x's cotangent, the output (which the gradient of its square reads) and its
    # cotangent
    per_example = (64 - 16) * 512 * (3 + 32 + 32) * 4
    assert g64 <= 1.1 * g16 + per_example + 2**20, (g16, g64)


def test_softmax_with_values_on_y_without_a_dot_product(rng):
    """A softmax whose logits have no dot product (a Gaussian score) and whose values are rows
    of ``y``: weighted by one matrix product per tile, as the dense softmax gives it, with its
    gradient."""
    with jax.enable_x64(True):
        x, y = rng.normal(size=(M, 3)), rng.normal(size=(N, 3))
        v = rng.normal(size=(N, 4))

        def f(x, y, v):
            kernel = lambda a, b: (-jnp.sum((a - b[0]) ** 2), b[1])  # noqa: E731
            return foldax.pairwise_reduce(kernel, x, (y, v), reduction="softmax", block_size=BLOCKS)

        logits = -sqdist_matrix(x, y)
        p = np.exp(logits - logits.max(1, keepdims=True))
        assert_allclose(f(x, y, v), (p / p.sum(1, keepdims=True)) @ v, dtype=F64)
        assert _uses_dot(f, x, y, v)
        check_grads(jax.jit(f), (x, y, v), order=1, modes=("fwd", "rev"))


# ----------------------------------------------------------------------------------------------
# Derivatives of min / max / k-min at the pairs they pick


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_picked_derivatives_split_ties_like_jnp(rng, copies):
    """Gradient, jvp and second order of max, min and min_argmin's value where one, two or
    three rows of ``y`` tie (duplicated rows), as dense ``jnp`` gives them: max / min split
    evenly between ties (three ties take the streamed rule on those rows only), min_argmin's
    goes to its index; with a mask, under ``vmap``."""
    with jax.enable_x64(True):
        x, y0 = rng.normal(size=(M, 3)), rng.normal(size=(N // copies + 1, 3))
        y = np.concatenate([y0] * copies)
        keep = np.arange(y.shape[0])[None] <= np.arange(M)[:, None] + 40

        def ours(x, y):
            kw = dict(block_size=BLOCKS, mask=lambda i, j: j <= i + 40)
            lo = foldax.pairwise_reduce(sqdist, x, y, reduction="min", **kw)
            hi = foldax.pairwise_reduce(sqdist, x, y, reduction="max", **kw)
            both = foldax.pairwise_reduce(sqdist, x, y, reduction="min_argmin", **kw)[0]
            return jnp.sum(jnp.sin(lo)) + jnp.sum(jnp.cos(hi)) + jnp.sum(both**2)

        def dense(x, y):
            d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
            lo = jnp.min(jnp.where(keep, d, jnp.inf), 1)
            hi = jnp.max(jnp.where(keep, d, -jnp.inf), 1)
            at = jnp.argmin(jnp.where(keep, d, jnp.inf), 1)
            both = jnp.take_along_axis(d, at[:, None], 1)[:, 0]
            return jnp.sum(jnp.sin(lo)) + jnp.sum(jnp.cos(hi)) + jnp.sum(both**2)

        grads = jax.jit(jax.grad(ours, (0, 1)))(x, y)
        for got, want in zip(grads, jax.grad(dense, (0, 1))(x, y), strict=True):
            assert_allclose(got, want, dtype=F64)
        h = jax.jacfwd(jax.grad(lambda x: ours(x, y)))(x)
        assert_allclose(h, jax.jacfwd(jax.grad(lambda x: dense(x, y)))(x), dtype=F64)
        batch = (np.stack([x, -x]), np.stack([y, 2 * y]))
        t = jax.vmap(lambda x, y: jax.jvp(ours, (x, y), (x, y))[1])(*batch)
        want = jax.vmap(lambda x, y: jax.jvp(dense, (x, y), (x, y))[1])(*batch)
        assert_allclose(t, want, dtype=F64)


def _cancelling(a, b):
    """A squared distance that cancels (``a.a + b.b - 2 a.b``): recomputed in another program
    it may land tens of units in the last place from the forward pass's value."""
    return jnp.dot(a, a) + jnp.dot(b, b) - 2 * jnp.dot(a, b)


@pytest.mark.parametrize("reduction", ["min", "max"])
def test_three_ties_of_a_cancelling_kernel(rng, reduction):
    """Gradient and jvp where each row of ``y`` is present three times and the kernel cancels,
    pairwise (blocks that split the copies) and per segment (``fn=``), called twice each: the
    ties are told apart from the rest by the forward pass's runner-up, not by recomputing
    their value bitwise."""
    pick = getattr(jnp, reduction)
    with jax.enable_x64(True):
        x, y0 = rng.normal(size=(70, 3)), rng.normal(size=(30, 3))
        y = np.concatenate([y0] * 3)

        def ours(x, y):
            d = foldax.pairwise_reduce(_cancelling, x, y, reduction=reduction, block_size=(16, 24))
            return jnp.sum(jnp.sin(d))

        def dense(x, y):
            d = jax.vmap(lambda a: jax.vmap(lambda b: _cancelling(a, b))(y))(x)
            return jnp.sum(jnp.sin(pick(d, 1)))

        for _ in range(2):
            for got, want in zip(
                jax.grad(ours, (0, 1))(x, y), jax.grad(dense, (0, 1))(x, y), strict=True
            ):
                assert_allclose(got, want, dtype=F64)
            t = jax.jvp(ours, (x, y), (x, y))[1]
            assert_allclose(t, jax.jvp(dense, (x, y), (x, y))[1], dtype=F64)

        sizes = [30, 60]  # the rows of y, each three times, in two segments
        rows = np.concatenate([y0[:10]] * 3 + [y0[10:]] * 3)
        seg = getattr(foldax, f"segment_{reduction}")

        def ours_seg(p):
            return seg(rows, sizes=sizes, fn=lambda r: jax.vmap(lambda b: _cancelling(p, b))(r))

        def dense_seg(p):
            d = jax.vmap(lambda b: _cancelling(p, b))(rows)
            return jnp.stack([pick(d[:30]), pick(d[30:])])

        p, dp = x[0], x[1]
        for _ in range(2):
            assert_allclose(jax.jacrev(ours_seg)(p), jax.jacrev(dense_seg)(p), dtype=F64)
            t = jax.jvp(ours_seg, (p,), (dp,))[1]
            assert_allclose(t, jax.jvp(dense_seg, (p,), (dp,))[1], dtype=F64)


def test_kmin_derivatives_at_its_indices_second_order(rng):
    """k-min's values differentiate at their own pairs, to second order, under ``vmap``."""
    with jax.enable_x64(True):
        x, y = rng.normal(size=(M, 3)), rng.normal(size=(N, 3))

        def f(x, y):
            return foldax.pairwise_reduce(sqdist, x, y, reduction="kmin", k=4, block_size=BLOCKS)[0]

        assert np.all(np.isfinite(np.asarray(f(x, y))))  # (check_grads takes NaN == NaN)
        check_grads(jax.jit(f), (x, y), order=1, modes=("fwd", "rev"))
        h = jax.hessian(lambda x: jnp.sum(f(x, y) ** 2))(x[:3])
        want = jax.hessian(
            lambda x: jnp.sum(jnp.sort(jnp.sum((x[:, None] - y[None]) ** 2, -1), 1)[:, :4] ** 2)
        )(x[:3])
        assert_allclose(h, want, dtype=F64)


# ----------------------------------------------------------------------------------------------
# Nearest neighbours by squared distance in high dimension

D = 48  # at least the dimension from which matrix products are used


@pytest.mark.parametrize("dtype", [F32, F64])
def test_high_dimensional_neighbours_equal_the_users_formula(rng, dtype):
    """k-NN, argmin, min_argmin and min of ``jnp.sum((a - b) ** 2)`` at D = 48 through matrix
    products: indices equal NumPy's stable argsort of float64 distances, values the
    distances; duplicated rows (exact ties, ranked by index) and a near tie of 1e-6 at the
    k-th neighbour (left to the exact fold) included."""
    with jax.enable_x64(dtype == F64):
        x = rng.normal(size=(M, D)).astype(dtype)
        y = rng.normal(size=(4 * N, D)).astype(dtype)
        y[7] = y[3] = y[100]
        x[0] = y[3]
        order = np.argsort(sqdist_matrix(x, y), axis=1, kind="stable")
        y[order[1, 4]] = y[order[1, 3]] + 1e-6  # rows 3 and 4 of x[1] nearly tie
        ref = sqdist_matrix(x, y)
        order = np.argsort(ref, axis=1, kind="stable")

        def f(x, y):
            red = ("kmin", "argmin", "min_argmin", "min")
            kw = dict(k=5)
            return [
                foldax.pairwise_reduce(sqdist, x, y, reduction=r, **(kw if r == "kmin" else {}))
                for r in red
            ]

        (kv, ki), am, (mv, mi), mn = jax.jit(f)(x, y)
        np.testing.assert_array_equal(ki, order[:, :5])
        np.testing.assert_array_equal(am, order[:, 0])
        np.testing.assert_array_equal(mi, order[:, 0])
        want = np.take_along_axis(ref, order[:, :5], 1)
        scale = float(np.max(ref))
        assert_allclose(kv, want, dtype=dtype, scale=scale)
        assert_allclose(mv, want[:, 0], dtype=dtype, scale=scale)
        assert_allclose(mn, want[:, 0], dtype=dtype, scale=scale)
        assert _uses_dot(lambda x, y: f(x, y)[0], x, y)


def test_high_dimensional_neighbours_non_finite_and_derivatives(rng):
    """NaN and inf rows give what the exact fold gives (NaN last for k-min, first for argmin);
    min and k-min differentiate at their pairs (finite differences, ``vmap``)."""
    with jax.enable_x64(True):
        x, y = rng.normal(size=(M, D)), rng.normal(size=(N, D))
        xn, yn = x.copy(), y.copy()
        xn[2, 5], yn[11, 0] = np.nan, np.inf

        def both(x, y):
            kmin = foldax.pairwise_reduce(sqdist, x, y, reduction="kmin", k=3)
            return kmin, foldax.pairwise_reduce(sqdist, x, y, reduction="argmin")

        (kv, ki), am = both(xn, yn)
        ref = sqdist_matrix(xn, yn)
        order = np.argsort(ref, axis=1, kind="stable")
        np.testing.assert_array_equal(ki, order[:, :3])
        np.testing.assert_array_equal(am[np.arange(M) != 2], order[np.arange(M) != 2, 0])
        assert am[2] == 0  # every distance of x[2] is NaN: the first
        assert_allclose(kv, np.take_along_axis(ref, order[:, :3], 1), dtype=F64, scale=100.0)

        def f(x, y):
            lo = foldax.pairwise_reduce(sqdist, x, y, reduction="min")
            return lo + foldax.pairwise_reduce(sqdist, x, y, reduction="kmin", k=3)[0][:, 2]

        def dense(x, y):
            d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
            return jnp.min(d, 1) + jnp.sort(d, 1)[:, 2]

        loss = lambda f: lambda x, y: jnp.sum(jnp.sin(f(x, y)))  # noqa: E731
        g = jax.jit(jax.vmap(jax.grad(loss(f), (0, 1))))(np.stack([x, x + 1]), np.stack([y, y]))
        want = jax.jit(jax.grad(loss(dense), (0, 1)))(x, y)
        assert_allclose(g[1][0], want[1], dtype=F64)
        t = jax.jit(lambda x, y: jax.jvp(f, (x, y), (y[:M] * 0 + x, y))[1])(x, y)
        assert_allclose(t, jax.jvp(dense, (x, y), (x, y))[1], dtype=F64)
        assert_allclose(g[0][0], want[0], dtype=F64)


def test_high_dimensional_neighbours_memory_flat_in_n():
    """k-NN at D = 784 keeps no copy of the training set: temp does not grow with it (4,000
    -> 16,000 rows), forward and for the gradient of the k distances."""
    c = jax.ShapeDtypeStruct

    def temp(n):
        x, y = c((128, 784), F32), c((n, 784), F32)

        def f(x, y):
            return foldax.pairwise_reduce(sqdist, x, y, reduction="kmin", k=10)

        def g(x, y):
            return jax.grad(lambda x, y: jnp.sum(f(x, y)[0]), argnums=(0, 1))(x, y)

        return report(f, x, y).temp_bytes, report(g, x, y).temp_bytes

    small, big = temp(4000), temp(16000)
    assert big[0] <= 1.1 * small[0] + 2**20, (small, big)
    # the gradient's cotangent of y is y's size: it grows with y as an output does, no more
    assert big[1] - small[1] <= 1.1 * 12000 * 784 * 4 + 2**20, (small, big)
