"""``foldax.dot_product_attention`` as a drop-in for ``jax.nn.dot_product_attention`` and for
Flax's ``attention_fn``: masks and biases broadcast as ``jax.nn``'s do, the residual's gradient,
Flax's masks, batch axes and keywords, the logits' soft cap and masks of the head; values and
gradients against ``jax.nn``, Flax's own attention or a float64 dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose
from jax.test_util import check_grads

import foldax
from foldax._pairwise._attention import _pairs_array
from foldax.memory import report

F32 = np.float32
B, T, S, N, K, H = 2, 6, 5, 4, 2, 4


def _qkv(rng, batch=(B,), t=T, s=S, n=N, k=K, h=H):
    q = jnp.asarray(rng.standard_normal((*batch, t, n, h)), F32)
    kv = (jnp.asarray(rng.standard_normal((*batch, s, k, h)), F32) for _ in range(2))
    return (q, *kv)


def _nn(q, k, v, bias=None, mask=None, **kw):
    """``jax.nn``'s attention, a query with no kept key set to 0 (foldax's convention)."""
    out = jax.nn.dot_product_attention(q, k, v, bias, mask, **kw)
    if mask is None:
        return out
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    full = jnp.broadcast_to(mask, np.broadcast_shapes(mask.shape, (1, N, T, S)))
    any_kept = jnp.swapaxes(full.any(-1), -1, -2)  # (1 or B, T, N)
    return jnp.where(any_kept[..., None], out, 0.0).reshape(out.shape)


def _dense64(q, k, v, keep=True, bias=0.0, cap=None):
    """float64 attention ``(B, T, N, H)`` with K key / value heads; empty rows give 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[-2] // k.shape[-2]
    k, v = (np.repeat(a, g, axis=-2) for a in (k, v))
    logits = np.einsum("...tnh,...snh->...nts", q, k) / np.sqrt(q.shape[-1]) + bias
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    logits = np.where(keep, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    z = p.sum(-1, keepdims=True)
    return np.einsum("...nts,...snh->...tnh", p / np.where(z > 0, z, 1.0), v)


# ----------------------------------------------------------------------------------------------
# 1. masks and biases broadcast as jax.nn's

_SHAPES = [(S,), (1, 1, S), (T, 1), (T, S), (N, T, S), (1, N, 1, S), (B, 1, 1, S), (B, N, T, S)]


@pytest.mark.parametrize(
    "layout", ["BTNH", pytest.param("BNTH", marks=pytest.mark.slow), "unbatched"]
)
def test_mask_and_bias_shapes_broadcast_as_jax_nn(rng, layout):
    q, k, v = _qkv(rng)
    to = (lambda a: jnp.swapaxes(a, 1, 2)) if layout == "BNTH" else (lambda a: a)
    unbatched = layout == "unbatched"
    shapes = [a for a in _SHAPES if not (unbatched and len(a) == 4 and a[0] == B)]
    for mask_shape, bias_shape in zip(shapes, shapes[3:] + shapes[:3], strict=True):
        mask = jnp.asarray(rng.random(mask_shape) < 0.7)
        bias = jnp.asarray(rng.standard_normal(bias_shape), F32)
        if unbatched:
            args, want = (q[0], k[0], v[0]), _nn(q[:1], k[:1], v[:1], bias, mask)[0]
        else:
            args, want = tuple(map(to, (q, k, v))), _nn(q, k, v, bias, mask)
        got = foldax.dot_product_attention(
            *args, bias, mask, layout="BNTH" if layout == "BNTH" else "BTNH", block_size=4
        )
        assert_allclose(to(got), want, dtype=F32, scale=3, err_msg=f"{mask_shape} {bias_shape}")


def test_broadcast_mask_and_bias_gradients_match_jax_nn(rng):
    q, k, v = _qkv(rng)
    mask = jnp.asarray(rng.random((T, S)) < 0.7).at[:, 0].set(True)
    for shape in [(N, 1, S), (B, 1, 1, S)]:
        bias = jnp.asarray(rng.standard_normal(shape), F32)

        def loss(f):
            return lambda q, k, v, b: (f(q, k, v, b, mask) ** 2).sum()

        got = jax.grad(loss(foldax.dot_product_attention), (0, 1, 2, 3))(q, k, v, bias)
        want = jax.grad(loss(jax.nn.dot_product_attention), (0, 1, 2, 3))(q, k, v, bias)
        for g, w in zip(got, want, strict=True):
            assert_allclose(g, w, dtype=F32, scale=10, err_msg=f"{shape}")


def test_shared_masks_are_not_copied_per_example_or_head():
    ones = jnp.ones
    for shape, want in [
        ((S,), (1, S)),
        ((1, 1, S), (1, S)),
        ((B, 1, 1, S), (B, 1, S)),
        ((N, T, 1), (N, T, 1)),
        ((1, N, T, S), (N, T, S)),
    ]:
        a, axis, heads = _pairs_array(ones(shape, bool), (B,), N, T, S, "mask")
        assert a.shape == want, shape
        assert axis == (0 if len(shape) == 4 and shape[0] == B else None)
        assert heads == (N in shape[-3:-2])


def test_broadcast_errors_name_the_shapes():
    q, k, v = _qkv(np.random.default_rng(0))
    cases = [
        ((3, T, S), r"mask of shape \(3, 6, 5\) does not broadcast to \(B, N, T, S\) = "
         r"\(2, 4, 6, 5\): N = 4 where it has 3"),
        ((2, 1, B, N, T, S), r"mask of shape .* it has 6 axes, at most 4"),
        ((T, S + 1), r"mask of shape .*: S = 5 where it has 6"),
    ]  # fmt: skip
    for shape, match in cases:
        with pytest.raises(ValueError, match=r"foldax.dot_product_attention: " + match):
            foldax.dot_product_attention(q, k, v, mask=jnp.ones(shape, bool))


# ----------------------------------------------------------------------------------------------
# 2. the residual's gradient


def test_residual_is_stop_gradient_unless_asked(rng):
    q, k, v = _qkv(rng)

    def lse(q, k, grad):
        f = foldax.dot_product_attention
        return f(q, k, v, is_causal=True, return_residual=True, residual_gradient=grad)[1]

    got = jax.jit(lse, static_argnums=2)(q, k, False)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)[1]
    assert_allclose(got, want, dtype=F32, scale=3)
    zero = jax.grad(lambda q, k: lse(q, k, False).sum(), (0, 1))(q, k)
    assert all(not np.any(np.asarray(g)) for g in zero)

    def dense_lse(q, k):
        kk = jnp.repeat(k, N // K, axis=2)
        logits = jnp.einsum("btnh,bsnh->btns", q, kk) / np.sqrt(H).astype(F32)
        causal = np.arange(S)[None, :] <= np.arange(T)[:, None]
        return jax.nn.logsumexp(jnp.where(causal[:, None], logits, -jnp.inf), -1)

    got = jax.grad(lambda q, k: (lse(q, k, True) ** 2).sum(), (0, 1))(q, k)
    want = jax.grad(lambda q, k: (dense_lse(q, k) ** 2).sum(), (0, 1))(q, k)
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, w, dtype=F32, scale=10)


