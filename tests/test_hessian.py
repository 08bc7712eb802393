"""Second (and third) order: ``jax.hessian``, ``jax.jacrev(jax.grad(f))``, ``jax.grad`` of a
function of ``jax.grad(f)``, a ``vjp`` of a ``vjp`` and forward over reverse agree with the same
derivatives of the registry's dense plain-``jnp`` references, for every differentiable public
function (segment reductions, pairwise reductions, cauchy / vandermonde), also under vmap and
jit; check_grads of order 2 in both modes; segment_prod through the zeros of a segment against
jnp.prod's in float64. Integer outputs (counts, indices) take symbolic zero cotangents at every
order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_allclose,
    check_each,
    dense,
    dense_matrix,
    op,
    pairwise_dense,
    random_partition,
    reference,
    tol,
)
from jax.test_util import check_grads

import foldax

SIZES = [2, 1, 4, 3]
IDS = np.repeat(np.arange(len(SIZES)), SIZES)
N = sum(SIZES)
#: the segment reductions checked with sizes (and, for some, with ids)
SECOND_ORDER = ("sum", "mean", "max", "min", "prod", "logsumexp", "logmeanexp", "var", "std",
                "softmax", "log_softmax")  # fmt: skip


def _data(rng, n, feat=(), scale=1.0, shift=0.0):
    return (rng.standard_normal((n, *feat)) * scale + shift).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Reverse over reverse against the dense references' Hessians


def _check_second_order(loss, dense, x):
    """:func:`_check_second_orders` of one case."""
    _check_second_orders({"": (loss, dense, x)})


def _check_second_orders(cases):
    """Per case ``{label: (loss, dense, x)}``: reverse over reverse three ways against the dense
    twin's Hessian. All jitted, every case in one program: one compilation, which is what takes
    the time. Each case is checked by itself; one report lists every case that failed."""

    def vjp_of_vjp(loss, t, u):  # the Hessian-vector product by pulling back twice
        _, pull = jax.vjp(lambda t: jax.vjp(loss, t)[1](jnp.float32(1))[0], t)
        return pull(u)[0]

    def derivatives(loss, dense, t, u):
        hess = jax.jacrev(jax.grad(loss))(t)
        gg = jax.grad(lambda t, u: jnp.vdot(jax.grad(loss)(t), u))(t, u)
        want = jax.hessian(dense)(t)
        hvp = want.reshape(t.size, t.size) @ u.ravel()
        return want, hvp, hess, gg, vjp_of_vjp(loss, t, u)

    xs = {k: x for k, (_, _, x) in cases.items()}
    us = {
        k: jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32).reshape(x.shape)
        for k, x in xs.items()
    }
    outs = jax.jit(
        lambda xs, us: {
            k: derivatives(loss, dense, xs[k], us[k]) for k, (loss, dense, _) in cases.items()
        }
    )(xs, us)

    def check(k):
        want, hvp, hess, gg, vv = (np.asarray(a) for a in outs[k])
        scale = float(np.max(np.abs(want))) + 1.0
        assert_allclose(hess, want, dtype=np.float32, scale=scale, err_msg=f"{k} jacrev(grad)")
        assert_allclose(gg.ravel(), hvp, dtype=np.float32, scale=scale, err_msg=f"{k} grad(grad)")
        assert_allclose(vv.ravel(), hvp, dtype=np.float32, scale=scale, err_msg=f"{k} vjp(vjp)")

    check_each(cases, check, prefix="")


CASES = [(name, "sizes") for name in sorted(SECOND_ORDER)] + [
    (name, "ids") for name in ("max", "prod", "logsumexp", "var", "softmax")
]


@pytest.mark.slow
def test_segment_reverse_over_reverse(rng):
    """Every case of CASES, in one program."""
    cases = {}
    for name, how in CASES:
        f = op(name)
        # distinct values, away from 0 (prod) and from ties (max / min)
        x = jnp.asarray(rng.permutation(N).astype(np.float32) * 0.25 + 0.5)
        w = jnp.asarray(
            rng.standard_normal(len(SIZES) if name not in ("softmax", "log_softmax") else N)
        )
        w = w.astype(jnp.float32)
        ids = jnp.asarray(np.repeat(np.arange(len(SIZES)), SIZES))
        kw = (
            {"sizes": SIZES} if how == "sizes" else {"segment_ids": ids, "num_segments": len(SIZES)}
        )

        def loss(v, f=f, kw=kw, w=w):
            return jnp.sum(jnp.sin(f(v, **kw)) * w)

        def dense_loss(v, name=name, w=w):
            return jnp.sum(jnp.sin(dense(name, v, IDS, len(SIZES))) * w)

        cases[f"segment_{name} ({how})"] = (loss, dense_loss, x)
    _check_second_orders(cases)


@pytest.mark.slow
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


@pytest.mark.slow
def test_pairwise_reverse_over_reverse(rng):
    """Every reduction of PAIRWISE, in one program."""
    cases = {}
    for reduction in PAIRWISE:
        xs = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))
        ys = jnp.asarray(rng.standard_normal((6, 2)).astype(np.float32))
        kernel = (lambda a, b: (jnp.dot(a, b), b)) if reduction == "softmax" else _sq
        kw = {"k": 2} if reduction == "kmin" else {}

        def loss(x, reduction=reduction, kernel=kernel, ys=ys, kw=kw):
            out = foldax.pairwise_reduce(kernel, x, ys, reduction=reduction, **kw)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(jnp.sin(out))

        def dense(x, reduction=reduction, kernel=kernel, ys=ys, kw=kw):
            out = pairwise_dense(reduction, dense_matrix(kernel, x, ys), **kw)
            return jnp.sum(jnp.sin(out[0] if isinstance(out, tuple) else out))

        cases[f"pairwise {reduction}"] = (loss, dense, xs)
    _check_second_orders(cases)


@pytest.mark.slow
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

    ell = jnp.arange(length, dtype=jnp.float32).astype(jnp.complex64)

    def vander(t, fold):
        x = -0.3 + 1j * t.astype(jnp.complex64)
        k = (
            foldax.vandermonde(v, x, length)
            if fold
            else jnp.sum(v[:, None] * jnp.exp(x[:, None] * ell[None, :]), axis=0)
        )
        return jnp.sum(jnp.abs(k) ** 2)

    _check_second_orders(  # both in one program
        {
            "cauchy": (lambda t: cauchy(t, True), lambda t: cauchy(t, False), theta),
            "vandermonde": (lambda t: vander(t, True), lambda t: vander(t, False), theta),
        }
    )


@pytest.mark.slow
def test_reverse_over_reverse_under_vmap_and_jit(rng):
    x = jnp.asarray(rng.standard_normal((3, N)).astype(np.float32))

    def loss(v):
        return jnp.sum(jnp.sin(foldax.segment_max(v, sizes=SIZES)))

    def dense_loss(v):
        return jnp.sum(jnp.sin(dense("max", v, IDS, len(SIZES))))

    def both(x):  # one program: one compilation
        return jax.vmap(jax.jacrev(jax.grad(loss)))(x), jax.vmap(jax.hessian(dense_loss))(x)

    got, want = jax.jit(both)(x)
    assert_allclose(got, want, dtype=np.float32, scale=2.0)


@pytest.mark.slow
def test_hessian_and_jvp_of_grad(rng):
    sizes = [30, 70]
    x = jnp.asarray(rng.standard_normal((100, 3)).astype(np.float32))
    theta = jnp.asarray(rng.standard_normal(3).astype(np.float32))

    def loss(t):
        return jnp.sum(foldax.segment_logsumexp(x, sizes=sizes, fn=lambda r: r @ t, chunk_size=8))

    def dense_loss(t):
        return jnp.sum(dense("logsumexp", x @ t, np.repeat([0, 1], sizes), 2))

    # foldax's side runs eagerly (the other tests jit it); the dense references are jitted, in
    # one program
    u = jnp.ones(3, jnp.float32)
    want_hessian, want_jvp, want_gg = jax.jit(
        lambda t: (
            jax.hessian(dense_loss)(t),
            jax.jvp(jax.grad(dense_loss), (t,), (u,))[1],
            jax.grad(lambda t: jnp.sum(jax.grad(dense_loss)(t) ** 2))(t),
        )
    )(theta)
    assert_allclose(jax.hessian(loss)(theta), want_hessian, dtype=np.float32)
    got = jax.jvp(jax.grad(loss), (theta,), (u,))[1]
    assert_allclose(got, want_jvp, dtype=np.float32)
    got = jax.grad(lambda t: jnp.sum(jax.grad(loss)(t) ** 2))(theta)
    assert_allclose(got, want_gg, dtype=np.float32, scale=float(jnp.max(jnp.abs(want_gg))))


# ----------------------------------------------------------------------------------------------
# check_grads of order 2, both modes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prod", "var", "std"])
def test_check_grads_second_order(rng, name):
    part = random_partition(rng, num_segments=4, max_size=5)
    x = jnp.asarray(_data(rng, part.n, scale=0.5, shift=1.0))
    sizes = [int(s) for s in part.sizes]
    f = getattr(foldax, f"segment_{name}")

    def g(x):
        out = f(x, sizes=sizes, chunk_size=3)
        return jnp.where(jnp.isnan(out), 0.0, out)

    # g zeroes NaNs (a variance of no rows) and check_grads passes NaNs matching NaNs: the
    # NaNs are only the reference's
    want = reference(name, np.asarray(x), part.ids, len(sizes))
    np.testing.assert_array_equal(np.isnan(f(x, sizes=sizes, chunk_size=3)), np.isnan(want))
    t = tol(np.float32)
    check_grads(jax.jit(g), (x,), order=2, modes=("fwd", "rev"), eps=t["fd_eps"], atol=t["fd_tol"],
                rtol=t["fd_tol"])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["var", "std"])
def test_var_gradients_check_grads(rng, name):
    """check_grads (second order, both modes) on moderate values, unsorted repeated ids, small
    chunks and ddof=1 (test_check_grads_second_order checks sizes, ddof=0): the derivatives are untouched by
    the merges' guards."""
    ids = jnp.asarray(rng.permutation(np.repeat(np.arange(4), [5, 3, 1, 4])).astype(np.int32))
    x = jnp.asarray((rng.standard_normal(13) * 0.5 + 1.0).astype(np.float32))
    f = getattr(foldax, f"segment_{name}")

    def g(x):
        out = f(x, ids, 4, chunk_size=3, ddof=1)
        return jnp.where(jnp.isnan(out), 0.0, out)

    want = reference(name, np.asarray(x), np.asarray(ids), 4, ddof=1)  # NaNs: as in the previous
    np.testing.assert_array_equal(np.isnan(f(x, ids, 4, chunk_size=3, ddof=1)), np.isnan(want))
    t = tol(np.float32)
    check_grads(jax.jit(g), (x,), order=2, modes=("fwd", "rev"), eps=t["fd_eps"], atol=t["fd_tol"],
                rtol=t["fd_tol"])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# segment_prod: derivatives through zeros


