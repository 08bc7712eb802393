"""Edges of two monoids: the second (and third) derivatives of segment_prod through the zeros of
a segment, against jnp.prod's in float64; and segment_var / segment_std of values whose squares
overflow float32 (means past ~1.8e19, NaN from ``0 * inf`` where a state merged into an empty
one), against float64 NumPy, with NumPy's float32 ``inf`` where the variance overflows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, tol
from jax.test_util import check_grads

import foldax
from foldax._reductions._var import Var

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
    """sum_k weights[k] * jnp.prod(x[ids == k]): the reference, differentiable."""
    return sum(w * jnp.prod(x[np.flatnonzero(ids == k)]) for k, w in enumerate(weights))


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


def test_prod_hessian_reproduction():
    """The report: a segment with one zero, Hessian [[0, 3, 2], [0, 0, 0], [0, 0, 0]] (the
    derivative of P / x_j in the zero was lost); jnp.prod's is symmetric."""
    x = jnp.array([0.0, 2.0, 3.0])
    want = np.array([[0.0, 3.0, 2.0], [3.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    assert_allclose(jax.hessian(jnp.prod)(x), want, dtype=np.float32)

    def f(v):
        return foldax.segment_prod(v, sizes=[3]).sum()

    for name, order in ORDERS.items():
        got = jax.jit(order(f))(x)
        assert_allclose(got, want, dtype=np.float32, err_msg=name)
        np.testing.assert_array_equal(got, np.asarray(got).T, err_msg=name)
    assert_allclose(jax.jit(jax.jacrev(jax.grad(f)))(x), want, dtype=np.float32)


@pytest.mark.parametrize("form", ["sizes", "sorted_ids", "unsorted_ids"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_prod_second_derivatives_against_jnp_float64(rng, form, order):
    """Every second-order composition, segments with 0-3 zeros, under jit, in float64."""
    with jax.enable_x64(True):
        x = np.concatenate([np.asarray(s, np.float64) for s in PROD_SEGMENTS])
        ours, x, ids = _prod_call(form, x, rng)
        x = jnp.asarray(x)
        w = jnp.asarray(PROD_WEIGHTS, jnp.float64)
        got = jax.jit(ORDERS[order](lambda v: jnp.sum(ours(v) * w)))(x)
        want = ORDERS[order](lambda v: _dense_prod(v, ids, w))(x)
        assert_allclose(got, want, dtype=np.float64, err_msg=order)
        assert np.count_nonzero(np.asarray(want)) > 20  # the zeros' entries are there


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

        want = jax.vmap(jax.hessian(lambda v: _dense_prod(v, ids, w)))(xs)
        assert_allclose(jax.jit(jax.vmap(jax.hessian(ours)))(xs), want, dtype=np.float64)
        total = jax.hessian(lambda xs: jnp.sum(jax.vmap(ours)(xs)))(xs)
        got = jnp.stack([total[b, :, b, :] for b in range(xs.shape[0])])
        assert_allclose(got, want, dtype=np.float64)


def test_prod_third_derivatives_up_to_two_zeros_float64():
    """Third derivatives are exact in segments with at most two zeros (the docstring's claim)."""
    with jax.enable_x64(True):
        x = jnp.asarray([0.0, 2.0, 0.0, 3.0, 0.0, 1.5, -2.0, 1.25, 0.5, -1.5])
        ids = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2], np.int32)
        w = jnp.asarray([1.0, -2.0, 0.5], jnp.float64)
        third = lambda f: jax.jacfwd(jax.jacfwd(jax.jacfwd(f)))  # noqa: E731
        got = jax.jit(third(lambda v: jnp.sum(foldax.segment_prod(v, sizes=[4, 3, 3]) * w)))(x)
        assert_allclose(got, third(lambda v: _dense_prod(v, ids, w))(x), dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# segment_var / segment_std: values past the square root of the float32 range

VAR_FORMS = ("sizes", "sorted_ids", "unsorted_ids", "jit_sizes")


def _var(name, x, sizes, form, chunk_size, ddof, rng):
    """``segment_<name>`` of ``x`` (float32 ``(N, ...)``, in segment order) as ``form``; the
    result, the per-segment float64 NumPy reference (NaN where ``n <= ddof``) and the ids."""
    f = getattr(foldax, f"segment_{name}")
    ids = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    kw = dict(ddof=ddof, chunk_size=chunk_size)
    xx = jnp.asarray(x)
    if form == "sizes":
        got = f(xx, sizes=list(sizes), **kw)
    elif form == "jit_sizes":
        got = jax.jit(lambda v, s: f(v, sizes=s, **kw))(xx, jnp.asarray(sizes, jnp.int32))
    elif form == "sorted_ids":
        got = f(xx, jnp.asarray(ids), len(sizes), indices_are_sorted=True, **kw)
    else:  # unsorted ids: the scatter merges one-row tiles into repeated slots
        perm = rng.permutation(len(ids))
        got = f(xx[perm], jnp.asarray(ids[perm]), len(sizes), **kw)
    want = []
    for k in range(len(sizes)):
        seg = np.asarray(x, np.float64)[ids == k]
        v = np.var(seg, axis=0, ddof=ddof) if len(seg) > ddof else np.full(x.shape[1:], np.nan)
        want.append(np.sqrt(v) if name == "std" else v)
    return np.asarray(got), np.asarray(want), ids


def _check_segments(name, got, want, x, ids, err_msg):
    """Each segment against its reference, with the magnitude of its values as the scale
    (squared for a variance: its unit)."""
    for k in range(len(want)):
        seg = np.abs(np.asarray(x, np.float64)[ids == k])
        scale = float(seg.max()) if seg.size else 1.0
        scale = max(scale**2 if name == "var" else scale, 1.0)
        assert_allclose(got[k], want[k], dtype=np.float32, scale=scale, err_msg=f"{err_msg} {k}")


def test_var_huge_mean_reproductions():
    """The report: NaN (``0 * inf`` merging into the empty initial state) for means past
    ~1.8e19 in float32."""
    f32 = jnp.float32
    np.testing.assert_array_equal(foldax.segment_var(jnp.array([1e30], f32), sizes=[1]), [0.0])
    np.testing.assert_array_equal(foldax.segment_var(jnp.full(4, 3e19, f32), sizes=[4]), [0.0])
    x = np.array([2e19, 2.1e19], np.float32)
    got = foldax.segment_std(jnp.asarray(x), sizes=[2])
    assert_allclose(got, [np.std(x.astype(np.float64))], dtype=np.float32, scale=2.1e19)
    assert_allclose(got, [5e17], dtype=np.float32, scale=2.1e19)


#: Huge segments: one value; equal values (several tiles with small chunks); two close ones; a
#: spread of 1e18 about 2e19 (variance 1e36); two equal values near the float32 max; moderate
#: values next to them; an empty segment.
HUGE_SEGMENTS = ([1e30], [3e19] * 4, [2e19, 2.1e19], "spread", [-3.4e38] * 2, "moderate", [])


def _huge_data(rng):
    parts = []
    for s in HUGE_SEGMENTS:
        if s == "spread":
            s = 2e19 + 1e18 * rng.standard_normal(9)
        elif s == "moderate":
            s = rng.standard_normal(5)
        parts.append(np.asarray(s, np.float64))
    return np.concatenate(parts).astype(np.float32), [len(p) for p in parts]


@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("form", VAR_FORMS)
def test_var_huge_values_against_float64(rng, name, ddof, form):
    x, sizes = _huge_data(rng)
    for chunk_size in (None, 2, 3):
        got, want, ids = _var(name, x, sizes, form, chunk_size, ddof, rng)
        _check_segments(name, got, want, x, ids, f"{form} chunk_size={chunk_size}")
        # equal values whose means are exact (a sum of 2, or of 4 in one tile, or one-row or
        # two-row tiles; else within rounding): exactly 0
        assert got[4] == 0 and (chunk_size == 3 or got[1] == 0), (got, chunk_size)
        assert ddof == 1 or got[0] == 0


@pytest.mark.parametrize("name", ["var", "std"])
def test_var_overflowing_variance_is_inf_never_nan(rng, name):
    """Where the true variance overflows float32 the result is inf, as NumPy's float32 var; no
    finite input gives NaN (segments with ``n > ddof``)."""
    segments = ([1e30, -1e30], [2e19, -2e19], [3e38, -3e38, 3e38, -3e38], [-3.4e38, 3.4e38, 1.0])
    with np.errstate(over="ignore", invalid="ignore"):
        for s in segments:
            assert np.isinf(np.var(np.asarray(s, np.float32)))
    x = np.concatenate([np.asarray(s, np.float32) for s in segments])
    x = np.stack([x, -x[::-1]], axis=1)  # a feature axis: the other column reversed, negated
    sizes = [len(s) for s in segments]
    for form in ("sizes", "unsorted_ids", "jit_sizes"):
        for chunk_size in (None, 1):
            for ddof in (0, 1):
                got, _, _ = _var(name, x, sizes, form, chunk_size, ddof, rng)
                np.testing.assert_array_equal(got, np.inf, err_msg=f"{form} {chunk_size}")
    # random magnitudes up to the float32 max, both signs: never NaN
    mags = 10.0 ** rng.uniform(15, 38.5, size=200)
    x = (rng.choice([-1.0, 1.0], size=200) * np.minimum(mags, 3.4e38)).astype(np.float32)
    sizes = list(rng.multinomial(200 - 12, np.ones(12) / 12) + 1)
    for form in ("sizes", "unsorted_ids"):
        for chunk_size in (None, 3):
            got, want, _ = _var(name, x, sizes, form, chunk_size, 0, rng)
            assert not np.any(np.isnan(got)), (form, chunk_size, got)
            big = want > (3.5e38 if name == "var" else 1.9e19)
            assert np.all(np.isinf(got[big])), (form, chunk_size, got, want)


def test_var_equal_huge_values_across_tiles_and_duplicates(rng):
    """Equal values give exactly 0 across many tiles and steps, and repeated ids merged in one
    step (steps of one or two rows: the tiles' and merges' means are exact), whatever their
    squares."""
    sizes = [1, 2, 3, 5, 0, 16]
    c = np.array([3e19, 1e30, -1e30, 3.4e38, -3.4e38], np.float32)  # a feature axis
    x = np.broadcast_to(c, (sum(sizes), len(c)))
    for form in VAR_FORMS:
        for chunk_size in (1, 2):
            for name in ("var", "std"):
                got, want, _ = _var(name, x, sizes, form, chunk_size, 0, rng)
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {form} {chunk_size}")


def test_var_nonfinite_values_give_nan():
    """As NumPy: inf or NaN in a segment gives NaN, in any tile and merge."""
    x = jnp.array([np.inf, 1.0, np.nan, 2.0, np.inf, np.inf, -np.inf, 3.0, 1.0, 2.0], jnp.float32)
    sizes = [2, 2, 2, 2, 2]
    ids = jnp.asarray(np.repeat(np.arange(5), 2), jnp.int32)
    want = [np.nan] * 4 + [0.25]
    for chunk_size in (None, 1, 2, 3):
        got = foldax.segment_var(x, sizes=sizes, chunk_size=chunk_size)
        assert_allclose(got, want, dtype=np.float32, err_msg=str(chunk_size))
        perm = jnp.asarray([9, 3, 0, 5, 7, 1, 4, 8, 2, 6])
        got = foldax.segment_std(x[perm], ids[perm], 5, chunk_size=chunk_size)
        assert_allclose(got, np.sqrt(want), dtype=np.float32, err_msg=str(chunk_size))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_var_half_precision_near_the_top_of_the_range(rng, dtype):
    """float16 values near 6e4 (bfloat16 near 3e19: squares past float32) accumulate in
    float32; the result in the values' dtype (a float16 variance past 65504: inf, as NumPy's
    float16 var)."""
    top = 6.0e4 if dtype == jnp.float16 else 3.0e19
    spread = 32.0 if dtype == jnp.float16 else 2e17
    segments = [
        [top] * 6,
        top + spread * rng.integers(-8, 8, size=7),
        [top, top * 0.9],  # float16: variance 9e6 overflows, std 3e3
        [-top] * 3,
    ]
    x = np.concatenate([np.asarray(s, np.float64) for s in segments]).astype(dtype)
    xf = np.asarray(x, np.float64)
    sizes = [len(s) for s in segments]
    ids = np.repeat(np.arange(len(sizes)), sizes)
    equal = np.array([0, 3])  # exact (0) for steps of two rows, else within rounding
    for chunk_size in (None, 2):
        for name in ("var", "std"):
            f = getattr(foldax, f"segment_{name}")
            for ddof in (0, 1):
                kw = dict(chunk_size=chunk_size, ddof=ddof)
                got = f(jnp.asarray(x), sizes=sizes, **kw)
                perm = rng.permutation(len(ids))
                got_ids = f(jnp.asarray(x)[perm], jnp.asarray(ids[perm]), len(sizes), **kw)
                assert got.dtype == dtype and got_ids.dtype == dtype
                want = []
                for k in range(len(sizes)):
                    v = np.var(xf[ids == k], ddof=ddof)
                    want.append(np.sqrt(v) if name == "std" else v)
                with np.errstate(over="ignore"):
                    want = np.asarray(want).astype(dtype)  # inf past the dtype's range
                msg = f"{name} ddof={ddof} chunk_size={chunk_size}"
                for g in (got, got_ids):
                    g = np.asarray(g, np.float64)
                    assert_allclose(g[1:3], want[1:3], dtype=dtype, err_msg=msg)
                    scale = top**2 if name == "var" else top
                    assert_allclose(g[equal], want[equal], dtype=dtype, scale=scale, err_msg=msg)
                    assert chunk_size != 2 or np.all(g[equal] == 0), msg
    if dtype == jnp.float16:
        with np.errstate(over="ignore"):
            assert np.isinf(np.var(np.array([top, top * 0.9], np.float16)))


def test_var_combine_and_scatter_with_empty_states_are_exact():
    """The merge (also across devices: allreduce folds with combine) keeps a state merged with
    an empty one exactly, with means whose squares overflow; equal means merge exactly."""
    mon = Var()
    st = (
        jnp.array([1, 4, 3, 0], jnp.int32),
        jnp.array([[1e30, -2e19], [3e19, 3.4e38], [2.5, -1e36], [0.0, 0.0]], jnp.float32),
        jnp.array([[0.0, 0.0], [1e36, 0.0], [2.0, 3e30], [0.0, 0.0]], jnp.float32),
    )
    empty = mon.init(4, (2,), jnp.float32)
    for got in (mon.combine(empty, st), mon.combine(st, empty)):
        for a, b in zip(got, st, strict=True):
            np.testing.assert_array_equal(a, b)
    n, mean, q = mon.combine(st, st)
    np.testing.assert_array_equal(n, 2 * st[0])
    np.testing.assert_array_equal(mean, st[1])
    np.testing.assert_array_equal(q, 2 * st[2])
    # scatter into empty slots (dropped ids: the value 5), then the same tiles again
    seg = jnp.array([2, 0, 5, 4], jnp.int32)
    carry = mon.scatter(mon.init(5, (2,), jnp.float32), seg, st)
    want_n, want_m, want_q = (np.zeros((5, *a.shape[1:]), a.dtype) for a in st)
    for g, s in ((2, 0), (0, 1), (4, 3)):
        want_n[g], want_m[g], want_q[g] = st[0][s], st[1][s], st[2][s]
    for a, b in zip(carry, (want_n, want_m, want_q), strict=True):
        np.testing.assert_array_equal(a, b)
    n, mean, q = mon.scatter(carry, seg, st)
    np.testing.assert_array_equal(n, 2 * want_n)
    np.testing.assert_array_equal(mean, want_m)
    np.testing.assert_array_equal(q, 2 * want_q)


@pytest.mark.parametrize("name", ["var", "std"])
def test_var_gradients_check_grads(rng, name):
    """check_grads (second order, both modes) on moderate values, unsorted repeated ids, small
    chunks and ddof=1 (test_segment_more checks sizes, ddof=0): the derivatives are untouched by
    the merges' guards."""
    ids = jnp.asarray(rng.permutation(np.repeat(np.arange(4), [5, 3, 1, 4])).astype(np.int32))
    x = jnp.asarray((rng.standard_normal(13) * 0.5 + 1.0).astype(np.float32))
    f = getattr(foldax, f"segment_{name}")

    def g(x):
        out = f(x, ids, 4, chunk_size=3, ddof=1)
        return jnp.where(jnp.isnan(out), 0.0, out)

    t = tol(np.float32)
    check_grads(g, (x,), order=2, modes=("fwd", "rev"), eps=t["fd_eps"], atol=t["fd_tol"],
                rtol=t["fd_tol"])  # fmt: skip


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


@pytest.mark.parametrize(
    "values",
    [[0.0, np.nan, 2.0], [0.0, np.inf], [np.inf, 2.0, 0.0], [-np.inf, 0.0, 0.0], [np.nan, 1.0]],
)
def test_prod_a_zero_does_not_hide_nan_or_inf(values):
    """0 * NaN and 0 * inf are NaN (as jnp.prod and jax.ops.segment_prod give), never 0."""
    v = jnp.asarray(values, jnp.float32)
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN is the point
        want = np.asarray([np.prod(np.asarray(values, np.float64))])
    assert_allclose(foldax.segment_prod(v, sizes=[len(values)]), want, dtype=np.float32)
    ids = jnp.zeros(len(values), jnp.int32)
    assert_allclose(foldax.segment_prod(v, ids, 1), want, dtype=np.float32)
    got = foldax.segment_prod(v, ids, 1, chunk_size=1)
    assert_allclose(got, jax.ops.segment_prod(v, ids, 1), dtype=np.float32)


def test_empty_segment_sum_is_positive_zero():
    """An empty segment sums to +0.0 as in jax.ops (never -0.0), eager and jitted."""
    x = jnp.arange(1.0, 6.0, dtype=jnp.float32)
    for f in (foldax.segment_sum, jax.jit(foldax.segment_sum, static_argnames="sizes")):
        out = np.asarray(f(x, sizes=(2, 0, 3)))
        assert out[1] == 0 and not np.signbit(out[1])


def test_monoids_compare_and_show_their_parameters():
    """A monoid is a value: parameters take part in equality and hashing (a fold's static
    description is keyed on them) and show in its repr."""
    from foldax._reductions import ArgExtremum, ExtremumWithIndex, KMin, SoftmaxSum
    from foldax._reductions._extremum import Max, Min, SegmentArgExtremum
    from foldax._reductions._logsumexp import LogSumExp

    makers = [
        lambda: KMin(3), lambda: KMin(5), lambda: Var(0), lambda: Var(1),
        lambda: Var(1, std=True), Max, Min, LogSumExp, lambda: LogSumExp(mean=True),
        lambda: SegmentArgExtremum(True), lambda: SegmentArgExtremum(False),
        lambda: ArgExtremum(True), lambda: ArgExtremum(False), lambda: ExtremumWithIndex(True),
        SoftmaxSum, lambda: SoftmaxSum(shared=True),
    ]  # fmt: skip
    for i, make in enumerate(makers):
        assert make() == make() and hash(make()) == hash(make()), make()
        for other in makers[i + 1 :]:
            assert make() != other(), (make(), other())
    shown = {"k=3": KMin(3), "ddof=1": Var(1), "shared=True": SoftmaxSum(shared=True)}
    for param, mon in shown.items():
        assert param in repr(mon), repr(mon)
