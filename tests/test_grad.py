"""Reverse mode: foldax's custom VJPs of every differentiable segment reduction (the registry,
one program for all of them) against jax.vjp of the dense references with the same random
cotangent, wrt the data, fn's params and pytree leaves, with dropped ids, ties, empty segments
and -inf entries, under jit(vmap(grad)); against float64 / float32 finite differences
(jax.test_util.check_grads); prod through zeros, var / std at huge means.

Second order is in test_hessian.py; pairwise_reduce's gradients in test_pairwise.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL,
    DIFFERENTIABLE,
    NORMALIZERS,
    REDUCTIONS,
    SEGMENT,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    dense,
    fn_inputs,
    jit_each,
    normal_rows,
    op,
    permute_rows,
    random_partition,
    sample,
    segment_data,
    tol,
)
from jax.test_util import check_grads

import foldax

F32 = np.float32


def _vjps(names, foldax_fn, dense_fn, args, rng):
    """``{name: (foldax grads, dense grads)}``, both for all names in one program (one
    compilation); ``args``: the arguments of every name, or ``{name: its arguments}``."""
    per = args if isinstance(args, dict) else {n: args for n in names}
    outs = jax.eval_shape(lambda per: {n: foldax_fn(n, *per[n]) for n in names}, per)
    cts = {n: jnp.asarray(rng.standard_normal(o.shape).astype(o.dtype)) for n, o in outs.items()}

    def grads(f, per, cts):
        return {n: jax.vjp(lambda *a, n=n: f(n, *a), *per[n])[1](cts[n]) for n in names}

    got, want = jax.jit(lambda *a: (grads(foldax_fn, *a), grads(dense_fn, *a)))(per, cts)
    return {n: (got[n], want[n]) for n in names}


def _assert_grads_match(pairs, scale):
    """No NaN/inf, and equal to the dense gradients. Float32 gradients through exp/log of values
    of magnitude ``scale`` (or ``{name: scale}``) are accurate to ~eps * scale * |grad|: the atol
    scales with both."""

    def check(name):
        got, want = pairs[name]
        s = scale[name] if isinstance(scale, dict) else scale
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.all(np.isfinite(g)), f"gradient has NaN/inf: {g}"
            assert_allclose(g, w, dtype=g.dtype, scale=s * data_scale(w))

    check_each(pairs, check)


def _fn_inputs_each(rng, names, ids, num_segments):
    """``({name: x}, {name: w})`` of :func:`helpers.fn_inputs`, with the largest shift each
    reduction's data may take (one draw per shift)."""
    drawn = {}
    for n in names:
        shift = max(abs(v) for v in SEGMENT[n].shifts)
        if shift not in drawn:
            drawn[shift] = fn_inputs(rng, ids, num_segments, shift=shift)
    pick = {n: drawn[max(abs(v) for v in SEGMENT[n].shifts)] for n in names}
    return {n: p[0] for n, p in pick.items()}, {n: p[1] for n, p in pick.items()}


