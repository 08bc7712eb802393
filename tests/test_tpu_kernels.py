"""The Pallas TPU kernels of the dense fold, in Pallas' interpret mode on the CPU.

``implementation="pallas"`` runs on a CPU the same kernels a TPU compiles (their grid, block
tables, padding and accumulators; not Mosaic's code generation): each against the XLA fold
and a float64 dense reference, with blocks of 128 so that every case spans several blocks
both ways and ends in a partial one. Forward and reverse derivatives take kernels too (the
tangent and cotangent folds). The same tests compiled on a TPU: ``FOLDAX_TPU=1 python -m
pytest tests/test_tpu_kernels.py -p no:xdist`` there (``tpu`` marks them; off a TPU they skip).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, data_scale, reference
from jax.test_util import check_grads

import foldax
from foldax import _engine
from foldax._engine._budget import DEFAULT_BUDGET
from foldax._kernels.tpu import _contracting

ON_TPU = os.environ.get("FOLDAX_TPU") == "1"
#: on a TPU its own compiled kernels; elsewhere interpreted
IMPL = None if ON_TPU else "pallas"
#: the widest floats the kernels take: float64 interpreted, float32 on a TPU
WIDE = np.float32 if ON_TPU else np.float64
M, N = 300, 700  # blocks of 128: three and six of them, the last ones partial

if ON_TPU and jax.default_backend() != "tpu":  # pragma: no cover - a TPU run without one
    pytest.skip("FOLDAX_TPU=1 asks for a TPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(_contracting, "DEFAULT_BLOCKS", _contracting.BlockSizes(128, 128))


@pytest.fixture
def lowered(monkeypatch):
    """The number of folds a kernel computed while the test ran."""
    from foldax._engine import _primitive

    count = [0]
    real = _primitive.tpu_kernels.lower

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_primitive.tpu_kernels, "lower", counted)
    return count


def kernel_and_xla(f, *args):
    """``(f(*args) with the kernels, f(*args) with the XLA fold)``, each jitted (on a TPU
    at the highest precision of products, XLA's being bfloat16 by default). Each is traced
    anew: ``jax.jit`` caches a trace by the function, and the implementation is read when the
    fold is traced."""
    precision = "highest" if ON_TPU else None
    with _engine.implementation(IMPL), jax.default_matmul_precision(precision):
        ours = jax.jit(lambda *a: f(*a))(*args)
    with _engine.implementation("xla"), jax.default_matmul_precision(precision):
        theirs = jax.jit(lambda *a: f(*a))(*args)
    return ours, theirs


def wide():
    """float64 where the kernels take it (interpreted)."""
    return jax.enable_x64(not ON_TPU)


def soft(a, b):
    return jnp.dot(a, b[0]), b[1]


def gauss(a, b):
    return jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1]


def sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def data(rng, dtype=np.float64, d=16, f=8):
    x = rng.normal(size=(M, d)).astype(dtype)
    y = rng.normal(size=(N, d)).astype(dtype)
    v = rng.normal(size=(N, f)).astype(dtype)
    return x, y, v


def dense_softmax(x, y, v, mask=None):
    z = x @ y.T
    if mask is not None:
        z = np.where(mask, z, -np.inf)
    m = np.max(z, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(z - m)
    s = p.sum(1, keepdims=True)
    return np.where(s > 0, (p @ v) / np.where(s > 0, s, 1), 0.0)


@pytest.mark.parametrize("dtype", [np.float32, WIDE])
def test_softmax_with_values(rng, lowered, dtype):
    x, y, v = data(rng, dtype)
    f = lambda x, y, v: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax")  # noqa: E731
    with jax.enable_x64(dtype == np.float64):
        ours, theirs = kernel_and_xla(f, x, y, v)
    assert lowered[0] == 1
    want = dense_softmax(*(a.astype(np.float64) for a in (x, y, v)))
    assert_allclose(ours, want, dtype=dtype)
    assert_allclose(ours, theirs, dtype=dtype)


@pytest.mark.parametrize(
    "reduction", ["logsumexp", "min", "max", "argmin", "argmax", "min_argmin", "max_argmax"]
)
def test_reductions_of_a_kernel(rng, lowered, reduction):
    x, y, _ = data(rng, WIDE, d=3)
    kernel = jnp.dot if reduction == "logsumexp" else sqdist
    f = lambda x, y: foldax.pairwise_reduce(kernel, x, y, reduction=reduction)  # noqa: E731
    with wide():
        ours, theirs = kernel_and_xla(f, x, y)
    assert lowered[0] == 1
    z = x @ y.T if reduction == "logsumexp" else ((x[:, None] - y[None]) ** 2).sum(-1)
    want = {
        "logsumexp": lambda: np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1),
        "min": lambda: z.min(1),
        "max": lambda: z.max(1),
        "argmin": lambda: z.argmin(1),
        "argmax": lambda: z.argmax(1),
        "min_argmin": lambda: (z.min(1), z.argmin(1)),
        "max_argmax": lambda: (z.max(1), z.argmax(1)),
    }[reduction]()
    for a, b, w in zip(*(jax.tree.leaves(t) for t in (ours, theirs, want)), strict=True):
        if np.issubdtype(np.asarray(w).dtype, np.integer):
            np.testing.assert_array_equal(a, w)
        else:
            assert_allclose(a, w, dtype=WIDE, scale=data_scale(z))
        np.testing.assert_array_equal(a, b) if a.dtype.kind == "i" else None


def test_kernel_sum_times_values(rng, lowered):
    """An elementwise kernel (rows walked last) times values on ``y``: one product a tile."""
    x, y, v = data(rng, WIDE, d=3, f=2)
    f = lambda x, y, v: foldax.pairwise_reduce(gauss, x, (y, v), reduction="sum")  # noqa: E731
    with wide():
        ours, theirs = kernel_and_xla(f, x, y, v)
    assert lowered[0] == 1
    x, y, v = (a.astype(np.float64) for a in (x, y, v))
    k = np.exp(-((x[:, None] - y[None]) ** 2).sum(-1))
    scale = data_scale(k @ np.abs(v))  # a sum of terms that cancel
    assert_allclose(ours, k @ v, dtype=WIDE, scale=scale)
    assert_allclose(ours, theirs, dtype=WIDE, scale=scale)


@pytest.mark.parametrize("dtype", [np.float32, WIDE])
def test_non_finite_values_stay_where_they_are(rng, dtype):
    """A value of ``y`` that is inf or NaN reaches its own rows' results only, as in the
    dense sum (at the highest precision too, whose float32 products Mosaic splits into
    parts: an infinity's low part is NaN); the padded columns (copies of the last row) add
    nothing. So do infinite logits in a softmax's product with its values."""
    x, y, v = data(rng, dtype, d=3, f=2)
    v[-1, 0], v[5, 1] = np.inf, np.nan
    f = lambda x, y, v: foldax.pairwise_reduce(gauss, x, (y, v), reduction="sum")  # noqa: E731
    with wide():
        ours, theirs = kernel_and_xla(f, x, y, v)
    with jax.default_matmul_precision("highest"), _engine.implementation(IMPL):
        highest = jax.jit(lambda *a: f(*a))(x, y, v)
    for got in (ours, highest):
        assert_allclose(got, theirs, dtype=dtype, scale=data_scale(theirs))
    np.testing.assert_array_equal(np.isposinf(ours[:, 0]), True)  # w > 0 times inf
    assert np.all(np.isnan(ours[:, 1]))  # and NaN
    soft = lambda a, b: (jnp.dot(a, b[0]), b[1])  # noqa: E731
    g = lambda x, y, v: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax")  # noqa: E731
    y[3] = np.inf  # logits of +-inf (or NaN: 0 * inf) against every row of x
    with jax.default_matmul_precision("highest"), wide():
        ours, theirs = kernel_and_xla(g, x, y, v)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    assert_allclose(ours, theirs, dtype=dtype, scale=data_scale(theirs))


@pytest.mark.parametrize("reduction", ["min", "max"])
def test_extrema_with_ties_and_nan_and_their_gradients(rng, lowered, reduction):
    """The indices a differentiated min / max keeps (one value attaining it, two: a duplicated
    row, or more: split evenly) and the arg-extrema's first index and NaN, by the kernel's own
    integer reductions: equal to the XLA fold's, the gradients to a float64 dense one's."""
    x, y, _ = data(rng, WIDE, d=3)
    y[400], y[650] = y[3], y[3]  # three equal rows, across blocks, nearest a row of x
    y[200] = y[10]  # ... and two nearest another
    x[20], x[7] = y[3] + 0.01, y[10] + 0.01
    x[299, 1] = np.nan
    pick = {"min": "argmin", "max": "argmax"}[reduction]
    reduce = lambda r: lambda x, y: foldax.pairwise_reduce(sqdist, x, y, reduction=r)  # noqa: E731
    loss = lambda x, y: jnp.sum(reduce(reduction)(x[:299], y) ** 2)  # noqa: E731
    both = lambda x, y: (reduce(pick)(x, y), reduce(reduction)(x, y), jax.grad(loss, (0, 1))(x, y))  # noqa: E731
    with wide():
        ours, theirs = kernel_and_xla(both, x, y)
    assert lowered[0] >= 3  # the index, the value, the value with its indices
    idx, val, grads = ours
    np.testing.assert_array_equal(idx, theirs[0])
    assert np.isnan(val[299]) and idx[299] == 0  # NaN is the extreme, at the first column
    z = ((x[:299, None] - y[None]) ** 2).sum(-1)
    want_idx = z.argmin(1) if reduction == "min" else z.argmax(1)
    np.testing.assert_array_equal(idx[:299], want_idx)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(theirs[2]), strict=True):
        assert np.all(np.isfinite(a))
        assert_allclose(a, b, dtype=WIDE, scale=data_scale(b))
    with jax.enable_x64(True):
        want = jax.grad(
            lambda x, y: jnp.sum(
                getattr(jnp, reduction)(((x[:299, None] - y[None]) ** 2).sum(-1), axis=1) ** 2
            ),
            (0, 1),
        )(x.astype(np.float64), y.astype(np.float64))
    for a, b in zip(grads, want, strict=True):
        assert_allclose(a, b, dtype=WIDE, scale=data_scale(b))


@pytest.mark.parametrize("mask", ["causal", "window", "formula", "segment_ids", "lengths"])
def test_attention_masks(rng, lowered, mask):
    """Masks skip blocks through the kernel's table of live blocks: forward and gradient."""
    q, k, v = (rng.normal(size=(2, M, 2, 16)).astype(np.float32) for _ in range(3))
    ids = np.sort(rng.integers(0, 4, (2, M)), axis=1).astype(np.int32)
    kw = {
        "causal": dict(is_causal=True),
        "window": dict(local_window_size=(40, 7)),
        "formula": dict(mask=lambda t, s: (t // 64) >= (s // 64)),
        "segment_ids": dict(segment_ids=ids),
        "lengths": dict(key_value_seq_lengths=np.array([M - 77, 5], np.int32)),
    }[mask]
    f = lambda q, k, v: foldax.dot_product_attention(q, k, v, **kw)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    grad = jax.grad(loss, (0, 1, 2))
    ours, theirs = kernel_and_xla(lambda *a: (f(*a), grad(*a)), q, k, v)
    assert lowered[0] >= 3  # the forward fold and the gradient's two passes
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert np.all(np.isfinite(a))
        assert_allclose(a, b, dtype=np.float32, scale=data_scale(b))


@pytest.mark.skipif(ON_TPU, reason="finite differences want float64, which a TPU kernel lacks")
def test_gradients_in_float64(rng):
    """Reverse and forward mode of the kernels' folds, by finite differences."""
    x, y, v = (a[:150] for a in data(rng, d=3, f=2))
    with jax.enable_x64(True), _engine.implementation(IMPL):
        for f in (
            lambda x, y, v: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax"),
            lambda x, y, v: foldax.pairwise_reduce(gauss, x, (y, v), reduction="sum"),
        ):
            check_grads(f, (x, y, v), order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-6)


def test_linear_cross_entropy(rng, lowered):
    h = rng.normal(size=(M, 32)).astype(np.float32)
    w = (rng.normal(size=(N, 32)) / 6).astype(np.float32)
    labels = rng.integers(0, N, M).astype(np.int32)
    labels[::7] = -100  # ignored
    f = lambda h, w: foldax.linear_cross_entropy(h, w, labels)  # noqa: E731
    ours, theirs = kernel_and_xla(lambda h, w: jax.value_and_grad(f, (0, 1))(h, w), h, w)
    assert lowered[0] == 2  # the loss, and its gradient's folds (two passes)
    z = h.astype(np.float64) @ w.T
    keep = labels != -100
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = np.mean((lse - z[np.arange(M), np.maximum(labels, 0)])[keep])
    assert_allclose(ours[0], want, dtype=np.float32)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=data_scale(b))


def test_half_precision_under_highest_precision(rng, lowered):
    """bfloat16 attention under ``jax.default_matmul_precision("highest")``: the kernels ask
    Mosaic for products it compiles (half-precision operands at the default precision)."""
    q = rng.normal(size=(1, M, 2, 16)).astype(jnp.bfloat16)
    f = lambda q: foldax.dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ours, theirs = kernel_and_xla(f, q)
    assert lowered[0] == 1
    assert_allclose(ours, theirs, dtype=jnp.bfloat16)


def test_vmapped_and_batched_heads(rng, lowered):
    x, y, v = data(rng, np.float32)
    xs = np.stack([x, 2 * x, -x])
    f = lambda x: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax")  # noqa: E731
    ours, theirs = kernel_and_xla(jax.vmap(f), xs)
    assert lowered[0] == 1
    assert_allclose(ours, theirs, dtype=np.float32)


def test_attention_implementation_argument(rng, lowered):
    q = rng.normal(size=(1, 200, 2, 16)).astype(np.float32)
    out = foldax.dot_product_attention(q, q, q, implementation="xla")
    assert lowered[0] == 0
    if not ON_TPU:
        assert_allclose(
            foldax.dot_product_attention(q, q, q, implementation="pallas"), out, dtype=np.float32
        )
        assert lowered[0] == 1


@pytest.mark.parametrize("k", [1, 5, 10])
def test_k_smallest(rng, lowered, k):
    """The k smallest distances and their indices by the kernel's rounds of integer
    reductions, ascending, ties by the lower index, NaN last, a row's missing entries (fewer
    columns than k, a mask) empty: equal to the XLA fold's and to a float64 sort."""
    x, y, _ = data(rng, WIDE, d=3)
    y[400], y[650] = y[3], y[3]  # three equal distances, across blocks
    x[20] = y[3] + 0.01
    x[299, 1] = np.nan
    few = lambda t, s: (s < 7) | (t < 100)  # noqa: E731  (rows from 100 on: 7 columns)
    ways = {
        "all": lambda x, y: foldax.pairwise_reduce(sqdist, x, y, reduction="kmin", k=k),
        "masked": lambda x, y: foldax.pairwise_reduce(
            sqdist, x, y, reduction="kmin", k=k, mask=few
        ),
    }
    z = ((x[:, None].astype(np.float64) - y[None]) ** 2).sum(-1)
    for name, f in ways.items():
        with _engine.implementation("pallas"), wide():  # (on a TPU: taken when asked for)
            ours = jax.jit(lambda *a, f=f: f(*a))(x, y)
        with _engine.implementation("xla"), wide():
            theirs = jax.jit(lambda *a, f=f: f(*a))(x, y)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
        zz = (
            np.where(few(np.arange(M)[:, None], np.arange(N)[None]), z, np.inf)
            if name == "masked"
            else z
        )
        want_i = np.argsort(zz, axis=1, kind="stable")[:, :k]
        live = np.take_along_axis(zz, want_i, 1) < np.inf
        np.testing.assert_array_equal(ours[1][:299][live[:299]], want_i[:299][live[:299]])
        assert np.all(ours[1][:299][~live[:299]] == np.iinfo(np.int32).max)
        assert np.isnan(ours[0][299, 0]) and ours[1][299, 0] == 0  # NaN last: every one NaN
    assert lowered[0] == 2


@pytest.mark.parametrize("reduction", ["kmin", "min", "argmin"])
def test_nearest_in_many_dimensions(rng, lowered, reduction):
    """In 40 dimensions the min family finds candidates by matrix products, ranks them exactly
    and reduces the rows it cannot certify again (a fold restricted to them, by a boolean
    per row read block by block): kernels for both, the results the XLA fold's."""
    x, y, _ = data(rng, np.float32, d=40)
    x[7] = y[11]  # a distance of 0 ...
    y[500] = y[11]  # ... twice: a tie the candidates cannot certify alone
    kw = {"k": 4} if reduction == "kmin" else {}
    f = lambda x, y, impl: foldax.pairwise_reduce(  # noqa: E731
        sqdist, x, y, reduction=reduction, implementation=impl, **kw
    )
    ours = jax.jit(lambda x, y: f(x, y, "pallas"))(x, y)  # (the k-min kernel: asked for)
    theirs = jax.jit(lambda x, y: f(x, y, "xla"))(x, y)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)
    assert lowered[0] == 2  # the candidates' fold and the restricted one


@pytest.mark.skipif(ON_TPU, reason="lowers for a TPU from the CPU")
def test_the_k_smallest_kernel_is_taken_where_it_keeps_lists_per_lane():
    """On a TPU the k smallest's kernel is taken unasked where it keeps its lists per lane
    (32-bit values in blocks of whole lanes); in half precision, where its lists would be per
    row (slower there than the XLA loop), only when the kernels are asked for."""
    for dtype, unasked in ((jnp.float32, 1), (jnp.bfloat16, 0)):
        x = jax.ShapeDtypeStruct((300, 3), dtype)
        for impl, kernels in ((None, unasked), ("xla", 0), ("pallas", 1)):
            f = lambda x, y, impl=impl: foldax.pairwise_reduce(  # noqa: E731
                sqdist, x, y, reduction="kmin", k=5, implementation=impl
            )
            text = jax.jit(f).trace(x, x).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("tpu_custom_call") == kernels, (dtype, impl)
    with pytest.raises(ValueError, match="pairwise_reduce: implementation='gpu'"):
        foldax.pairwise_reduce(sqdist, np.ones((3, 2)), np.ones((3, 2)), implementation="gpu")


def test_block_sizes_fit_the_vmem_budget():
    b = _contracting.BlockSizes(1024, 1024).fit(10**6, 10**6, x_row=2 * 8192, y_row=2 * 8192)
    assert _contracting._step_bytes(b.rows, b.cols, 2 * 8192, 2 * 8192) <= 48 * 2**20
    assert b.rows % 128 == 0 and b.cols % 128 == 0
    with pytest.raises(ValueError, match="multiple of 128"):
        _contracting.BlockSizes(100, 128)


@pytest.mark.skipif(ON_TPU, reason="lowers for a TPU from the CPU")
def test_blocks_fit_what_a_tile_keeps_live(monkeypatch):
    """At the default blocks, a body that meets its features pair by pair (the gradient of a
    Gaussian sum: ``(bi, 3, bj)`` values, each padded to 8 sublanes, none fused) gets blocks
    small enough that what it keeps live fits VMEM; a body of ``(bi, bj)`` tiles (the min of
    distances, features along the lanes) keeps its blocks."""
    monkeypatch.setattr(_contracting, "DEFAULT_BLOCKS", _contracting.BlockSizes())
    seen = []
    real = _contracting._vmem_limit
    monkeypatch.setattr(
        _contracting, "_vmem_limit", lambda g, a: seen.append((g.b, g.body)) or real(g, a)
    )
    x = jax.ShapeDtypeStruct((20_000, 3), jnp.float32)
    v = jax.ShapeDtypeStruct((20_000, 1), jnp.float32)
    gsum = lambda x, v: jnp.sum(foldax.pairwise_reduce(gauss, x, (x, v), reduction="sum"))  # noqa: E731
    near = lambda x: jnp.sum(foldax.pairwise_reduce(sqdist, x, x, reduction="min"))  # noqa: E731
    for f, args in ((jax.grad(gsum), (x, v)), (near, (x,))):
        seen.clear()
        jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
        assert seen and all(body <= _contracting._BODY_BUDGET for _, body in seen)
        grown = _contracting.BlockSizes() in {b for b, _ in seen}
        assert grown == (f is near)


@pytest.mark.skipif(ON_TPU, reason="lowers for a TPU from the CPU")
def test_lowered_for_a_tpu_kernels_or_the_loop():
    """Lowered for a TPU (from this CPU: no TPU needed to lower), attention takes its kernels
    (the forward fold, the gradient's two passes; by segment ids too), and so does a differentiated min (its
    indices, which the gradient reads; and, where the kernels are asked for, the pass over the
    rows where three or more tie, restricted to them); a fold whose kernel Pallas cannot lower
    (a kernel that sorts) takes the XLA loop in its place, in a module that verifies, and the
    refusal is kept."""
    from foldax._kernels import tpu as kernels

    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    attention = lambda q: foldax.dot_product_attention(q, q, q, is_causal=True)  # noqa: E731
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 64)[None]
    by_ids = lambda q: foldax.dot_product_attention(q, q, q, segment_ids=ids)  # noqa: E731
    x = jax.ShapeDtypeStruct((300, 3), jnp.float32)
    nearest = lambda x, y, impl=None: foldax.pairwise_reduce(  # noqa: E731
        sqdist, x, y, reduction="min", implementation=impl
    )
    least = lambda a, b: jnp.sort(a - b)[0]  # noqa: E731
    sorting = lambda x, y: foldax.pairwise_reduce(least, x, y, reduction="min")  # noqa: E731
    cases = (
        (jax.grad(lambda q: jnp.sum(attention(q).astype(jnp.float32))), (q,), 3),
        (jax.grad(lambda q: jnp.sum(by_ids(q).astype(jnp.float32))), (q,), 3),  # (keyed)
        (jax.grad(lambda x, y: jnp.sum(nearest(x, y))), (x, x), 1),
        (jax.grad(lambda x, y: jnp.sum(nearest(x, y, "pallas"))), (x, x), 2),
        (jax.grad(lambda x, y: jnp.sum(sorting(x, y))), (x, x), 0),
    )
    for f, args, kernels_expected in cases:
        kernels._REFUSALS.clear()
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))
        lowered.compiler_ir().operation.verify()
        text = lowered.as_text()
        assert text.count("tpu_custom_call") == kernels_expected
        refused = bool(kernels.refusals())
        assert refused == (kernels_expected == 0)
        assert not refused or "stablehlo.while" in text  # the XLA loop in its place