# ----------------------------------------------------------------------------------------------
# 3. Flax's attention_fn


def test_flax_masks_batch_axes_and_keywords(rng):
    """Flax's float masks (nonzero keeps), several batch axes, and its keywords."""
    q, k, v = _qkv(rng, batch=(2, 3))
    keep = rng.random((2, 3, 1, T, S)) < 0.7
    keep[..., 0] = True
    kw = dict(dropout_rate=0.1, deterministic=True, dropout_rng=jax.random.key(0), dtype=F32)
    got = foldax.dot_product_attention(q, k, v, mask=jnp.asarray(keep, F32), **kw)
    assert got.shape == (2, 3, T, N, H)
    lengths = jnp.asarray(rng.integers(1, S + 1, (2, 3)), jnp.int32)
    flat = lambda a: a.reshape((6, *a.shape[2:]))  # noqa: E731
    want = jax.nn.dot_product_attention(*map(flat, (q, k, v)), mask=flat(jnp.asarray(keep)))
    assert_allclose(flat(got), want, dtype=F32, scale=3)
    got, lse = foldax.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True, return_residual=True
    )
    want, want_lse = jax.nn.dot_product_attention(
        *map(flat, (q, k, v)), key_value_seq_lengths=flat(lengths), is_causal=True,
        return_residual=True,
    )  # fmt: skip
    assert lse.shape == (2, 3, T, N)
    assert_allclose(flat(got), want, dtype=F32, scale=3)
    assert_allclose(flat(lse), want_lse, dtype=F32, scale=30)


