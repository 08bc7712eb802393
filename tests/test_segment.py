"""foldax.segment_* against float64 NumPy/SciPy references and dense jnp gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL,
    ALL_SHIFTS,
    FORMS,
    INT_OK,
    LOG_FAMILY,
    NORMALIZERS,
    REDUCTIONS,
    Partition,
    apply,
    assert_allclose,
    data_scale,
    dense,
    op,
    permute_rows,
    random_partition,
    reference,
    segment_data,
    tol,
)
from jax.test_util import check_grads

F32 = np.float32

# Known bugs (see the xfail reasons for the repros).
BUG_NAN_MAXMIN = (
    "BUG: segment_max/segment_min drop a NaN when the step is large (default chunk_size): "
    "segment_max(jnp.array([1., nan, 2., 3., 4.]), sizes=[3, 2]) gives [2., 4.], expected "
    "[nan, 4.] (chunk_size=4 gives [nan, 4.]). XLA:CPU's wide reduce-max in "
    "_Extremum.reduce does not propagate NaN."
)
BUG_SORTED_OOR_SOFTMAX = (
    "BUG: segment_softmax/log_softmax give 0 instead of NaN for rows with out-of-range ids when "
    "the ids are sorted (tile path): segment_softmax(jnp.arange(5.), jnp.array([-1, 0, 0, 1, 5]), "
    "2) gives [0., .27, .73, 1., 0.], expected [nan, .27, .73, 1., nan]; those rows are in no "
    "tile and never written."
)
BUG_NEG_SCALE = (
    "BUG: log-sum-exp state is NaN when a segment's max is below ~-88 (float32; exp overflow): "
    "segment_logsumexp(jnp.array([-1000., -1001.]), sizes=[2]) gives [nan], expected "
    "[-999.687]; LogSumExp.scatter computes 0 * exp(0 - m) = 0 * inf for the empty initial "
    "state. Same for logmeanexp, softmax, log_softmax."
)
BUG_NUMPY_COTANGENT = (
    "BUG: the VJP of every reduction fails on a NumPy cotangent: "
    "jax.vjp(lambda x: segment_sum(x, sizes=[2]), jnp.ones(2))[1](np.ones(1, np.float32)) "
    "raises TracerArrayConversionError (_fold._take_slots indexes the NumPy array with a "
    "tracer); expected [1., 1.]. jax.test_util.check_grads passes NumPy cotangents."
)


def _weights(rng, shape):
    """Positive weights: rows shifted by +1000 map to large positive values (not to -1000s,
    which would hit BUG_NEG_SCALE)."""
    return (np.abs(rng.standard_normal(shape)) / shape[-2]).astype(F32)


def _check(name, out, values, ids, num_segments, *, dtype=F32, err_msg=""):
    """Compare ``out`` with the float64 reference computed from ``values`` (= fn(data))."""
    ref = reference(name, values, ids, num_segments)
    assert_allclose(out, ref, dtype=dtype, scale=data_scale(values), err_msg=err_msg)


# ----------------------------------------------------------------------------------------------
# Values against the reference, every partition form


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ALL)
def test_matches_reference(name, form, rng):
    part = random_partition(rng, num_segments=12, max_size=20)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    out = apply(name, jnp.asarray(x), ids, part.num_segments, form, chunk_size=7)
    assert out.dtype == jnp.float32
    _check(name, out, x, ids, part.num_segments, err_msg=f"sizes={part.sizes.tolist()}")


@pytest.mark.parametrize(
    ("chunk_size", "form"),
    [(1, "sizes"), (64, "sizes"), (None, "sizes"), (3, "unsorted_ids"), (64, "unsorted_ids"),
     (None, "jit_sizes")],
)
@pytest.mark.parametrize("name", ALL)
def test_chunk_sizes(name, chunk_size, form, rng):
    """Many steps, segments crossing steps, N not a multiple of the chunk, the default chunk."""
    part = random_partition(rng, num_segments=20, max_size=40)
    if chunk_size and chunk_size > 1 and part.n % chunk_size == 0:  # N not a multiple of it
        part = Partition(part.sizes + (np.arange(20) == np.argmax(part.sizes)))
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    out = apply(name, jnp.asarray(x), ids, part.num_segments, form, chunk_size=chunk_size)
    _check(name, out, x, ids, part.num_segments)


def test_one_long_segment_many_steps(rng):
    """One segment spanning hundreds of steps: the running state is combined many times."""
    x = segment_data(rng, np.zeros(1000, np.int32), 1)
    for name in ("sum", "logsumexp", "max"):
        out = op(name)(jnp.asarray(x), sizes=[1000], chunk_size=3)
        _check(name, out, x, np.zeros(1000), 1)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
@pytest.mark.parametrize("name", ALL)
def test_trailing_feature_dims(name, form, rng):
    part = random_partition(rng, num_segments=9)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(3,))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    out = apply(name, jnp.asarray(x), ids, part.num_segments, form, chunk_size=7)
    expected_shape = x.shape if name in NORMALIZERS else (part.num_segments, 3)
    assert out.shape == expected_shape
    _check(name, out, x, ids, part.num_segments)


@pytest.mark.parametrize("form", ["sizes", "jit_unsorted_ids"])
@pytest.mark.parametrize("name", ALL)
def test_fn_closing_over_params(name, form, rng):
    part = random_partition(rng, num_segments=9)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(5,))
    w = _weights(rng, (5, 3))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    wj = jnp.asarray(w)
    out = apply(name, jnp.asarray(x), ids, part.num_segments, form, fn=lambda rows: rows @ wj)
    values = x.astype(np.float64) @ w.astype(np.float64)
    _check(name, out, values, ids, part.num_segments)


@pytest.mark.parametrize("name", ["sum", "max", "logsumexp", "softmax"])
def test_pytree_data_with_fn(name, rng):
    part = random_partition(rng, num_segments=9)
    data = {
        "a": segment_data(rng, part.ids, part.num_segments, feature_shape=(4,)),
        "b": rng.standard_normal(part.n).astype(F32),
    }
    w = _weights(rng, (4, 2))
    wj = jnp.asarray(w)

    def fn(rows):
        return rows["a"] @ wj + rows["b"][:, None]

    out = apply(name, jax.tree.map(jnp.asarray, data), part.ids, part.num_segments, "sizes", fn=fn)
    values = data["a"].astype(np.float64) @ w.astype(np.float64) + data["b"][:, None]
    _check(name, out, values, part.ids, part.num_segments)


# ----------------------------------------------------------------------------------------------
# Edge cases


@pytest.mark.parametrize("sizes", [[0, 1, 0, 0, 3, 0, 1], [0, 0, 5, 0]], ids=["mixed", "one"])
@pytest.mark.parametrize("name", ALL)
def test_empty_and_singleton_segments(name, sizes, rng):
    part = Partition(np.asarray(sizes))
    x = rng.standard_normal(part.n).astype(F32)
    out = op(name)(jnp.asarray(x), sizes=sizes, chunk_size=2)
    _check(name, out, x, part.ids, part.num_segments)
    if name not in NORMALIZERS:
        empty = part.sizes == 0
        identity = {"sum": 0.0, "mean": np.nan, "max": -np.inf, "min": np.inf,
                    "logsumexp": -np.inf, "logmeanexp": np.nan}[name]
        np.testing.assert_array_equal(np.asarray(out)[empty], identity)
        one = np.flatnonzero(part.sizes == 1)
        if name != "sum" and one.size:
            assert_allclose(np.asarray(out)[one], x[part.offsets[one]], dtype=F32)


@pytest.mark.parametrize("name", ALL)
def test_no_rows(name):
    """N = 0: every segment empty (sizes, offsets and ids); normalizers return shape (0, ...)."""
    x = jnp.zeros((0, 3), jnp.float32)
    outs = [
        op(name)(x, sizes=[0, 0, 0]),
        op(name)(x, offsets=[0, 0, 0, 0]),
        op(name)(x, jnp.zeros((0,), jnp.int32), 3),
    ]
    for out in outs:
        if name in NORMALIZERS:
            assert out.shape == (0, 3)
        else:
            assert out.shape == (3, 3)
            _check(name, out, np.zeros((0, 3)), np.zeros(0), 3)


@pytest.mark.parametrize("name", ALL)
def test_zero_segments(name):
    x = jnp.arange(4.0, dtype=jnp.float32)
    out = op(name)(x, jnp.array([0, 1, -1, 2]), 0)
    if name in NORMALIZERS:
        assert out.shape == (4,)
        assert np.all(np.isnan(out))
    else:
        assert out.shape == (0,)
    out = op(name)(jnp.zeros((0,), jnp.float32), sizes=[])
    assert out.shape == (0,)


def _nan_marks(name, chunk_size):
    if chunk_size is None and name in ("max", "min"):
        return [pytest.mark.xfail(reason=BUG_NAN_MAXMIN, strict=True)]
    return []


@pytest.mark.parametrize(
    ("name", "chunk_size"),
    [pytest.param(n, c, marks=_nan_marks(n, c)) for n in ALL for c in (7, None)],
)
def test_nan_stays_in_its_segment(name, chunk_size, rng):
    sizes = [3, 10, 0, 1, 20, 5]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    x[part.offsets[1] + 4] = np.nan  # segment 1
    x[part.offsets[4] + 15] = np.nan  # segment 4, later step
    out = np.asarray(op(name)(jnp.asarray(x), sizes=sizes, chunk_size=chunk_size))
    bad = np.isin(part.ids, [1, 4]) if name in NORMALIZERS else np.isin(np.arange(6), [1, 4])
    assert np.all(np.isnan(out[bad]))
    _check(name, out, x, part.ids, part.num_segments)


@pytest.mark.parametrize("name", ["sum", "max", "logsumexp", "logmeanexp"])
def test_posinf(name, rng):
    sizes = [4, 9, 3]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, 3)
    x[part.offsets[1] + 7] = np.inf
    out = np.asarray(op(name)(jnp.asarray(x), sizes=sizes, chunk_size=3))
    assert out[1] == np.inf
    _check(name, out, x, part.ids, 3)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
@pytest.mark.parametrize("name", ALL)
def test_neginf_entries(name, form, rng):
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
    out = np.asarray(apply(name, jnp.asarray(x), ids, part.num_segments, form, chunk_size=3))
    if name in ("logsumexp", "logmeanexp", "max"):
        assert out[1] == -np.inf
        assert np.all(np.isfinite(out[[0, 3, 4, 5]]))
    _check(name, out, x, ids, part.num_segments)


@pytest.mark.parametrize("shifts", [(-1000.0, 1000.0), ALL_SHIFTS])
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
def test_scales_pm_1000(name, shifts, rng):
    part = random_partition(rng, num_segments=10)
    x = segment_data(rng, part.ids, part.num_segments, shifts=shifts)
    out = op(name)(jnp.asarray(x), sizes=part.sizes.tolist(), chunk_size=7)
    _check(name, out, x, part.ids, part.num_segments)


@pytest.mark.parametrize("name", ["logsumexp", "logmeanexp", "softmax", "log_softmax"])
def test_scales_0_and_plus_1000(name, rng):
    """Neighbouring segments at 0 and +1000 (-1000: see test_very_negative_segment)."""
    sizes = [6, 9, 1, 12, 4]
    part = Partition(np.asarray(sizes))
    x = rng.standard_normal(part.n).astype(F32) + np.repeat([0, 1000, 0, 1000, 1000], sizes).astype(F32)
    out = op(name)(jnp.asarray(x), sizes=sizes, chunk_size=4)
    _check(name, out, x, part.ids, part.num_segments)


@pytest.mark.xfail(reason=BUG_NEG_SCALE, strict=True)
@pytest.mark.parametrize("name", LOG_FAMILY)
def test_very_negative_segment(name, rng):
    part = random_partition(rng, num_segments=10)
    x = segment_data(rng, part.ids, part.num_segments, shifts=ALL_SHIFTS)
    x[part.offsets[2] : part.offsets[3]] -= 1000  # make sure at least one segment is at -1000
    out = op(name)(jnp.asarray(x), sizes=part.sizes.tolist(), chunk_size=7)
    _check(name, out, x, part.ids, part.num_segments)


def _oor_cases():
    for name in ALL:
        for form in ("unsorted_ids", "sorted_ids", "jit_sorted_ids", "jit_unsorted_ids"):
            marks = []
            if name in NORMALIZERS and form in ("sorted_ids", "jit_sorted_ids"):
                marks = [pytest.mark.xfail(reason=BUG_SORTED_OOR_SOFTMAX, strict=True)]
            yield pytest.param(name, form, marks=marks)


@pytest.mark.parametrize(("name", "form"), list(_oor_cases()))
def test_out_of_range_ids_dropped(name, form, rng):
    """Ids < 0 or >= num_segments are dropped; their rows are NaN for softmax/log_softmax."""
    num_segments = 5
    ids = np.sort(rng.integers(-3, num_segments + 3, size=40)).astype(np.int32)
    ids[:2] = [-5, -1]
    ids[-2:] = [num_segments, num_segments + 7]
    ids = np.sort(ids)
    x = segment_data(rng, ids, num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    out = apply(name, jnp.asarray(x), ids, num_segments, form, chunk_size=4)
    _check(name, out, x, ids, num_segments)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sorted_ids"])
@pytest.mark.parametrize("name", INT_OK)
def test_int_data(name, form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x = rng.integers(-100, 100, size=(part.n, 2)).astype(np.int32)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    out = apply(name, jnp.asarray(x), ids, part.num_segments, form, chunk_size=3)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, reference(name, x, ids, part.num_segments))
    jax_ops = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min}
    np.testing.assert_array_equal(out, jax_ops[name](x, ids, part.num_segments))


# ----------------------------------------------------------------------------------------------
# vmap / jit


@pytest.mark.parametrize("name", ALL)
def test_vmap_over_data(name, rng):
    part = random_partition(rng, num_segments=8)
    xs = np.stack([segment_data(rng, part.ids, part.num_segments) for _ in range(3)])
    sizes = part.sizes.tolist()
    out = jax.jit(jax.vmap(lambda x: op(name)(x, sizes=sizes, chunk_size=7)))(jnp.asarray(xs))
    for b in range(3):
        _check(name, out[b], xs[b], part.ids, part.num_segments, err_msg=f"batch {b}")


@pytest.mark.parametrize("name", ["sum", "max", "logsumexp", "softmax"])
def test_nested_vmap(name, rng):
    part = random_partition(rng, num_segments=6)
    ids, xs = permute_rows(rng, part.ids, rng.standard_normal((part.n, 2, 3)).astype(F32))
    xs = np.moveaxis(xs, 0, -1)  # (2, 3, N)
    idsj = jnp.asarray(ids)
    f = jax.vmap(jax.vmap(lambda x: op(name)(x, idsj, part.num_segments, chunk_size=5)))
    out = f(jnp.asarray(xs))
    for a in range(2):
        for b in range(3):
            _check(name, out[a, b], xs[a, b], ids, part.num_segments)


@pytest.mark.parametrize("name", ["mean", "min", "logmeanexp", "log_softmax"])
def test_vmap_over_closed_over_params(name, rng):
    part = random_partition(rng, num_segments=7)
    x = segment_data(rng, part.ids, part.num_segments, feature_shape=(5,))
    ws = _weights(rng, (4, 5, 2))
    sizes = part.sizes.tolist()
    xj = jnp.asarray(x)

    def f(w):
        return op(name)(xj, sizes=sizes, fn=lambda rows: rows @ w, chunk_size=6)

    out = jax.vmap(f)(jnp.asarray(ws))
    for b in range(4):
        values = x.astype(np.float64) @ ws[b].astype(np.float64)
        _check(name, out[b], values, part.ids, part.num_segments)


@pytest.mark.parametrize("name", ["sum", "logsumexp"])
def test_vmap_over_traced_sizes(name, rng):
    """A batch of different partitions of the same N (the tile plan is built under vmap)."""
    n, s = 30, 5
    parts = [rng.multinomial(n, np.ones(s) / s) for _ in range(3)]
    parts[0][1] = 0
    parts[0][0] = n - parts[0][2:].sum()
    x = rng.standard_normal((3, n)).astype(F32)
    f = jax.jit(jax.vmap(lambda x, sz: op(name)(x, sizes=sz, chunk_size=4)))
    out = f(jnp.asarray(x), jnp.asarray(np.stack(parts), jnp.int32))
    for b in range(3):
        p = Partition(np.asarray(parts[b]))
        _check(name, out[b], x[b], p.ids, s)


# ----------------------------------------------------------------------------------------------
# Gradients


def _vjp_pair(name, args, ids, num_segments, foldax_fn, dense_fn, rng):
    """VJPs of the foldax function and of its dense reference with one random cotangent."""
    out, pull = jax.vjp(foldax_fn, *args)
    ref_out, ref_pull = jax.vjp(dense_fn, *args)
    ct = jnp.asarray(rng.standard_normal(out.shape).astype(out.dtype))
    return pull(ct), ref_pull(ct)


def _assert_grads_match(got, want, scale=1.0):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.all(np.isfinite(g)), "gradient has NaN/inf"
        assert_allclose(g, w, dtype=g.dtype, scale=scale)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "jit_sizes"])
@pytest.mark.parametrize("name", ALL)
def test_grad_wrt_data(name, form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    got, want = _vjp_pair(
        name,
        (jnp.asarray(x),),
        ids,
        s,
        lambda x: apply(name, x, ids, s, form, chunk_size=5),
        lambda x: dense(name, x, ids, s),
        rng,
    )
    _assert_grads_match(got, want)


@pytest.mark.parametrize("form", ["sizes", "unsorted_ids"])
@pytest.mark.parametrize("name", ALL)
def test_grad_wrt_closed_over_params(name, form, rng):
    part = random_partition(rng, num_segments=8)
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=(5,))
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    w = jnp.asarray(_weights(rng, (5, 3)))
    s = part.num_segments
    got, want = _vjp_pair(
        name,
        (jnp.asarray(x), w),
        ids,
        s,
        lambda x, w: apply(name, x, ids, s, form, chunk_size=5, fn=lambda rows: rows @ w),
        lambda x, w: dense(name, x @ w, ids, s),
        rng,
    )
    _assert_grads_match(got, want, scale=data_scale(x))


@pytest.mark.parametrize("name", ["sum", "logsumexp", "softmax"])
def test_grad_pytree_data_with_fn(name, rng):
    part = random_partition(rng, num_segments=6)
    data = {
        "a": jnp.asarray(rng.standard_normal((part.n, 4)).astype(F32)),
        "b": jnp.asarray(rng.standard_normal(part.n).astype(F32)),
        "k": jnp.asarray(rng.integers(0, 3, part.n).astype(np.int32)),  # not differentiable
    }
    w = jnp.asarray(rng.standard_normal((4, 2)).astype(F32))

    def fn(rows, w):
        return rows["a"] @ w + (rows["b"] * rows["k"].astype(jnp.float32))[:, None]

    sizes = part.sizes.tolist()

    def f(d, w):
        return op(name)(d, sizes=sizes, fn=lambda r: fn(r, w), chunk_size=4)

    def loss(f):
        def inner(a, b, w):
            return f({"a": a, "b": b, "k": data["k"]}, w)

        return inner

    got, want = _vjp_pair(
        name,
        (data["a"], data["b"], w),
        part.ids,
        part.num_segments,
        loss(f),
        loss(lambda d, w: dense(name, fn(d, w), part.ids, part.num_segments)),
        rng,
    )
    _assert_grads_match(got, want)


@pytest.mark.parametrize("name", ["mean", "max", "logsumexp", "softmax"])
def test_jit_vmap_grad(name, rng):
    part = random_partition(rng, num_segments=8)
    xs = np.stack([segment_data(rng, part.ids, part.num_segments) for _ in range(3)])
    ct = jnp.asarray(rng.standard_normal(
        (part.n if name in NORMALIZERS else part.num_segments,)).astype(F32))
    sizes = part.sizes.tolist()

    def loss(x):
        return jnp.sum(ct * jnp.nan_to_num(
            op(name)(x, sizes=sizes, chunk_size=5), nan=0.0, posinf=0.0, neginf=0.0))

    def loss_ref(x):
        return jnp.sum(ct * jnp.nan_to_num(dense(name, x, part.ids, part.num_segments),
                                           nan=0.0, posinf=0.0, neginf=0.0))

    got = jax.jit(jax.vmap(jax.grad(loss)))(jnp.asarray(xs))
    want = jax.vmap(jax.grad(loss_ref))(jnp.asarray(xs))
    _assert_grads_match(got, want)


@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_max_min_gradient_splits_ties(name, chunk_size, rng):
    """Ties across tiles and steps share the gradient evenly, like jnp.max."""
    sizes = [7, 1, 0, 9, 4]
    part = Partition(np.asarray(sizes))
    x = rng.integers(-2, 3, size=part.n).astype(F32)  # many ties
    x[part.offsets[3] + np.array([0, 4, 8])] = 5.0 if name == "max" else -5.0  # 3-way tie
    got, want = _vjp_pair(
        name,
        (jnp.asarray(x),),
        part.ids,
        part.num_segments,
        lambda x: op(name)(x, sizes=sizes, chunk_size=chunk_size),
        lambda x: dense(name, x, part.ids, part.num_segments),
        rng,
    )
    _assert_grads_match(got, want)
    g = np.asarray(jax.grad(lambda x: op(name)(x, sizes=sizes, chunk_size=chunk_size)[3])(
        jnp.asarray(x)))
    np.testing.assert_array_equal(g[part.offsets[3] + np.array([0, 4, 8])], np.float32(1 / 3))


@pytest.mark.parametrize("name", ALL)
def test_grads_finite_with_empty_segments_and_neginf(name, rng):
    """Cotangents on empty segments and -inf entries never produce NaN gradients."""
    sizes = [0, 5, 0, 6, 1, 0, 4]
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    if name not in ("sum", "mean", "min"):
        x[part.offsets[1] + np.array([0, 2])] = -np.inf
        x[part.offsets[3] + 5] = -np.inf
        if name not in NORMALIZERS:
            x[part.offsets[6] : part.offsets[7]] = -np.inf  # all -inf segment
    got, want = _vjp_pair(
        name,
        (jnp.asarray(x),),
        part.ids,
        part.num_segments,
        lambda x: op(name)(x, sizes=sizes, chunk_size=3),
        lambda x: dense(name, x, part.ids, part.num_segments),
        rng,
    )
    _assert_grads_match(got, want)


def _partial_outputs(out, keep):
    # A gather, so that the cotangent reaching foldax is a jax array (see BUG_NUMPY_COTANGENT).
    return jnp.take(out, jnp.asarray(keep), axis=0)


@pytest.mark.parametrize("name", ALL)
def test_check_grads_float64(name, seed):
    """Reverse-mode gradients against float64 finite differences (jax.test_util.check_grads)."""
    rng = np.random.default_rng(seed)
    part = random_partition(rng, num_segments=6, max_size=9)
    x = rng.standard_normal(part.n)  # continuous: no ties for max/min
    sizes = part.sizes.tolist()
    # Outputs of empty segments are constants (and NaN/inf): leave them out of the check.
    keep = np.arange(part.n) if name in NORMALIZERS else np.flatnonzero(part.sizes > 0)
    t = tol(np.float64)
    with jax.enable_x64(True):
        xj = jnp.asarray(x)
        assert xj.dtype == jnp.float64

        def f(x):
            return _partial_outputs(op(name)(x, sizes=sizes, chunk_size=4), keep)

        assert f(xj).dtype == jnp.float64
        check_grads(f, (xj,), order=1, modes=["rev"], eps=t["fd_eps"], atol=t["fd_tol"],
                    rtol=t["fd_tol"])


@pytest.mark.parametrize("name", ["logsumexp", "max", "log_softmax"])
def test_check_grads_float32_params(name, rng):
    """Gradients wrt closed-over params of fn, float32 finite differences."""
    part = random_partition(rng, num_segments=5, max_size=8)
    x = jnp.asarray(rng.standard_normal((part.n, 3)).astype(F32))
    w = jnp.asarray(rng.standard_normal((3, 2)).astype(F32))
    sizes = part.sizes.tolist()
    keep = np.arange(part.n) if name in NORMALIZERS else np.flatnonzero(part.sizes > 0)
    t = tol(F32)

    def f(w):
        out = op(name)(x, sizes=sizes, fn=lambda rows: rows @ w, chunk_size=4)
        return _partial_outputs(out, keep)

    check_grads(f, (w,), order=1, modes=["rev"], eps=t["fd_eps"], atol=t["fd_tol"],
                rtol=t["fd_tol"])


@pytest.mark.xfail(reason=BUG_NUMPY_COTANGENT, strict=True)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_vjp_accepts_numpy_cotangent(name):
    x = jnp.arange(4.0, dtype=jnp.float32)
    out, pull = jax.vjp(lambda x: op(name)(x, sizes=[1, 3]), x)
    (g,) = pull(np.ones(out.shape, np.float32))
    (want,) = pull(jnp.ones(out.shape, jnp.float32))
    np.testing.assert_array_equal(g, want)
