"""The peers' own attention tests, ported to run against ``foldax.dot_product_attention``.

Each case calls the peer's implementation and foldax's on the same inputs and compares forward
values and gradients (of query, key, value and bias through ``jax.vjp``, or of a Flax module's
parameters) with the tolerances of :mod:`helpers`. Sizes are shrunk (``T, S <= 16``, at most 4
heads of size at most 8). Conventions that differ on purpose (foldax's docstring): a query with
no kept key gives 0 where Flax's and ``jax.nn``'s XLA paths average every value, so such rows
are left out of the comparisons (their cotangent is 0); dropout's keep bits are not Flax's, so
dropout is compared by its properties; sowing the attention weights (``module=``) is refused.

Every case is a compilation or two of one to three seconds on a CPU core: to keep the file
within its time budget (about 30 s on one core, half of it ``-m "not slow"``), the peers'
parameter products are cut to the cases named below, chosen so that each mask, dtype and
option is taken at least once.

From ``jax-ml/jax`` ``tests/nn_test.py`` (``NNFunctionsTest``), against ``jax.nn``'s XLA
implementation:

- ``testDotProductAttention`` (``dtype`` x ``group_num`` x ``use_vmap``: float16, 2 groups,
  foldax under ``jax.vmap``; float32 grouped heads come through nnx below, bfloat16 in the
  bias-gradient test): grouped-query heads against the peer on key / value heads repeated;
- ``testDotProductAttentionMask`` (``mask_mode`` ``('custom', 'padding')`` and ``('bias',
  'causal')``, which take each single mode: a mask array, ``query_seq_lengths`` /
  ``key_value_seq_lengths``, a bias and its gradient, causal);
- ``testDotProductAttentionBiasGradient`` (``batch_size=3``, ``use_vmap=True``, bfloat16 as
  the peer: the vjp through ``x``, the bias and the boolean mask);
- ``return_residual``: the log-sum-exp, and its ``stop_gradient``, with grouped heads, a
  bias, a mask, causal with a local window and both sequence lengths, ``T != S``.

From ``google/flax`` ``tests/linen/linen_attention_test.py`` (``AttentionTest``), with
``attention_fn=foldax.dot_product_attention`` against the default ``attention_fn``:

- ``test_multihead_self_attention``, ``test_multihead_encoder_decoder_attention`` and
  ``test_multihead_self_attention_w_dropout_disabled``, merged into one scenario with the
  brief's variants (two batch axes, cross-attention, ``qkv_features`` / ``out_features``,
  ``normalize_qk``, ``dropout_rate`` with ``deterministic=True``, masks of
  ``make_attention_mask`` / ``make_causal_mask`` / ``combine_masks``): output and parameter
  gradients;
- ``test_multihead_self_attention_explicit_dropout`` verbatim (``deterministic=False``, the
  ``dropout`` stream and ``dropout_rng``; ``broadcast_dropout=True``), and
  ``broadcast_dropout=False`` with finite gradients (slow);
- ``test_multihead_sow_attention_weights`` (refused) and ``test_dtype_infer`` (complex64:
  refused by foldax with a clear error).

From ``google/flax`` ``tests/nnx/nn/attention_test.py``: nnx's ``MultiHeadAttention`` with
``num_kv_heads`` and its ``is_causal`` call (slow).

Beyond the peers: dropout draws that depend on ``unsafe_rbg`` keys.

Not ported: the peers' tests that never reach ``attention_fn``'s arithmetic
(``test_causal_mask_1d``, ``test_multihead_mask_warning``, ``test_attention_alias_*``, nnx's
``test_keep_rngs``), cuDNN-only checks, and, for the time budget,
``test_decoding``, ``test_multihead_self_attention_w_dropout``,
``test_autoregresive_receptive_field_1d``, ``test_multihead_kv_args``,
``test_autoregressive_decode_with_x64``, nnx's ``test_basic`` and ``TestLinenConsistency``
(checked while porting: they pass with foldax, decoding through the cache within float32's
tolerance of the default attention over the whole sequence, linen's float64 decoding within
float64's; nnx's default takes its softmax in float32, through ``jax.nn``).

The peers' tests run under ``jax_numpy_dtype_promotion="standard"`` (``nn_test`` asks for it;
Flax needs it for mixed dtypes): their implementations run under it here, foldax under the
suite's strict promotion (but for the complex64 case, where Flax's layers need standard).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, data_scale

import foldax

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

F32, F16, BF16 = np.float32, jnp.float16, jnp.bfloat16
FX = foldax.dot_product_attention
slow = pytest.mark.slow


def _standard():
    """The peers' dtype promotion (see the module docstring)."""
    return jax.numpy_dtype_promotion("standard")


