"""foldax.pairwise_reduce against the registry's float64 NumPy references (one per reduction,
on the dense kernel matrix) and dense jnp gradients: every reduction on pytree, array, complex,
integer, NaN and half-precision kernels; k-min over many tiles; softmax (attention); the
weighted log-sum-exp; min / max with their index in one pass; masks that remove pairs and skip
tiles (causal, sliding-window, block-sparse); gradients, vmap and jit; memory flat in M * N; and
the errors.

Most tests evaluate several reductions inside one ``jax.jit`` (compiling dominates the run time)
and report every reduction that fails. ``M = 37`` and ``N = 53`` are multiples of no block size.
Edge cases of the index reductions (values at the ends of the dtype) are in
test_pairwise_edges.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_allclose,
    data_scale,
    dense_matrix,
    pairwise_dense,
    pairwise_reference,
    tol,
)
from helpers import check_each as _check_each_segment
from jax import lax
from jax.test_util import check_grads

import foldax
from foldax._engine._budget import DEFAULT_BUDGET
from foldax.memory import report


def check_each(names, check):
    """``helpers.check_each`` with plain names in its failure messages."""
    _check_each_segment(names, check, prefix="")


F32 = np.float32
M, N = 37, 53
NAME = "foldax.pairwise_reduce"
#: Reductions with a real (M, *F) float output, differentiable.
FLOAT_REDUCTIONS = ("sum", "logsumexp", "max", "min")
INDEX_REDUCTIONS = ("argmax", "argmin")


def dense_reduce(reduction, kernel, x, y, k=None):
    """The registry's plain-jnp reference of ``pairwise_reduce(kernel, x, y, reduction)``
    (differentiable; float outputs only)."""
    return pairwise_dense(reduction, dense_matrix(kernel, x, y), k=k)


# ----------------------------------------------------------------------------------------------
# Kernels (jnp) with their dense float64 NumPy matrices


def k_tree(xi, yj):
    """Pytree rows: ``xi = {"p": (3,), "s": ()}``, ``yj = (q (3,), c ())``."""
    q, c = yj
    return xi["s"] * jnp.sum((xi["p"] - q) ** 2) + c


def np_tree(x, y):
    p, s = (np.asarray(x[k], np.float64) for k in ("p", "s"))
    q, c = (np.asarray(a, np.float64) for a in y)
    return s[:, None] * ((p[:, None] - q[None]) ** 2).sum(-1) + c[None]


def k_vec(xi, yj):
    """Array output ``F = (2,)``."""
    return jnp.stack([-jnp.sum((xi - yj) ** 2), jnp.sum(xi * yj)])


def np_vec(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.stack([-((x[:, None] - y[None]) ** 2).sum(-1), x @ y.T], axis=-1)


def k_complex(xi, yj):
    return jnp.exp(lax.complex(-jnp.sum((xi - yj) ** 2), jnp.sum(xi * yj)))


def np_complex(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.exp(-((x[:, None] - y[None]) ** 2).sum(-1) + 1j * (x @ y.T))


def k_nan(xi, yj):
    """Squared distance, NaN where the labels of the two rows agree."""
    (p, a), (q, b) = xi, yj
    return jnp.where(a == b, jnp.nan, jnp.sum((p - q) ** 2))


def np_nan(x, y):
    (p, a), (q, b) = x, y
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    d = ((p[:, None] - q[None]) ** 2).sum(-1)
    return np.where(np.asarray(a)[:, None] == np.asarray(b)[None], np.nan, d)


def integer_tree(rng, m=M, n=N):
    """Integer-valued float32 pytree data: the kernel is exact in float32 and full of ties, and
    ``y`` has duplicate rows (1, 17, 40 = 5; 30 = 31 = 52)."""
    x = {
        "p": rng.integers(-2, 3, (m, 3)).astype(F32),
        "s": rng.choice(np.array([-1.0, 1.0, 2.0], F32), m),
    }
    q = rng.integers(-2, 3, (n, 3)).astype(F32)
    c = rng.integers(-3, 4, n).astype(F32)
    for dup, src in ((1, 5), (17, 5), (40, 5), (30, 31), (52, 31)):
        q[dup], c[dup] = q[src], c[src]
    return x, (q, c)


def normal_tree(rng, m=M, n=N):
    x = {
        "p": rng.standard_normal((m, 3)).astype(F32),
        "s": rng.uniform(0.5, 1.5, m).astype(F32),
    }
    return x, (rng.standard_normal((n, 3)).astype(F32), rng.standard_normal(n).astype(F32))


def _separated_rows(d, k, gap):
    """Rows of ``d`` ``(M, N)`` whose ``k + 1`` smallest and 2 largest values are ``gap`` apart:
    there float32 rounding cannot reorder the indices of argmin / argmax / kmin."""
    s = np.sort(d, axis=1)
    low = np.all(np.diff(s[:, : k + 1], axis=1) > gap, axis=1)
    return low & (s[:, -1] - s[:, -2] > gap)


def _check_all(outs, d, k, *, exact=True, err=""):
    """Every entry of ``outs`` (by reduction name) against the float64 reference on ``d``.

    ``exact``: ``d`` is exactly representable in float32 (ties are real ties), so every index
    must equal NumPy's; otherwise only rows without float32-level near-ties are compared.
    """
    scale = data_scale(d)
    rows = np.ones(d.shape[0], bool)
    if not exact:
        rows = _separated_rows(d, k or 1, 1e-4 * scale)
        assert rows.mean() > 0.8, rows

    def check(r):
        ref = pairwise_reference(r, d, k=k)
        if r in INDEX_REDUCTIONS:
            assert outs[r].dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(outs[r])[rows], ref[rows], err_msg=err)
        elif r == "kmin":
            vals, idx = outs[r]
            assert vals.dtype == jnp.float32 and idx.dtype == jnp.int32
            np.testing.assert_array_equal(
                np.asarray(idx)[rows], ref[1][rows], err_msg=f"kmin indices {err}"
            )
            assert_allclose(vals, ref[0], dtype=F32, scale=scale, err_msg=err)
        else:
            # a sum's rounding error grows with the magnitude of the terms it adds
            s = np.nanmax(np.abs(d).sum(1), initial=1.0) if r == "sum" else scale
            assert outs[r].dtype == jnp.float32
            assert_allclose(outs[r], ref, dtype=F32, scale=s, err_msg=err)

    check_each(list(outs), check)


def _run_all(kernel, x, y, reductions, block_size, k=None):
    def call(x, y):
        return {
            r: foldax.pairwise_reduce(
                kernel, x, y, reduction=r, block_size=block_size, k=k if r == "kmin" else None
            )
            for r in reductions
        }

    return jax.jit(call)(x, y)


# ----------------------------------------------------------------------------------------------
# Values against float64 NumPy


ALL_SCALAR = (*FLOAT_REDUCTIONS, *INDEX_REDUCTIONS, "kmin")


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_size",
    [(8, 16), 64, None, (1, 5)],
    ids=["8x16", "larger_than_M_N", "default", "1x5"],
)
def test_all_reductions_integer_data_with_ties(block_size, rng):
    """Exact kernel values with many ties and duplicate rows of y: indices equal NumPy's."""
    x, y = integer_tree(rng)
    outs = _run_all(k_tree, x, y, ALL_SCALAR, block_size, k=7)
    _check_all(outs, np_tree(x, y), 7, err=f"block_size={block_size}")


@pytest.mark.slow
def test_all_reductions_continuous_data(rng):
    x, y = normal_tree(rng)
    y[1][:] *= 10.0  # larger offsets: logsumexp is dominated by a few columns
    outs = _run_all(k_tree, x, y, ALL_SCALAR, (8, 16), k=5)
    _check_all(outs, np_tree(x, y), 5, exact=False)


