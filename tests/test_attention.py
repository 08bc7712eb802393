"""Attention with masks from traced arrays: ``pairwise_reduce(mask=, segment_ids=)`` and
``foldax.dot_product_attention`` against float64 references and ``jax.nn``, under ``jit``,
``vmap`` and ``grad``; the blocks a mask or segment ids remove listed without looking at
their pairs, and memory that grows like L, not L^2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose
from jax.test_util import check_grads

import foldax
from foldax import _closure, _eager
from foldax._pairwise._intervals import block_test
from foldax.memory import report

F32 = np.float32
#: dot_product_attention's options that are not arrays (static under jit)
_STATIC = ("is_causal", "return_residual", "layout")


def _kernel(a, b):
    return a @ b[0], b[1]


def _attend(q, k, v, seg):
    """The packed-sequence call as users write it: a mask closing over a jit argument."""
    return foldax.pairwise_reduce(
        _kernel, q, (k, v), reduction="softmax", mask=lambda i, j: (seg[i] == seg[j]) & (j <= i)
    )


def _softmax_ref(q, k, v, keep, scale=1.0, bias=0.0):
    """float64 masked softmax attention, ``(..., T, H)`` against ``(..., S, H)``; a query with
    nothing kept is 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("...th,...sh->...ts", q, k) * scale + bias
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    z = p.sum(-1, keepdims=True)
    return np.einsum("...ts,...sh->...th", p / np.where(z > 0, z, 1.0), v)


