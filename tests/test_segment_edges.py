"""Edge cases of foldax.segment_*: empty and one-row segments, no rows and no segments, NaN and
+-inf entries, segments whose exp underflows, dropped (out-of-range) ids, long tiles, argmax /
argmin of data at the ends of its dtype; segment_var / segment_std of values whose squares
overflow float32 (means past ~1.8e19, NaN from ``0 * inf`` where a state merged into an empty
one), against float64 NumPy, with NumPy's float32 ``inf`` where the variance overflows;
segment_prod of zeros next to NaN / inf; and the monoids as values (equality, repr).

References and identities are the registry's (registry.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL,
    NORMALIZERS,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    expect,
    expect_each,
    identity,
    jit_each,
    op,
    permute_rows,
    reference,
    segment_data,
)

import foldax
from foldax._reductions._var import Var

F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Empty segments, no rows, no segments


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes", [[0, 1, 0, 0, 3, 0, 1], [0, 0, 5, 0], [1]], ids=["mixed", "one_nonempty", "single_row"]
)
def test_empty_and_singleton_segments(sizes, rng):
    part = Partition(np.asarray(sizes))
    x = segment_data(rng, part.ids, part.num_segments)
    outs = jit_each(ALL, lambda n, x: op(n)(x, sizes=sizes, chunk_size=2))(jnp.asarray(x))
    expect_each(outs, x, part.ids, part.num_segments)
    empty, one = part.sizes == 0, np.flatnonzero(part.sizes == 1)

    def exact(name):
        out = np.asarray(outs[name])
        if name in NORMALIZERS:
            want = 0.0 if name == "log_softmax" else 1.0
            np.testing.assert_array_equal(out[part.offsets[one]], want)
            return
        np.testing.assert_array_equal(out[empty], identity(name, F32))
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
            np.testing.assert_array_equal(out, identity(name, F32))


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
        expect(name, op(name)(jnp.asarray(x), jnp.asarray(ids)), x, ids, 5)


def test_empty_segment_sum_is_positive_zero():
    """An empty segment sums to +0.0 as in jax.ops (never -0.0), eager and jitted."""
    x = jnp.arange(1.0, 6.0, dtype=jnp.float32)
    for f in (foldax.segment_sum, jax.jit(foldax.segment_sum, static_argnames="sizes")):
        out = np.asarray(f(x, sizes=(2, 0, 3)))
        assert out[1] == 0 and not np.signbit(out[1])


# ----------------------------------------------------------------------------------------------
# NaN, +-inf and underflowing entries


@pytest.mark.slow
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
        expect(name, out, x, part.ids, part.num_segments)

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
        expect(name, outs[name], x, part.ids, 3)

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
        expect(name, out, x, ids, s)

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
    expect_each(outs, x, ids, s)
    # eager too: the one-liner of the original report
    assert_allclose(
        op("logsumexp")(jnp.array([-1000.0, -1001.0]), sizes=[2]),
        [-1000 + np.log1p(np.exp(-1.0))],
        dtype=F32,
        scale=1000,
    )


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


# ----------------------------------------------------------------------------------------------
# Dropped ids, long tiles, data at the ends of its dtype


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
    expect_each(f(jnp.asarray(x)), x, ids, num_segments)
    # eager, the original repro of the sorted case
    out = op("softmax")(jnp.arange(5.0, dtype=jnp.float32), jnp.array([-1, 0, 0, 1, 5]), 2)
    assert np.isnan(out[0]) and np.isnan(out[4]) and out[3] == 1.0


@pytest.mark.slow
def test_all_ids_out_of_range(rng):
    x = rng.standard_normal(6).astype(F32)
    cases = [
        (np.array([-2, -1, -1, -1, -1, -1]), "sorted_ids"),
        (np.array([3, 3, 4, 5, 6, 7]), "jit_sorted_ids"),
        (np.array([5, -1, 3, 4, -2, 9]), "jit_unsorted_ids"),
    ]
    every = jax.jit(  # one program for the three cases
        lambda x: [{n: apply(n, x, ids, 3, form) for n in ALL} for ids, form in cases]
    )
    for (ids, form), outs in zip(cases, every(jnp.asarray(x)), strict=True):
        expect_each(outs, x, ids, 3, err_msg=f"ids={ids} {form}")


@pytest.mark.slow
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
    expect_each(f(jnp.asarray(x)), x, part.ids, s)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8, np.float32])
def test_segment_arg_extremum_at_the_ends(rng, dtype):
    """segment_argmin of data all at the dtype's highest value (iinfo.max, +inf), segment_argmax
    at its lowest: each segment's first row, -1 for an empty one (sorted ids, unsorted, sizes)."""
    n, s = 300, 7
    ids = np.sort(rng.integers(0, s - 1, n)).astype(np.int32)  # the last segment is empty
    first = np.array([np.flatnonzero(ids == g)[0] if (ids == g).any() else -1 for g in range(s)])
    perm = rng.permutation(n)
    first_perm = [np.flatnonzero(ids[perm] == g) for g in range(s)]
    first_perm = np.array([f[0] if f.size else -1 for f in first_perm])
    if jnp.issubdtype(dtype, jnp.floating):
        ends = {"argmin": np.inf, "argmax": -np.inf}
    else:
        ends = {"argmin": np.iinfo(dtype).max, "argmax": np.iinfo(dtype).min}
    fns = {"argmin": foldax.segment_argmin, "argmax": foldax.segment_argmax}

    # One program for the six calls. Each is what the eager call ran (one cached jax.jit with
    # the ids as its input): sorted ids are told so, also where the eager call read it.
    @jax.jit
    def calls(ids, ids_perm):
        out = {}
        for r, fn in fns.items():
            data = jnp.full((n,), ends[r], dtype)
            out[r] = (
                fn(data, ids, num_segments=s, indices_are_sorted=True),
                fn(data, ids, num_segments=s, chunk_size=16, indices_are_sorted=True),
                fn(data, ids_perm, num_segments=s),
            )
        return out

    outs = calls(jnp.asarray(ids), jnp.asarray(ids[perm]))
    for r in fns:
        for got, want in zip(outs[r], (first, first, first_perm), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=r)