@pytest.mark.slow
def test_array_output(rng):
    """Kernel output ``F = (2,)``: every reduction (except kmin) per feature."""
    x = rng.integers(-2, 3, (M, 3)).astype(F32)
    y = rng.integers(-2, 3, (N, 3)).astype(F32)
    y[[10, 30]] = y[3]
    reds = (*FLOAT_REDUCTIONS, *INDEX_REDUCTIONS)
    outs = _run_all(k_vec, x, y, reds, (8, 16))
    assert outs["sum"].shape == (M, 2) and outs["argmax"].shape == (M, 2)
    _check_all(outs, np_vec(x, y), None)


@pytest.mark.parametrize("block_size", [(8, 16), 64])
def test_complex_sum(block_size, rng):
    x = rng.standard_normal((M, 3)).astype(F32)
    y = rng.standard_normal((N, 3)).astype(F32)
    out = jax.jit(lambda x, y: foldax.pairwise_reduce(k_complex, x, y, block_size=block_size))(x, y)
    assert out.dtype == jnp.complex64 and out.shape == (M,)
    ref = pairwise_reference("sum", np_complex(x, y))
    scale = np.abs(np_complex(x, y)).sum(1).max()
    assert_allclose(
        np.stack([out.real, out.imag]), np.stack([ref.real, ref.imag]), dtype=F32, scale=scale
    )


@pytest.mark.slow
def test_nan_entries(rng):
    """NaN counts as the extreme for argmax/argmin (first NaN wins), propagates through
    sum/logsumexp/max/min and sorts last (stably, by index) in kmin, like NumPy."""
    p = rng.integers(-2, 3, (M, 3)).astype(F32)
    q = rng.integers(-2, 3, (N, 3)).astype(F32)
    a = rng.integers(0, 10, M).astype(np.int32)
    a[M // 2 :] = -1  # rows that never match: no NaN
    b = rng.integers(0, 10, N).astype(np.int32)
    a[0] = 99
    b[3:] = np.where(np.arange(3, N) % 17 == 0, b[3:], 99)  # row 0: 7 finite entries
    b[N - 1] = a[1] = 50  # row 1: one NaN, in the last column (the clamped block)
    x, y = (p, a), (q, b)
    d = np_nan(x, y)
    assert np.isnan(d).any(axis=1).sum() > 5 and (~np.isnan(d)).any(axis=1).all()
    assert (~np.isnan(d[0])).sum() < 8 and np.flatnonzero(np.isnan(d[1])).tolist() == [N - 1]
    outs = _run_all(k_nan, x, y, ALL_SCALAR, (8, 16), k=8)
    _check_all(outs, d, 8)


@pytest.mark.slow
def test_kmin_full_sort_and_k_larger_than_block(rng):
    x, y = integer_tree(rng)
    d = np_tree(x, y)

    def call(x, y):
        return {
            n: foldax.pairwise_reduce(k_tree, x, y, reduction="kmin", k=n, block_size=(8, 4))
            for n in (1, 20, N)
        }

    outs = jax.jit(call)(x, y)
    for n, (vals, idx) in outs.items():
        ref_vals, ref_idx = pairwise_reference("kmin", d, k=n)
        assert vals.shape == idx.shape == (M, n)
        np.testing.assert_array_equal(idx, ref_idx, err_msg=f"k={n}")
        np.testing.assert_array_equal(vals, ref_vals, err_msg=f"k={n}")


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 5, 32])
def test_kmin_over_many_tiles_ties_and_nan(rng, k):
    """k-min over many tiles (the k-th best filters them) is exact: a stable sort by (NaN last,
    value, index); with ties across tiles, a NaN row of x (every column ties: the lowest indices
    win) and NaN columns of y (never among the k best of a row without NaN)."""
    m, n = 45, 700
    x = rng.standard_normal((m, 3)).astype(np.float32)
    y = rng.standard_normal((n, 3)).astype(np.float32)
    y[600:610] = y[3:13]  # exact ties, in different tiles
    x[5] = y[650]
    y[[20, 300]] = np.nan  # NaN columns: never among the k best of a row without NaN
    x[7] = np.nan  # a row of NaN only: every column ties, the lowest indices win
    d = -np.asarray(jax.jit(jax.vmap(jax.vmap(_sqdist, (None, 0)), (0, None)))(x, y))
    ref_idx = pairwise_reference("kmin", d, k=k)[1]
    outs = jax.jit(
        lambda x, y: {
            str(b): foldax.pairwise_reduce(
                lambda a, b: -_sqdist(a, b), x, y, reduction="kmin", k=k, block_size=b
            )
            for b in (None, (16, 64), (8, 16))
        }
    )(x, y)
    for b, (vals, idx) in outs.items():
        np.testing.assert_array_equal(np.asarray(idx), ref_idx, err_msg=f"block {b}")
        assert_allclose(vals, np.take_along_axis(d, ref_idx, 1), dtype=np.float32, err_msg=b)


@pytest.mark.parametrize("t", [1, 7, 256, 257, 700, 1024])
def test_kmin_hit_counts_exact(rng, t):
    """The per-row count and column sum k-min reads off one float32 pass, exact for every count
    (in chunks of 256 columns, the last one padded); rows with none, all, one or two true."""
    from foldax._reductions._kmin import _hits

    hit = rng.random((64, t)) < rng.random((64, 1))
    hit[0], hit[1] = False, True
    hit[2], hit[2, t - 1] = False, True
    if t > 1:
        hit[3], hit[3, [0, t - 1]] = False, True
    c, colsum = jax.jit(_hits)(jnp.asarray(hit))
    np.testing.assert_array_equal(np.asarray(c), hit.sum(1))
    np.testing.assert_array_equal(np.asarray(colsum), (hit * np.arange(t)).sum(1))


@pytest.mark.slow
@pytest.mark.parametrize("k, block", [(1, None), (5, None), (64, None), (5, (64, 700))])
def test_kmin_many_tiles_inf_nan_and_mask(rng, k, block):
    """k-min over many tiles (the default 256 wide, and wider ones, counted in chunks), where
    rows take one entry per tile (vectorised) or several (the whole tile at once, or a few rows
    gathered, in column or value order): +inf and NaN entries, exact ties across tiles, a mask;
    against a stable NumPy sort by (NaN last, value, index)."""
    m, n = 300, 5000
    x = rng.standard_normal((m, 2)).astype(np.float32)
    y = rng.standard_normal((n, 2)).astype(np.float32)
    y[4000:4100] = y[:100]  # ties across tiles
    flag = np.zeros(n, np.float32)
    flag[rng.choice(n, 40, replace=False)] = np.inf
    flag[rng.choice(n, 40, replace=False)] = np.nan
    x[:10, 0] = 2.0  # rows that ignore the flags: no inf / NaN

    def ker(a, b):
        return jnp.sum((a - b[0]) ** 2) + jnp.where(a[0] > 1.5, 0.0, b[1])

    def mask(i, j):
        return (j % 7 != 0) | (i < 200)

    vals, idx = jax.jit(
        lambda x, y: foldax.pairwise_reduce(
            ker, x, (y, flag), reduction="kmin", k=k, mask=mask, block_size=block
        )
    )(x, y)
    d = ((x[:, None] - y[None]) ** 2).sum(-1) + np.where(x[:, :1] > 1.5, 0.0, flag[None])
    j = np.broadcast_to(np.arange(n), d.shape)
    out = (j % 7 == 0) & (np.arange(m)[:, None] >= 200)  # masked: after everything
    ref_vals, ref = pairwise_reference("kmin", d, k=k, valid=~out)  # by value, then index
    np.testing.assert_array_equal(np.asarray(idx), ref)
    assert_allclose(vals, ref_vals, dtype=np.float32)