def _dense(q, k, v, keep):
    """The same in jnp (a reference for gradients, in the inputs' dtype)."""
    s = jnp.where(keep, q @ jnp.swapaxes(k, -1, -2), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    z = p.sum(-1, keepdims=True)
    return jnp.where(z > 0, (p @ v) / jnp.where(z > 0, z, 1.0), 0.0)


def _docs(rng, length, n_docs, batch=None):
    shape = (length,) if batch is None else (batch, length)
    return jnp.asarray(np.sort(rng.integers(0, n_docs, shape), axis=-1), jnp.int32)


def _qkv(rng, *shape):
    return tuple(jnp.asarray(rng.standard_normal(shape), F32) for _ in range(3))


def _keep_docs(seg):
    seg = np.asarray(seg)
    n = seg.shape[-1]
    causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
    return (seg[..., :, None] == seg[..., None, :]) & causal


# ----------------------------------------------------------------------------------------------
# Masks closing over traced arrays


@pytest.mark.slow
def test_mask_closing_over_jit_argument_under_jit_vmap_and_grad(rng):
    q, k, v = _qkv(rng, 72, 8)
    seg = _docs(rng, 72, 5)
    keep = _keep_docs(seg)
    assert_allclose(jax.jit(_attend)(q, k, v, seg), _softmax_ref(q, k, v, keep), dtype=F32)

    segs = _docs(rng, 72, 6, batch=4)  # a batch of four packings, each its own mask
    qs, ks, vs = (jnp.stack([a] * 4) for a in (q, k, v))
    got = jax.jit(jax.vmap(_attend))(qs, ks, vs, segs)
    assert_allclose(got, _softmax_ref(qs, ks, vs, _keep_docs(segs)), dtype=F32)

    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    got = jax.jit(jax.grad(loss(lambda q, k, v: _attend(q, k, v, seg)), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(lambda q, k, v: _dense(q, k, v, keep)), (0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, w, dtype=F32, scale=10)


@pytest.mark.slow
def test_padding_mask_from_traced_lengths(rng):
    q, k, v = _qkv(rng, 4, 40, 8)
    lengths = jnp.array([40, 17, 1, 29])

    def pad(q, k, v, n):
        return foldax.pairwise_reduce(
            _kernel, q, (k, v), reduction="softmax", mask=lambda i, j: j < n, block_size=8
        )

    keep = np.arange(40)[None, None, :] < np.asarray(lengths)[:, None, None]
    got = jax.jit(jax.vmap(pad))(q, k, v, lengths)
    assert_allclose(got, _softmax_ref(q, k, v, keep), dtype=F32)
    g = jax.jit(jax.grad(lambda q: (jax.vmap(pad)(q, k, v, lengths) ** 2).sum()))(q)
    w = jax.jit(jax.grad(lambda q: (_dense(q, k, v, jnp.asarray(keep)) ** 2).sum()))(q)
    assert_allclose(g, w, dtype=F32, scale=10)


@pytest.mark.slow
def test_segment_ids_keyword_matches_the_mask_and_skips_nothing_it_needs(rng):
    q, k, v = _qkv(rng, 90, 8)
    seg = _docs(rng, 90, 7)
    want = _softmax_ref(q, k, v, _keep_docs(seg))
    causal = lambda i, j: j <= i  # noqa: E731
    for block in (None, 8, (16, 4)):
        got = jax.jit(
            lambda q, k, v, s, b=block: foldax.pairwise_reduce(
                _kernel, q, (k, v), reduction="softmax", segment_ids=s, mask=causal, block_size=b
            )
        )(q, k, v, seg)
        assert_allclose(got, want, dtype=F32, err_msg=f"block {block}")
    # unsorted ids and a pair of ids (cross attention): same values, fewer blocks skipped
    ids_x = jnp.asarray(rng.integers(0, 4, 90), jnp.int32)
    ids_y = jnp.asarray(rng.integers(0, 4, 50), jnp.int32)
    k2, v2 = k[:50], v[:50]
    got = jax.jit(
        lambda q, k, v, ix, iy: foldax.pairwise_reduce(
            _kernel, q, (k, v), reduction="softmax", segment_ids=(ix, iy), block_size=8
        )
    )(q, k2, v2, ids_x, ids_y)
    keep = np.asarray(ids_x)[:, None] == np.asarray(ids_y)[None, :]
    assert_allclose(got, _softmax_ref(q, k2, v2, keep), dtype=F32)


def test_segment_ids_for_other_reductions_and_their_errors(rng):
    x = jnp.asarray(rng.standard_normal((30, 2)), F32)
    ids = jnp.asarray(np.repeat(np.arange(3), 10), jnp.int32)
    dist = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    got = foldax.pairwise_reduce(dist, x, x, reduction="argmax", segment_ids=ids, block_size=4)
    d = np.sum((np.asarray(x)[:, None] - np.asarray(x)[None]) ** 2, -1)
    d = np.where(np.asarray(ids)[:, None] == np.asarray(ids)[None, :], d, -np.inf)
    np.testing.assert_array_equal(got, d.argmax(1))
    with pytest.raises(ValueError, match=r"pairwise_reduce: segment_ids for the rows of y"):
        foldax.pairwise_reduce(dist, x, x[:5], segment_ids=ids)
    with pytest.raises(ValueError, match=r"pairwise_reduce: segment_ids for the rows of x must be"):
        foldax.pairwise_reduce(dist, x, x, segment_ids=ids.astype(F32))
    with pytest.raises(ValueError, match=r"pairwise_reduce: segment_ids must be one array"):
        foldax.pairwise_reduce(dist, x, x, segment_ids=(ids, ids, ids))


@pytest.mark.slow
def test_packed_attention_gradients_check_numerically(rng):
    q, k, v = (np.asarray(a, np.float64) for a in _qkv(rng, 24, 3))
    seg = _docs(rng, 24, 3)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(a) for a in (q, k, v))
        f = lambda q, k, v: foldax.dot_product_attention(  # noqa: E731
            q[:, None], k[:, None], v[:, None], is_causal=True, segment_ids=seg, block_size=8
        )
        assert np.all(np.isfinite(np.asarray(f(q, k, v))))  # (check_grads takes NaN == NaN)
        check_grads(
            jax.jit(f), (q, k, v), order=2, modes=("fwd", "rev"), eps=1e-6, atol=1e-5, rtol=1e-5
        )


# ----------------------------------------------------------------------------------------------
# Blocks listed from the mask's formula


_N = jnp.int32(40)
_SEG = jnp.repeat(jnp.arange(4), 16)
_BIG = jnp.int32(2**31 - 10)
_MASKS = {  # name -> (mask, bounded by the analysis, blocks listed exactly)
    "causal": (lambda i, j: j <= i, True, True),
    "window": (lambda i, j: (j <= i) & (j > i - 7), True, True),
    "padding": (lambda i, j: j < _N, True, True),
    "block-diagonal": (lambda i, j: i // 8 == j // 8, True, True),
    "two-sided": (lambda i, j: jnp.abs(i - j) <= 3, True, True),
    "branches": (lambda i, j: jnp.where(i > 10, j < 5, j > 20), True, True),
    "float": (lambda i, j: i.astype(jnp.float32) * 0.5 >= j.astype(jnp.float32), True, True),
    # bounds that overflow int32 or turn NaN are widened, never wrapped
    "overflow": (lambda i, j: (i + _BIG) < (j + _BIG), True, False),
    "product overflow": (lambda i, j: i * 100_000_000 > j * 100_000_000, True, False),
    "inf - inf": (
        lambda i, j: i.astype(jnp.float32) * jnp.inf - j.astype(jnp.float32) * jnp.inf == 0,
        True,
        False,
    ),
    "documents": (lambda i, j: (_SEG[i] == _SEG[j]) & (j <= i), False, False),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n == "block-diagonal" else n for n in _MASKS],
)
def test_block_test_is_never_wrong_and_exact_where_bounded(rng, name):
    mask, bounded, exact_blocks = _MASKS[name]
    index = jax.ShapeDtypeStruct((), jnp.int32)
    closed, consts = _closure.trace(mask, index, index)
    live, exact = block_test(closed)
    assert exact == bounded
    cells = jnp.arange(64)
    pairs = np.asarray(jax.vmap(jax.vmap(mask, (None, 0)), (0, None))(cells, cells))
    lo = rng.integers(0, 64, (400, 2))
    hi = np.minimum(lo + rng.integers(0, 12, (400, 2)), 63)
    got = np.asarray(live(consts, lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]))
    truth = np.array(
        [pairs[a : b + 1, c : d + 1].any() for a, c, b, d in zip(*lo.T, *hi.T, strict=True)]
    )
    assert not np.any(truth & ~got), "a block with a kept pair was skipped"
    if exact_blocks:
        np.testing.assert_array_equal(got, truth)


@pytest.mark.slow
def test_listed_blocks_follow_documents_and_causality():
    """With sorted ids and a causal mask, the live blocks are those on the diagonal blocks of
    documents below the diagonal: counted from the engine's own block test."""
    from foldax._pairwise._masks import check_masking

    ids = jnp.asarray(np.repeat(np.arange(4), [40, 24, 32, 32]), jnp.int32)  # 128 tokens
    masking = check_masking("t", lambda i, j: j <= i, ids, 128, 128, False)
    live = masking.block_live(0)
    j0 = jnp.arange(0, 128, 8, dtype=jnp.int32)
    got = np.stack(
        [np.asarray(live(masking.consts, jnp.int32(i0), j0, 8, 8)) for i0 in range(0, 128, 8)]
    )
    keep = _keep_docs(ids)
    want = keep.reshape(16, 8, 16, 8).any(axis=(1, 3))
    np.testing.assert_array_equal(got, want)
    assert got.sum() < 0.3 * got.size


def test_array_mask_blocks_from_its_table_of_cells(rng):
    """A boolean array of pairs lists its blocks from a table of its cells: a block holding a
    kept pair is never skipped, whatever its start and size (clamped, unaligned); blocks on
    cells are listed exactly; and the values skip nothing (against a float64 reference)."""
    from foldax._pairwise._masks import CELL, _cell_table, check_masking

    m, n = 2 * CELL + 44, 3 * CELL + 8  # neither a multiple of a cell
    pairs = np.zeros((m, n), bool)
    for _ in range(6):  # a few rectangles of kept pairs, one of them a single pair
        a, c = rng.integers(0, m), rng.integers(0, n)
        pairs[a : a + rng.integers(1, 90), c : c + rng.integers(1, 90)] = True
    pairs[m - 1, 5] = True
    masking = check_masking("t", None, None, m, n, False, jnp.asarray(pairs))
    live = masking.block_live(0)
    for bi, bj, aligned in ((CELL, CELL, True), (2 * CELL, CELL, True), (48, 200, False)):
        starts_i = [*range(0, m - bi + 1, bi), m - bi]  # the clamped last block too
        j0 = np.asarray([*range(0, n - bj + 1, bj), n - bj], np.int32)
        for i0 in starts_i:
            got = np.asarray(live(masking.consts, jnp.int32(i0), jnp.asarray(j0), bi, bj))
            truth = np.array([pairs[i0 : i0 + bi, j : j + bj].any() for j in j0])
            assert not np.any(truth & ~got), ("a block with a kept pair was skipped", bi, bj)
            on_cells = aligned and i0 % CELL == 0
            if on_cells:
                np.testing.assert_array_equal(got[j0 % CELL == 0], truth[j0 % CELL == 0])
    for shape in ((m, n), (2 * CELL, 3 * CELL)):  # read as booleans, and as words of 4
        some = np.zeros(shape, bool)
        some[rng.integers(0, shape[0], 5), rng.integers(0, shape[1], 5)] = True  # a few pairs
        some[-1, -1] = True
        table = np.asarray(_cell_table(jnp.asarray(some)))
        cells = -(-np.asarray(shape) // CELL)
        padded = np.zeros(cells * CELL, bool)
        padded[: shape[0], : shape[1]] = some
        want = padded.reshape(cells[0], CELL, cells[1], CELL).any(axis=(1, 3))
        np.testing.assert_array_equal(table, want)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 1, 8)), F32) for t in (m, n, n))
    pairs[np.arange(m), np.arange(m) * n // m] = True  # a kept pair in every row
    want = _grouped_ref(q, k, v, keep=pairs)
    for block in ((64, 128), (48, 200), (512, 512)):  # tiles on cells, unaligned, wider than it
        got = foldax.dot_product_attention(q, k, v, mask=jnp.asarray(pairs), block_size=block)
        assert_allclose(got, want, dtype=F32)


def _heads_last(a):
    return jnp.swapaxes(a, 1, 2)


def _planned_tiles(f, *args):
    """The ``(bi, bj)`` of every dense plan made while ``f(*args)`` is lowered, in order."""
    from foldax._engine import _loop

    seen, make = [], _loop.make_plan

    def spy(spec, *rest, **kw):
        plan = make(spec, *rest, **kw)
        if spec.kind == "dense":
            seen.append((plan.bi, plan.bj))
        return plan

    _loop.make_plan = spy
    try:
        jax.jit(f).lower(*args)
    finally:
        _loop.make_plan = make
    return sorted(set(seen))


def test_a_masked_gradient_takes_finer_tiles():
    """Under a mask that skips blocks, the gradient's folds take tiles of 512 (a pair costs the
    same in them, and they skip more of the pairs a causal mask or a boolean array removes);
    the forward fold keeps 1,024; without a mask, or where a window asks for smaller tiles
    still, both take the same."""
    q = jnp.zeros((1, 4096, 1, 8), F32)
    mask = jnp.asarray(np.tril(np.ones((4096, 4096), bool)))[None, None]
    cases = {
        "none": ({}, [(1024, 1024)]),
        "is_causal": ({"is_causal": True}, [(512, 512), (1024, 1024)]),
        "array": ({"mask": mask}, [(512, 512), (1024, 1024)]),
        "window": ({"local_window_size": (255, 0)}, [(256, 256)]),
    }
    for name, (kw, tiles) in cases.items():
        f = lambda q, kw=kw: foldax.dot_product_attention(q, q, q, **kw)  # noqa: E731
        assert _planned_tiles(f, q) == [(1024, 1024) if tiles != [(256, 256)] else tiles[0]], name
        grad = jax.grad(lambda q, f=f: f(q).sum())
        assert _planned_tiles(grad, q) == tiles, name


@pytest.mark.slow
def test_long_tiles_under_masks_match_the_reference(rng):
    """Values and gradients in tiles of 1,024 and more (sizes no multiple of them; the gradient
    in its own, smaller tiles): causal, a window, a boolean array and segment ids, against a
    float64 reference and plain-jnp gradients."""
    t, s = 1300, 1100
    q = jnp.asarray(rng.standard_normal((1, t, 2, 8)), F32)
    k, v = (jnp.asarray(rng.standard_normal((1, s, 2, 8)), F32) for _ in range(2))
    ii, jj = np.ogrid[:t, :s]
    pairs = rng.random((t, s)) < 0.02
    pairs[:, :300] |= jj[:, :300] <= ii  # a causal band and scattered pairs
    ids = jnp.asarray(np.sort(rng.integers(0, 4, t)), jnp.int32)
    ids_np = np.asarray(ids)
    cases = {
        "causal": ({"is_causal": True}, jj <= ii),
        "window": ({"local_window_size": (400, 100)}, (jj >= ii - 400) & (jj <= ii + 100)),
        "array": ({"mask": jnp.asarray(pairs)}, pairs),
        "ids": ({"segment_ids": (ids[None], ids[None, :s])}, ids_np[:, None] == ids_np[None, :s]),
    }
    loss = lambda fn: lambda *qkv: jnp.sum(fn(*qkv) * jnp.cos(q))  # noqa: E731
    for name, (kw, keep) in cases.items():
        want = _grouped_ref(q, k, v, keep)
        for block in (None, (1024, 1100)):
            f = lambda q, k, v, kw=kw, b=block: foldax.dot_product_attention(  # noqa: E731
                q, k, v, block_size=b, **kw
            )
            assert_allclose(jax.jit(f)(q, k, v), want, dtype=F32, err_msg=f"{name} {block}")

        def ref(q, k, v, keep=keep):
            qt, kt, vt = (_heads_last(a) for a in (q, k, v))
            return _heads_last(_dense(qt / np.sqrt(8), kt, vt, jnp.asarray(keep)))

        got = jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
        for mine, theirs in zip(got, jax.grad(loss(ref), (0, 1, 2))(q, k, v), strict=True):
            assert_allclose(mine, theirs, dtype=F32, scale=10, err_msg=name)


@pytest.mark.slow
def test_windows_take_tiles_that_skip_their_blocks(rng):
    """A causal mask or window bounds the pairs kept to a band: its attention takes the tiles
    whose live blocks cost least (a window of 256 at 4,096^2 skips 7 in 8 of 256-tiles but only
    9 in 16 of 1024-tiles), and the values and gradients on them are jax.nn's."""
    from foldax._pairwise._masks import check_masking

    def tile(band, t=4096):
        masking = check_masking("t", lambda i, j: j <= i, None, t, t, False, band=band)
        return masking.gemm_tiles(t, t)[0]

    assert tile((255, 0)) == (256, 256) and tile((1023, 0)) == (512, 512)
    assert tile((None, 0)) == (1024, 1024) and tile((40, 0), 200) is None

    def formula(mask, t=4096):  # a mask of the indices alone, read from its formula
        return check_masking("t", mask, None, t, t, False).gemm_tiles(t, t)[0]

    assert formula(lambda i, j: j <= i) == (1024, 1024)
    assert formula(lambda i, j: (j <= i) & (j > i - 256)) == (256, 256)
    assert formula(lambda i, j: i // 256 == j // 256) == (256, 256)  # block-diagonal
    by_floats = lambda a: jnp.floor(a.astype(F32) / 256)  # noqa: E731
    assert formula(lambda i, j: by_floats(i) == by_floats(j)) == (256, 256)  # in floats
    starts = jnp.arange(4096) - 256
    assert formula(lambda i, j: j >= starts[i]) is None  # it reads an array: the default
    assert formula(lambda i, j: jnp.sin(i.astype(F32)) > j.astype(F32)) is None  # unread: sin
    t = 1500  # the last tile of each size partial (clamped)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 16)), F32) for _ in range(3))
    for window in ((63, 0), (100, 30), 50):
        assert tile(window if isinstance(window, tuple) else (window, window), t) != (1024, 1024)
        kw = dict(local_window_size=window, is_causal=window == (63, 0))
        f = lambda q, k, v, kw=kw: foldax.dot_product_attention(q, k, v, **kw)  # noqa: E731
        g = lambda q, k, v, kw=kw: jax.nn.dot_product_attention(q, k, v, **kw)  # noqa: E731
        assert_allclose(jax.jit(f)(q, k, v), g(q, k, v), dtype=F32, err_msg=str(window))
        left, right = window if isinstance(window, tuple) else (window, window)
        by_pairs = lambda q, k, v, left=left, right=right: foldax.pairwise_reduce(  # noqa: E731
            lambda a, b: (jnp.dot(a, b[0]) / 4, b[1]), q[0, :, 0], (k[0, :, 0], v[0, :, 0]),
            reduction="softmax", mask=lambda i, j: (j >= i - left) & (j <= i + right),
        )  # fmt: skip
        want = jax.nn.dot_product_attention(q, k, v, local_window_size=(left, right))[0, :, 0]
        assert_allclose(jax.jit(by_pairs)(q, k, v), want, dtype=F32, err_msg=str(window))
        loss = lambda fn: lambda *qkv: jnp.sum(fn(*qkv) * v)  # noqa: E731
        got = jax.jit(jax.grad(loss(f), (0, 1, 2)))(q, k, v)
        for mine, theirs in zip(got, jax.grad(loss(g), (0, 1, 2))(q, k, v), strict=True):
            assert_allclose(mine, theirs, dtype=F32, scale=10, err_msg=str(window))


# ----------------------------------------------------------------------------------------------
# dot_product_attention: jax.nn's call


def _grouped_ref(q, k, v, keep=True, bias=0.0, scale=None):
    """float64 reference in jax.nn's layout ``(B, T, N, H)`` with K key / value heads."""
    n, kh, h = q.shape[2], k.shape[2], q.shape[3]
    g = n // kh
    k, v = (np.repeat(np.asarray(a, np.float64), g, axis=2) for a in (k, v))
    t = lambda a: np.swapaxes(np.asarray(a, np.float64), 1, 2)  # noqa: E731
    scale = 1 / np.sqrt(h) if scale is None else scale
    return np.swapaxes(_softmax_ref(t(q), t(k), t(v), keep, scale, bias), 1, 2)


@pytest.fixture
def heads(rng):
    b, t, n, kh, h = 2, 36, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), F32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), F32) for _ in range(2))
    return q, k, v