#: Segments with 0, 1, 2 and 3 zeros, one value, none, and two zeros alone (product of the others
#: in the Hessian: the empty product, 1).
PROD_SEGMENTS = (
    [1.5, -2.0, 0.5, 3.0, -0.75],
    [0.0, 1.5, -2.0, 0.5, 1.25],
    [2.0, 0.0, -1.5, 0.0, 0.5],
    [0.0, 0.0, 1.25, -2.0, 0.0],
    [-1.75],
    [],
    [0.0, 0.0],
)
PROD_SIZES = [len(s) for s in PROD_SEGMENTS]
PROD_IDS = np.repeat(np.arange(len(PROD_SEGMENTS)), PROD_SIZES).astype(np.int32)
#: A weight per segment, so that every segment's second derivatives are told apart.
PROD_WEIGHTS = [1.0, -0.5, 2.0, 0.75, 1.5, 3.0, -1.25]

ORDERS = {
    "jacfwd(jacrev)": lambda f: jax.jacfwd(jax.jacrev(f)),
    "jacfwd(jacfwd)": lambda f: jax.jacfwd(jax.jacfwd(f)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f)),
    "jacrev(jacfwd)": lambda f: jax.jacrev(jax.jacfwd(f)),
}


def _dense_prod(x, ids, weights):
    """sum_k weights[k] * prod(x[ids == k]): the registry's dense reference, weighted."""
    return jnp.sum(dense("prod", x, ids, len(weights)) * weights)