# ----------------------------------------------------------------------------------------------
# segment_var / segment_std: values past the square root of the float32 range


VAR_FORMS = ("sizes", "sorted_ids", "unsorted_ids", "jit_sizes")


def _var_group(x, sizes, cases, rng):
    """The inputs of ``segment_<name>`` of ``x`` (float32 ``(N, ...)``, in segment order) for
    every ``(name, form, chunk_size, ddof)`` of ``cases``, run by :func:`_var_run`.

    The forms are those an eager call runs (an eager call is one cached ``jax.jit`` with the
    ids as its input, told ``indices_are_sorted`` as below): ``sizes`` static, ``jit_sizes``
    traced, ``sorted_ids`` with ``indices_are_sorted=True``, ``unsorted_ids`` of rows permuted
    (one fresh permutation per case, drawn in order): the scatter merges one-row tiles into
    repeated slots."""
    x = np.asarray(x)
    ids = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    inputs = []
    for _, form, _, _ in cases:
        if form == "unsorted_ids":
            perm = rng.permutation(len(ids))
            inputs.append((x[perm], ids[perm]))
        else:
            inputs.append((x, ids))
    return x, [int(n) for n in sizes], ids, cases, inputs


def _var_run(*groups):
    """The cases of every group (:func:`_var_group`) in one compiled program (compiling is
    what the time goes to); per group, per case ``(result, per-segment float64 NumPy reference
    (NaN where n <= ddof), ids)``."""

    def one(name, form, chunk_size, ddof, v, i, sizes, tsizes):
        f = getattr(foldax, f"segment_{name}")
        kw = dict(ddof=ddof, chunk_size=chunk_size)
        if form == "sizes":
            return f(v, sizes=sizes, **kw)
        if form == "jit_sizes":
            return f(v, sizes=tsizes, **kw)
        if form == "sorted_ids":
            return f(v, i, len(sizes), indices_are_sorted=True, **kw)
        assert form == "unsorted_ids", form
        return f(v, i, len(sizes), **kw)

    def run(inputs, tsizes):
        return [
            [one(*case, v, i, g[1], t) for case, (v, i) in zip(g[3], inp, strict=True)]
            for g, inp, t in zip(groups, inputs, tsizes, strict=True)
        ]

    got = jax.jit(run)([g[4] for g in groups], [np.asarray(g[1], np.int32) for g in groups])
    return [
        [
            (np.asarray(r), reference(name, x, ids, len(sizes), ddof=ddof), ids)
            for r, (name, _, _, ddof) in zip(rs, cases, strict=True)
        ]
        for rs, (x, sizes, ids, cases, _) in zip(got, groups, strict=True)
    ]