@pytest.mark.slow
def test_matches_jax_nn_on_its_own_options(rng, heads):
    q, k, v = heads
    t = q.shape[1]
    ii, jj = np.arange(t)[:, None], np.arange(t)[None, :]
    lengths = jnp.array([30, 7])
    bias = jnp.asarray(rng.standard_normal((1, 4, t, t)), F32)
    pairs = jnp.asarray(rng.random((2, 1, t, t)) < 0.6)
    cases = {
        "plain": ({}, True, 0.0),
        "causal": ({"is_causal": True}, jj <= ii, 0.0),
        "window": ({"local_window_size": (3, 2)}, (jj >= ii - 3) & (jj <= ii + 2), 0.0),
        "lengths": (
            {"key_value_seq_lengths": lengths},
            jj[None, None] < np.asarray(lengths)[:, None, None, None],
            0.0,
        ),
        "bias": ({"bias": bias}, True, np.asarray(bias)),
        "mask": ({"mask": pairs}, np.asarray(pairs), 0.0),
        "scale": ({"scale": 0.3}, True, 0.0),
    }
    for name, (kw, keep, b) in cases.items():
        got = jax.jit(lambda q, k, v, kw=kw: foldax.dot_product_attention(q, k, v, **kw))(q, k, v)
        want = _grouped_ref(q, k, v, keep, b, kw.get("scale"))
        assert_allclose(got, want, dtype=F32, scale=3, err_msg=name)
        assert_allclose(got, jax.nn.dot_product_attention(q, k, v, **kw), dtype=F32, scale=3)