@pytest.mark.slow
def test_extremum_on_its_preferred_block(rng):
    """min / max / argmin / argmax on the planner's block for them ((8, 1024): a clamped last
    block of y) with ties, NaN (first NaN wins, also in the clamped block) and NaN-only rows;
    and the rule that picks that block."""
    from foldax._engine._plan import dense_block

    assert dense_block(2**14, 20_000, 20_000, (8, 1024)) == (8, 1024)
    assert dense_block(2**14, 500, 100, (8, 1024)) == (81, 100)  # as many pairs as asked
    assert dense_block(2**13, 500, 20_000, (8, 1024)) == (8, 1024)
    assert dense_block(2**11, 500, 20_000, (8, 1024)) == (2, 1024)  # within the budget
    assert dense_block(2**9, 500, 20_000, (8, 1024)) == dense_block(2**9, 500, 20_000)
    m, n = 21, 2500
    p = rng.integers(-3, 4, (m, 3)).astype(F32)
    q = rng.integers(-3, 4, (n, 3)).astype(F32)
    a = np.full(m, -1, np.int32)
    a[:4] = [0, 1, 2, 3]
    b = np.full(n, -2, np.int32)
    b[[2401, 1500, 7, 1030, 2499]] = [0, 1, 1, 2, 2]  # row 0: NaN in the clamped block only
    b[1024:] = np.where(np.arange(1024, n) % 3 == 0, 3, b[1024:])  # row 3: NaN from column 1026
    d = np_nan((p, a), (q, b))
    assert np.isnan(d[:4]).any(axis=1).all() and not np.isnan(d[4:]).any()
    names = ("min", "max", "argmin", "argmax")
    outs = jax.jit(
        lambda x, y: {r: foldax.pairwise_reduce(k_nan, x, y, reduction=r) for r in names}
    )((p, a), (q, b))
    ref = {r: pairwise_reference(r, d) for r in names}
    for r in names:
        np.testing.assert_array_equal(np.asarray(outs[r]), ref[r], err_msg=r)


def test_integer_kernel_argmin_max(rng):
    xi = rng.integers(0, 10, (M, 2)).astype(np.int32)
    yi = rng.integers(0, 10, (N, 2)).astype(np.int32)

    def ker(a, b):
        return jnp.sum(jnp.abs(a - b))

    d = np.abs(xi[:, None].astype(np.int64) - yi[None]).sum(-1)
    outs = _run_all(ker, xi, yi, ("sum", "max", "min", "argmax", "argmin"), (8, 16))
    for r, out in outs.items():
        assert out.dtype == jnp.int32, r
        np.testing.assert_array_equal(out, pairwise_reference(r, d), err_msg=r)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_kmin_ties(rng, dtype):
    """k-min of a half-precision kernel over the default tiles: small whole numbers (exact in
    that dtype however XLA rounds the steps, and tied everywhere, also at a row's k-th best)
    and NaN, which sorts last; against a stable sort of the same values."""
    x = jnp.asarray(rng.integers(0, 8, (150, 2)), dtype)
    y = jnp.asarray(rng.integers(0, 8, (2000, 2)), dtype)
    y = y.at[::97, 0].set(jnp.nan)

    def ker(a, b):
        return jnp.sum((a - b) ** 2)

    vals, idx = jax.jit(lambda x, y: foldax.pairwise_reduce(ker, x, y, reduction="kmin", k=7))(x, y)
    d = np.asarray(jax.vmap(lambda a: jax.vmap(lambda b: ker(a, b))(y))(x), np.float32)
    ref_vals, ref = pairwise_reference("kmin", d, k=7)  # NaN last, then index
    assert vals.dtype == dtype
    np.testing.assert_array_equal(np.asarray(idx), ref)
    np.testing.assert_array_equal(np.asarray(vals, np.float32), ref_vals)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("m, n, block", [(M, N, (8, 16)), (200, 3000, None)])
def test_integer_kernel_kmin(rng, m, n, block):
    """Integer k-min, on small tiles and on the default ones (a few values: ties everywhere, so
    rows insert several entries per tile, in column or value order)."""
    xi = rng.integers(0, 10, (m, 2)).astype(np.int32)
    yi = rng.integers(0, 10, (n, 2)).astype(np.int32)
    d = np.abs(xi[:, None].astype(np.int64) - yi[None]).sum(-1)
    vals, idx = foldax.pairwise_reduce(
        lambda a, b: jnp.sum(jnp.abs(a - b)), xi, yi, reduction="kmin", k=4, block_size=block
    )
    ref_vals, ref_idx = pairwise_reference("kmin", d, k=4)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(vals, ref_vals)


@pytest.mark.slow
@pytest.mark.parametrize("vshape", [(), (3,)])
def test_softmax(vshape, rng):
    """Exact attention ``sum_j softmax_j(logit) value_j``, value scalar or ``(3,)``."""
    x = rng.standard_normal((M, 3)).astype(F32)
    y = rng.standard_normal((N, 3)).astype(F32)
    y[:5] *= 20.0  # logits spread over ~1000: the shift matters

    def ker(a, b):
        v = jnp.tanh(a + b) if vshape else jnp.sum(a * b)
        return -jnp.sum((a - b) ** 2), v

    xd, yd = x.astype(np.float64), y.astype(np.float64)
    logits = -((xd[:, None] - yd[None]) ** 2).sum(-1)
    vals = np.tanh(xd[:, None] + yd[None]) if vshape else np.einsum("id,jd->ij", xd, yd)
    ref = pairwise_reference("softmax", (logits, vals))
    for bs in [(8, 16), 64]:
        f = jax.jit(
            lambda x, y, bs=bs: foldax.pairwise_reduce(
                ker, x, y, reduction="softmax", block_size=bs
            )
        )
        out = f(x, y)
        assert out.shape == (M, *vshape) and out.dtype == jnp.float32
        assert_allclose(out, ref, dtype=F32, scale=data_scale(vals), err_msg=f"{bs}")


def test_softmax_very_negative_logits(rng):
    """Logits ~ -1000 (exp underflows in float32): the running shift keeps the result exact."""
    x = rng.standard_normal((M, 2)).astype(F32)
    y = rng.standard_normal((N, 2)).astype(F32)

    def ker(a, b):
        return jnp.sum(a * b) - 1000.0, b

    xd, yd = x.astype(np.float64), y.astype(np.float64)
    ref = pairwise_reference("softmax", (xd @ yd.T - 1000.0, np.broadcast_to(yd[None], (M, N, 2))))
    out = foldax.pairwise_reduce(ker, x, y, reduction="softmax", block_size=(8, 16))
    assert_allclose(out, ref, dtype=F32, scale=1000.0)


def test_softmax_under_strict_promotion():
    x = jnp.zeros((3, 1), jnp.float32)
    y = jnp.arange(5.0, dtype=jnp.float32).reshape(5, 1)
    out = foldax.pairwise_reduce(lambda a, b: (jnp.sum(a - b), b), x, y, reduction="softmax")
    logits = -np.arange(5.0)[None].repeat(3, 0)
    ref = pairwise_reference("softmax", (logits, np.arange(5.0)[None, :, None].repeat(3, 0)))
    assert_allclose(out, ref, dtype=F32)


# ----------------------------------------------------------------------------------------------
# The weighted log-sum-exp: a kernel returning (logit, weight)


