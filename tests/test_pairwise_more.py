"""KeOps' other forms of a pairwise reduction: a log-sum-exp with weights, and masks that skip
the tiles they remove (causal, sliding-window and block-sparse reductions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose
from jax.test_util import check_grads

import foldax
from foldax.memory import report


def _sq(a, b):
    return -jnp.sum((a - b) ** 2)


def _weighted_kernel(a, b):
    yj, wj = b
    return _sq(a, yj), wj


def _weighted_reference(x, y, w):
    d = -((np.asarray(x, np.float64)[:, None] - np.asarray(y, np.float64)[None]) ** 2).sum(-1)
    m = np.max(np.where(np.asarray(w)[None] > 0, d, -np.inf), axis=1, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        s = (np.asarray(w, np.float64)[None] * np.exp(d - shift)).sum(1, keepdims=True)
        return (shift + np.log(s))[:, 0]


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


def test_weighted_logsumexp_gradients(rng):
    x = rng.standard_normal((12, 2)).astype(np.float32)
    y = rng.standard_normal((40, 2)).astype(np.float32)
    w = rng.uniform(0.1, 2, 40).astype(np.float32)

    def f(x, w):
        return foldax.pairwise_reduce(_weighted_kernel, x, (y, w), reduction="logsumexp")

    check_grads(f, (x, w), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
    # at a zero weight the derivative is exp(l - out): finite, not NaN
    w0 = w.copy()
    w0[5] = 0.0
    gw = jax.grad(lambda w: f(x, w).sum())(w0)
    d = -((x.astype(np.float64)[:, None] - y.astype(np.float64)[None]) ** 2).sum(-1)
    want = np.exp(d - _weighted_reference(x, y, w0)[:, None]).sum(0)
    assert_allclose(gw, want, dtype=np.float32, scale=10)


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
    want_idx = np.argmax(d, 1) if is_max else np.argmin(d, 1)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(idx, foldax.pairwise_reduce(kernel, x, y, reduction=arg))
    assert_allclose(val, d[np.arange(33), want_idx], dtype=np.float32, scale=10)
    finite = np.delete(y, 40, axis=0)
    f_both = lambda x: foldax.pairwise_reduce(kernel, x, finite, reduction=both)[0]  # noqa: E731
    f_plain = lambda x: foldax.pairwise_reduce(kernel, x, finite, reduction=plain)  # noqa: E731
    g = jax.grad(lambda x: f_both(x).sum())(x)
    assert_allclose(g, jax.grad(lambda x: f_plain(x).sum())(x), dtype=np.float32)
    t = jax.jvp(f_both, (x,), (np.ones_like(x),))[1]
    assert_allclose(t, jax.jvp(f_plain, (x,), (np.ones_like(x),))[1], dtype=np.float32)


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


# ----------------------------------------------------------------------------------------------
# Masks: pairs removed, tiles skipped


def _attention(q, k, v, mask=None, block=None):
    kernel = lambda qi, kv: (jnp.dot(qi, kv[0]) / 4.0, kv[1])  # noqa: E731
    return foldax.pairwise_reduce(
        kernel, q, (k, v), reduction="softmax", mask=mask, block_size=block
    )


def _dense_masked_attention(q, k, v, keep):
    logits = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / 4.0
    logits = np.where(keep, logits, -np.inf)
    m = np.max(logits, axis=1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    s = p.sum(1, keepdims=True)
    return np.where(s > 0, (p / np.where(s > 0, s, 1.0)) @ np.asarray(v, np.float64), 0.0)


MASKS = {
    "causal": lambda i, j: j <= i,
    "window": lambda i, j: (j <= i) & (j > i - 20),
    "block-sparse": lambda i, j: (i // 16) % 2 == (j // 16) % 2,
    "empty rows": lambda i, j: (j < i) & (i % 5 != 0),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("block", [None, (8, 16), (5, 7)])
def test_masked_attention_matches_dense(rng, name, block):
    m, n = 70, 90
    q, k, v = (rng.standard_normal((s, 4)).astype(np.float32) for s in (m, n, n))
    keep = np.asarray(MASKS[name](np.arange(m)[:, None], np.arange(n)[None, :]))
    keep = np.broadcast_to(keep, (m, n))
    got = _attention(q, k, v, MASKS[name], block)
    assert_allclose(got, _dense_masked_attention(q, k, v, keep), dtype=np.float32, scale=10)

    def dense(q, k, v):
        logits = jnp.where(keep, q @ k.T / 4.0, -jnp.inf)
        w = jnp.where(keep, jnp.exp(logits - jnp.max(logits, 1, keepdims=True)), 0.0)
        s = jnp.sum(w, 1, keepdims=True)
        return jnp.where(s > 0, (w / jnp.where(s > 0, s, 1.0)) @ v, 0.0)

    g = jax.grad(lambda *a: jnp.sum(jnp.sin(_attention(*a, MASKS[name], block))), (0, 1, 2))(
        q, k, v
    )
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), (0, 1, 2))(q, k, v)
    for a, b in zip(g, want, strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        assert_allclose(a, b, dtype=np.float32, scale=10)


@pytest.mark.parametrize("reduction", ["sum", "logsumexp", "min", "argmin", "min_argmin"])
def test_masked_reductions_match_dense(rng, reduction):
    x = rng.standard_normal((40, 2)).astype(np.float32)
    y = rng.standard_normal((60, 2)).astype(np.float32)
    mask = lambda i, j: (j >= i) & (i != 3)  # noqa: E731  (row 3 fully masked)
    keep = np.asarray(mask(np.arange(40)[:, None], np.arange(60)[None, :]))
    d = -((x.astype(np.float64)[:, None] - y.astype(np.float64)[None]) ** 2).sum(-1)
    kernel = lambda a, b: -jnp.sum((a - b) ** 2)  # noqa: E731
    got = foldax.pairwise_reduce(kernel, x, y, reduction=reduction, mask=mask, block_size=(8, 16))
    with np.errstate(divide="ignore"):
        want = {
            "sum": np.where(keep, np.exp(d) * 0 + d, 0).sum(1),
            "logsumexp": np.log(np.where(keep, np.exp(d), 0).sum(1)),
            "min": np.where(keep, d, np.inf).min(1),
        }
    if reduction == "sum":
        got = foldax.pairwise_reduce(lambda a, b: -jnp.sum((a - b) ** 2), x, y, mask=mask)
        assert_allclose(got, want["sum"], dtype=np.float32, scale=50)
    elif reduction in ("argmin", "min_argmin"):
        idx = got[1] if reduction == "min_argmin" else got
        want_idx = np.where(keep, d, np.inf).argmin(1)
        live = keep.any(1)
        np.testing.assert_array_equal(np.asarray(idx)[live], want_idx[live])
        assert np.asarray(idx)[3] == np.iinfo(np.int32).max
    else:
        assert_allclose(got, want[reduction], dtype=np.float32, scale=50)
    if reduction in ("logsumexp", "sum"):
        f = lambda x: foldax.pairwise_reduce(kernel, x, y, reduction=reduction, mask=mask)  # noqa: E731
        g = jax.grad(lambda x: jnp.sum(jnp.where(jnp.isfinite(f(x)), f(x), 0.0)))(x)
        assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[3] == 0)


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


def test_mask_errors():
    x = jnp.ones((4, 2))
    dot = lambda a, b: jnp.sum(a * b)  # noqa: E731
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask must be a callable"):
        foldax.pairwise_reduce(dot, x, x, mask=True)
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask\(i, j\) must return one boolean"):
        foldax.pairwise_reduce(dot, x, x, mask=lambda i, j: i + j)
    with pytest.raises(TypeError, match=r"pairwise_reduce: mask\(i, j\) failed"):
        foldax.pairwise_reduce(dot, x, x, mask=lambda i, j: i.nonexistent)


@pytest.mark.parametrize(
    "call",
    [
        lambda t, x: foldax.segment_var(x, sizes=_sizes(x), fn=lambda r: jnp.sin(r @ t)),
        lambda t, x: foldax.segment_prod(x, sizes=_sizes(x), fn=lambda r: jnp.cos(r @ t)),
        lambda t, x: foldax.pairwise_reduce(
            lambda a, b: (jnp.dot(a, b * t), 1.0 + jnp.sin(b[0])), x[:64], x, reduction="logsumexp"
        ),
        lambda t, x: foldax.pairwise_reduce(
            lambda a, b: (jnp.dot(a, b * t), b),
            x[:64],
            x,
            reduction="softmax",
            mask=lambda i, j: j <= i * 64,
        ),
        lambda t, x: foldax.vandermonde_transpose(
            x[:, 0], jax.lax.complex(t[:2], t[:2]), jax.lax.complex(-1.0 - t[2:] ** 2, t[2:])
        ),
    ],
    ids=["segment_var", "segment_prod", "weighted_lse", "masked_softmax", "vandermonde_t"],
)
def test_new_reductions_under_a_vmap_of_128_keep_memory_flat_in_n(call):
    """Gradients of the new reductions inside ``jax.vmap`` over B = 128 parameter vectors:
    temp memory does not grow when N grows 4x (the planner counts the batch)."""

    def temp(n):
        t = jax.ShapeDtypeStruct((128, 4), jnp.float32)
        x = jax.ShapeDtypeStruct((n, 4), jnp.float32)
        grad = jax.vmap(jax.grad(lambda t, x: jnp.sum(jnp.abs(call(t, x))) ** 1), (0, None))
        return report(grad, t, x).temp_bytes

    small, big = temp(4096), temp(16384)
    assert big <= 1.15 * small + 24 * (16384 - 4096), (small, big)  # + O(N) input-sized copies


def _sizes(x):
    n = x.shape[0]
    return [n // 4, 0, n // 2, n - n // 4 - n // 2]