# ----------------------------------------------------------------------------------------------
# Against jax.vjp of the dense references, same random cotangent


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sizes"])
def test_grad_wrt_data(form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    xs = sample(rng, DIFFERENTIABLE, ids, part.num_segments)
    if "unsorted" in form:
        ids, xs = permute_rows(rng, ids, xs)
    s = part.num_segments
    pairs = _vjps(
        DIFFERENTIABLE,
        lambda n, x: apply(n, x, ids, s, form, chunk_size=5),
        lambda n, x: dense(n, x, ids, s),
        {n: (jnp.asarray(x),) for n, x in xs.items()},
        rng,
    )
    _assert_grads_match(pairs, {n: data_scale(x) for n, x in xs.items()})


@pytest.mark.parametrize("name", ["sum", "mean", "max", "logsumexp", "logmeanexp"])
def test_grad_dropped_rows_minimal(name):
    x = jnp.array([2.0, 1.0, 2.0], jnp.float32)  # the dropped 2. ties segment 1's max
    ids = jnp.array([1, 0, 5])
    g = jax.grad(lambda x: op(name)(x, ids, 2).sum())(x)
    assert g[2] == 0.0, g


@pytest.mark.slow
@pytest.mark.parametrize(
    "form",
    [
        "unsorted_ids",
        "jit_sorted_ids",
    ],
)
def test_grad_out_of_range_ids(form, rng):
    """Rows with dropped ids get no gradient (and their NaN softmax outputs spread no NaN)."""
    num_segments = 5
    ids = np.sort(rng.integers(-2, num_segments + 2, size=30).astype(np.int32))
    xs = sample(rng, DIFFERENTIABLE, ids, num_segments)
    if "unsorted" in form:
        ids, xs = permute_rows(rng, ids, xs)
    pairs = _vjps(
        DIFFERENTIABLE,
        lambda n, x: apply(n, x, ids, num_segments, form, chunk_size=4),
        lambda n, x: dense(n, x, ids, num_segments),
        {n: (jnp.asarray(x),) for n, x in xs.items()},
        rng,
    )
    _assert_grads_match(pairs, {n: data_scale(x) for n, x in xs.items()})
    dropped = (ids < 0) | (ids >= num_segments)
    check_each(
        DIFFERENTIABLE, lambda n: np.testing.assert_array_equal(pairs[n][0][0][dropped], 0.0)
    )


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
def test_grad_wrt_closed_over_params(form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    xs, ws = _fn_inputs_each(rng, DIFFERENTIABLE, ids, part.num_segments)
    if "unsorted" in form:
        ids, xs = permute_rows(rng, ids, xs)
    s = part.num_segments

    def lib(n, x, w):
        dom = SEGMENT[n].domain
        return apply(n, x, ids, s, form, chunk_size=5, fn=lambda rows: dom(rows @ w))

    def ref(n, x, w):
        return dense(n, SEGMENT[n].domain(x @ w), ids, s)

    args = {n: (jnp.asarray(xs[n]), jnp.asarray(ws[n])) for n in DIFFERENTIABLE}
    pairs = _vjps(DIFFERENTIABLE, lib, ref, args, rng)
    scale = {n: data_scale(SEGMENT[n].domain(xs[n] @ ws[n])) for n in DIFFERENTIABLE}
    _assert_grads_match(pairs, scale)


@pytest.mark.slow
def test_grad_pytree_data_with_fn(rng):
    part = random_partition(rng, num_segments=6)
    a, w = fn_inputs(rng, part.ids, part.num_segments, features=4, outputs=2)
    b = rng.standard_normal(part.n).astype(F32)
    k = jnp.asarray(rng.integers(0, 3, part.n).astype(np.int32))  # a non-differentiable leaf

    def fn(rows, w):
        return rows["a"] @ w + (rows["b"] * rows["k"].astype(jnp.float32))[:, None]

    sizes = part.sizes.tolist()

    def lib(n, a, b, w):
        return op(n)({"a": a, "b": b, "k": k}, sizes=sizes, fn=lambda r: fn(r, w), chunk_size=4)

    def ref(n, a, b, w):
        return dense(n, fn({"a": a, "b": b, "k": k}, w), part.ids, part.num_segments)

    pairs = _vjps(ALL, lib, ref, (jnp.asarray(a), jnp.asarray(b), jnp.asarray(w)), rng)
    _assert_grads_match(pairs, data_scale(a @ w))


@pytest.mark.slow
def test_jit_vmap_grad(rng):
    part = random_partition(rng, num_segments=8)
    batches = [sample(rng, DIFFERENTIABLE, part.ids, part.num_segments) for _ in range(3)]
    xs = {n: np.stack([b[n] for b in batches]) for n in DIFFERENTIABLE}
    sizes = part.sizes.tolist()
    cts = {
        n: jnp.asarray(
            rng.standard_normal((part.n if n in NORMALIZERS else part.num_segments,)).astype(F32)
        )
        for n in DIFFERENTIABLE
    }

    def loss(f):
        return lambda x, ct: jnp.sum(ct * jnp.nan_to_num(f(x), nan=0.0, posinf=0.0, neginf=0.0))

    def lib(n, xs):
        f = loss(lambda x: op(n)(x, sizes=sizes, chunk_size=5))
        return jax.vmap(jax.grad(f), in_axes=(0, None))(xs[n], cts[n])

    def ref(n, xs):
        f = loss(lambda x: dense(n, x, part.ids, part.num_segments))
        return jax.vmap(jax.grad(f), in_axes=(0, None))(xs[n], cts[n])

    pairs = jit_each(DIFFERENTIABLE, lambda n, xs: (lib(n, xs), ref(n, xs)))(xs)  # one program
    _assert_grads_match(pairs, {n: data_scale(x) for n, x in xs.items()})


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_max_min_gradient_splits_ties(chunk_size, rng):
    """Ties across tiles and steps share the gradient evenly, like jnp.max."""
    names = ["max", "min"]
    sizes = [7, 1, 0, 9, 4]
    part = Partition(np.asarray(sizes))
    x = rng.integers(-2, 3, size=part.n).astype(F32)  # many ties
    tied = part.offsets[3] + np.array([0, 4, 8])
    pairs = _vjps(
        names,
        lambda n, x: op(n)(x, sizes=sizes, chunk_size=chunk_size),
        lambda n, x: dense(n, x, part.ids, part.num_segments),
        (jnp.asarray(x),),
        rng,
    )
    _assert_grads_match(pairs, 1.0)
    for name, extreme in (("max", 5.0), ("min", -5.0)):
        x[tied] = extreme  # a 3-way tie in segment 3
        g = jax.grad(lambda x, name=name: op(name)(x, sizes=sizes, chunk_size=chunk_size)[3])(
            jnp.asarray(x)
        )
        np.testing.assert_array_equal(np.flatnonzero(g), tied)
        np.testing.assert_array_equal(g[tied], np.float32(1 / 3))


@pytest.mark.slow
def test_grads_finite_with_empty_segments_and_neginf(rng):
    """Nonzero cotangents on empty segments, -inf entries, an all -inf segment: no NaN."""
    sizes = [0, 5, 0, 6, 1, 0, 4]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    some_inf = x.copy()
    some_inf[part.offsets[1] + np.array([0, 2])] = -np.inf
    some_inf[part.offsets[3] + 5] = -np.inf
    all_inf = some_inf.copy()
    all_inf[part.offsets[6] : part.offsets[7]] = -np.inf  # all -inf segment (softmax: NaN)
    cases = {(n, "some -inf"): some_inf for n in NORMALIZERS}
    cases |= {(n, "an all -inf segment"): all_inf for n in REDUCTIONS}
    pairs = _vjps(  # both data in one program
        list(cases),
        lambda n, x: op(n[0])(x, sizes=sizes, chunk_size=3),
        lambda n, x: dense(n[0], x, part.ids, part.num_segments),
        {n: (jnp.asarray(data),) for n, data in cases.items()},
        rng,
    )
    _assert_grads_match(pairs, {n: data_scale(data) for n, data in cases.items()})


@pytest.mark.slow
def test_vjp_accepts_numpy_cotangent():
    """Regression: a NumPy cotangent (as jax.test_util.check_grads passes) used to fail."""
    x = jnp.arange(4.0, dtype=jnp.float32)

    def check(name):
        out, pull = jax.vjp(lambda x: op(name)(x, sizes=[1, 3]), x)
        (g,) = pull(np.ones(out.shape, np.float32))
        (want,) = pull(jnp.ones(out.shape, jnp.float32))
        np.testing.assert_array_equal(g, want)

    check_each(["sum", "logsumexp", "softmax"], check)  # fold and normalize VJPs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prod", "var", "std"])
def test_gradient_against_dense(rng, name):
    """Reverse and forward mode against dense jnp, with repeated unsorted ids (and zeros for
    prod: one zero in a segment, two in another)."""
    part = random_partition(rng, num_segments=8, max_size=6)
    ids, x = permute_rows(rng, part.ids, normal_rows(rng, part.n, (2,), scale=0.5, shift=1.0))
    if name == "prod":
        big = [k for k in range(8) if np.sum(ids == k) >= 3]
        x[np.flatnonzero(ids == big[0])[0]] = 0.0
        x[np.flatnonzero(ids == big[1])[:2]] = 0.0
    w = jnp.asarray(rng.standard_normal((8, 2)), jnp.float32)
    f = getattr(foldax, f"segment_{name}")

    def ours(x):
        out = f(x, jnp.asarray(ids), 8, chunk_size=3)
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) * w)

    def dense_loss(x):
        d = dense(name, x, ids, 8)
        return jnp.sum(jnp.where(jnp.isnan(d), 0.0, d) * w)

    x = jnp.asarray(x)
    t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    grad, grad_dense, jvp, jvp_dense = jax.jit(  # one program: one compilation
        lambda x, t: (
            jax.grad(ours)(x),
            jax.grad(dense_loss)(x),
            jax.jvp(ours, (x,), (t,))[1],
            jax.jvp(dense_loss, (x,), (t,))[1],
        )
    )(x, t)
    assert_allclose(grad, grad_dense, dtype=np.float32, scale=4)
    assert_allclose(jvp, jvp_dense, dtype=np.float32, scale=10)