def _sq(a, b):
    return -jnp.sum((a - b) ** 2)


def _weighted_kernel(a, b):
    yj, wj = b
    return _sq(a, yj), wj


def _weighted_reference(x, y, w):
    """The registry's weighted log-sum-exp of ``_weighted_kernel``, in float64."""
    d = -((np.asarray(x, np.float64)[:, None] - np.asarray(y, np.float64)[None]) ** 2).sum(-1)
    return pairwise_reference("weighted_logsumexp", (d, w))


@pytest.mark.parametrize(("m", "n", "block"), [(30, 50, None), (7, 129, (4, 16)), (1, 1, None)])
def test_weighted_logsumexp_matches_float64(rng, m, n, block):
    x = rng.standard_normal((m, 2)).astype(np.float32)
    y = rng.standard_normal((n, 2)).astype(np.float32) * 3
    w = rng.uniform(0, 2, n).astype(np.float32)
    w[::3] = 0.0
    if n > 1:
        w[0] = 1e-30  # tiny but positive: it still counts
    got = foldax.pairwise_reduce(
        _weighted_kernel, x, (y, w), reduction="logsumexp", block_size=block
    )
    assert_allclose(got, _weighted_reference(x, y, w), dtype=np.float32, scale=20)


@pytest.mark.slow
def test_weighted_logsumexp_gradients(rng):
    x = rng.standard_normal((12, 2)).astype(np.float32)
    y = rng.standard_normal((40, 2)).astype(np.float32)
    w = rng.uniform(0.1, 2, 40).astype(np.float32)

    def f(x, w):
        return foldax.pairwise_reduce(_weighted_kernel, x, (y, w), reduction="logsumexp")

    assert np.isfinite(jax.jit(f)(x, w)).all()  # check_grads passes NaNs matching NaNs
    check_grads(jax.jit(f), (x, w), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
    # at a zero weight the derivative is exp(l - out): finite, not NaN
    w0 = w.copy()
    w0[5] = 0.0
    gw = jax.grad(lambda w: f(x, w).sum())(w0)
    d = -((x.astype(np.float64)[:, None] - y.astype(np.float64)[None]) ** 2).sum(-1)
    want = np.exp(d - _weighted_reference(x, y, w0)[:, None]).sum(0)
    assert_allclose(gw, want, dtype=np.float32, scale=10)


@pytest.mark.slow
def test_weighted_logsumexp_of_all_zero_weights_is_minus_inf_with_zero_gradients():
    x, y = jnp.ones((3, 2)), jnp.zeros((5, 2))
    w = jnp.zeros(5)
    out = foldax.pairwise_reduce(_weighted_kernel, x, (y, w), reduction="logsumexp")
    assert np.all(np.asarray(out) == -np.inf)
    g = jax.grad(
        lambda x: jnp.sum(
            jnp.where(
                jnp.isfinite(
                    o := foldax.pairwise_reduce(_weighted_kernel, x, (y, w), reduction="logsumexp")
                ),
                o,
                0.0,
            )
        )
    )(x)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g) == 0)


# ----------------------------------------------------------------------------------------------
# min / max with their index in one pass


