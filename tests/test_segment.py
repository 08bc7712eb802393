"""foldax.segment_* against float64 NumPy/SciPy references and dense jnp gradients.

Most tests evaluate every reduction inside one ``jax.jit`` (compiling dominates the run time) and
report every reduction that fails (``check_each``).
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
    NORMALIZERS,
    REDUCTIONS,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    dense,
    jit_each,
    op,
    permute_rows,
    random_partition,
    reference,
    segment_data,
    tol,
)
from jax.test_util import check_grads

import foldax

F32 = np.float32


def _expect(name, out, values, ids, num_segments, *, err_msg=""):
    """``out`` against the float64 reference computed from ``values`` (= fn(data)), in float32."""
    ref = reference(name, values, ids, num_segments)
    assert_allclose(out, ref, dtype=F32, scale=data_scale(values), err_msg=err_msg)


def _expect_all(outs, values, ids, num_segments, err_msg=""):
    check_each(outs, lambda n: _expect(n, outs[n], values, ids, num_segments, err_msg=err_msg))


def _weights(rng, shape):
    return (rng.standard_normal(shape) / shape[-2]).astype(F32)


def _fn_inputs(rng, ids, num_segments, features=5, outputs=3):
    """Rows ``x`` and params ``w`` such that ``x @ w`` has per-segment scales -1000 / 0 / +1000.

    The shift comes from the last column of ``x`` (-1, 0 or 1 per segment) times the last row of
    ``w`` (1000), not from ``x`` being ~1000: the gradient wrt ``w`` is then a well-conditioned
    sum (with ``|x| ~ 1000`` it would cancel to ~1e-3 of its terms, beyond float32).
    """
    x = rng.standard_normal((len(ids), features)).astype(F32)
    x[:, -1] = rng.choice([-1.0, 0.0, 1.0], size=num_segments + 1)[np.clip(ids, 0, num_segments)]
    w = _weights(rng, (features, outputs))
    w[-1] = 1000.0
    return x, w


# ----------------------------------------------------------------------------------------------
# Values against the reference, every partition form


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
    _expect_all(outs, x, ids, s, err_msg=f"sizes={part.sizes.tolist()}")


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
    _expect_all(f(jnp.asarray(x)), x, ids, s)


def test_one_long_segment_many_steps(rng):
    """One segment spanning hundreds of steps: the running state is merged many times."""
    x = rng.standard_normal(1000).astype(F32)
    x[::7] -= 1000
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=[1000], chunk_size=3))(jnp.asarray(x))
    _expect_all(outs, x, np.zeros(1000), 1)


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
    _expect_all(outs, x, ids, s)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sorted_ids"])
def test_fn_closing_over_params(form, rng):
    part = random_partition(rng, num_segments=9)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(5,))
    w = _weights(rng, (5, 3))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments

    def call(n, x, w):
        return apply(n, x, ids, s, form, chunk_size=7, fn=lambda rows: rows @ w)

    outs = jit_each(ALL, call)(jnp.asarray(x), jnp.asarray(w))
    _expect_all(outs, x.astype(np.float64) @ w.astype(np.float64), ids, s)


def test_pytree_data_with_fn(rng):
    part = random_partition(rng, num_segments=9)
    data = {
        "a": segment_data(rng, part.ids, part.num_segments, feature_shape=(4,)),
        "b": rng.standard_normal(part.n).astype(F32),
    }
    w = _weights(rng, (4, 2))

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
    _expect_all(outs, values, part.ids, part.num_segments)


def test_eager_matches_jit(rng):
    """Outside jit (each call compiles its own loop) the results are the same."""
    part = random_partition(rng, num_segments=5, max_size=6)
    x = segment_data(rng, part.ids, part.num_segments)
    for name in ("sum", "logsumexp", "softmax"):
        out = op(name)(jnp.asarray(x), sizes=part.sizes.tolist(), chunk_size=4)
        _expect(name, out, x, part.ids, part.num_segments)


# ----------------------------------------------------------------------------------------------
# Edge cases

IDENTITY = {
    "sum": 0.0,
    "mean": np.nan,
    "max": -np.inf,
    "min": np.inf,
    "logsumexp": -np.inf,
    "logmeanexp": np.nan,
}


@pytest.mark.parametrize(
    "sizes", [[0, 1, 0, 0, 3, 0, 1], [0, 0, 5, 0], [1]], ids=["mixed", "one_nonempty", "single_row"]
)
def test_empty_and_singleton_segments(sizes, rng):
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=sizes, chunk_size=2))(jnp.asarray(x))
    _expect_all(outs, x, part.ids, part.num_segments)
    empty, one = part.sizes == 0, np.flatnonzero(part.sizes == 1)

    def exact(name):
        out = np.asarray(outs[name])
        if name in NORMALIZERS:
            want = 0.0 if name == "log_softmax" else 1.0
            np.testing.assert_array_equal(out[part.offsets[one]], want)
            return
        np.testing.assert_array_equal(out[empty], IDENTITY[name])
        # every reduction of a single row is that row
        assert_allclose(out[one], x[part.offsets[one]], dtype=F32, scale=data_scale(x))

    check_each(ALL, exact)


@pytest.mark.parametrize("name", ALL)
def test_no_rows(name):
    """N = 0: every segment is empty (sizes, offsets, ids); normalizers return shape (0, ...)."""
    x = jnp.zeros((0, 3), jnp.float32)
    outs = [
        op(name)(x, sizes=[0, 0, 0]),
        op(name)(x, offsets=[0, 0, 0, 0]),
        op(name)(x, jnp.zeros((0,), jnp.int32), 3),
        jax.jit(lambda x, s: op(name)(x, sizes=s))(x, jnp.zeros(3, jnp.int32)),
    ]
    for out in outs:
        if name in NORMALIZERS:
            assert out.shape == (0, 3)
        else:
            assert out.shape == (3, 3)
            np.testing.assert_array_equal(out, IDENTITY[name])


@pytest.mark.parametrize("name", ALL)
def test_zero_segments(name):
    x = jnp.arange(4.0, dtype=jnp.float32)
    out = op(name)(x, jnp.array([0, 1, -1, 2]), 0)
    if name in NORMALIZERS:  # every row is in no segment
        assert out.shape == (4,)
        assert np.all(np.isnan(out))
    else:
        assert out.shape == (0,)
    assert op(name)(jnp.zeros((0,), jnp.float32), offsets=[0]).shape == (0,)
    assert op(name)(jnp.zeros((0,), jnp.float32), sizes=jnp.zeros((0,), jnp.int32)).shape == (0,)


@pytest.mark.parametrize("name", ["sum", "logsumexp", "softmax"])
def test_zero_segments_empty_sizes_list(name):
    assert op(name)(jnp.zeros((0,), jnp.float32), sizes=[]).shape == (0,)


def test_num_segments_inferred_from_static_ids(rng):
    """Without num_segments, concrete ids give max(ids) + 1 segments (negative ids dropped)."""
    ids = np.array([2, 0, -1, 2, 4, 0, 4], np.int32)
    x = segment_data(rng, ids, 5)
    for name in ("sum", "logsumexp", "softmax"):
        _expect(name, op(name)(jnp.asarray(x), jnp.asarray(ids)), x, ids, 5)


@pytest.mark.parametrize("chunk_size", [7, None])
def test_nan_stays_in_its_segment(chunk_size, rng):
    """The default chunk makes steps wide (XLA:CPU's wide reduce-max used to drop the NaN)."""
    sizes = [3, 10, 0, 1, 20, 5]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    x[part.offsets[1] + 4] = np.nan  # segment 1
    x[part.offsets[4] + 15] = np.nan  # segment 4, a later step
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=sizes, chunk_size=chunk_size))(jnp.asarray(x))

    def check(name):
        out = np.asarray(outs[name])
        bad = np.isin(part.ids, [1, 4]) if name in NORMALIZERS else np.isin(np.arange(6), [1, 4])
        assert np.all(np.isnan(out[bad])), out
        _expect(name, out, x, part.ids, part.num_segments)

    check_each(ALL, check)


