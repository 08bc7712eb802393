"""Values of every foldax.segment_* against the registry's float64 NumPy/SciPy references: every
partition form, chunk sizes, trailing features, ``fn`` and pytree data, integer, half-precision,
bool and complex data, and what is particular to prod, var / std (ddof, large means) and argmax /
argmin (ties, NaN).

Edge cases (empty segments, NaN / inf, dropped ids, huge values) are in test_segment_edges.py;
the transformations in test_vmap.py, test_jvp.py, test_grad.py and test_hessian.py. Most tests
evaluate every reduction inside one ``jax.jit`` (compiling dominates the run time) and report
every reduction that fails (``check_each``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL,
    FORMS,
    INT_OK,
    MORE,
    NORMALIZERS,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    dense,
    expect,
    expect_each,
    jit_each,
    normal_rows,
    op,
    permute_rows,
    random_partition,
    reference,
    segment_data,
    tol,
    weights,
)

import foldax

F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Values against the reference, every partition form


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_matches_reference(form, rng):
    part = random_partition(rng, num_segments=12, max_size=20)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(ALL, lambda n, x: apply(n, x, ids, s, form, chunk_size=7))(jnp.asarray(x))
    assert all(o.dtype == jnp.float32 for o in outs.values())
    expect_each(outs, x, ids, s, err_msg=f"sizes={part.sizes.tolist()}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chunk_size", "form"),
    [
        (1, "sizes"),
        (64, "offsets"),
        (None, "sizes"),
        (3, "unsorted_ids"),
        (64, "jit_unsorted_ids"),
        (None, "jit_sizes"),
    ],
)
def test_chunk_sizes(chunk_size, form, rng):
    """Many steps, segments crossing steps, N not a multiple of the chunk, the default chunk."""
    part = random_partition(rng, num_segments=20, max_size=40)
    if chunk_size and chunk_size > 1 and part.n % chunk_size == 0:  # N not a multiple of it
        part = Partition(part.sizes + (np.arange(20) == np.argmax(part.sizes)))
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    f = jit_each(ALL, lambda n, x: apply(n, x, ids, s, form, chunk_size=chunk_size))
    expect_each(f(jnp.asarray(x)), x, ids, s)


@pytest.mark.slow
def test_one_long_segment_many_steps(rng):
    """One segment spanning hundreds of steps: the running state is merged many times."""
    x = rng.standard_normal(1000).astype(F32)
    x[::7] -= 1000
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=[1000], chunk_size=3))(jnp.asarray(x))
    expect_each(outs, x, np.zeros(1000), 1)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sizes", "jit_unsorted_ids"])
def test_trailing_feature_dims(form, rng):
    part = random_partition(rng, num_segments=9)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(3,))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(ALL, lambda n, x: apply(n, x, ids, s, form, chunk_size=7))(jnp.asarray(x))
    for n, out in outs.items():
        assert out.shape == (x.shape if n in NORMALIZERS else (s, 3)), n
    expect_each(outs, x, ids, s)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sorted_ids"])
def test_fn_closing_over_params(form, rng):
    part = random_partition(rng, num_segments=9)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(5,))
    w = weights(rng, (5, 3))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments

    def call(n, x, w):
        return apply(n, x, ids, s, form, chunk_size=7, fn=lambda rows: rows @ w)

    outs = jit_each(ALL, call)(jnp.asarray(x), jnp.asarray(w))
    expect_each(outs, x.astype(np.float64) @ w.astype(np.float64), ids, s)


@pytest.mark.slow
def test_pytree_data_with_fn(rng):
    part = random_partition(rng, num_segments=9)
    data = {
        "a": segment_data(rng, part.ids, part.num_segments, feature_shape=(4,)),
        "b": rng.standard_normal(part.n).astype(F32),
    }
    w = weights(rng, (4, 2))

    def call(n, data, w):
        return apply(
            n,
            data,
            part.ids,
            part.num_segments,
            "sizes",
            fn=lambda rows: rows["a"] @ w + rows["b"][:, None],
        )

    outs = jit_each(ALL, call)(data, jnp.asarray(w))
    values = data["a"].astype(np.float64) @ w.astype(np.float64) + data["b"][:, None]
    expect_each(outs, values, part.ids, part.num_segments)


@pytest.mark.slow
def test_eager_matches_jit(rng):
    """Outside jit (each call compiles its own loop) the results are the same."""
    part = random_partition(rng, num_segments=5, max_size=6)
    x = segment_data(rng, part.ids, part.num_segments)
    for name in ("sum", "logsumexp", "softmax"):
        out = op(name)(jnp.asarray(x), sizes=part.sizes.tolist(), chunk_size=4)
        expect(name, out, x, part.ids, part.num_segments)


# ----------------------------------------------------------------------------------------------
# Integer, half-precision, bool and complex data


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sorted_ids"])
def test_int_data(form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x = rng.integers(-100, 100, size=(part.n, 2)).astype(np.int32)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(INT_OK, lambda n, x: apply(n, x, ids, s, form, chunk_size=3))(jnp.asarray(x))
    jax_ops = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min}

    def check(name):
        assert outs[name].dtype == jnp.int32
        np.testing.assert_array_equal(outs[name], reference(name, x, ids, s))
        np.testing.assert_array_equal(outs[name], jax_ops[name](x, ids, s))

    check_each(INT_OK, check)


@pytest.mark.parametrize(
    "name",
    [
        "max",
        "min",
        "sum",
    ],
)
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16])
def test_small_int_dtypes(name, dtype, rng):
    part = random_partition(rng, num_segments=6, max_size=8)
    x = rng.integers(0, 10, size=part.n).astype(dtype)
    out = op(name)(jnp.asarray(x), sizes=part.sizes.tolist(), chunk_size=3)
    jax_ops = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min}
    want = jax_ops[name](jnp.asarray(x), jnp.asarray(part.ids), part.num_segments)
    assert out.dtype == want.dtype == dtype
    np.testing.assert_array_equal(out, want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision(dtype, rng):
    """The result keeps the (low) precision of the data and is accurate to it."""
    part = random_partition(rng, num_segments=8, max_size=12)
    x = jnp.asarray(3 * rng.standard_normal(part.n), dtype)
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=part.sizes.tolist(), chunk_size=4))(x)
    values = np.asarray(x.astype(jnp.float32))

    def check(name):
        assert outs[name].dtype == dtype
        ref = reference(name, values, part.ids, part.num_segments)
        assert_allclose(outs[name], ref, dtype=dtype, scale=data_scale(values))

    check_each(ALL, check)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_mean_does_not_overflow(dtype):
    """A float16 sum of 70000 ones overflows (max 65504); the mean accumulates in float32."""
    x = jnp.ones(70_000, dtype)
    out = foldax.segment_mean(x, sizes=[3, 69_997])
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), [1.0, 1.0])
    g = jax.grad(lambda x: foldax.segment_mean(x, sizes=[3, 69_997]).astype(jnp.float32).sum())(x)
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g[:3], np.float32), 1 / 3, rtol=tol(dtype)["rtol"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_accumulates_in_float32(rng, dtype):
    part = random_partition(rng, num_segments=5, max_size=400)
    x = normal_rows(rng, part.n, shift=3.0).astype(dtype)
    for name in ("var", "std", "prod"):
        xx = x if name != "prod" else (jnp.ones_like(x) + (x - 3) / 100).astype(dtype)
        got = getattr(foldax, f"segment_{name}")(jnp.asarray(xx), sizes=list(map(int, part.sizes)))
        assert got.dtype == dtype
        want = reference(name, np.asarray(xx, np.float64), part.ids, 5)
        assert_allclose(got, want, dtype=dtype, err_msg=name)


@pytest.mark.slow
def test_bool_max_min_and_complex_mean(rng):
    b = rng.random(30) > 0.5
    ids = rng.integers(-1, 6, size=30).astype(np.int32)
    for name in ("max", "min"):
        got = getattr(foldax, f"segment_{name}")(jnp.asarray(b), jnp.asarray(ids), 6)
        want = getattr(jax.ops, f"segment_{name}")(jnp.asarray(b), jnp.asarray(ids), 6)
        assert got.dtype == jnp.bool_
        np.testing.assert_array_equal(got, want)
    z = (rng.standard_normal(30) + 1j * rng.standard_normal(30)).astype(np.complex64)
    got = foldax.segment_mean(jnp.asarray(z), jnp.asarray(ids), 6, chunk_size=4)
    want = reference("mean", z, ids, 6)
    want = np.where(np.isnan(want), np.nan + 1j * np.nan, want)
    assert got.dtype == jnp.complex64
    assert_allclose(got, want, dtype=np.float32)
    # the gradient of a real loss of the complex mean, against dense jnp
    loss = lambda m: jnp.sum(jnp.abs(jnp.where(jnp.isnan(m), 0, m)) ** 2)  # noqa: E731
    g = jax.grad(lambda z: loss(foldax.segment_mean(z, jnp.asarray(ids), 6)))(jnp.asarray(z))
    gd = jax.grad(lambda z: loss(dense("mean", z, ids, 6)))(jnp.asarray(z))
    assert_allclose(g, gd, dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# prod, var / std, argmax / argmin


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_more_values_against_float64(rng, form):
    """prod, var, std, argmax, argmin with trailing features, empty and size-1 segments, in
    every form (the jit forms in one program, the others eagerly, as users call them)."""
    part = random_partition(rng, num_segments=9)
    x = normal_rows(rng, part.n, (2,), scale=0.6)
    xs = {n: x + np.float32(0.3) if n == "prod" else x for n in MORE}
    ids = part.ids
    if form.endswith("unsorted_ids"):
        ids, xs = permute_rows(rng, ids, xs)
    s = part.num_segments

    def call(name, xs):
        return apply(name, xs[name], ids, s, form, chunk_size=5)

    xs = {n: jnp.asarray(v) for n, v in xs.items()}
    eager = not form.startswith("jit_")
    outs = {n: call(n, xs) for n in MORE} if eager else jit_each(MORE, call)(xs)
    check_each(MORE, lambda n: expect(n, outs[n], np.asarray(xs[n]), ids, s, scale=1.0))


@pytest.mark.parametrize("ddof", [0, 1, 2])
def test_var_ddof_and_small_segments(rng, ddof):
    ids = np.array([0, 1, 1, 2, 2, 2, 4, 4, 4, 4], np.int32)  # sizes 1, 2, 3, 0, 4
    x = normal_rows(rng, len(ids))
    for name, f in (("var", foldax.segment_var), ("std", foldax.segment_std)):
        got = f(jnp.asarray(x), jnp.asarray(ids), 5, ddof=ddof, chunk_size=3)
        assert_allclose(got, reference(name, x, ids, 5, ddof=ddof), dtype=np.float32)


@pytest.mark.slow
def test_var_is_stable_at_large_mean(rng):
    """Mean 1e4, unit spread: float32 within 1e-3 relative of float64 (E[x^2]-E[x]^2 is off by
    ~100%); measured ~1e-6."""
    part = random_partition(rng, num_segments=6, max_size=3000)
    x = normal_rows(rng, part.n, shift=1e4)
    want = reference("var", x, part.ids, 6)
    for kw in ({"sizes": [int(s) for s in part.sizes]}, {}):
        args = (jnp.asarray(part.ids), 6) if not kw else ()
        got = np.asarray(foldax.segment_var(jnp.asarray(x), *args, **kw))
        ok = np.isfinite(want) & (want > 0)
        rel = np.abs(got[ok] - want[ok]) / want[ok]
        assert rel.max() < 1e-3, rel.max()
    rows = jnp.asarray(rng.permutation(part.n))
    got = np.asarray(foldax.segment_var(jnp.asarray(x)[rows], jnp.asarray(part.ids)[rows], 6))
    assert (np.abs(got[ok] - want[ok]) / want[ok]).max() < 1e-3


@pytest.mark.slow
def test_argmax_ties_nan_and_ints():
    x = jnp.array([3.0, 1.0, 3.0, np.nan, 2.0, np.nan, 5.0, 5.0])
    ids = jnp.array([0, 0, 0, 1, 1, 1, 3, 3])
    np.testing.assert_array_equal(foldax.segment_argmax(x, ids, 4), [0, 3, -1, 6])
    np.testing.assert_array_equal(foldax.segment_argmin(x, ids, 4), [1, 3, -1, 6])
    np.testing.assert_array_equal(
        foldax.segment_argmax(x, sizes=[3, 3, 0, 2], chunk_size=2), [0, 3, -1, 6]
    )
    xi = jnp.array([4, 9, 9, -2], jnp.int32)
    np.testing.assert_array_equal(foldax.segment_argmax(xi, jnp.array([1, 0, 0, 1]), 2), [1, 0])
    np.testing.assert_array_equal(foldax.segment_argmin(xi, jnp.array([1, 0, 0, 1]), 2), [1, 3])
    assert foldax.segment_argmax(jnp.zeros((0,)), jnp.zeros((0,), jnp.int32), 2).tolist() == [
        -1,
        -1,
    ]