@pytest.mark.slow
@pytest.mark.parametrize("is_max", [False, True])
def test_extremum_with_index_in_one_pass(rng, is_max):
    x = rng.standard_normal((33, 3)).astype(np.float32)
    y = rng.standard_normal((150, 3)).astype(np.float32)
    y[100] = y[7]  # exact ties: the lower index wins
    y[40, 0] = np.nan  # a NaN distance is the extreme, like NumPy
    kernel = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    both, plain, arg = (
        ("max_argmax", "max", "argmax") if is_max else ("min_argmin", "min", "argmin")
    )
    val, idx = foldax.pairwise_reduce(kernel, x, y, reduction=both, block_size=(8, 32))
    d = ((x.astype(np.float64)[:, None] - y.astype(np.float64)[None]) ** 2).sum(-1)
    want_val, want_idx = pairwise_reference(both, d)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(idx, foldax.pairwise_reduce(kernel, x, y, reduction=arg))
    assert_allclose(val, want_val, dtype=np.float32, scale=10)
    finite = np.delete(y, 40, axis=0)
    f_both = lambda x: foldax.pairwise_reduce(kernel, x, finite, reduction=both)[0]  # noqa: E731
    f_plain = lambda x: foldax.pairwise_reduce(kernel, x, finite, reduction=plain)  # noqa: E731
    g = jax.grad(lambda x: f_both(x).sum())(x)
    assert_allclose(g, jax.grad(lambda x: f_plain(x).sum())(x), dtype=np.float32)
    t = jax.jvp(f_both, (x,), (np.ones_like(x),))[1]
    assert_allclose(t, jax.jvp(f_plain, (x,), (np.ones_like(x),))[1], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Masks: pairs removed, tiles skipped


def _attention(q, k, v, mask=None, block=None):
    kernel = lambda qi, kv: (jnp.dot(qi, kv[0]) / 4.0, kv[1])  # noqa: E731
    return foldax.pairwise_reduce(
        kernel, q, (k, v), reduction="softmax", mask=mask, block_size=block
    )


def _masked_attention_reference(q, k, v, keep):
    """The registry's masked softmax of ``_attention``'s kernel, in float64."""
    logits = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / 4.0
    vals = np.broadcast_to(np.asarray(v, np.float64)[None], (*logits.shape, v.shape[-1]))
    return pairwise_reference("softmax", (logits, vals), valid=keep)


MASKS = {
    "causal": lambda i, j: j <= i,
    "window": lambda i, j: (j <= i) & (j > i - 20),
    "block-sparse": lambda i, j: (i // 16) % 2 == (j // 16) % 2,
    "empty rows": lambda i, j: (j < i) & (i % 5 != 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("block", [None, (8, 16), (5, 7)])
def test_masked_attention_matches_dense(rng, name, block):
    m, n = 70, 90
    q, k, v = (rng.standard_normal((s, 4)).astype(np.float32) for s in (m, n, n))
    keep = np.asarray(MASKS[name](np.arange(m)[:, None], np.arange(n)[None, :]))
    keep = np.broadcast_to(keep, (m, n))
    got = _attention(q, k, v, MASKS[name], block)
    assert_allclose(got, _masked_attention_reference(q, k, v, keep), dtype=np.float32, scale=10)

    def dense(q, k, v):
        vals = jnp.broadcast_to(v[None], (m, *v.shape))
        return pairwise_dense("softmax", (q @ k.T / 4.0, vals), valid=keep)

    g = jax.grad(lambda *a: jnp.sum(jnp.sin(_attention(*a, MASKS[name], block))), (0, 1, 2))(
        q, k, v
    )
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), (0, 1, 2))(q, k, v)
    for a, b in zip(g, want, strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        assert_allclose(a, b, dtype=np.float32, scale=10)


@pytest.mark.parametrize(
    "reduction",
    [
        pytest.param("sum", marks=pytest.mark.slow),
        pytest.param("logsumexp", marks=pytest.mark.slow),
        "min",
        "argmin",
        "min_argmin",
    ],
)
def test_masked_reductions_match_dense(rng, reduction):
    x = rng.standard_normal((40, 2)).astype(np.float32)
    y = rng.standard_normal((60, 2)).astype(np.float32)
    mask = lambda i, j: (j >= i) & (i != 3)  # noqa: E731  (row 3 fully masked)
    keep = np.asarray(mask(np.arange(40)[:, None], np.arange(60)[None, :]))
    d = -((x.astype(np.float64)[:, None] - y.astype(np.float64)[None]) ** 2).sum(-1)
    kernel = lambda a, b: -jnp.sum((a - b) ** 2)  # noqa: E731
    got = foldax.pairwise_reduce(kernel, x, y, reduction=reduction, mask=mask, block_size=(8, 16))
    want = {r: pairwise_reference(r, d, valid=keep) for r in ("sum", "logsumexp", "min")}
    if reduction == "sum":
        got = foldax.pairwise_reduce(lambda a, b: -jnp.sum((a - b) ** 2), x, y, mask=mask)
        assert_allclose(got, want["sum"], dtype=np.float32, scale=50)
    elif reduction in ("argmin", "min_argmin"):
        idx = got[1] if reduction == "min_argmin" else got
        want_idx = pairwise_reference("argmin", d, valid=keep)
        live = keep.any(1)
        np.testing.assert_array_equal(np.asarray(idx)[live], want_idx[live])
        assert np.asarray(idx)[3] == np.iinfo(np.int32).max
    else:
        assert_allclose(got, want[reduction], dtype=np.float32, scale=50)
    if reduction in ("logsumexp", "sum"):
        f = lambda x: foldax.pairwise_reduce(kernel, x, y, reduction=reduction, mask=mask)  # noqa: E731
        g = jax.grad(lambda x: jnp.sum(jnp.where(jnp.isfinite(f(x)), f(x), 0.0)))(x)
        assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[3] == 0)


def test_mask_errors():
    x = jnp.ones((4, 2))
    dot = lambda a, b: jnp.sum(a * b)  # noqa: E731
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask must be a callable"):
        foldax.pairwise_reduce(dot, x, x, mask=True)
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask\(i, j\) must return one boolean"):
        foldax.pairwise_reduce(dot, x, x, mask=lambda i, j: i + j)
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask\(i, j\) failed"):
        foldax.pairwise_reduce(dot, x, x, mask=lambda i, j: i.nonexistent)


# ----------------------------------------------------------------------------------------------
# Gradients


def _grad_inputs(rng, m=M, n=N, d=3):
    x = {"p": rng.standard_normal((m, d)).astype(F32), "s": rng.uniform(0.5, 1.5, m).astype(F32)}
    y = (rng.standard_normal((n, d)).astype(F32), rng.standard_normal(n).astype(F32))
    theta = rng.uniform(0.5, 1.5, d).astype(F32)
    return x, y, theta


def _param_kernel(theta):
    def ker(xi, yj):
        q, c = yj
        return -xi["s"] * jnp.sum(theta * (xi["p"] - q) ** 2) + c

    return ker


def _softmax_param_kernel(theta):
    def ker(xi, yj):
        q, c = yj
        return -jnp.sum(theta * (xi["p"] - q) ** 2), jnp.tanh(xi["p"] * c + q) * xi["s"]

    return ker


def _loss(reduction, block_size, w, k=None, dense=False):
    """``sum(out * w)``: a non-trivial cotangent. kmin: its values only."""

    def loss(x, y, theta):
        ker = (_softmax_param_kernel if reduction == "softmax" else _param_kernel)(theta)
        if dense:
            out = dense_reduce(reduction, ker, x, y, k=k)
        else:
            out = foldax.pairwise_reduce(ker, x, y, reduction=reduction, k=k, block_size=block_size)
        if reduction == "kmin":
            out = out[0]
        return jnp.sum(out * w)

    return loss


def _assert_grads_close(got, want, err):
    for g, r, path in zip(
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        ["x.p", "x.s", "y.q", "y.c", "theta"],
        strict=True,
    ):
        # the gradient of theta sums M * N terms, of y over M, of x over N: cancellation
        assert_allclose(g, r, dtype=F32, scale=10 * data_scale(r), err_msg=f"{err} d/d{path}")


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [(8, 16)])
def test_grads_vs_dense(block_size, rng):
    """Gradients wrt pytree x, pytree y and a closed-over parameter, every float reduction."""
    x, y, theta = _grad_inputs(rng)
    reds = (*FLOAT_REDUCTIONS, "kmin", "softmax")
    k = 4
    ws = {
        r: rng.standard_normal(
            (M, k) if r == "kmin" else (M, 3) if r == "softmax" else (M,)
        ).astype(F32)
        for r in reds
    }

    def grads(dense):
        return {
            r: jax.grad(
                _loss(r, block_size, ws[r], k if r == "kmin" else None, dense), argnums=(0, 1, 2)
            )
            for r in reds
        }

    got = jax.jit(lambda *a: {r: g(*a) for r, g in grads(False).items()})(x, y, theta)
    want = jax.jit(lambda *a: {r: g(*a) for r, g in grads(True).items()})(x, y, theta)
    check_each(reds, lambda r: _assert_grads_close(got[r], want[r], r))


@pytest.mark.slow
def test_grads_array_output_and_complex(rng):
    """``F = (2,)`` outputs (every float reduction) and a complex kernel (sum)."""
    x = rng.standard_normal((M, 3)).astype(F32)
    y = rng.standard_normal((N, 3)).astype(F32)
    theta = rng.uniform(0.5, 1.5, 3).astype(F32)
    w = rng.standard_normal((M, 2)).astype(F32)

    def vec(theta):
        return lambda a, b: jnp.stack([-jnp.sum(theta * (a - b) ** 2), jnp.sum(theta * a * b)])

    def cplx(theta):
        return lambda a, b: jnp.exp(lax.complex(-jnp.sum(theta * (a - b) ** 2), jnp.sum(a * b)))

    def losses(dense):
        def run(r, ker, x, y):
            if dense:
                return dense_reduce(r, ker, x, y)
            return foldax.pairwise_reduce(ker, x, y, reduction=r, block_size=(8, 16))

        out = {
            r: (lambda x, y, t, r=r: jnp.sum(run(r, vec(t), x, y) * w)) for r in FLOAT_REDUCTIONS
        }

        def complex_loss(x, y, t):
            k = run("sum", cplx(t), x, y)
            return jnp.sum(jnp.real(k) * w[:, 0] + jnp.imag(k) * w[:, 1])

        out["complex_sum"] = complex_loss
        return out

    def all_grads(dense):
        fs = losses(dense)
        return jax.jit(lambda *a: {r: jax.grad(f, argnums=(0, 1, 2))(*a) for r, f in fs.items()})

    got = all_grads(False)(x, y, theta)
    want = all_grads(True)(x, y, theta)

    def check(r):
        for g, ref, what in zip(got[r], want[r], "xyt", strict=True):
            assert_allclose(g, ref, dtype=F32, scale=10 * data_scale(ref), err_msg=f"d/d{what}")

    check_each(list(got), check)


#: Every differentiable pairwise reduction; blocks that leave a partial last block of rows of x
#: (9 rows) and of y (130 rows), wider than tall and taller than wide; and the planned blocks
#: (None: the one block a problem this small takes).
PARTIAL_REDUCTIONS = (*FLOAT_REDUCTIONS, "max_argmax", "min_argmin", "kmin", "softmax")
PARTIAL_BLOCKS = ((4, 8), (5, 16), None)


def test_partial_blocks_grad_and_jvp_match_float64():
    """``jax.grad`` (wrt x and y) and ``jax.jacfwd`` (wrt x) of every differentiable reduction,
    with partial last blocks of x and y, against the float64 dense reference. The derivative
    rules recompute the kernel in another program than the forward fold, which XLA may round
    differently (D = 7 here, whose sum of squares XLA:CPU vectorises differently per tile): a
    max found by comparing recomputed values with the forward's lost its gradient. Two-way
    ties (a duplicated row of y) split it evenly, as jnp.max's does (the arg-forms give it to
    the first, as their values are)."""
    rng = np.random.default_rng(1177)  # data on which the old rule failed on jax 0.10 and 0.12
    x, y = rng.standard_normal((9, 7)), rng.standard_normal((130, 7))
    # two-way ties across blocks (a duplicated row of y): row 0's min, row 1's max
    y[100], x[0] = y[3], y[3] + 0.01
    y[7] = y[120] = np.eye(7)[0] * -4.5
    x[1, 0] = 4.0
    d = np.sum((x[:, None] - y[None]) ** 2, -1)
    hits = {r: np.sum(d == getattr(d, r)(1, keepdims=True), 1) for r in ("max", "min")}
    assert hits["min"][0] == 2 and hits["max"][1] == 2 and np.sum(hits["max"] == 1) >= 5, hits
    with jax.enable_x64(True):
        x, y = jnp.asarray(x), jnp.asarray(y)
        w = {r: jnp.asarray(rng.standard_normal((9, 3) if r in ("kmin", "softmax") else 9))
             for r in PARTIAL_REDUCTIONS}  # fmt: skip

        def kernel(r):
            if r == "softmax":
                return lambda a, b: (-jnp.sum((a - b) ** 2), jnp.tanh(a[:3] * b[:3]))
            return lambda a, b: jnp.sum((a - b) ** 2)

        def out(r, x, y, block):
            k = 3 if r == "kmin" else None
            if block == "dense" and r in ("max_argmax", "min_argmin"):  # the first of ties'
                v = dense_matrix(kernel(r), x, y)
                at = (jnp.argmax if r == "max_argmax" else jnp.argmin)(v, axis=1)
                return jnp.take_along_axis(v, at[:, None], axis=1)[:, 0]
            if block == "dense":  # k-min: (values, indices)
                o = dense_reduce(r, kernel(r), x, y, k=k)
                return o[0] if r == "kmin" else o
            o = foldax.pairwise_reduce(kernel(r), x, y, reduction=r, k=k, block_size=block)
            return o[0] if r in ("kmin", "max_argmax", "min_argmin") else o

        def derivatives(block):
            def one(r, x, y):
                loss = lambda x, y: jnp.sum(out(r, x, y, block) * w[r])  # noqa: E731
                return jax.grad(loss, argnums=(0, 1))(x, y), jax.jacfwd(out, 1)(r, x, y, block)

            return {r: one(r, x, y) for r in PARTIAL_REDUCTIONS}

        blocks = PARTIAL_BLOCKS
        got = dict(zip(blocks, jax.jit(lambda: [derivatives(b) for b in blocks])(), strict=True))
        want = jax.jit(lambda: derivatives("dense"))()

    def check(r):
        for b in blocks:
            for g, ref, what in zip(jax.tree.leaves(got[b][r]), jax.tree.leaves(want[r]),
                                    ("grad x", "grad y", "jacfwd x"), strict=True):  # fmt: skip
                assert_allclose(g, ref, dtype=np.float64, scale=data_scale(ref),
                                err_msg=f"{what}, block_size={b}")  # fmt: skip

    check_each(PARTIAL_REDUCTIONS, check)


@pytest.mark.slow
def test_grad_max_ties_split_evenly():
    """Rows of y attaining the max share its gradient evenly (like jnp.max), across tiles."""
    x = jnp.asarray([[0.5], [3.0]], jnp.float32)
    y = jnp.asarray([[1.0], [0.0], [1.0], [2.0], [0.0], [2.0], [-1.0]], jnp.float32)
    w = jnp.asarray([1.0, 2.0], jnp.float32)

    def ker(a, b):
        return -jnp.sum((a - b) ** 2)

    def loss(y, dense):
        if dense:
            return jnp.sum(dense_reduce("max", ker, x, y) * w)
        return jnp.sum(foldax.pairwise_reduce(ker, x, y, reduction="max", block_size=(1, 2)) * w)

    got = jax.grad(loss)(y, False)
    want = jax.grad(loss)(y, True)
    # row 0: 4 ties (y = 0 or 1, value -0.25), row 1: 2 ties (y = 2)
    np.testing.assert_array_equal(np.asarray(want)[:, 0] != 0, [1, 1, 1, 1, 1, 1, 0])
    assert np.isfinite(np.asarray(want)).all()  # assert_allclose takes NaN == NaN
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.slow
def test_check_grads_float64(rng):
    """Reverse-mode gradients of every float reduction (one program) against float64 finite
    differences (jax.test_util.check_grads)."""
    x, y, theta = _grad_inputs(rng, m=5, n=7, d=2)
    t = tol(np.float64)
    with jax.enable_x64(True):
        cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), t)  # noqa: E731
        x, y, theta = cast(x), cast(y), cast(theta)

        def f(x, y, theta):
            def run(r, **kw):
                ker = (_softmax_param_kernel if r == "softmax" else _param_kernel)(theta)
                return foldax.pairwise_reduce(ker, x, y, reduction=r, block_size=(2, 3), **kw)

            out = {r: run(r) for r in (*FLOAT_REDUCTIONS, "softmax")}
            out["kmin"] = run("kmin", k=3)[0]
            return out

        f = jax.jit(f)
        assert all(a.dtype == jnp.float64 for a in jax.tree.leaves(f(x, y, theta)))
        # check_grads passes NaNs matching NaNs
        assert all(np.isfinite(a).all() for a in jax.tree.leaves(f(x, y, theta)))
        check_grads(
            f,
            (x, y, theta),
            order=1,
            modes=["rev"],
            eps=t["fd_eps"],
            atol=t["fd_tol"],
            rtol=t["fd_tol"],
        )