@pytest.mark.slow
def test_layouts_residual_query_lengths_and_unbatched(heads):
    q, k, v = heads
    want, lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    attend = jax.jit(foldax.dot_product_attention, static_argnames=_STATIC)
    out, got_lse = attend(t(q), t(k), t(v), is_causal=True, return_residual=True, layout="BNTH")
    assert_allclose(t(out), want, dtype=F32, scale=3)
    assert got_lse.shape == (2, 4, 36) and got_lse.dtype == jnp.float32
    assert_allclose(t(got_lse), lse, dtype=F32, scale=30)
    one = attend(q[1], k[1], v[1], is_causal=True)
    assert_allclose(one, want[1], dtype=F32, scale=3)
    lengths = jnp.array([36, 5])
    got = attend(q, k, v, query_seq_lengths=lengths)
    ref = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths)
    assert_allclose(got, ref, dtype=F32, scale=3)
    assert np.all(np.asarray(got)[1, 5:] == 0)


@pytest.mark.slow
def test_packed_documents_under_vmap_of_batch_and_grad(rng, heads):
    q, k, v = heads
    seg = _docs(rng, 36, 4, batch=2)
    keep = _keep_docs(seg)[:, None]
    f = jax.jit(
        lambda q, k, v, s: foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=s)
    )
    assert_allclose(f(q, k, v, seg), _grouped_ref(q, k, v, keep), dtype=F32, scale=3)

    def dense_loss(q, k, v):
        g = q.shape[2] // k.shape[2]
        kk, vv = (jnp.repeat(a, g, axis=2) for a in (k, v))
        t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        return (_dense(t(q) / np.sqrt(8).astype(F32), t(kk), t(vv), jnp.asarray(keep)) ** 2).sum()

    got = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v, seg) ** 2).sum(), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(dense_loss, (0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, w, dtype=F32, scale=10)


@pytest.mark.slow
def test_bias_gradient_and_cross_attention_ids(rng):
    q = jnp.asarray(rng.standard_normal((1, 20, 2, 4)), F32)
    k, v = (jnp.asarray(rng.standard_normal((1, 12, 1, 4)), F32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((1, 2, 20, 12)), F32)
    got = jax.jit(jax.grad(lambda b: foldax.dot_product_attention(q, k, v, b).sum()))(bias)
    want = jax.jit(jax.grad(lambda b: jax.nn.dot_product_attention(q, k, v, b).sum()))(bias)
    assert_allclose(got, want, dtype=F32, scale=3)
    iq = jnp.asarray(np.sort(rng.integers(0, 3, (1, 20))), jnp.int32)
    ik = jnp.asarray(np.sort(rng.integers(0, 3, (1, 12))), jnp.int32)
    out = jax.jit(lambda q, k, v, s: foldax.dot_product_attention(q, k, v, segment_ids=s))(
        q, k, v, (iq, ik)
    )
    keep = (np.asarray(iq)[:, :, None] == np.asarray(ik)[:, None, :])[:, None]
    assert_allclose(out, _grouped_ref(q, k, v, keep), dtype=F32, scale=3)


def test_errors_name_the_function_and_the_fix(heads):
    q, k, v = heads
    cases = [
        ((q, k[..., :4], v), {}, r"key's head size 4 is not query's 8"),
        ((q, k[:, :, :1].repeat(3, 2), v), {}, r"value has 36 rows and 2 heads where key has"),
        ((q[..., :3, :], k, v), {}, r"query's 3 heads are not a multiple of key's 2"),
        ((q, k, v), {"layout": "TBNH"}, r"layout must be 'BTNH' or 'BNTH'"),
        ((q, k, v[0]), {}, r"query, key and value must all be 4-D"),
        ((q, k, v), {"segment_ids": jnp.zeros((3, 36), jnp.int32)}, r"segment_ids has shape"),
        ((q, k, v), {"mask": jnp.ones((2, 4, 36, 36), jnp.complex64)}, r"mask must be boolean"),
        ((q, k, v), {"bias": jnp.ones((2, 3, 36, 36))}, r"bias of shape .* does not broadcast"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=r"foldax.dot_product_attention: " + match):
            foldax.dot_product_attention(*args, **kw)


def test_real_scalar_options_of_any_type_are_taken(rng):
    """``dropout_rate`` and ``logits_soft_cap`` as any real scalar -- NumPy scalars of every
    width, 0-d NumPy and JAX arrays -- act as the Python float (and run its executable); bools,
    complex numbers, arrays and traced values are refused."""
    q, k, v = _qkv(rng, 1, 8, 2, 4)
    key = jax.random.key(0)
    f = lambda **kw: foldax.dot_product_attention(q, k, v, dropout_rng=key, **kw)  # noqa: E731
    scalars = lambda x: [  # noqa: E731
        np.float32(x), np.float16(x), np.float64(x), np.array(x, F32), jnp.asarray(x, F32),
        jnp.asarray(x, jnp.bfloat16),
    ]  # fmt: skip
    dropped, capped = f(dropout_rate=0.25), f(logits_soft_cap=3.0)
    entries = len(_eager.CACHE)
    for rate in scalars(0.25):
        np.testing.assert_array_equal(f(dropout_rate=rate), dropped, err_msg=repr(rate))
    for cap in [3, *scalars(3.0), np.int8(3), np.uint64(3), np.array(3)]:
        np.testing.assert_array_equal(f(logits_soft_cap=cap), capped, err_msg=repr(cap))
    assert len(_eager.CACHE) == entries
    for bad in [True, np.bool_(False), np.array(True), 0.5j, np.complex64(0.5), np.ones(1, F32)]:
        with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\)"):
            f(dropout_rate=bad)
        with pytest.raises(ValueError, match=r"logits_soft_cap must be a positive number"):
            f(logits_soft_cap=bad)
    with pytest.raises(ValueError, match=r"logits_soft_cap must be a positive number"):
        f(logits_soft_cap=np.float32(np.inf))
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\)"):
        jax.jit(lambda rate: f(dropout_rate=rate))(0.25)  # static: a traced rate is refused


# ----------------------------------------------------------------------------------------------
# Memory


@pytest.mark.slow
def test_packed_attention_memory_grows_like_length_not_its_square(rng):
    """Temp bytes from L to 4L (16 documents) grow at most 4.5x, forward and gradient, and stay
    far below one (L, L) float32 buffer."""

    def temps(length):
        q = jax.ShapeDtypeStruct((1, length, 1, 32), jnp.float32)
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        f = lambda q, k, v, s: foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=s)  # noqa: E731
        g = jax.grad(lambda q, k, v, s: f(q, k, v, s).sum(), (0, 1, 2))
        return report(f, q, q, q, ids).temp_bytes, report(g, q, q, q, ids).temp_bytes

    # past one tile (1,024 x 1,024 pairs, a matrix product each) in both directions
    small, large = temps(4096), temps(16384)
    for s, lg, what in zip(small, large, ("forward", "gradient"), strict=True):
        assert lg <= 4.5 * max(s, 1), f"{what}: {s} -> {lg} bytes"
        assert lg < 16384 * 16384 * 4 / 8, f"{what}: {lg} bytes, near an L x L buffer"