def test_flax_options_it_cannot_honour_are_refused(rng):
    q, k, v = _qkv(rng)
    f = foldax.dot_product_attention
    with pytest.raises(ValueError, match=r"dropout_rate=0.1 without deterministic=True needs"):
        f(q, k, v, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\), got 1"):
        f(q, k, v, dropout_rate=1, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"dropout_rng must be a PRNG key, got float32"):
        f(q, k, v, dropout_rate=0.1, dropout_rng=jnp.zeros(2))
    with pytest.raises(ValueError, match=r"dropout_rng must be one key, got shape \(2,\)"):
        f(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0)))
    with pytest.raises(ValueError, match=r"the attention weights, which are never formed"):
        f(q, k, v, module=object())
    with pytest.raises(
        ValueError, match=r"implementation must be None, 'xla', 'pallas' or 'cudnn'"
    ):
        f(q, k, v, implementation="triton")
    with pytest.raises(ValueError, match=r"logits_soft_cap must be a positive number, got 0"):
        f(q, k, v, logits_soft_cap=0)


def _module_pair(linen, make, x, mask):
    """The module with Flax's attention and with foldax's, one set of parameters: their
    outputs and input gradients (and parameter gradients for linen)."""
    ref, ours = make(None), make(foldax.dot_product_attention)
    if linen:
        params = ref.init(jax.random.key(0), x, mask=mask)

        def run(m):
            loss = lambda p, x: (m.apply(p, x, mask=mask) ** 2).sum()  # noqa: E731
            return m.apply(params, x, mask=mask), jax.grad(loss, (0, 1))(params, x)

        return run(ref), run(ours)
    from flax import nnx

    ours = nnx.clone(ref)
    ours.attention_fn = foldax.dot_product_attention

    def run(m):
        loss = lambda x: (m(x, mask=mask, decode=False) ** 2).sum()  # noqa: E731
        return m(x, mask=mask, decode=False), jax.grad(loss)(x)

    return run(ref), run(ours)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_multi_head_attention_module(rng, api):
    nn = pytest.importorskip("flax.linen")

    x = jnp.asarray(rng.standard_normal((2, 3, T, 8)), F32)  # two batch axes
    tokens = jnp.asarray(rng.integers(0, 3, (2, 3, T)), jnp.int32).at[..., 0].set(1)
    causal = nn.make_causal_mask(tokens)
    padding = nn.make_attention_mask(jnp.ones_like(tokens), (tokens > 0).astype(jnp.int32))
    for mask in (causal, nn.combine_masks(causal, padding), padding):
        if api == "linen":

            def make(fn):
                kw = {} if fn is None else {"attention_fn": fn}
                return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, **kw)

        else:

            def make(fn):
                nnx = pytest.importorskip("flax.nnx")
                return nnx.MultiHeadAttention(
                    num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
                )

        (out_ref, g_ref), (out, g) = _module_pair(api == "linen", make, x, mask)
        assert_allclose(out, out_ref, dtype=F32, scale=3)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            assert_allclose(a, b, dtype=F32, scale=30)


def test_flax_sow_weights_is_refused(rng):
    pytest.importorskip("flax")
    from flax import linen as nn

    x = jnp.asarray(rng.standard_normal((2, T, 8)), F32)
    m = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, attention_fn=foldax.dot_product_attention
    )
    params = m.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"attention weights, which are never formed"):
        m.apply(params, x, sow_weights=True, mutable=["intermediates"])
    drop = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dropout_rate=0.1, attention_fn=foldax.dot_product_attention
    )
    assert drop.apply(params, x, deterministic=True).shape == x.shape


# ----------------------------------------------------------------------------------------------
# 4. the logits' soft cap


def test_logits_soft_cap_values_and_gradients(rng):
    q, k, v = _qkv(rng)
    q = 4 * q  # logits well past the cap
    bias = jnp.asarray(rng.standard_normal((N, T, S)), F32)
    causal = np.arange(S)[None, :] <= np.arange(T)[:, None]
    f = jax.jit(
        lambda q, k, v, b: foldax.dot_product_attention(
            q, k, v, b, is_causal=True, logits_soft_cap=2.5
        )
    )
    got = f(q, k, v, bias)
    assert_allclose(got, _dense64(q, k, v, causal, np.asarray(bias), cap=2.5), dtype=F32, scale=3)

    def dense(q, k, v, b):
        kk, vv = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
        logits = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H).astype(F32) + b[None]
        logits = jnp.where(causal[None, None], 2.5 * jnp.tanh(logits / 2.5), -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, -1), vv)

    loss = lambda f: lambda *a: (f(*a) ** 2).sum()  # noqa: E731
    got = jax.grad(loss(f), (0, 1, 2, 3))(q, k, v, bias)
    want = jax.grad(loss(dense), (0, 1, 2, 3))(q, k, v, bias)
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, w, dtype=F32, scale=30)


# ----------------------------------------------------------------------------------------------
# 5. masks of the head