@pytest.mark.parametrize("reduction, d", [("min", 5), ("kmin", 5), ("min", 130)])
def test_picked_gradients_gathered_in_chunks(rng, monkeypatch, reduction, d):
    """The derivatives of the min family gather the picked rows a chunk of slots at a time
    (here a few slots per chunk, the last one partial), narrow rows from a features-first
    copy, rows wider than a lane as they are: derivatives forward and reverse against float64
    finite differences, and a gradient equal to one gather of them all."""
    from foldax._engine import _picks

    x, y = rng.normal(size=(11, d)), rng.normal(size=(17, d))
    kw = {"k": 3} if reduction == "kmin" else {}
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    f = lambda x, y: jax.tree.leaves(foldax.pairwise_reduce(sq, x, y, reduction=reduction, **kw))[0]  # noqa: E731
    loss = lambda x, y: jnp.sum(f(x, y) ** 2)  # noqa: E731
    with jax.enable_x64(True):
        x, y = jnp.asarray(x), jnp.asarray(y)
        whole = jax.jit(jax.grad(loss, (0, 1)))(x, y)
        monkeypatch.setattr(_picks, "GATHER_BYTES", 50 * d)  # (chunks of 6 / 2 slots)
        chunked = jax.jit(jax.grad(loss, (0, 1)))(x, y)
        for a, b in zip(whole, chunked, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        check_grads(jax.jit(f), (x, y), order=1, modes=("fwd", "rev"))


@pytest.mark.slow
def test_grad_with_integer_closure_and_unused_inputs(rng):
    """A closed-over int array (a tracer under jit) and an x leaf the kernel ignores."""
    x = {
        "p": jnp.asarray(rng.standard_normal((M, 2)).astype(F32)),
        "unused": jnp.zeros(M, jnp.float32),
    }
    y = jnp.asarray(rng.standard_normal((N, 2)).astype(F32))
    labels = jnp.asarray(rng.integers(0, 3, N).astype(np.int32))

    def loss(x, y, labels, dense):
        def ker(xi, yj):
            return -jnp.sum((xi["p"] - yj) ** 2)

        if dense:
            v = dense_matrix(ker, x, y) + labels[None, :].astype(jnp.float32)
            return jnp.sum(pairwise_dense("logsumexp", v))
        rows = jnp.arange(N, dtype=jnp.int32)

        def ker2(xi, yj):
            j, yv = yj
            return ker(xi, yv) + labels[j].astype(jnp.float32)

        return jnp.sum(
            foldax.pairwise_reduce(ker2, x, (rows, y), reduction="logsumexp", block_size=(8, 16))
        )

    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)(x, y, labels, False)
    want = jax.grad(loss, argnums=(0, 1))(x, y, labels, True)
    np.testing.assert_array_equal(got[0]["unused"], np.zeros(M, F32))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_allclose(g, r, dtype=F32, scale=10 * data_scale(r))