def test_nan_in_wide_max_min():
    """Regression: segment_max([1, nan, 2, 3, 4], sizes=[3, 2]) with the default chunk."""
    x = jnp.array([1.0, np.nan, 2.0, 3.0, 4.0], jnp.float32)
    np.testing.assert_array_equal(op("max")(x, sizes=[3, 2]), [np.nan, 4.0])
    np.testing.assert_array_equal(op("min")(x, sizes=[3, 2]), [np.nan, 3.0])


def test_posinf(rng):
    names = ["sum", "max", "logsumexp", "logmeanexp"]
    sizes = [4, 9, 3]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, 3)
    x[part.offsets[1] + 7] = np.inf
    outs = jit_each(names, lambda n, x: op(n)(x, sizes=sizes, chunk_size=3))(jnp.asarray(x))

    def check(name):
        assert outs[name][1] == np.inf
        _expect(name, outs[name], x, part.ids, 3)

    check_each(names, check)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
def test_neginf_entries(form, rng):
    """-inf entries are ignored by log-sum-exp; an all -inf segment has log-sum-exp -inf."""
    sizes = [5, 4, 0, 7, 1, 3]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    x[part.offsets[0] + np.array([1, 3])] = -np.inf
    x[part.offsets[1] : part.offsets[2]] = -np.inf  # all -inf segment
    x[part.offsets[3] + 6] = -np.inf
    ids = part.ids
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(ALL, lambda n, x: apply(n, x, ids, s, form, chunk_size=3))(jnp.asarray(x))

    def check(name):
        out = np.asarray(outs[name])
        if name in ("logsumexp", "logmeanexp", "max"):
            assert out[1] == -np.inf
            assert np.all(np.isfinite(out[[0, 3, 4, 5]]))
        _expect(name, out, x, ids, s)

    check_each(ALL, check)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