def _var_many(x, sizes, cases, rng):
    """:func:`_var_run` of one group."""
    return _var_run(_var_group(x, sizes, cases, rng))[0]


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


@pytest.mark.slow
@pytest.mark.parametrize("form", VAR_FORMS)
def test_var_huge_values_against_float64(rng, form):
    """Every name, ddof and chunk size of ``form`` in one compiled program."""
    x, sizes = _huge_data(rng)
    cases = [
        (name, form, chunk_size, ddof)
        for name in ("var", "std")
        for ddof in (0, 1)
        for chunk_size in (None, 2, 3)
    ]
    results = _var_many(x, sizes, cases, rng)
    for (name, _, chunk_size, ddof), (got, want, ids) in zip(cases, results, strict=True):
        case = f"{name} ddof={ddof} {form} chunk_size={chunk_size}"
        _check_segments(name, got, want, x, ids, case)
        # equal values whose means are exact (a sum of 2, or of 4 in one tile, or one-row or
        # two-row tiles; else within rounding): exactly 0
        assert got[4] == 0 and (chunk_size == 3 or got[1] == 0), (case, got)
        assert ddof == 1 or got[0] == 0, (case, got)


@pytest.mark.slow
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
    cases = [
        (name, form, chunk_size, ddof)
        for form in ("sizes", "unsorted_ids", "jit_sizes")
        for chunk_size in (None, 1)
        for ddof in (0, 1)
    ]
    overflowing = _var_group(x, sizes, cases, rng)
    # random magnitudes up to the float32 max, both signs: never NaN
    mags = 10.0 ** rng.uniform(15, 38.5, size=200)
    x = (rng.choice([-1.0, 1.0], size=200) * np.minimum(mags, 3.4e38)).astype(np.float32)
    sizes = list(rng.multinomial(200 - 12, np.ones(12) / 12) + 1)
    spread_cases = [(name, form, c, 0) for form in ("sizes", "unsorted_ids") for c in (None, 3)]
    spread = _var_group(x, sizes, spread_cases, rng)
    results, spread_results = _var_run(overflowing, spread)  # both in one program
    for (_, form, chunk_size, _), (got, _, _) in zip(cases, results, strict=True):
        np.testing.assert_array_equal(got, np.inf, err_msg=f"{form} {chunk_size}")
    for (_, form, chunk_size, _), (got, want, _) in zip(spread_cases, spread_results, strict=True):
        assert not np.any(np.isnan(got)), (form, chunk_size, got)
        big = want > (3.5e38 if name == "var" else 1.9e19)
        assert np.all(np.isinf(got[big])), (form, chunk_size, got, want)