# ----------------------------------------------------------------------------------------------
# Transformations


@pytest.mark.slow
def test_transformations(rng):
    """jit, vmap over x, vmap over a closed-over parameter, nested vmap, jit(vmap(grad))."""
    b = 3
    # integer data, power-of-2 weights: exact kernel values, so indices (with ties) are exact
    xb = jnp.asarray(rng.integers(-2, 3, (b, M, 2)).astype(F32))
    y = jnp.asarray(rng.integers(-2, 3, (N, 2)).astype(F32))
    thetas = jnp.asarray(rng.choice(np.array([0.5, 1.0, 2.0], F32), (b, 2)))

    def ker(theta):
        return lambda a, c: -jnp.sum(theta * (a - c) ** 2)

    def fx(x, theta, r="logsumexp"):
        return foldax.pairwise_reduce(ker(theta), x, y, reduction=r, block_size=(8, 16))

    def dense_lse(x, theta):
        return dense_reduce("logsumexp", ker(theta), x, y)

    outs = jax.jit(
        lambda xb, th: {
            "vmap_x": jax.vmap(fx, (0, None))(xb, th[0]),
            "vmap_theta": jax.vmap(fx, (None, 0))(xb[0], th),
            "nested": jax.vmap(jax.vmap(fx, (None, 0)), (0, None))(xb, th),
            "argmin_nested": jax.vmap(
                jax.vmap(lambda x, t: fx(x, t, "argmin"), (None, 0)), (0, None)
            )(xb, th),
            "kmin_vmap": jax.vmap(
                lambda x, t: foldax.pairwise_reduce(
                    ker(t), x, y, reduction="kmin", k=3, block_size=(8, 16)
                )
            )(xb, th),
            "grad": jax.vmap(jax.grad(lambda x, t: jnp.sum(fx(x, t) ** 2), argnums=(0, 1)))(xb, th),
        }
    )(xb, thetas)
    want_nested, dist, want_grad = jax.jit(  # the dense references: one compilation
        lambda xb, th: (
            jax.vmap(jax.vmap(dense_lse, (None, 0)), (0, None))(xb, th),
            jax.vmap(jax.vmap(lambda x, t: dense_matrix(ker(t), x, y), (None, 0)), (0, None))(
                xb, th
            ),
            jax.vmap(jax.grad(lambda x, t: jnp.sum(dense_lse(x, t) ** 2), argnums=(0, 1)))(xb, th),
        )
    )(xb, thetas)
    dist = np.asarray(dist, np.float64)
    s = data_scale(want_nested)
    assert_allclose(outs["nested"], want_nested, dtype=F32, scale=s)
    assert_allclose(outs["vmap_x"], want_nested[:, 0], dtype=F32, scale=s)
    assert_allclose(outs["vmap_theta"], want_nested[0], dtype=F32, scale=s)
    want_argmin = pairwise_reference("argmin", np.moveaxis(dist, -1, 1))  # (b, b, M)
    np.testing.assert_array_equal(outs["argmin_nested"], want_argmin)
    diag = dist[np.arange(b), np.arange(b)]
    want_kmin = pairwise_reference("kmin", diag.reshape(-1, N), k=3)[1].reshape(b, M, 3)
    np.testing.assert_array_equal(outs["kmin_vmap"][1], want_kmin)
    for g, r in zip(outs["grad"], want_grad, strict=True):
        assert_allclose(g, r, dtype=F32, scale=10 * data_scale(r))


# ----------------------------------------------------------------------------------------------
# Memory (compiled only: XLA's deterministic figures)


def _sqdist(a, b):
    return -jnp.sum((a - b) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["sum", "logsumexp"])
def test_memory_independent_of_m_times_n(reduction):
    """Temp memory is O(tile + M + N), forward and backward: 16x the pairs, ~ the same bytes."""

    def fwd(x, y):
        return foldax.pairwise_reduce(_sqdist, x, y, reduction=reduction)

    def loss(x, y):
        return jnp.sum(fwd(x, y))

    grad = jax.grad(loss, argnums=(0, 1))
    temps = {}
    for n in (2048, 8192):
        s = jax.ShapeDtypeStruct((n, 3), jnp.float32)
        temps[n] = (report(fwd, s, s).temp_bytes, report(grad, s, s).temp_bytes)
    for which, small, big in zip(("forward", "grad"), temps[2048], temps[8192], strict=True):
        # a little slack for the O(M + N) per-row summaries (e.g. the log-sum-exp) and, for the
        # gradient, y's cotangent accumulated in y's walking layout (D, N) before its transpose
        slack = 8 * (8192 + 8192) + (3 * 4 * 8192 if which == "grad" else 0)
        assert big <= 1.15 * small + slack, (which, temps)
        dense_bytes = 8192 * 8192 * 4
        assert big < dense_bytes / 256, (which, temps)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["argmin", "kmin"])
def test_memory_nearest_flat_in_n(reduction):
    """argmin and k-min (k = 5; its values' gradient too) stay O(tile + M + N) as N grows 4x."""
    kw = {"k": 5} if reduction == "kmin" else {}

    def fwd(x, y):
        return foldax.pairwise_reduce(_sqdist, x, y, reduction=reduction, **kw)

    def grad(x, y):
        return jax.grad(lambda x, y: jnp.sum(fwd(x, y)[0]), argnums=(0, 1))(x, y)

    passes = {"forward": fwd, **({"grad": grad} if reduction == "kmin" else {})}
    for which, f in passes.items():
        temps = {}
        for n in (4096, 32768):
            s = jax.ShapeDtypeStruct((n, 3), jnp.float32)
            temps[n] = report(f, s, s).temp_bytes
        # the tile is as large as the default budget allows (it spreads over XLA's threads);
        # what grows with N is the O(M + N) states, indices and y's cotangent
        slack = 8 * 5 * 2 * 32768 + (3 * 4 * 32768 if which == "grad" else 0)
        assert temps[32768] <= 1.15 * temps[4096] + slack, (which, temps)
        assert temps[32768] < DEFAULT_BUDGET, (which, temps)


@pytest.mark.slow
def test_weighted_logsumexp_memory_flat_in_n():
    def temp(n):
        c = jax.ShapeDtypeStruct
        args = (c((256, 3), jnp.float32), (c((n, 3), jnp.float32), c((n,), jnp.float32)))
        f = lambda x, yw: foldax.pairwise_reduce(_weighted_kernel, x, yw, reduction="logsumexp")  # noqa: E731
        g = jax.grad(lambda x, yw: f(x, yw).sum(), argnums=(0, 1))
        return report(f, *args).temp_bytes, report(g, *args).temp_bytes

    small, big = temp(4096), temp(16384)
    for s, b in zip(small, big, strict=True):
        assert b <= 1.15 * s + 64 * 16384, (small, big)  # + O(N) cotangent of the weights