def test_mask_of_the_head_matches_its_array(rng):
    q, k, v = _qkv(rng)
    hh, tt, ss = np.ix_(np.arange(N), np.arange(T), np.arange(S))

    def per_head(h, t, s):
        return (s <= t + h - 2) | (s == 0)  # each head its own window

    def shifted(t, s, h=3):  # a default: still the (t, s) form
        return s <= t + h - 2

    pairs = jnp.asarray(per_head(hh, tt, ss))
    f = jax.jit(lambda q, k, v: foldax.dot_product_attention(q, k, v, mask=per_head))
    assert_allclose(f(q, k, v), jax.nn.dot_product_attention(q, k, v, mask=pairs), dtype=F32)
    eager = foldax.dot_product_attention(q, k, v, mask=per_head, block_size=2)  # cached trace
    assert_allclose(eager, jax.nn.dot_product_attention(q, k, v, mask=pairs), dtype=F32)
    two = foldax.dot_product_attention(q, k, v, mask=shifted)
    want = _dense64(q, k, v, shifted(tt[0], ss[0]))
    assert_allclose(two, want, dtype=F32, scale=3)

    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    got = jax.grad(loss(f), (0, 1, 2))(q, k, v)
    nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=pairs)  # noqa: E731
    want = jax.grad(loss(nn), (0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, w, dtype=F32, scale=10)


# ----------------------------------------------------------------------------------------------
# 6. dropout on the attention weights

RATE = 0.3


def _keep_mask(key, *, broadcast=True, block_size=None, batch=(2,), t=40, s=56, n=2, k=2):
    """The keep mask ``(*batch, T, N, S)`` of a call, read off its output: zero logits and the
    identity as values make ``out[t, :] = keep[t, :] / (S (1 - rate))``."""
    q = jnp.zeros((*batch, t, n, 1))
    kk = jnp.zeros((*batch, s, k, 1))
    v = jnp.broadcast_to(jnp.eye(s)[:, None, :], (*batch, s, k, s))
    out = foldax.dot_product_attention(
        q, kk, v, dropout_rate=RATE, dropout_rng=key, broadcast_dropout=broadcast,
        block_size=block_size,
    )  # fmt: skip
    m = np.asarray(out, np.float64) * s * (1 - RATE)
    assert np.allclose(m, np.round(m), atol=1e-4), "weights are not 0 or 1 / (1 - rate)"
    return np.round(m).astype(bool)


def _within(count, n, p, sigmas=5.0):
    """Whether ``count`` of ``n`` draws is a plausible binomial(n, p) outcome."""
    return abs(count - n * p) <= sigmas * np.sqrt(n * p * (1 - p))


def test_dropout_keep_mask_statistics_and_reproducibility():
    key = jax.random.key(7)
    m = _keep_mask(key, batch=(3,), n=4)
    assert _within(m[0, :, 0].sum(), m[0, :, 0].size, 1 - RATE)
    # the same bits for any tiling, and again on a second call
    assert np.array_equal(m, _keep_mask(key, batch=(3,), n=4, block_size=(8, 16)))
    assert np.array_equal(m, _keep_mask(key, batch=(3,), n=4, block_size=3))
    # broadcast_dropout (Flax's default): one mask for every example and head
    assert all(np.array_equal(m[0, :, 0], m[b, :, h]) for b in range(3) for h in range(4))
    # otherwise independent draws per example and head: agreement p^2 + (1 - p)^2
    per = _keep_mask(key, broadcast=False, batch=(3,), n=4)
    agree = 1 - 2 * RATE * (1 - RATE)
    for (b1, h1), (b2, h2) in [((0, 0), (0, 1)), ((0, 0), (1, 0)), ((1, 2), (2, 3))]:
        same = (per[b1, :, h1] == per[b2, :, h2]).sum()
        assert _within(same, per[0, :, 0].size, agree), (b1, h1, b2, h2)
    # another key, another mask; neighbouring tiles of 8 x 8 pairs are not alike
    other = _keep_mask(jax.random.key(8))
    assert _within((other[0, :, 0] == m[0, :, 0]).sum(), m[0, :, 0].size, agree)
    tile = m[0, :, 0][:40, :48].reshape(5, 8, 6, 8).swapaxes(1, 2).reshape(30, 64)
    assert _within((tile[1:] == tile[:-1]).sum(), tile[1:].size, agree)
    # a raw PRNGKey is taken as its key
    raw = _keep_mask(jax.random.PRNGKey(7))
    assert np.array_equal(raw, _keep_mask(jax.random.wrap_key_data(jax.random.PRNGKey(7))))


def test_dropout_values_and_gradients_match_dense_with_its_mask(rng):
    t, s, n, k, h = 8, 7, 2, 1, 4
    key = jax.random.key(3)
    keep = _keep_mask(key, broadcast=False, t=t, s=s, n=n, k=k)  # (B, T, N, S)
    keep = keep.swapaxes(1, 2)  # (B, N, T, S)
    causal = np.tril(np.ones((t, s), bool))
    q, kk, v = _qkv(rng, t=t, s=s, n=n, k=k, h=h)
    bias = jnp.asarray(rng.standard_normal((n, t, s)), F32)
    f = lambda q, kk, v, bias: foldax.dot_product_attention(  # noqa: E731
        q, kk, v, bias, is_causal=True, dropout_rate=RATE, dropout_rng=key,
        broadcast_dropout=False, block_size=(4, 3),
    )  # fmt: skip
    # dense: softmax over the causal pairs, the dropped ones' weights zeroed, the rest / (1 - p)
    p = _dense_weights(q, kk, causal, np.asarray(bias, np.float64))
    want = np.einsum("bnts,bsnh->btnh", p * keep / (1 - RATE), _repeat(v, n // k))
    assert_allclose(f(q, kk, v, bias), want, dtype=F32, scale=3)
    assert_allclose(jax.jit(f)(q, kk, v, bias), want, dtype=F32, scale=3)
    # forward and reverse derivatives agree with finite differences: the backward pass
    # draws the forward pass's mask
    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a, jnp.float64) for a in (q, kk, v, bias))
        assert np.isfinite(jax.jit(f)(*args)).all()  # check_grads passes NaNs matching NaNs
        check_grads(jax.jit(f), args, order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-6, rtol=1e-6)


def _repeat(a, g):
    return np.repeat(np.asarray(a, np.float64), g, axis=-2)


def _dense_weights(q, k, keep, bias):
    """float64 softmax weights ``(B, N, T, S)`` over the kept pairs."""
    q, k = np.asarray(q, np.float64), _repeat(k, q.shape[-2] // k.shape[-2])
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    logits = np.where(keep, logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_dropout_is_unbiased_and_flax_modules_train_with_it(rng):
    nn = pytest.importorskip("flax.linen")
    x = jnp.asarray(rng.standard_normal((2, T, 8)), F32)
    m = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, dropout_rate=RATE, attention_fn=foldax.dot_product_attention
    )
    params = m.init(jax.random.key(0), x, deterministic=True)
    clean = m.apply(params, x, deterministic=True)

    @jax.jit
    def noisy(key):
        return m.apply(params, x, deterministic=False, rngs={"dropout": key})

    keys = jax.random.split(jax.random.key(1), 400)
    outs = jax.lax.map(noisy, keys)
    assert np.isfinite(outs).all() and np.isfinite(clean).all()  # NaNs are never "close"
    assert not np.allclose(outs[0], clean) and not np.allclose(outs[0], outs[1])
    # E[keep / (1 - p)] = 1: the mean over draws tends to the output without dropout
    spread = np.asarray(outs).std(0) / np.sqrt(len(keys))
    assert np.all(np.abs(np.asarray(outs).mean(0) - clean) <= 5 * spread + 1e-5)
    grad = jax.grad(
        lambda p: (m.apply(p, x, rngs={"dropout": keys[0]}, deterministic=False) ** 2).sum()
    )
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grad(params)))

    from flax import nnx

    mod = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, dropout_rate=RATE,
        attention_fn=foldax.dot_product_attention, rngs=nnx.Rngs(0, dropout=1),
    )  # fmt: skip
    a, b = mod(x, deterministic=False), mod(x, deterministic=False)
    assert np.isfinite(a).all() and np.isfinite(b).all()  # NaNs are never "close"
    assert a.shape == x.shape and not np.allclose(a, b)  # a new draw each call


def test_dropout_memory_grows_like_length_not_its_square():
    """Temp bytes from L to 4L grow at most 4.5x, forward and gradient, and stay within twice
    (and 1 MB of) the same call's without dropout."""

    def temps(length, rate):
        q = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
        key = jax.random.key(0)
        f = lambda q, k, v: foldax.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, dropout_rate=rate, dropout_rng=key
        )
        g = jax.grad(lambda q, k, v: f(q, k, v).sum(), (0, 1, 2))
        return report(f, q, q, q).temp_bytes, report(g, q, q, q).temp_bytes

    small, large, plain = temps(2048, 0.1), temps(8192, 0.1), temps(8192, 0.0)
    for s, lg, p, what in zip(small, large, plain, ("forward", "gradient"), strict=True):
        assert lg <= 4.5 * max(s, 1), f"{what}: {s} -> {lg} bytes"
        assert lg <= 2 * p + 2**20, f"{what}: {lg} bytes with dropout, {p} without"