@pytest.mark.skipif(ON_TPU, reason="lowers for a TPU from the CPU")
@pytest.mark.parametrize(
    "reduction", ["sum", "mean", "max", "min", "logsumexp", "softmax", "log_softmax"]
)
@pytest.mark.parametrize("indices_are_sorted", [False, True])
def test_segment_reductions_of_rows_lowered_for_a_tpu(reduction, indices_are_sorted, monkeypatch):
    """Traced and lowered for a TPU, a segment reduction of rows that exist (no ``fn``) and its
    gradient are ``jax.ops``' own program: scatters and gathers, no loop, the sorted ids
    promised; also where sorted ids make long contiguous segments of narrow rows, which the
    CPU walks. With sorted ids the softmaxes' and sums' gathers keep the hint, so that their
    transposes are sorted scatter-adds (unsorted ones took 12-18 s each to compile there, and
    twice the time to run)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # (traced as on a TPU)
    fn = getattr(foldax, f"segment_{reduction}")
    f = lambda x, ids: fn(x, ids, 40, indices_are_sorted=indices_are_sorted)  # noqa: E731
    x = jax.ShapeDtypeStruct((20_000, 2), jnp.float32)
    ids = jax.ShapeDtypeStruct((20_000,), jnp.int32)
    for g in (f, jax.grad(lambda x, ids: jnp.sum(f(x, ids)))):
        text = jax.jit(g).trace(x, ids).lower(lowering_platforms=("tpu",)).as_text()
        assert "stablehlo.while" not in text
        assert '"stablehlo.scatter"' in text or '"stablehlo.gather"' in text
        sorted_flag = f"indices_are_sorted = {str(indices_are_sorted).lower()}"
        assert g is not f or sorted_flag in text
        extrema = reduction in ("max", "min")  # (their gradient's gathers are not transposed)
        assert not indices_are_sorted or extrema or "indices_are_sorted = false" not in text
    if indices_are_sorted:  # static sizes: the same segments, the same program
        sizes = np.bincount(np.arange(20_000) // 500, minlength=40)
        by_sizes = lambda x: fn(x, sizes=sizes)  # noqa: E731
        for g in (by_sizes, jax.grad(lambda x: jnp.sum(by_sizes(x)))):
            text = jax.jit(g).trace(x).lower(lowering_platforms=("tpu",)).as_text()
            assert "stablehlo.while" not in text
            assert '"stablehlo.scatter"' in text or '"stablehlo.gather"' in text


def _sorted_edges(rng, num, rows, features):
    """``(ids, x, w)``: about ``rows`` sorted ids in ``[-3, num + 3)`` (out of range at both
    ends), segment 4 empty, 6 of one row, 1 all -inf, a NaN in 3; values and weights."""
    ids = np.sort(np.r_[rng.integers(-3, num + 3, rows), [-1, 2, num, num + 2]])
    ids = np.sort(np.r_[ids[(ids != 4) & (ids != 6)], [6]]).astype(np.int32)
    x = rng.standard_normal((ids.size, features)).astype(np.float32)
    x[ids == 1] = -np.inf
    x[np.flatnonzero(ids == 3)[:1], 1] = np.nan
    return ids, x, rng.standard_normal(x.shape).astype(np.float32)


@pytest.mark.skipif(ON_TPU, reason="runs as on a TPU on the CPU")
@pytest.mark.parametrize("log", [False, True])
def test_sorted_softmax_as_on_a_tpu_equals_the_cpu_program(rng, log, monkeypatch):
    """The program a TPU runs for a softmax of rows under sorted ids (its slots in the ids'
    order, between two extra slots) gives the CPU program's values and gradients, on ids out
    of range at both ends, an empty segment, a segment of one row, -inf and NaN segments."""
    name = "segment_log_softmax" if log else "segment_softmax"
    fn = getattr(foldax, name)
    ids, x, w = _sorted_edges(rng, 9, 60, 3)
    f = lambda x: fn(x, ids, 9, indices_are_sorted=True)  # noqa: E731
    loss = lambda x: jnp.sum(jnp.where(jnp.isnan(f(x)), 0.0, f(x) * w))  # noqa: E731
    want, want_grad = f(x), jax.grad(loss)(x)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    got, got_grad = jax.jit(f)(x), jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_allclose(got, want, dtype=np.float32)
    assert_allclose(got_grad, want_grad, dtype=np.float32)
    assert np.isnan(got[ids < 0]).all() and np.isnan(got[ids >= 9]).all()


@pytest.mark.parametrize("log", [False, True])
def test_sorted_softmax_equals_float64(rng, log):
    """With sorted ids, a segment softmax (or log-softmax) and its gradient equal float64 on
    the machine the tests run on (compiled on a TPU, whose program keeps its slots in the ids'
    order): ids out of range at both ends, an empty segment, one of one row, -inf and NaN
    segments, and segments long enough to span XLA's blocks. (On a TPU v5e, whose float32
    ``exp`` is off by up to 5e-6, the log-softmax's gradient ``w - p sum(w)`` is off by that
    much of ``|w|``.)"""
    name = "segment_log_softmax" if log else "segment_softmax"
    num = 40
    ids, x, w = _sorted_edges(rng, num, 3_000, 130)
    want = reference(name.removeprefix("segment_"), x, ids, num)
    live = np.isfinite(want)
    # a gradient through the finite outputs only: an output's cotangent reaches its segment
    sm = np.exp(want) if log else want
    wl = np.where(live, w, 0.0).astype(np.float64)
    grad = np.zeros_like(sm)
    for s in range(num):
        rows = ids == s
        if log:
            grad[rows] = wl[rows] - sm[rows] * wl[rows].sum(0)
        else:
            grad[rows] = sm[rows] * (wl[rows] - (sm[rows] * wl[rows]).sum(0))
    fn = getattr(foldax, name)
    f = jax.jit(lambda x: fn(x, ids, num, indices_are_sorted=True))
    loss = lambda x: jnp.sum(jnp.where(live, f(x) * w, 0.0))  # noqa: E731
    got, got_grad = f(x), jax.jit(jax.grad(loss))(x)
    assert_allclose(got, want, dtype=np.float32, scale=10.0)
    # (the gradient cancels terms of the cotangents' size: its error is theirs times exp's)
    got_grad, grad = np.where(live, got_grad, 0.0), np.where(live, grad, 0.0)
    assert_allclose(got_grad, grad, dtype=np.float32, scale=np.abs(w).max())


@pytest.mark.skipif(ON_TPU, reason="lowers for a TPU from the CPU")
def test_chamfer_gradient_pass_over_ties_keeps_to_its_share_of_the_budget(monkeypatch):
    """A min's gradient re-folds the rows where three or more values tie, which are rare, by
    the XLA loop (on a TPU) in steps of a quarter of the memory budget: its tile, the pairs'
    3-D differences a vmapped Chamfer gradient holds, keeps within the budget (in steps of
    the whole budget it took 48 MiB)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731

    def chamfer(x, y):
        near = lambda a, b: foldax.pairwise_reduce(sq, a, b, reduction="min")  # noqa: E731
        return jnp.mean(near(x, y)) + jnp.mean(near(y, x))

    x = jax.ShapeDtypeStruct((4, 16_384, 3), jnp.float32)
    grad = jax.jit(jax.vmap(jax.value_and_grad(chamfer, (0, 1))))
    text = grad.trace(x, x).lower(lowering_platforms=("tpu",)).as_text()
    sizes = [
        np.prod([int(d) for d in s.split("x")]) for s in re.findall(r"tensor<([\dx]+)xf32>", text)
    ]
    assert 4 * max(sizes) <= DEFAULT_BUDGET  # (float32 bytes)