# ----------------------------------------------------------------------------------------------
# Against finite differences and closed forms


def _select(out, keep):
    return jnp.take(out, jnp.asarray(keep), axis=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_check_grads_float64(name, seed):
    """Reverse-mode gradients against float64 finite differences (jax.test_util.check_grads)."""
    rng = np.random.default_rng(seed)
    part = random_partition(rng, num_segments=6, max_size=9)
    x = SEGMENT[name].domain(rng.standard_normal(part.n))  # continuous: no ties for max/min
    sizes = part.sizes.tolist()
    # Outputs of empty segments are constants (NaN/inf): leave them out of the check.
    keep = np.arange(part.n) if name in NORMALIZERS else np.flatnonzero(part.sizes > 0)
    t = tol(np.float64)
    with jax.enable_x64(True):
        xj = jnp.asarray(x)
        f = jax.jit(lambda x: _select(op(name)(x, sizes=sizes, chunk_size=4), keep))
        assert f(xj).dtype == jnp.float64
        assert np.isfinite(f(xj)).all()  # check_grads passes NaNs matching NaNs
        check_grads(
            f, (xj,), order=1, modes=["rev"], eps=t["fd_eps"], atol=t["fd_tol"], rtol=t["fd_tol"]
        )


@pytest.mark.slow
def test_check_grads_float32_params(rng):
    """Gradients wrt the closed-over params of fn, float32 finite differences."""
    part = random_partition(rng, num_segments=5, max_size=8)
    x = jnp.asarray(rng.standard_normal((part.n, 3)).astype(F32))
    w = jnp.asarray(rng.standard_normal((3, 2)).astype(F32))
    sizes = part.sizes.tolist()
    t = tol(F32)
    for name in ("logsumexp", "max", "log_softmax"):
        keep = np.arange(part.n) if name in NORMALIZERS else np.flatnonzero(part.sizes > 0)

        def f(w, name=name, keep=keep):
            out = op(name)(x, sizes=sizes, fn=lambda rows: rows @ w, chunk_size=4)
            return _select(out, keep)

        assert np.isfinite(jax.jit(f)(w)).all()  # check_grads passes NaNs matching NaNs
        check_grads(
            jax.jit(f),
            (w,),
            order=1,
            modes=["rev"],
            eps=t["fd_eps"],
            atol=t["fd_tol"],
            rtol=t["fd_tol"],
        )


@pytest.mark.parametrize("name", ["var", "std"])
def test_var_gradient_at_huge_mean(rng, name):
    """The gradient at values near 2e19 (mean squared past float32): ``2 (x - mean) / n`` (std:
    ``(x - mean) / (n std)``), against float64."""
    x = (2e19 + 1e18 * rng.standard_normal(12)).astype(np.float32)
    sizes = [5, 7]
    ids = np.repeat([0, 1], sizes)
    w = np.array([0.5, -1.5])
    f = getattr(foldax, f"segment_{name}")
    got = jax.grad(lambda v: jnp.sum(f(v, sizes=sizes, chunk_size=2) * jnp.asarray(w, v.dtype)))(
        jnp.asarray(x)
    )
    xf = x.astype(np.float64)
    want = np.empty(12)
    for k in range(2):
        seg = xf[ids == k]
        d = seg - seg.mean()
        want[ids == k] = w[k] * (2 * d / len(seg) if name == "var" else d / (len(seg) * seg.std()))
    assert_allclose(got, want, dtype=np.float32, scale=float(np.abs(want).max()))