def _prod_call(form, x, rng):
    """``(fn, x, ids)``: ``segment_prod`` as ``form``, and the values and ids of its rows
    (permuted for unsorted ids)."""
    s, ids = len(PROD_SEGMENTS), PROD_IDS
    if form == "sizes":
        return (lambda v: foldax.segment_prod(v, sizes=PROD_SIZES, chunk_size=2)), x, ids
    if form == "sorted_ids":
        fn = lambda v: foldax.segment_prod(v, jnp.asarray(ids), s, indices_are_sorted=True)  # noqa: E731
        return fn, x, ids
    perm = rng.permutation(len(ids))
    pids = jnp.asarray(ids[perm])
    return (lambda v: foldax.segment_prod(v, pids, s, chunk_size=3)), x[perm], ids[perm]


@pytest.mark.slow
def test_prod_hessian_reproduction():
    """The report: a segment with one zero, Hessian [[0, 3, 2], [0, 0, 0], [0, 0, 0]] (the
    derivative of P / x_j in the zero was lost); jnp.prod's is symmetric."""
    x = jnp.array([0.0, 2.0, 3.0])
    want = np.array([[0.0, 3.0, 2.0], [3.0, 0.0, 0.0], [2.0, 0.0, 0.0]])

    def f(v):
        return foldax.segment_prod(v, sizes=[3]).sum()

    def every(x):  # one program: one compilation
        outs = {name: order(f)(x) for name, order in ORDERS.items()}
        return jax.hessian(jnp.prod)(x), jax.jacrev(jax.grad(f))(x), outs

    dense_hessian, jacrev_grad, outs = jax.jit(every)(x)
    assert_allclose(dense_hessian, want, dtype=np.float32)
    for name, got in outs.items():
        assert_allclose(got, want, dtype=np.float32, err_msg=name)
        np.testing.assert_array_equal(got, np.asarray(got).T, err_msg=name)
    assert_allclose(jacrev_grad, want, dtype=np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sizes", "sorted_ids", "unsorted_ids"])
def test_prod_second_derivatives_against_jnp_float64(rng, form):
    """Every second-order composition, segments with 0-3 zeros, under jit, in float64 (the
    compositions of a form in one program: one compilation)."""
    with jax.enable_x64(True):
        x = np.concatenate([np.asarray(s, np.float64) for s in PROD_SEGMENTS])
        ours, x, ids = _prod_call(form, x, rng)
        x = jnp.asarray(x)
        w = jnp.asarray(PROD_WEIGHTS, jnp.float64)
        outs = jax.jit(
            lambda x: {
                order: (
                    compose(lambda v: jnp.sum(ours(v) * w))(x),
                    compose(lambda v: _dense_prod(v, ids, w))(x),
                )
                for order, compose in ORDERS.items()
            }
        )(x)

        def check(order):
            got, want = outs[order]
            assert_allclose(got, want, dtype=np.float64, err_msg=order)
            assert np.count_nonzero(np.asarray(want)) > 20  # the zeros' entries are there

        check_each(ORDERS, check, prefix=f"{form} ")


@pytest.mark.slow
def test_prod_hessian_under_vmap_float64():
    """A batch of rows with different zeros, vmapped inside and outside the Hessian."""
    with jax.enable_x64(True):
        xs = jnp.asarray(
            [
                [0.0, 2.0, 3.0, 1.5, -0.5, 2.0],
                [0.0, 0.0, 3.0, 2.0, 1.25, 0.0],
                [1.0, 2.0, -3.0, 4.0, 0.0, 0.0],
                [0.0, 0.0, 0.0, 2.0, 0.0, 1.5],
            ]
        )
        ids = np.array([0, 0, 0, 0, 1, 1], np.int32)
        w = jnp.asarray([1.0, -2.0], jnp.float64)

        def ours(v):
            return jnp.sum(foldax.segment_prod(v, jnp.asarray(ids), 2, chunk_size=2) * w)

        def every(xs):  # one program: one compilation
            want = jax.vmap(jax.hessian(lambda v: _dense_prod(v, ids, w)))(xs)
            inside = jax.vmap(jax.hessian(ours))(xs)
            total = jax.hessian(lambda xs: jnp.sum(jax.vmap(ours)(xs)))(xs)
            return want, inside, total

        want, inside, total = jax.jit(every)(xs)
        assert_allclose(inside, want, dtype=np.float64)
        total = np.asarray(total)
        got = np.stack([total[b, :, b, :] for b in range(xs.shape[0])])
        assert_allclose(got, want, dtype=np.float64)


@pytest.mark.slow
def test_prod_third_derivatives_up_to_two_zeros_float64():
    """Third derivatives are exact in segments with at most two zeros (the docstring's claim)."""
    with jax.enable_x64(True):
        x = jnp.asarray([0.0, 2.0, 0.0, 3.0, 0.0, 1.5, -2.0, 1.25, 0.5, -1.5])
        ids = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2], np.int32)
        w = jnp.asarray([1.0, -2.0, 0.5], jnp.float64)
        third = lambda f: jax.jacfwd(jax.jacfwd(jax.jacfwd(f)))  # noqa: E731
        got, want = jax.jit(  # one program: one compilation
            lambda x: (
                third(lambda v: jnp.sum(foldax.segment_prod(v, sizes=[4, 3, 3]) * w))(x),
                third(lambda v: _dense_prod(v, ids, w))(x),
            )
        )(x)
        assert_allclose(got, want, dtype=np.float64)