def test_very_negative_segments(form, rng):
    """Regression: a segment whose max is ~-1000 (exp underflows) next to others."""
    sizes = [6, 0, 9, 1, 12, 4]
    part = Partition(np.asarray(sizes))
    x = rng.standard_normal(part.n).astype(F32)
    x += np.repeat([-1000, 0, -1000, -1000, 1000, 0], sizes).astype(F32)
    ids = part.ids
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(ALL, lambda n, x: apply(n, x, ids, s, form, chunk_size=4))(jnp.asarray(x))
    _expect_all(outs, x, ids, s)
    # eager too: the one-liner of the original report
    assert_allclose(
        op("logsumexp")(jnp.array([-1000.0, -1001.0]), sizes=[2]),
        [-1000 + np.log1p(np.exp(-1.0))],
        dtype=F32,
        scale=1000,
    )


@pytest.mark.parametrize(
    "form", ["unsorted_ids", "sorted_ids", "jit_sorted_ids", "jit_unsorted_ids"]
)
def test_out_of_range_ids_dropped(form, rng):
    """Ids < 0 or >= num_segments are dropped; their rows are NaN for softmax/log_softmax."""
    num_segments = 5
    ids = rng.integers(-3, num_segments + 3, size=40).astype(np.int32)
    ids[:3] = [-5, -1, 2]
    ids[-2:] = [num_segments, num_segments + 7]
    ids = np.sort(ids)
    x = segment_data(rng, ids, num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    f = jit_each(ALL, lambda n, x: apply(n, x, ids, num_segments, form, chunk_size=4))
    _expect_all(f(jnp.asarray(x)), x, ids, num_segments)
    # eager, the original repro of the sorted case
    out = op("softmax")(jnp.arange(5.0, dtype=jnp.float32), jnp.array([-1, 0, 0, 1, 5]), 2)
    assert np.isnan(out[0]) and np.isnan(out[4]) and out[3] == 1.0


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


def test_all_ids_out_of_range(rng):
    x = rng.standard_normal(6).astype(F32)
    cases = [
        (np.array([-2, -1, -1, -1, -1, -1]), "sorted_ids"),
        (np.array([3, 3, 4, 5, 6, 7]), "jit_sorted_ids"),
        (np.array([5, -1, 3, 4, -2, 9]), "jit_unsorted_ids"),
    ]
    for ids, form in cases:
        outs = jit_each(ALL, lambda n, x, ids=ids, form=form: apply(n, x, ids, 3, form))(
            jnp.asarray(x)
        )
        _expect_all(outs, x, ids, 3, err_msg=f"ids={ids} {form}")


@pytest.mark.parametrize(
    ("form", "chunk_size"),
    [("sizes", None), ("jit_sizes", 64), ("jit_offsets", None), ("jit_sorted_ids", 64)],
)
def test_large_tiles(form, chunk_size, rng):
    """Few long segments: tiles of many rows, also with traced sizes (whose tile height is
    chosen from N and S only), partial last tiles and clamped reads at the end."""
    sizes = [700, 0, 1, 1299, 3]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    s = part.num_segments
    f = jit_each(ALL, lambda n, x: apply(n, x, part.ids, s, form, chunk_size=chunk_size))
    _expect_all(f(jnp.asarray(x)), x, part.ids, s)


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


# ----------------------------------------------------------------------------------------------
# vmap / jit


def test_vmap_over_data(rng):
    part = random_partition(rng, num_segments=8)
    xs = np.stack([segment_data(rng, part.ids, part.num_segments) for _ in range(3)])
    sizes = part.sizes.tolist()
    outs = jit_each(ALL, lambda n, x: jax.vmap(lambda r: op(n)(r, sizes=sizes, chunk_size=7))(x))(
        jnp.asarray(xs)
    )
    for b in range(3):
        _expect_all(
            {n: o[b] for n, o in outs.items()},
            xs[b],
            part.ids,
            part.num_segments,
            err_msg=f"batch {b}",
        )


def test_nested_vmap(rng):
    part = random_partition(rng, num_segments=6)
    ids, xs = permute_rows(rng, part.ids, segment_data(rng, part.ids, 6, feature_shape=(2, 3)))
    xs = np.moveaxis(xs, 0, -1)  # (2, 3, N)
    s = part.num_segments

    def call(n, x):
        idsj = jnp.asarray(ids)
        return jax.vmap(jax.vmap(lambda r: op(n)(r, idsj, s, chunk_size=5)))(x)

    outs = jit_each(ALL, call)(jnp.asarray(xs))
    for a in range(2):
        for b in range(3):
            _expect_all({n: o[a, b] for n, o in outs.items()}, xs[a, b], ids, s)


def test_vmap_over_closed_over_params(rng):
    part = random_partition(rng, num_segments=7)
    x = segment_data(rng, part.ids, part.num_segments, feature_shape=(5,))
    ws = _weights(rng, (4, 5, 2))
    sizes = part.sizes.tolist()

    def call(n, x, ws):
        return jax.vmap(lambda w: op(n)(x, sizes=sizes, fn=lambda rows: rows @ w, chunk_size=6))(ws)

    outs = jit_each(ALL, call)(jnp.asarray(x), jnp.asarray(ws))
    for b in range(4):
        values = x.astype(np.float64) @ ws[b].astype(np.float64)
        _expect_all({n: o[b] for n, o in outs.items()}, values, part.ids, part.num_segments)


def test_vmap_over_traced_sizes(rng):
    """A batch of different partitions of the same N (the plan is built under vmap)."""
    n, s = 30, 5
    parts = [rng.multinomial(n, np.ones(s) / s) for _ in range(3)]
    parts[0][1] = 0
    parts[0][0] = n - parts[0][2:].sum()
    x = (rng.standard_normal((3, n)) + rng.choice([-1000.0, 0.0, 1000.0], size=(3, 1))).astype(F32)
    f = jit_each(
        ALL, lambda name, x, sz: jax.vmap(lambda x, sz: op(name)(x, sizes=sz, chunk_size=4))(x, sz)
    )
    outs = f(jnp.asarray(x), jnp.asarray(np.stack(parts), jnp.int32))
    for b in range(3):
        p = Partition(np.asarray(parts[b]))
        _expect_all({k: o[b] for k, o in outs.items()}, x[b], p.ids, s)


# ----------------------------------------------------------------------------------------------
# Gradients: foldax's custom VJPs against jax.vjp of the dense reference, same random cotangent


def _vjps(names, foldax_fn, dense_fn, args, rng):
    """``{name: (foldax grads, dense grads)}``, each jitted once for all names."""
    outs = jax.eval_shape(lambda *a: {n: foldax_fn(n, *a) for n in names}, *args)
    cts = {n: jnp.asarray(rng.standard_normal(o.shape).astype(o.dtype)) for n, o in outs.items()}

    def grads(f):
        def run(args, cts):
            return {n: jax.vjp(lambda *a, n=n: f(n, *a), *args)[1](cts[n]) for n in names}

        return jax.jit(run)(args, cts)

    got, want = grads(foldax_fn), grads(dense_fn)
    return {n: (got[n], want[n]) for n in names}


def _assert_grads_match(pairs, scale):
    """No NaN/inf, and equal to the dense gradients. Float32 gradients through exp/log of values
    of magnitude ``scale`` are accurate to ~eps * scale * |grad|: the atol scales with both."""

    def check(name):
        got, want = pairs[name]
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.all(np.isfinite(g)), f"gradient has NaN/inf: {g}"
            assert_allclose(g, w, dtype=g.dtype, scale=scale * data_scale(w))

    check_each(pairs, check)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sizes"])
def test_grad_wrt_data(form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    pairs = _vjps(
        ALL,
        lambda n, x: apply(n, x, ids, s, form, chunk_size=5),
        lambda n, x: dense(n, x, ids, s),
        (jnp.asarray(x),),
        rng,
    )
    _assert_grads_match(pairs, data_scale(x))


@pytest.mark.parametrize("name", ["sum", "mean", "max", "logsumexp", "logmeanexp"])
def test_grad_dropped_rows_minimal(name):
    x = jnp.array([2.0, 1.0, 2.0], jnp.float32)  # the dropped 2. ties segment 1's max
    ids = jnp.array([1, 0, 5])
    g = jax.grad(lambda x: op(name)(x, ids, 2).sum())(x)
    assert g[2] == 0.0, g


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
    x = segment_data(rng, ids, num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    pairs = _vjps(
        ALL,
        lambda n, x: apply(n, x, ids, num_segments, form, chunk_size=4),
        lambda n, x: dense(n, x, ids, num_segments),
        (jnp.asarray(x),),
        rng,
    )
    _assert_grads_match(pairs, data_scale(x))
    dropped = (ids < 0) | (ids >= num_segments)
    check_each(ALL, lambda n: np.testing.assert_array_equal(pairs[n][0][0][dropped], 0.0))


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
def test_grad_wrt_closed_over_params(form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x, w = _fn_inputs(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    pairs = _vjps(
        ALL,
        lambda n, x, w: apply(n, x, ids, s, form, chunk_size=5, fn=lambda rows: rows @ w),
        lambda n, x, w: dense(n, x @ w, ids, s),
        (jnp.asarray(x), jnp.asarray(w)),
        rng,
    )
    _assert_grads_match(pairs, data_scale(x @ w))


def test_grad_pytree_data_with_fn(rng):
    part = random_partition(rng, num_segments=6)
    a, w = _fn_inputs(rng, part.ids, part.num_segments, features=4, outputs=2)
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


def test_jit_vmap_grad(rng):
    part = random_partition(rng, num_segments=8)
    xs = np.stack([segment_data(rng, part.ids, part.num_segments) for _ in range(3)])
    sizes = part.sizes.tolist()
    cts = {
        n: jnp.asarray(
            rng.standard_normal((part.n if n in NORMALIZERS else part.num_segments,)).astype(F32)
        )
        for n in ALL
    }

    def loss(f):
        return lambda x, ct: jnp.sum(ct * jnp.nan_to_num(f(x), nan=0.0, posinf=0.0, neginf=0.0))

    def lib(n, x):
        f = loss(lambda x: op(n)(x, sizes=sizes, chunk_size=5))
        return jax.vmap(jax.grad(f), in_axes=(0, None))(x, cts[n])

    def ref(n, x):
        f = loss(lambda x: dense(n, x, part.ids, part.num_segments))
        return jax.vmap(jax.grad(f), in_axes=(0, None))(x, cts[n])

    got = jit_each(ALL, lib)(jnp.asarray(xs))
    want = jit_each(ALL, ref)(jnp.asarray(xs))
    _assert_grads_match({n: (got[n], want[n]) for n in ALL}, data_scale(xs))


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
    for data, names in ((some_inf, NORMALIZERS), (all_inf, REDUCTIONS)):
        pairs = _vjps(
            names,
            lambda n, x: op(n)(x, sizes=sizes, chunk_size=3),
            lambda n, x: dense(n, x, part.ids, part.num_segments),
            (jnp.asarray(data),),
            rng,
        )
        _assert_grads_match(pairs, data_scale(data))


def _select(out, keep):
    return jnp.take(out, jnp.asarray(keep), axis=0)


@pytest.mark.parametrize("name", ALL)
def test_check_grads_float64(name, seed):
    """Reverse-mode gradients against float64 finite differences (jax.test_util.check_grads)."""
    rng = np.random.default_rng(seed)
    part = random_partition(rng, num_segments=6, max_size=9)
    x = rng.standard_normal(part.n)  # continuous: no ties for max/min
    sizes = part.sizes.tolist()
    # Outputs of empty segments are constants (NaN/inf): leave them out of the check.
    keep = np.arange(part.n) if name in NORMALIZERS else np.flatnonzero(part.sizes > 0)
    t = tol(np.float64)
    with jax.enable_x64(True):
        xj = jnp.asarray(x)
        f = jax.jit(lambda x: _select(op(name)(x, sizes=sizes, chunk_size=4), keep))
        assert f(xj).dtype == jnp.float64
        check_grads(
            f, (xj,), order=1, modes=["rev"], eps=t["fd_eps"], atol=t["fd_tol"], rtol=t["fd_tol"]
        )


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

        check_grads(
            jax.jit(f),
            (w,),
            order=1,
            modes=["rev"],
            eps=t["fd_eps"],
            atol=t["fd_tol"],
            rtol=t["fd_tol"],
        )


def test_vjp_accepts_numpy_cotangent():
    """Regression: a NumPy cotangent (as jax.test_util.check_grads passes) used to fail."""
    x = jnp.arange(4.0, dtype=jnp.float32)

    def check(name):
        out, pull = jax.vjp(lambda x: op(name)(x, sizes=[1, 3]), x)
        (g,) = pull(np.ones(out.shape, np.float32))
        (want,) = pull(jnp.ones(out.shape, jnp.float32))
        np.testing.assert_array_equal(g, want)

    check_each(["sum", "logsumexp", "softmax"], check)  # fold and normalize VJPs


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