def _peer(f, *args):
    """``jax.jit(f)(*args)`` under the peers' dtype promotion (the whole call: a ``with`` inside
    a jitted function does not reach the transposition of the jits it calls)."""
    with _standard():
        return jax.jit(f)(*args)


def _rand(rng, shape, dtype=F32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _vjp(f, primals, cotangent):
    out, pull = jax.vjp(f, *primals)
    return out, pull(cotangent)


def _close(actual, desired, dtype, *inputs, err_msg=""):
    """``actual`` against ``desired`` with ``dtype``'s tolerance, the absolute part scaled by
    the magnitude of the result and of the inputs it came from."""
    scale = data_scale(desired, *(np.asarray(a, np.float64) for a in inputs))
    assert_allclose(actual, desired, dtype=dtype, scale=scale, err_msg=err_msg)


def _close_trees(actual, desired, dtype, err_msg=""):
    """Every leaf of ``actual`` against ``desired``'s, the absolute tolerance scaled by the
    largest leaf (a gradient that is 0 in exact arithmetic, such as the key projection's bias's,
    is rounding noise of the size of the others)."""
    paths = jax.tree_util.tree_flatten_with_path(desired)[0]
    got = jax.tree.leaves(actual)
    assert len(got) == len(paths), err_msg
    scale = data_scale(*(d for _, d in paths))
    for a, (path, d) in zip(got, paths, strict=True):
        msg = f"{jax.tree_util.keystr(path)} {err_msg}"
        assert_allclose(a, d, dtype=dtype, scale=scale, err_msg=msg)


# ==============================================================================================
# jax-ml/jax tests/nn_test.py


def _param(*values, slow_case=False):
    return pytest.param(*values, marks=slow) if slow_case else pytest.param(*values)


# testDotProductAttention: dtype x group_num x use_vmap; of its 18 cases (each a compilation of
# about two seconds) one, in the peer's float16, grouped, under vmap. float32: the grouped heads
# of test_nnx_grouped_heads_is_causal_and_masks; bfloat16: test_nn_dot_product_attention_bias_
# gradient
_GQA = [(F16, 2, True)]


@pytest.mark.parametrize("dtype, group_num, use_vmap", _GQA)
def test_nn_dot_product_attention(rng, dtype, group_num, use_vmap):
    """``testDotProductAttention``: grouped-query heads (``K = N / G``) against ``jax.nn``'s on
    key / value heads repeated ``G`` times, values and the gradients of q, k and v; foldax
    under ``jax.vmap`` over the batch (unbatched calls) with ``use_vmap``. float16: the peer
    runs on the same inputs in float32 (its float16 path asks for the ``F16_F16_F32`` dot
    algorithm, which XLA:CPU refuses)."""
    B, S, T, N, H, G = 2, 16, 16, 4, 8, group_num
    q, grad = _rand(rng, (B, T, N, H), dtype), _rand(rng, (B, T, N, H), dtype)
    k, v = _rand(rng, (B, S, N // G, H), dtype), _rand(rng, (B, S, N // G, H), dtype)
    ans = jax.vmap(FX, in_axes=(0, 0, 0, None, None)) if use_vmap else FX

    def peer(q, k, v, grad):
        if dtype == F16:
            q, k, v, grad = (a.astype(F32) for a in (q, k, v, grad))
        k_ref, v_ref = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
        sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation=None)
        out_ref, (dq_ref, dk_ref, dv_ref, *_) = _vjp(sdpa_ref, (q, k_ref, v_ref, None, None), grad)
        group = lambda d: d.astype(F32).reshape(B, S, N // G, G, H).sum(3)  # noqa: E731
        return out_ref, dq_ref, group(dk_ref), group(dv_ref)

    def ours(q, k, v, grad):
        out, (dq, dk, dv, *_) = _vjp(ans, (q, k, v, None, None), grad)
        return out, dq, dk, dv

    ref, got = _peer(peer, q, k, v, grad), jax.jit(ours)(q, k, v, grad)
    assert got[0].dtype == dtype and got[0].shape == (B, T, N, H)
    assert got[2].shape == k.shape and got[3].shape == v.shape
    for name, a, d in zip(("out", "dQ", "dK", "dV"), got, ref, strict=True):
        _close(a, d, dtype, q, k, v, grad, err_msg=name)


# testDotProductAttentionMask: mask_mode; of its 9 modes, two that take bias, causal, padding and
# custom (the single modes are parts of them). The causal local window: test_nn_return_residual
_MASK_MODES = [("custom", "padding"), ("bias", "causal")]


@pytest.mark.parametrize("mask_mode", _MASK_MODES, ids=lambda m: "-".join(m))
def test_nn_dot_product_attention_mask(rng, mask_mode):
    """``testDotProductAttentionMask``: ``jax.nn``'s masks combined (``custom``: a causal mask
    passed as an array; ``padding``: ``query_seq_lengths`` and ``key_value_seq_lengths``),
    values and the gradients of q, k, v and bias (float32 where the peer uses bfloat16, for a
    tighter comparison; every query keeps a key)."""
    dtype = F32
    B, S, T, N, H = 2, 16, 16, 4, 8
    q, grad = _rand(rng, (B, T, N, H), dtype), _rand(rng, (B, T, N, H), dtype)
    k, v = _rand(rng, (B, S, N, H), dtype), _rand(rng, (B, S, N, H), dtype)
    bias = mask = q_seqlen = kv_seqlen = None
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
        bias = _rand(rng, (1, N, T, S), dtype)
    kw = dict(
        is_causal="causal" in mask_mode, query_seq_lengths=q_seqlen,
        key_value_seq_lengths=kv_seqlen,
    )  # fmt: skip

    sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kw)

    def run(f, q, k, v, bias, grad):
        return _vjp(lambda q, k, v, b: f(q, k, v, b, mask), (q, k, v, bias), grad)

    out_ref, d_ref = _peer(functools.partial(run, sdpa_ref), q, k, v, bias, grad)
    out, d = jax.jit(functools.partial(run, functools.partial(FX, **kw)))(q, k, v, bias, grad)
    _close(out, out_ref, dtype, q, k, v, err_msg="out")
    for name, a, b in zip(("dQ", "dK", "dV", "dbias"), d, d_ref, strict=True):
        if b is not None:
            _close(a, b, dtype, q, k, v, grad, err_msg=name)


@pytest.mark.parametrize("batch_size, use_vmap", [_param(3, True, slow_case=True)])  # of 4
def test_nn_dot_product_attention_bias_gradient(rng, batch_size, use_vmap):
    """``testDotProductAttentionBiasGradient``: self-attention ``q = k = v = x`` with a bias per
    example and head, an all-true ``(1, 1, S)`` mask; the vjp (cotangent ``x``) taken through
    ``x``, the bias and the boolean mask (bfloat16, as the peer)."""
    dtype = BF16
    B, S, N, H = batch_size, 16, 4, 8
    x, bias = _rand(rng, (B, S, N, H), dtype), _rand(rng, (B, N, S, S), dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(impl, x, bias, mask):
        return impl(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation=None)
    attn_ref, attn_ans = (functools.partial(attention, f) for f in (sdpa_ref, FX))
    if use_vmap:
        attn_ref, attn_ans = (jax.vmap(f, in_axes=(0, 0, None)) for f in (attn_ref, attn_ans))

    def run(f, x, bias, mask):
        return _vjp(f, (x, bias, mask), x)

    y_ref, (dx_ref, dbias_ref, dmask_ref) = _peer(functools.partial(run, attn_ref), x, bias, mask)
    y, (dx, dbias, dmask) = jax.jit(functools.partial(run, attn_ans))(x, bias, mask)
    _close(y, y_ref, dtype, x, bias, err_msg="y")
    _close(dbias, dbias_ref, dtype, x, bias, err_msg="dbias")
    _close(dx, dx_ref, dtype, x, bias, err_msg="dx")
    assert dmask.dtype == dmask_ref.dtype == jax.dtypes.float0 and dmask.shape == mask.shape


def test_nn_return_residual(rng):
    """``return_residual=True``: the output and the log-sum-exp of each query's kept logits
    (grouped heads, a bias, a random mask, causal, a window and both sequence lengths), and
    that the residual is a ``stop_gradient`` ed value in both. Compared on the queries that
    keep a key and lie within ``query_seq_lengths`` (elsewhere the peer averages every value
    and its log-sum-exp is that of its large negative fill; foldax gives 0 and ``-inf``); the
    output also where ``query_seq_lengths`` removes the query (0 in both)."""
    B, T, S, N, K, H = 2, 16, 12, 4, 2, 8
    q, k, v = _rand(rng, (B, T, N, H)), _rand(rng, (B, S, K, H)), _rand(rng, (B, S, K, H))
    bias = _rand(rng, (1, N, T, S))
    keep = rng.random((B, 1, T, S)) < 0.6
    mask = jnp.asarray(keep)
    q_len, kv_len = np.array([T - 3, T], np.int32), np.array([9, S], np.int32)
    kw = dict(
        is_causal=True, local_window_size=(6, 0), query_seq_lengths=jnp.asarray(q_len),
        key_value_seq_lengths=jnp.asarray(kv_len), return_residual=True,
    )  # fmt: skip
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    pairs = keep[:, 0] & (s <= t) & (s >= t - 6) & (s < kv_len[:, None, None])  # (B, T, S)
    rows = pairs.any(-1) & (np.arange(T) < q_len[:, None])  # (B, T)
    assert rows.any()
    compared = (rows | (np.arange(T) >= q_len[:, None]))[:, :, None, None]

    def run(f, q, k, v, bias):
        lse_sum = lambda q: f(q, k, v, bias, mask, **kw)[1].sum()  # noqa: E731
        return f(q, k, v, bias, mask, **kw), jax.grad(lse_sum)(q)

    sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    (out_ref, lse_ref), g_ref = _peer(functools.partial(run, sdpa_ref), q, k, v, bias)
    (out, lse), g = jax.jit(functools.partial(run, FX))(q, k, v, bias)
    assert lse.shape == lse_ref.shape == (B, T, N) and lse.dtype == F32
    _close(np.where(compared, out, 0.0), np.where(compared, out_ref, 0.0), F32, q, k, v)
    lse, lse_ref = (np.where(rows[:, :, None], a, 0.0) for a in (lse, lse_ref))
    _close(lse, lse_ref, F32, q, k, bias, err_msg="lse")
    assert np.all(np.asarray(g_ref) == 0) and np.all(np.asarray(g) == 0)


# ==============================================================================================
# google/flax tests/linen/linen_attention_test.py


def _mha(attention_fn=None, **kw):
    """``nn.MultiHeadDotProductAttention`` with Flax's default ``attention_fn`` or another."""
    fn = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nn.MultiHeadDotProductAttention(**fn, **kw)


def _variables(module, rng, *args, **kw):
    """Variables of the shapes ``module.init(key, *args, **kw)`` makes, without running the
    module: parameters drawn at random (normal, standard deviation 0.5; biases and layer-norm
    scales too), every other collection (the decoding cache) zero."""
    with _standard():
        shapes = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a, **kw), *args)

    def draw(path, a):
        if path[0].key != "params":
            return jnp.zeros(a.shape, a.dtype)
        return jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _valid_rows(mask):
    """``(..., T, 1)`` booleans: the queries that keep a key under a Flax mask ``(..., 1, T,
    S)``."""
    return np.asarray(mask).any(-1)[..., 0, :, None]


def test_linen_module_matches_default_attention(rng):
    """``test_multihead_self_attention`` / ``test_multihead_encoder_decoder_attention`` /
    ``test_multihead_self_attention_w_dropout_disabled`` in one scenario: two batch axes,
    cross-attention (key / value inputs of another width), ``qkv_features`` and
    ``out_features``, ``normalize_qk``, ``dropout_rate=0.5`` with ``deterministic=True``,
    a mask of Flax's helpers (``combine_masks`` of ``make_attention_mask`` of padded tokens and
    ``make_causal_mask``). One set of random parameters; Flax's default attention
    against foldax's: the output and the gradients of every parameter (queries without a kept
    key left out: their cotangent is 0)."""
    kw = dict(
        num_heads=4, qkv_features=16, out_features=3, normalize_qk=True, dropout_rate=0.5,
        deterministic=True,
    )  # fmt: skip
    dtype = F32
    x, kv = _rand(rng, (2, 3, 8, 5)), _rand(rng, (2, 3, 8, 6))
    lengths = rng.integers(1, 9, (2, 3))
    lengths[0, 0] = 8
    tokens = jnp.asarray(np.arange(8) < lengths[..., None], jnp.int32)
    padding = nn.make_attention_mask(tokens, tokens)
    mask = nn.combine_masks(padding, nn.make_causal_mask(tokens))
    rows = _valid_rows(mask)
    assert not rows.all()  # the convention on queries without a kept key applies
    ref, ours = _mha(None, **kw), _mha(FX, **kw)
    params = _variables(ref, rng, x, kv, mask=mask)["params"]
    cot = jnp.asarray(np.where(rows, rng.standard_normal((2, 3, 8, 3)), 0.0), dtype)

    def run(m, params):
        def loss(params):
            out = m.apply({"params": params}, x, kv, mask=mask)
            return jnp.sum((out * cot).astype(F32)), out

        return jax.value_and_grad(loss, has_aux=True)(params)

    (_, out_ref), g_ref = _peer(functools.partial(run, ref), params)
    (_, out), g = jax.jit(functools.partial(run, ours))(params)
    assert out.shape == out_ref.shape == (2, 3, 8, 3) and out.dtype == out_ref.dtype == dtype
    rows = np.broadcast_to(rows, out.shape)
    _close(np.where(rows, out, 0.0), np.where(rows, out_ref, 0.0), dtype, err_msg="out")
    _close_trees(g, g_ref, dtype, err_msg="grad")


def test_linen_multihead_self_attention_explicit_dropout():
    """``test_multihead_self_attention_explicit_dropout``, verbatim but for 4 heads: the
    ``dropout`` stream gives each module its own draw, the same stream the same draws, an
    explicit ``dropout_rng`` the same draw to both modules."""

    class Foo(nn.Module):
        attention_kwargs: dict

        @nn.compact
        def __call__(self, x, dropout_rng=None):
            a = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(
                x, x, dropout_rng=dropout_rng
            )
            b = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(
                x, x, dropout_rng=dropout_rng
            )
            return a, b

    module = Foo(
        dict(
            num_heads=4, qkv_features=16, kernel_init=jax.nn.initializers.ones,
            bias_init=jax.nn.initializers.zeros, dropout_rate=0.5, deterministic=False,
            attention_fn=FX,
        )
    )  # fmt: skip
    rng1, rng2, rng3, rng4 = jax.random.split(jax.random.key(0), 4)
    x = jnp.ones((4, 2, 3, 5))
    rngs = {"params": rng1, "dropout": rng2}
    v = module.init(rngs, x)
    a, b = module.apply(v, x, rngs=rngs)
    c, d = module.apply(v, x, rngs={"dropout": rng2})
    e, f = module.apply(v, x, rngs={"dropout": rng3})
    assert not (a == b).all()
    assert (a == c).all()
    assert (b == d).all()
    assert not (a == e).all()
    assert not (b == f).all()
    a, b = module.apply(v, x, rngs=rngs, dropout_rng=rng4)
    assert (a == b).all()
    a, b = module.apply(v, x, dropout_rng=rng4)
    assert (a == b).all()
    assert a.shape == b.shape == x.shape
    # broadcast_dropout=True (Flax's default): one mask for the batch and the heads, so the
    # identical examples of x get one draw
    assert (a == a[:1, :1]).all()


def test_linen_multihead_sow_attention_weights_is_refused():
    """``test_multihead_sow_attention_weights``: foldax never forms the weights, so a module
    asked to sow them refuses; without ``sow_weights`` nothing is sown."""

    class Model(nn.Module):
        attention_kwargs: dict

        @nn.compact
        def __call__(self, x, sow_weights=False):
            x = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(x, sow_weights=sow_weights)
            x = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(x)
            return nn.MultiHeadDotProductAttention(**self.attention_kwargs)(
                x, sow_weights=sow_weights
            )

    x = jnp.ones((4, 6, 5))
    kw = dict(num_heads=4, qkv_features=16, deterministic=False, attention_fn=FX)
    module = Model(kw)
    v = jax.eval_shape(module.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match="never formed"):
        jax.eval_shape(lambda v: module.apply(v, x, mutable=["intermediates"], sow_weights=True), v)
    _, intermediates = jax.eval_shape(
        lambda v: module.apply(v, x, mutable=["intermediates"], sow_weights=False), v
    )
    assert "intermediates" not in intermediates


def test_linen_dtype_infer_complex64():
    """``test_dtype_infer``: Flax's attention takes complex64 inputs; foldax's logits must be
    real, so it refuses them with an error that says so (never a silent real part)."""
    x = jnp.ones((4, 6, 5), jnp.complex64)
    kw = dict(
        num_heads=4, qkv_features=16, kernel_init=jax.nn.initializers.ones,
        bias_init=jax.nn.initializers.zeros, deterministic=False,
    )  # fmt: skip
    with _standard():
        want, _ = _mha(None, **kw).init_with_output(jax.random.key(0), x)
        assert want.dtype == jnp.complex64
        with pytest.raises(ValueError, match=r"query, key and value must be real, got complex64"):
            _mha(FX, **kw).init_with_output(jax.random.key(0), x)


# ----------------------------------------------------------------------------------------------
# dropout in Flax's modules: the draws' properties (the keep bits are not Flax's)


@slow
def test_linen_dropout_broadcast_and_gradients(rng):
    """Rate 0.5, ``deterministic=False``, ``broadcast_dropout=False`` (the keep bits are not
    Flax's, so the draws' properties are compared): the same key gives the same output and
    gradients, another key others; identical examples get different draws (with ``True``, one
    mask for the batch and the heads, as Flax's: see the previous test); the parameter
    gradients are finite and nonzero."""
    x = jnp.broadcast_to(_rand(rng, (1, 6, 5)), (3, 6, 5))  # three identical examples
    kw = dict(num_heads=2, qkv_features=8, dropout_rate=0.5, broadcast_dropout=False)
    params = _variables(_mha(None, **kw), rng, x, deterministic=True)["params"]

    def loss(params, key):
        out = _mha(FX, **kw).apply(
            {"params": params}, x, deterministic=False, rngs={"dropout": key}
        )
        return jnp.sum(out**2), out

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    ((_, a), ga), ((_, b), gb), ((_, c), _) = (step(params, jax.random.key(k)) for k in (1, 1, 2))
    assert np.isfinite(a).all() and np.isfinite(c).all()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert not np.allclose(a[0], a[1]) and not np.allclose(a[1], a[2])
    leaves = jax.tree.leaves(ga)
    assert all(np.isfinite(leaf).all() for leaf in leaves)
    assert any(np.any(leaf != 0) for leaf in leaves)
    jax.tree.map(np.testing.assert_array_equal, ga, gb)


@slow
@slow
def test_dropout_draw_depends_on_the_unsafe_rbg_key():
    """As with Flax's attention (``random.bernoulli`` of the key), another key gives another
    dropout draw, for ``unsafe_rbg`` keys too (JAX's ``jax_default_prng_impl`` choice for speed,
    e.g. on TPU)."""
    q = jax.random.normal(jax.random.key(0), (8, 1, 4))

    def draw(seed):
        key = jax.random.key(seed, impl="unsafe_rbg")
        return FX(q, q, q, dropout_rate=0.5, dropout_rng=key)

    assert not np.array_equal(draw(1), draw(2))


# ==============================================================================================
# google/flax tests/nnx/nn/attention_test.py


def _nnx_pair(rng, **kw):
    """An ``nnx.MultiHeadAttention`` with the default attention and a clone with foldax's, its
    parameters drawn as :func:`_variables` draws them (made with a zero ``kernel_init`` first:
    nnx's random initializers would run, and compile, eagerly)."""
    zero = nnx.initializers.zeros_init()
    ref = nnx.MultiHeadAttention(**kw, kernel_init=zero, keep_rngs=False, rngs=nnx.Rngs(0))
    draw = lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype)  # noqa: E731
    nnx.update(ref, jax.tree.map(draw, nnx.state(ref, nnx.Param)))
    ours = nnx.clone(ref)
    ours.attention_fn = FX
    return ref, ours


