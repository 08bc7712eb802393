"""Edge cases of pairwise_reduce's index reductions: values at the ends of the kernel's dtype.

An empty slot (a k-min slot not yet filled, the argmin of no column) holds the dtype's largest
integer or NaN, but is told apart by its index (int32 max), never by its value: a kernel may
return that value for real (an "unreachable" integer distance at ``iinfo.max``). Every integer
dtype (the 64-bit ones under x64), unsigned ones included, against the registry's references
(stable NumPy sorts); and the checks of ``reduction`` / ``k``, the name first.

The kernels here look their values up in a dense matrix ``d`` (closed over), so each pair's
value is exactly the reference's: values are compared exactly.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NO_INDEX, pairwise_reference

import foldax

NAME = "foldax.pairwise_reduce"
INTS = (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32)
INTS_X64 = (np.int64, np.uint64)
FLOATS = (np.float32, jnp.float16)


def _mask(i, j):
    """Rows 0 .. 4 keep every column, odd rows from 5 on every third, row 6 none."""
    return ((i < 5) | (i % 2 == 0) | (j % 3 == 0)) & (i != 6)


def _valid(m, n):
    i, j = np.arange(m)[:, None], np.arange(n)[None]
    return np.broadcast_to(((i < 5) | (i % 2 == 0) | (j % 3 == 0)) & (i != 6), (m, n))


def _lookup(d):
    """A kernel of row numbers ``x`` (M, 1) and ``y`` (N, 1) whose values are ``d`` (M, N)."""
    return lambda a, b: d[a[0], b[0]]


def _rows(m, n):
    return jnp.arange(m, dtype=jnp.int32)[:, None], jnp.arange(n, dtype=jnp.int32)[:, None]


def int_matrix(rng, dtype, m, n):
    """Values over the whole range of ``dtype``, most at its max (some rows all at it), many at
    its min and next to them, ties everywhere."""
    info = np.iinfo(dtype)
    d = rng.integers(info.min, info.max, (m, n), dtype=dtype, endpoint=True)
    u = rng.random((m, n))
    d = np.where(u < 0.5, info.max, d)
    d = np.where((u >= 0.5) & (u < 0.6), info.min, d)
    d = np.where((u >= 0.6) & (u < 0.65), info.max - 1, d)
    d = np.where((u >= 0.65) & (u < 0.7), info.min + 1, d)
    d[0] = info.max  # every pair "unreachable"
    d[1] = info.min
    d[2] = info.max
    d[2, -1] = info.max - 1  # one entry below the max, in the last column
    d[3] = rng.integers(0, 3, n).astype(dtype)  # small values, tied
    return d.astype(dtype)


def float_matrix(rng, dtype, m, n):
    """Normal values, +inf, -inf, NaN, the largest finite value; rows all +inf, all NaN."""
    d = rng.integers(-3, 4, (m, n)).astype(np.float64)
    u = rng.random((m, n))
    big = float(jnp.finfo(dtype).max)
    d = np.where(u < 0.3, np.inf, d)
    d = np.where((u >= 0.3) & (u < 0.4), np.nan, d)
    d = np.where((u >= 0.4) & (u < 0.45), -np.inf, d)
    d = np.where((u >= 0.45) & (u < 0.5), big, d)
    d[0] = np.inf
    d[1] = np.nan
    d[2] = np.inf
    d[2, -1] = np.nan
    return np.array(jnp.asarray(d, dtype))


def _kmin_cases(d, n):
    """k-min of ``d`` (masked: rows 0 .. 4 keep every column) for k = 1 on the default tiles,
    k = 3 on small ones, k = N (more than a masked row's columns) on tiles narrower than k; in
    one jit."""
    m = d.shape[0]
    cases = ((1, None, True), (3, (8, 16), True), (n, (4, 3), True))
    x, y = _rows(m, n)

    def run(d):
        return [
            foldax.pairwise_reduce(
                _lookup(d),
                x,
                y,
                reduction="kmin",
                k=c[0],
                block_size=c[1],
                mask=_mask if c[2] else None,
            )
            for c in cases
        ]

    return dict(zip(cases, jax.jit(run)(jnp.asarray(d)), strict=True))


def _check_kmin(d, outs):
    m, n = d.shape
    for (k, block, masked), (vals, idx) in outs.items():
        ref_vals, ref_idx = pairwise_reference(
            "kmin", d, k=k, valid=_valid(m, n) if masked else None
        )
        err = f"{d.dtype} k={k} block={block} mask={masked}"
        assert vals.dtype == d.dtype and idx.dtype == jnp.int32, err
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=err)
        np.testing.assert_array_equal(
            np.asarray(vals).astype(np.float64), ref_vals.astype(np.float64), err_msg=err
        )


# ----------------------------------------------------------------------------------------------
# k-min


@pytest.mark.slow
def test_kmin_int32_max_everywhere():
    """The report: every value int32 max (a common "unreachable" marker) took the value for an
    empty slot, and every row came back with indices [0, 0, 1]."""
    big = np.iinfo(np.int32).max

    def ker(a, b):
        return jnp.full((), big, jnp.int32) + 0 * (a[0] - b[0]).astype(jnp.int32)

    x, y = jnp.arange(6.0)[:, None], jnp.arange(5.0)[:, None]
    vals, idx = foldax.pairwise_reduce(ker, x, y, reduction="kmin", k=3)
    np.testing.assert_array_equal(np.asarray(idx), np.tile([0, 1, 2], (6, 1)))
    np.testing.assert_array_equal(np.asarray(vals), np.full((6, 3), big, np.int32))
    # masked: rows keep the columns j >= i; too few for k = 3 from row 3 on, none in row 5
    vals, idx = foldax.pairwise_reduce(ker, x, y, reduction="kmin", k=3, mask=lambda i, j: j >= i)
    want = [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, NO_INDEX], [4, NO_INDEX, NO_INDEX]]
    np.testing.assert_array_equal(np.asarray(idx), [*want, [NO_INDEX] * 3])
    np.testing.assert_array_equal(np.asarray(vals), np.full((6, 3), big, np.int32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_kmin_hamming(rng, dtype):
    """The report: k-min of a Hamming distance (population_count of an unsigned xor) raised an
    OverflowError for uint32 (min and argmin worked); against a stable argsort, ties by index."""
    bits = 8 * np.dtype(dtype).itemsize
    x = rng.integers(0, 2**bits, (40, 1), dtype=dtype)
    y = rng.integers(0, 2**bits, (300, 1), dtype=dtype)
    y[100:110] = y[:10]  # exact ties, in later tiles

    def ham(a, b):
        return jax.lax.population_count(a[0] ^ b[0])

    outs = jax.jit(
        lambda x, y: {
            k: foldax.pairwise_reduce(ham, x, y, reduction="kmin", k=k, block_size=(8, 32))
            for k in (1, 3, 20)
        }
    )(x, y)
    d = np.unpackbits((x ^ y.T)[..., None].view(np.uint8), axis=-1).sum(-1).astype(dtype)
    for k, (vals, idx) in outs.items():
        ref_idx = pairwise_reference("kmin", d, k=k)[1]
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(d, ref_idx, 1))
        assert vals.dtype == dtype
    # min / argmin of the same kernel (which worked) agree with k = 1
    mins = foldax.pairwise_reduce(ham, x, y, reduction="min")
    np.testing.assert_array_equal(np.asarray(mins), np.asarray(outs[1][0][:, 0]))
    arg = foldax.pairwise_reduce(ham, x, y, reduction="argmin")
    np.testing.assert_array_equal(np.asarray(arg), np.asarray(outs[1][1][:, 0]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", INTS, ids=lambda t: np.dtype(t).name)
def test_kmin_integers_at_their_ends(rng, dtype):
    m, n = 37, 300
    d = int_matrix(rng, dtype, m, n)
    _check_kmin(d, _kmin_cases(d, n))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", INTS_X64, ids=lambda t: np.dtype(t).name)
def test_kmin_64bit_integers_at_their_ends(rng, dtype):
    m, n = 37, 300
    with jax.enable_x64(True):
        d = int_matrix(rng, dtype, m, n)
        _check_kmin(d, _kmin_cases(d, n))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda t: np.dtype(t).name)
def test_kmin_floats_inf_nan_and_empty_slots(rng, dtype):
    """+inf before NaN, NaN last (by index), empty slots (NaN, int32 max) after them all."""
    m, n = 37, 300
    d = float_matrix(rng, dtype, m, n)
    _check_kmin(d, _kmin_cases(d, n))


@pytest.mark.slow
def test_kmin_float64_inf_nan_and_empty_slots(rng):
    with jax.enable_x64(True):
        d = float_matrix(rng, np.float64, 37, 300)
        _check_kmin(d, _kmin_cases(d, 300))


@pytest.mark.parametrize(
    "dtype", (np.float32, jnp.float16, np.int8, np.uint32), ids=lambda t: np.dtype(t).name
)
def test_kmin_small_problem_in_blocks_of_every_column(rng, dtype):
    """A problem within one tile takes blocks of rows by every column, each block's k best one
    top-k (no insertion loop: at most the outer loop over blocks is a ``while``); with a small
    budget the last block overlaps the one before it, whose rows it must leave as they are."""
    m, n = 37, 300
    d = float_matrix(rng, dtype, m, n) if dtype in FLOATS else int_matrix(rng, dtype, m, n)
    x, y = _rows(m, n)

    for budget in (None, "48KB"):  # a new function each: traced under its budget

        def run(d):
            return {
                k: foldax.pairwise_reduce(_lookup(d), x, y, reduction="kmin", k=k) for k in (5, n)
            }

        with foldax.memory_budget(budget) if budget else contextlib.nullcontext():
            lowered = jax.jit(run).lower(jnp.asarray(d))
            outs = jax.jit(run)(jnp.asarray(d))
        assert lowered.as_text().count("stablehlo.while") <= 2 * (budget is not None), budget
        for k, (vals, idx) in outs.items():
            ref_vals, ref_idx = pairwise_reference("kmin", d, k=k)
            err = f"{d.dtype} k={k} budget={budget}"
            np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=err)
            np.testing.assert_array_equal(
                np.asarray(vals).astype(np.float64), ref_vals.astype(np.float64), err_msg=err
            )


@pytest.mark.slow
def test_kmin_many_default_tiles_at_int32_max(rng):
    """Over many default tiles, rows whose k-th best is a real int32 max: later entries at the
    max lose to it (ties by index), the few below it win, wherever they come."""
    m, n = 64, 3000
    d = int_matrix(rng, np.int32, m, n)
    d[4:8] = np.iinfo(np.int32).max
    d[4, 2500] = 5  # one real entry late, in a row full at the max
    d[5, [10, 2999]] = np.iinfo(np.int32).max - 1
    x, y = _rows(m, n)
    outs = jax.jit(
        lambda d: {
            k: foldax.pairwise_reduce(_lookup(d), x, y, reduction="kmin", k=k) for k in (1, 5)
        }
    )(jnp.asarray(d))
    for k, (vals, idx) in outs.items():
        ref_vals, ref_idx = pairwise_reference("kmin", d, k=k)
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(vals), ref_vals, err_msg=f"k={k}")


# ----------------------------------------------------------------------------------------------
# argmin / argmax / min_argmin / max_argmax


def _check_args(d):
    m, n = d.shape
    x, y = _rows(m, n)
    names = ("argmin", "argmax", "min_argmin", "max_argmax")

    cases = [(r, masked, b) for r in names for masked in (False, True) for b in ((8, 16), None)]

    def run(d):
        return [
            foldax.pairwise_reduce(
                _lookup(d), x, y, reduction=r, block_size=b, mask=_mask if masked else None
            )
            for r, masked, b in cases
        ]

    for (r, masked, b), out in zip(cases, jax.jit(run)(jnp.asarray(d)), strict=True):
        both = "max_argmax" if "max" in r else "min_argmin"
        ref_vals, ref_idx = pairwise_reference(both, d, valid=_valid(m, n) if masked else None)
        err = f"{d.dtype} {r} mask={masked} block={b}"
        if r.startswith("arg"):
            np.testing.assert_array_equal(np.asarray(out), ref_idx, err_msg=err)
        else:
            np.testing.assert_array_equal(np.asarray(out[1]), ref_idx, err_msg=err)
            np.testing.assert_array_equal(
                np.asarray(out[0]).astype(np.float64), ref_vals.astype(np.float64), err_msg=err
            )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", INTS, ids=lambda t: np.dtype(t).name)
def test_arg_extremum_integers_at_their_ends(rng, dtype):
    """argmin of a row all at iinfo.max, argmax of one all at iinfo.min: the first index (not
    "none"); a row with every pair masked: int32 max, its value the identity."""
    d = int_matrix(rng, dtype, 37, 300)
    d[4] = np.iinfo(dtype).min
    _check_args(d)


@pytest.mark.slow
def test_arg_extremum_64bit_integers_at_their_ends(rng):
    with jax.enable_x64(True):
        for dtype in INTS_X64:
            d = int_matrix(rng, dtype, 37, 300)
            d[4] = np.iinfo(dtype).min
            _check_args(d)


@pytest.mark.slow
def test_arg_extremum_floats_inf_nan(rng):
    d = float_matrix(rng, np.float32, 37, 300)
    d[4] = -np.inf
    _check_args(d)


def test_argmin_int32_max_everywhere():
    big, small = np.iinfo(np.int32).max, np.iinfo(np.int32).min
    x, y = jnp.arange(6.0)[:, None], jnp.arange(5.0)[:, None]

    def const(c):
        return lambda a, b: jnp.full((), c, jnp.int32) + 0 * (a[0] - b[0]).astype(jnp.int32)

    for r, c in (("argmin", big), ("argmax", small)):
        np.testing.assert_array_equal(
            np.asarray(foldax.pairwise_reduce(const(c), x, y, reduction=r)), np.zeros(6), err_msg=r
        )
        out = foldax.pairwise_reduce(const(c), x, y, reduction=r, mask=lambda i, j: j >= i)
        np.testing.assert_array_equal(np.asarray(out), [0, 1, 2, 3, 4, NO_INDEX], err_msg=r)


# ----------------------------------------------------------------------------------------------
# reduction / k checks


def _dot(a, b):
    return jnp.sum(a * b)


X, Y = jnp.ones((4, 2), jnp.float32), jnp.ones((5, 2), jnp.float32)
KNOWN = ("'sum'", "'logsumexp'", "'max'", "'min'", "'argmax'", "'argmin'", "'kmin'", "'softmax'")

BAD = {
    # the report: an unknown reduction with k was blamed on k
    "kmax_with_k": (ValueError, ("reduction", "'kmax'", *KNOWN), dict(reduction="kmax", k=2)),
    "kmax": (ValueError, ("reduction", "'kmax'", *KNOWN), dict(reduction="kmax")),
    "unknown_with_bad_k": (ValueError, ("'median'", *KNOWN), dict(reduction="median", k=0)),
    "not_str": (TypeError, ("reduction", "NoneType", *KNOWN), dict(reduction=None)),
    "list": (TypeError, ("reduction", "list"), dict(reduction=["kmin"], k=2)),
    "k_zero": (ValueError, ("k = 0", "N = 5", "k >= 1"), dict(reduction="kmin", k=0)),
    "k_negative": (ValueError, ("k = -2", "k >= 1"), dict(reduction="kmin", k=-2)),
    "k_too_large": (ValueError, ("k = 6", "N = 5", "k <= 5"), dict(reduction="kmin", k=6)),
    "k_missing": (ValueError, ("k", "kmin", "N = 5"), dict(reduction="kmin")),
    "k_float": (TypeError, ("k", "float", "int"), dict(reduction="kmin", k=2.0)),
    "k_bool": (TypeError, ("k", "bool", "int"), dict(reduction="kmin", k=True)),
    "k_np_bool": (TypeError, ("k", "bool", "int"), dict(reduction="kmin", k=np.True_)),
    "k_str": (TypeError, ("k", "str"), dict(reduction="kmin", k="3")),
    "k_with_sum": (ValueError, ("k=2", "'sum'", "drop k"), dict(k=2)),
    "k_with_argmin": (ValueError, ("k=0", "'argmin'", "drop k"), dict(reduction="argmin", k=0)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_reduction_and_k_errors(case):
    """Each names the argument and says what to pass: ``<name>: <arg> ...; <fix>.``"""
    exc, words, kw = BAD[case]
    with pytest.raises(exc) as info:
        foldax.pairwise_reduce(_dot, X, Y, **kw)
    msg = str(info.value)
    assert msg.startswith(f"{NAME}: ") and "; " in msg and msg.endswith("."), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.slow
def test_k_numpy_int_and_no_rows():
    vals, idx = foldax.pairwise_reduce(_dot, X, Y, reduction="kmin", k=np.int64(2))
    assert vals.shape == idx.shape == (4, 2)
    with pytest.raises(ValueError, match=r"N = 0.*at least k rows"):
        foldax.pairwise_reduce(_dot, X, Y[:0], reduction="kmin", k=1)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 5, 9, 10])
def test_kmin_topk_merge_over_many_tiles_and_blocks(rng, k):
    """Rows with one, two or many candidates per tile (ties, +inf, NaN, a mask), narrow tiles
    so that more rows need a tile's top k than one gathered block holds (k up to
    ``KMin.TOPK_UP_TO``; above, the entry-by-entry path), against a stable sort."""
    m, n = 150, 700
    d = rng.integers(0, 40, (m, n)).astype(np.float32)
    u = rng.random((m, n))
    d = np.where(u < 0.05, np.inf, np.where(u > 0.97, np.nan, d))
    d[:5] = np.sort(d[:5], axis=1)[:, ::-1]  # descending rows: every tile beats the last
    x, y = _rows(m, n)
    keep = lambda i, j: (i + j) % 7 != 0  # noqa: E731
    valid = (np.arange(m)[:, None] + np.arange(n)[None, :]) % 7 != 0
    for block in ((64, 32), (150, 128), None):
        vals, idx = jax.jit(
            lambda d, block=block: foldax.pairwise_reduce(
                _lookup(d), x, y, reduction="kmin", k=k, block_size=block, mask=keep
            )
        )(jnp.asarray(d))
        ref_vals, ref_idx = pairwise_reference("kmin", d, k=k, valid=valid)
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=f"{block}")
        np.testing.assert_array_equal(np.asarray(vals), ref_vals, err_msg=f"{block}")
