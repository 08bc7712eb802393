"""Forward mode under stress: ``jax.jvp``, ``jax.jacfwd`` and ``vmap`` of ``jvp`` (1 to 300
tangents) of every monoid and of contracting kernels, at sizes around and past the tiles
(1,000-5,000 rows of ``x`` against 30-300 of ``y``: one 2,048-row block of a 1,024 x 1,024 tile
plan, several, and a clamped last one), against the same function in dense float64 ``jnp``.

Each case is called several times and compared on the host, NaN counting as a failure: a
buffer read before it is written can be right on one call and wrong on the next, and
``jnp.max(|err|)`` of an all-NaN array is ``-inf``. Tangents are taken in ``x``, in ``y`` and in
both, while the values of a softmax stay fixed (their tangent is a symbolic zero: a product
with it once read memory XLA:CPU never wrote)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax

F64 = np.float64
CALLS = 3

#: ``(rows of x, rows of y)``: one block of 2,048 x 64, two blocks of 2,048 by 130, a clamped
#: last block of rows (3,000), few columns (30) and many (300) against 1,000 rows.
SIZES = [(2048, 64), (4096, 130), (3000, 30), (1000, 300)]


def _dot(a, b):
    return jnp.dot(a, b)


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def _dense_kmin(d):
    return -jax.lax.top_k(-d, 3)[0]


#: ``name -> (reduction, kernel, dense reference over the (M, N) kernel matrix)``; the kernel
#: and its values for softmax and the weighted log-sum-exp are made by :func:`_functions`.
CASES = {
    "softmax": ("softmax", None, None),
    "weighted_logsumexp": ("logsumexp", None, None),
    "logsumexp_dot": ("logsumexp", _dot, lambda d: jax.nn.logsumexp(d, axis=1)),
    "sum_sin_dot": ("sum", lambda a, b: jnp.sin(jnp.dot(a, b)), lambda d: jnp.sum(d, axis=1)),
    "min_sqdist": ("min", _sqdist, lambda d: jnp.min(d, axis=1)),
    "max_dot": ("max", _dot, lambda d: jnp.max(d, axis=1)),
    "min_argmin": ("min_argmin", _sqdist, lambda d: jnp.min(d, axis=1)),
    "kmin": ("kmin", _sqdist, _dense_kmin),
}


def _data(rng, m, n, d=3):
    x = rng.standard_normal((m, d))
    y = rng.standard_normal((n, d))
    vals = rng.standard_normal((n, 2))
    return x, y, vals


def _functions(name, vals):
    """``(ours, dense)`` of ``(x, y)``, both differentiable in each."""
    reduction, kernel, ref = CASES[name]
    v = jnp.asarray(vals)
    pair = lambda a, b: (jnp.dot(a, b[0]), b[1])  # noqa: E731
    if name == "softmax":  # attention-shaped: values of y that stay fixed
        return (
            lambda x, y: foldax.pairwise_reduce(pair, x, (y, v), reduction="softmax"),
            lambda x, y: jax.nn.softmax(x @ y.T, axis=1) @ v,
        )
    if name == "weighted_logsumexp":
        w = jnp.abs(v[:, 0]) + 0.1
        return (
            lambda x, y: foldax.pairwise_reduce(pair, x, (y, w), reduction="logsumexp"),
            lambda x, y: jax.nn.logsumexp(x @ y.T, b=w[None], axis=1),
        )
    k = {"k": 3} if reduction == "kmin" else {}

    def ours(x, y):
        out = foldax.pairwise_reduce(kernel, x, y, reduction=reduction, **k)
        return out[0] if reduction in ("min_argmin", "kmin") else out

    def dense(x, y):
        return ref(jax.vmap(lambda a: jax.vmap(lambda b: kernel(a, b))(y))(x))

    return ours, dense


def _check_calls(fn, args, want, what):
    """``fn(*args)`` called :data:`CALLS` times, each compared with ``want`` (NaN fails)."""
    for call in range(CALLS):
        got = jax.tree.map(np.asarray, fn(*args))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.all(np.isfinite(g)), f"{what}, call {call}: not finite"
            assert_allclose(g, w, dtype=F64, scale=10.0, err_msg=f"{what}, call {call}")


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", list(CASES))
def test_jvp_around_the_tiles(name, size, rng):
    """``jax.jvp`` in ``x``, in ``y`` and in both, jitted and called again and again."""
    with jax.enable_x64(True):
        x, y, vals = _data(rng, *size)
        ours, dense = _functions(name, vals)
        dx, dy = rng.standard_normal(x.shape), rng.standard_normal(y.shape)
        fn = jax.jit(lambda x, y, tx, ty: jax.jvp(ours, (x, y), (tx, ty)))
        for label, tx, ty in (("x", dx, 0 * dy), ("y", 0 * dx, dy), ("both", dx, dy)):
            want = jax.jvp(dense, (x, y), (tx, ty))
            _check_calls(fn, (x, y, tx, ty), want, f"{name} {size} jvp in {label}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "logsumexp_dot", "min_sqdist", "weighted_logsumexp"])
def test_jacfwd_batches_many_tangents(name, rng):
    """``jax.jacfwd`` in ``x`` (30 x 3 and 90 x 3 against 130 rows: 90 and 270 tangents, each
    a slot of the batched tangent fold), eager and jitted."""
    with jax.enable_x64(True):
        for m in (30, 90):
            x, y, vals = _data(rng, m, 130)
            ours, dense = _functions(name, vals)
            want = jax.jacfwd(dense)(x, y)
            _check_calls(jax.jacfwd(ours), (x, y), want, f"{name} jacfwd eager m={m}")
            _check_calls(jax.jit(jax.jacfwd(ours)), (x, y), want, f"{name} jacfwd jit m={m}")


@pytest.mark.slow
@pytest.mark.parametrize("tangents", [1, 2, 24, 300])
def test_vmap_of_jvp_over_tangents(tangents, rng):
    """``vmap`` of ``jvp`` over 1 to 300 tangents of ``x`` and ``y`` at once, softmax and the
    min of squared distances, 2,048 rows against 64."""
    with jax.enable_x64(True):
        x, y, vals = _data(rng, 2048, 64)
        tx = rng.standard_normal((tangents, *x.shape))
        ty = rng.standard_normal((tangents, *y.shape))
        for name in ("softmax", "min_sqdist"):
            ours, dense = _functions(name, vals)
            push = lambda f: jax.vmap(lambda a, b: jax.jvp(f, (x, y), (a, b))[1])  # noqa: E731
            want = push(dense)(tx, ty)
            _check_calls(jax.jit(push(ours)), (tx, ty), want, f"{name} vmap of jvp x{tangents}")


@pytest.mark.slow
def test_attention_jvp_in_the_query(rng):
    """``dot_product_attention``'s jvp in the query (T = 2,048, S = 256, float32), called
    again and again, against dense float64 attention."""
    q = jnp.asarray(rng.standard_normal((1, 2048, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 256, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 256, 2, 16)), jnp.float32)
    dq = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    ours = jax.jit(
        lambda q, dq: jax.jvp(lambda q: foldax.dot_product_attention(q, k, v), (q,), (dq,))
    )

    def dense(q):  # float64, (B, T, H, D) as jax.nn takes them
        logits = jnp.einsum("bthd,bshd->bhts", q, k64) / np.sqrt(q.shape[-1])
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v64)

    with jax.enable_x64(True):
        q64, k64, v64, dq64 = (np.asarray(a, F64) for a in (q, k, v, dq))
        want = jax.jvp(dense, (q64,), (dq64,))
    for call in range(CALLS):
        got = jax.tree.map(np.asarray, ours(q, dq))
        for g, w in zip(got, want, strict=True):
            assert np.all(np.isfinite(g)), f"call {call}: not finite"
            assert_allclose(g, w, dtype=np.float32, scale=10.0, err_msg=f"call {call}")