def _nnx_jit(f, module, *args):
    """``f(module, *args)`` as one ``jax.jit`` (the module split into its graph and state)."""
    graphdef, state = nnx.split(module)
    return jax.jit(lambda state, *args: f(nnx.merge(graphdef, state), *args))(state, *args)


@slow
def test_nnx_grouped_heads_is_causal_and_masks(rng):
    """nnx's ``num_kv_heads`` (grouped-query heads, which nnx's default attention passes to
    ``jax.nn.dot_product_attention`` as they are) and ``is_causal`` call with a padding mask of
    ``nnx.make_attention_mask``: output and parameter gradients against the default attention
    (padded queries left out)."""
    num_kv_heads = 2
    x = _rand(rng, (2, 7, 8))
    tokens = jnp.asarray(np.arange(7) < np.array([[7], [4]]), jnp.int32)
    mask = nnx.make_attention_mask(tokens, tokens)
    ref, ours = _nnx_pair(
        rng, num_heads=4, num_kv_heads=num_kv_heads, in_features=8, qkv_features=16, decode=False
    )
    keep = _valid_rows(mask)
    cot = jnp.asarray(np.where(keep, rng.standard_normal((2, 7, 8)), 0.0), F32)

    def run(m, x):
        def loss(m):
            out = m(x, mask=mask, is_causal=True)
            return jnp.sum(out * cot), out

        (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(m)
        return out, nnx.state(grads, nnx.Param)

    with _standard():
        want, g_ref = _nnx_jit(run, ref, x)
    got, g = _nnx_jit(run, ours, x)
    _close(np.where(keep, got, 0.0), np.where(keep, want, 0.0), F32, x, err_msg="out")
    _close_trees(g, g_ref, F32, err_msg="grad")