@pytest.mark.skipif(ON_TPU, reason="traces as on a TPU from the CPU")
def test_fused_tiles_take_large_steps_on_a_tpu(monkeypatch):
    """A step whose tile fuses into its reduction (``jnp.where`` and a custom derivative's
    call count as fused, as XLA fuses them) keeps no value per pair: on a TPU, where each
    step of the loop costs microseconds, S4's Cauchy gradient then runs in a few large steps
    (it ran in 16 MiB steps, 1.9x the broadcast), while a CPU keeps its cache-sized ones."""
    from foldax._engine import _loop, _probe

    v = jax.ShapeDtypeStruct((256, 512), jnp.complex64)
    z = jax.ShapeDtypeStruct((16_384,), jnp.complex64)
    loss = lambda v, z, w: jnp.sum(jnp.abs(foldax.cauchy(v, z, w)) ** 2)  # noqa: E731
    body = lambda m, c: jnp.sum(jnp.where(m, c / (c - 1), 0), axis=1)  # noqa: E731
    jaxpr = jax.make_jaxpr(body)(jnp.ones((4, 128), bool), jnp.ones((4, 128), jnp.complex64))
    on_tpu = _probe.peak_bytes(jaxpr.jaxpr, fused=_probe._FUSED_ON_TPU, calls=True)
    assert on_tpu == 4 * 8  # (only the (4,) sums kept; jax 0.12 divides by parts)
    assert _probe.peak_bytes(jaxpr.jaxpr) >= 4 * 128 * 8  # (a CPU keeps the tile)
    real, plans = _loop.make_plan, []
    spy = lambda *a, **k: plans.append(real(*a, **k)) or plans[-1]  # noqa: E731
    monkeypatch.setattr(_loop, "make_plan", spy)
    for backend, most in (("tpu", 2), ("cpu", None)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        plans.clear()
        jax.jit(jax.grad(loss, (0, 1, 2))).trace(v, z, v).lower(lowering_platforms=(backend,))
        steps = [p.steps for p in plans]
        assert steps and (max(steps) <= most if most else min(steps) >= 64), (backend, steps)