@pytest.mark.slow
def test_under_export_checkpoint_jacfwd_and_nested_vmap(rng):
    q = jnp.asarray(rng.standard_normal((2, 24, 2, 4)), F32)
    ids = _docs(rng, 24, 3, batch=2)
    # each transformation jitted: one compile each, not one per operation
    f = jax.jit(
        lambda q, ids: foldax.dot_product_attention(q, q, q, is_causal=True, segment_ids=ids)
    )
    want = f(q, ids)
    exported = jax.export.export(f)(q, ids)
    np.testing.assert_array_equal(exported.call(q, ids), want)
    g = jax.jit(jax.grad(jax.checkpoint(lambda q: (f(q, ids) ** 2).sum())))(q)
    assert_allclose(g, jax.jit(jax.grad(lambda q: (f(q, ids) ** 2).sum()))(q), dtype=F32)
    jac = jax.jit(jax.jacfwd(lambda q: f(q, ids)[0, 3, 1]))(q)
    rev = jax.jit(jax.jacrev(lambda q: f(q, ids)[0, 3, 1]))(q)
    assert_allclose(jac, rev, dtype=F32, scale=3)
    nested = jax.jit(jax.vmap(jax.vmap(f)))(jnp.stack([q, -q]), jnp.stack([ids, ids[::-1]]))
    assert_allclose(nested[0], want, dtype=F32)
    assert_allclose(nested[1, 1], f(-q, ids[::-1])[1], dtype=F32)