@pytest.mark.slow
def test_extremum_with_index_memory_flat_in_n():
    def temp(n):
        c = jax.ShapeDtypeStruct
        args = (c((512, 3), jnp.float32), c((n, 3), jnp.float32))
        f = lambda x, y: foldax.pairwise_reduce(  # noqa: E731
            lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="min_argmin"
        )
        g = jax.grad(lambda x, y: f(x, y)[0].sum(), argnums=(0, 1))
        return report(f, *args).temp_bytes, report(g, *args).temp_bytes

    small, big = temp(4096), temp(16384)
    for s, b in zip(small, big, strict=True):  # + O(N): y walked transposed, (3, N) float32
        assert b <= 1.15 * s + 2 * 12 * (16384 - 4096), (small, big)


@pytest.mark.slow
def test_masked_tiles_are_skipped_and_memory_stays_flat():
    """Masked attention's temp memory, forward and backward, is the unmasked one's plus a
    bounded amount (the blocks to visit are listed at most 2^20 mask cells at a time), whatever
    N is."""

    def temp(n, mask):
        c = jax.ShapeDtypeStruct((n, 16), jnp.float32)
        f = lambda q, k, v: _attention(q, k, v, mask)  # noqa: E731
        g = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))
        return report(f, c, c, c).temp_bytes, report(g, c, c, c).temp_bytes

    for n in (4096, 16384):  # the mask adds at most the bounded list of blocks to visit
        masked, plain = temp(n, MASKS["causal"]), temp(n, None)
        for a, b in zip(masked, plain, strict=True):
            assert a <= b + 1.2 * 2**20, (n, masked, plain)


# ----------------------------------------------------------------------------------------------
# Errors


def _x():
    return jnp.zeros((4, 2), jnp.float32)


def _y():
    return jnp.zeros((5, 2), jnp.float32)


def _dot(a, b):
    return jnp.sum(a * b)


ERRORS = {
    "x_leaves_mismatch": (
        ValueError,
        ("x",),
        lambda: foldax.pairwise_reduce(
            lambda a, b: jnp.sum(a["u"] * b) + a["v"],
            {"u": _x(), "v": jnp.zeros(3, jnp.float32)},
            _y(),
        ),
    ),
    "y_leaves_mismatch": (
        ValueError,
        ("y",),
        lambda: foldax.pairwise_reduce(
            lambda a, b: jnp.sum(a * b[0]) + b[1], _x(), (_y(), jnp.zeros(6, jnp.float32))
        ),
    ),
    "x_scalar_leaf": (
        ValueError,
        ("x",),
        lambda: foldax.pairwise_reduce(_dot, jnp.float32(1.0), _y()),
    ),
    "x_empty_tree": (TypeError, ("x",), lambda: foldax.pairwise_reduce(_dot, {}, _y())),
    "unknown_reduction": (
        ValueError,
        ("reduction", "median"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="median"),
    ),
    "reduction_not_str": (
        TypeError,
        ("reduction",),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction=None),
    ),
    "k_too_large": (
        ValueError,
        ("k", "6"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="kmin", k=6),
    ),
    "k_zero": (
        ValueError,
        ("k", "0"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="kmin", k=0),
    ),
    "k_negative": (
        ValueError,
        ("k", "-2"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="kmin", k=-2),
    ),
    "k_missing": (
        ValueError,
        ("kmin", "k"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="kmin"),
    ),
    "k_float": (
        TypeError,
        ("k",),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="kmin", k=2.0),
    ),
    "k_not_kmin": (ValueError, ("k", "sum"), lambda: foldax.pairwise_reduce(_dot, _x(), _y(), k=2)),
    "block_size_zero": (
        ValueError,
        ("block_size",),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), block_size=0),
    ),
    "block_size_negative_pair": (
        ValueError,
        ("block_size",),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), block_size=(4, -1)),
    ),
    "block_size_float": (
        TypeError,
        ("block_size",),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), block_size=2.5),
    ),
    "kernel_not_callable": (TypeError, ("kernel",), lambda: foldax.pairwise_reduce(3, _x(), _y())),
    "kernel_fails": (
        TypeError,
        ("kernel",),
        lambda: foldax.pairwise_reduce(lambda a, b: a @ jnp.ones((7,), jnp.float32), _x(), _y()),
    ),
    "kernel_returns_pair": (
        TypeError,
        ("kernel",),
        lambda: foldax.pairwise_reduce(lambda a, b: (a, b), _x(), _y()),
    ),
    "softmax_not_pair": (
        TypeError,
        ("softmax", "kernel"),
        lambda: foldax.pairwise_reduce(_dot, _x(), _y(), reduction="softmax"),
    ),
    "softmax_triple": (
        TypeError,
        ("softmax", "kernel"),
        lambda: foldax.pairwise_reduce(
            lambda a, b: (_dot(a, b), a, b), _x(), _y(), reduction="softmax"
        ),
    ),
    "softmax_vector_logit": (
        TypeError,
        ("softmax", "logit"),
        lambda: foldax.pairwise_reduce(lambda a, b: (a * b, b), _x(), _y(), reduction="softmax"),
    ),
    "softmax_complex_value": (
        TypeError,
        ("value",),
        lambda: foldax.pairwise_reduce(
            lambda a, b: (_dot(a, b), jnp.exp(lax.complex(b, b))), _x(), _y(), reduction="softmax"
        ),
    ),
    "kmin_vector_kernel": (
        ValueError,
        ("kmin", "scalar"),
        lambda: foldax.pairwise_reduce(lambda a, b: a * b, _x(), _y(), reduction="kmin", k=2),
    ),
    "max_complex_kernel": (
        TypeError,
        ("kernel",),
        lambda: foldax.pairwise_reduce(
            lambda a, b: lax.complex(_dot(a, b), _dot(a, b)), _x(), _y(), reduction="max"
        ),
    ),
    "logsumexp_int_kernel": (
        TypeError,
        ("kernel",),
        lambda: foldax.pairwise_reduce(
            lambda a, b: jnp.sum(a * b).astype(jnp.int32), _x(), _y(), reduction="logsumexp"
        ),
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    exc, words, call = ERRORS[case]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert NAME in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.parametrize("bs", [(2, 3, 4), (2,)])
def test_error_block_size_wrong_length(bs):
    with pytest.raises((ValueError, TypeError), match=r"foldax\.pairwise_reduce.*block_size"):
        foldax.pairwise_reduce(_dot, _x(), _y(), block_size=bs)


@pytest.mark.slow
def test_attention_gemm_path_matches_dense(rng):
    """A dot-product kernel whose values ignore x (attention) takes the P @ V GEMM path; values
    and gradients for q, k, v match dense softmax attention, with ragged blocks."""
    m, n, d = 37, 53, 8
    q, k, v = (
        jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in ((m, d), (n, d), (n, 3))
    )

    def fold(q, k, v):
        return foldax.pairwise_reduce(
            lambda qi, kv: (jnp.dot(qi, kv[0]) / np.float32(np.sqrt(d)), kv[1]),
            q,
            (k, v),
            reduction="softmax",
            block_size=(8, 16),
        )

    def dense(q, k, v):
        return jax.nn.softmax(q @ k.T / np.float32(np.sqrt(d)), axis=1) @ v

    assert_allclose(fold(q, k, v), dense(q, k, v), dtype=np.float32)
    ct = jnp.asarray(rng.standard_normal((m, 3)).astype(np.float32))
    ga = jax.vjp(fold, q, k, v)[1](ct)
    gb = jax.vjp(dense, q, k, v)[1](ct)
    for a, b in zip(ga, gb, strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=float(jnp.max(jnp.abs(b))))