@pytest.mark.slow
def test_var_equal_huge_values_across_tiles_and_duplicates(rng):
    """Equal values give exactly 0 across many tiles and steps, and repeated ids merged in one
    step (steps of one or two rows: the tiles' and merges' means are exact), whatever their
    squares."""
    sizes = [1, 2, 3, 5, 0, 16]
    c = np.array([3e19, 1e30, -1e30, 3.4e38, -3.4e38], np.float32)  # a feature axis
    x = np.broadcast_to(c, (sum(sizes), len(c)))
    cases = [
        (name, form, chunk_size, 0)
        for form in VAR_FORMS
        for chunk_size in (1, 2)
        for name in ("var", "std")
    ]
    for (name, form, chunk_size, _), (got, want, _) in zip(
        cases, _var_many(x, sizes, cases, rng), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {form} {chunk_size}")


@pytest.mark.slow
def test_var_nonfinite_values_give_nan():
    """As NumPy: inf or NaN in a segment gives NaN, in any tile and merge."""
    x = jnp.array([np.inf, 1.0, np.nan, 2.0, np.inf, np.inf, -np.inf, 3.0, 1.0, 2.0], jnp.float32)
    sizes = [2, 2, 2, 2, 2]
    ids = jnp.asarray(np.repeat(np.arange(5), 2), jnp.int32)
    want = [np.nan] * 4 + [0.25]
    chunks = (None, 1, 2, 3)
    perm = jnp.asarray([9, 3, 0, 5, 7, 1, 4, 8, 2, 6])

    @jax.jit  # one program for every call (unsorted ids: as the eager call ran them)
    def calls(x, x_perm, ids_perm):
        return [
            (
                foldax.segment_var(x, sizes=sizes, chunk_size=chunk_size),
                foldax.segment_std(x_perm, ids_perm, 5, chunk_size=chunk_size),
            )
            for chunk_size in chunks
        ]

    for chunk_size, (var, std) in zip(chunks, calls(x, x[perm], ids[perm]), strict=True):
        assert_allclose(var, want, dtype=np.float32, err_msg=str(chunk_size))
        assert_allclose(std, np.sqrt(want), dtype=np.float32, err_msg=str(chunk_size))


@pytest.mark.slow
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
    cases = [
        (chunk_size, name, ddof, rng.permutation(len(ids)))
        for chunk_size in (None, 2)
        for name in ("var", "std")
        for ddof in (0, 1)
    ]

    @jax.jit  # one program for every call (unsorted ids: as the eager call ran them)
    def calls(x, ids):
        outs = []
        for chunk_size, name, ddof, perm in cases:
            f = getattr(foldax, f"segment_{name}")
            kw = dict(chunk_size=chunk_size, ddof=ddof)
            outs.append((f(x, sizes=sizes, **kw), f(x[perm], ids[perm], len(sizes), **kw)))
        return outs

    outs = calls(jnp.asarray(x), jnp.asarray(ids, jnp.int32))
    for (chunk_size, name, ddof, _), (got, got_ids) in zip(cases, outs, strict=True):
        assert got.dtype == dtype and got_ids.dtype == dtype
        want = reference(name, xf, ids, len(sizes), ddof=ddof)
        with np.errstate(over="ignore"):
            want = want.astype(dtype)  # inf past the dtype's range
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------------
# The monoids are values


def test_monoids_compare_and_show_their_parameters():
    """A monoid is a value: parameters take part in equality and hashing (a fold's static
    description is keyed on them) and show in its repr."""
    from foldax._reductions import ArgExtremum, ExtremumWithIndex, KMin, SoftmaxSum
    from foldax._reductions._extremum import Max, Min
    from foldax._reductions._logsumexp import LogSumExp

    makers = [
        lambda: KMin(3), lambda: KMin(5), lambda: Var(0), lambda: Var(1),
        lambda: Var(1, std=True), Max, Min, LogSumExp, lambda: LogSumExp(mean=True),
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


@pytest.mark.parametrize("sort", [False, True])
def test_logsumexp_gradient_of_rows_at_every_edge_equals_the_walk(sort, rng):
    """A log-sum-exp's gradient of plain rows (``jax.ops``' program, its special segments
    told apart) equals the walk's, NaN for NaN, whatever the chunks: a +inf segment whose
    finite rows' ``exp(x)`` overflows (x = 100), one holding NaN, an all -inf and an empty
    one, ids out of range, and cotangents of 0, NaN and +-inf."""
    x = rng.standard_normal((60, 3)).astype(F32)
    ids = rng.integers(-1, 9, 60).astype(np.int32)
    ids[ids == 7] = 6  # segment 7 empty
    x[ids == 1] = 100.0
    x[np.flatnonzero(ids == 1)[:2], :2] = np.inf  # +inf segment 1, columns 0-1
    x[np.flatnonzero(ids == 2)[:1], 1] = np.nan
    x[ids == 3] = -np.inf
    x[np.flatnonzero(ids == 4)[:3]] = -np.inf
    g = rng.standard_normal((9, 3)).astype(F32)
    g[[0, 1, 4, 5], 0] = [0.0, 0.0, np.nan, np.inf]
    g[[1, 5, 6], 2] = [np.nan, -np.inf, 0.0]
    if sort:
        order = np.argsort(ids, kind="stable")
        ids, x = ids[order], x[order]

    def grad(**kw):
        f = lambda x: foldax.segment_logsumexp(x, ids, 9, indices_are_sorted=sort, **kw)  # noqa: E731
        return jax.jit(lambda x, g: jax.vjp(f, x)[1](g)[0])(jnp.asarray(x), jnp.asarray(g))

    direct, walk = np.asarray(grad()), np.asarray(grad(chunk_size=4))
    np.testing.assert_array_equal(np.isnan(direct), np.isnan(walk))
    assert_allclose(direct, walk, dtype=np.float32)
    assert (direct[ids == 1, 0] == 0).all() and np.isnan(direct[ids == 1, 1]).all()  # +inf
    assert np.isnan(direct[ids == 4, 0]).all()  # a NaN cotangent is NaN on every row
    assert (direct[ids == 3] == 0).all()  # all -inf, finite cotangents


EDGE_SEGMENTS = [  # three rows of one feature each
    [0.5, -1.0, -np.inf],
    [100.0, 99.0, -np.inf],
    [-np.inf, -np.inf, -np.inf],
    [np.nan, 1.0, -np.inf],
    [np.nan, np.inf, 1.0],
    [np.inf, 100.0, -1.0],
    [np.inf, np.inf, -np.inf],
    [2.0, 2.0, 1.0],
    [0.0, -0.0, 3.0],
]


@pytest.mark.parametrize(
    "name", ["sum", "mean", "max", "min", "logsumexp", "prod", "softmax", "log_softmax"]
)
def test_direct_program_equals_the_walk_at_every_edge(name):
    """A segment reduction of plain rows (the direct program: scatters and gathers) gives the
    walk's values and gradients (the same call with ``chunk_size``), NaN for NaN, on segments
    of +-inf, NaN, all -inf, ties and signed zeros, an empty one, ids out of range, and
    cotangents of 1, 0, NaN and +inf: the answers do not depend on ``chunk_size``."""
    s = len(EDGE_SEGMENTS) + 1  # (the last one empty)
    x = np.r_[[1.0], np.concatenate(EDGE_SEGMENTS), [2.0]].astype(F32)[:, None]
    ids = np.r_[[-1], np.repeat(np.arange(s - 1), 3), [s]].astype(np.int32)
    fn = getattr(foldax, f"segment_{name}")
    for gv in (1.0, 0.0, np.nan, np.inf):
        g = np.full((x.shape[0] if "softmax" in name else s, 1), gv, F32)
        got = []
        for kw in ({}, {"chunk_size": 2}):
            f = lambda x, kw=kw: fn(x, ids, s, indices_are_sorted=True, **kw)  # noqa: E731
            val, back = jax.jit(lambda x, g, f=f: (f(x), jax.vjp(f, x)[1](g)[0]))(x, g)
            got.append((np.asarray(val), np.asarray(back)))
        (direct, walk) = got
        for what, a, b in zip(("value", "gradient"), direct, walk, strict=True):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what}, g={gv}")
            assert_allclose(a, b, dtype=F32, err_msg=f"{what}, g={gv}")
