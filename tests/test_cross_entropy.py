"""``linear_cross_entropy`` against the plain loss built from its ``(T, V)`` logits in float64:
every option (ignored tokens, soft cap, z-loss, label smoothing, the three reductions, both
layouts of ``w``), values and gradients of ``h`` and ``w``, forward mode and second order,
half precision, bad input, and memory that does not grow with the vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose
from jax.test_util import check_grads

import foldax
from foldax import _eager
from foldax.memory import report

F32, F64 = np.float32, np.float64
T, V, D = 37, 203, 16  # tokens and vocabulary rows: multiples of no tile
IGNORE = -100


def reference(h, w, labels, *, eps=0.0, z_loss=0.0, cap=None, reduction="mean", lse=False):
    """The plain loss: every logit formed, in the inputs' dtype (float64 in the comparisons)."""
    z = jnp.einsum("...d,vd->...v", h, w)
    if cap is not None:
        z = cap * jnp.tanh(z / cap)
    s = jax.nn.logsumexp(z, axis=-1)
    kept = labels != IGNORE
    label = jnp.take_along_axis(z, jnp.where(kept, labels, 0)[..., None], axis=-1)[..., 0]
    loss = s - (1 - eps) * label - eps * jnp.mean(z, axis=-1) + z_loss * s**2
    loss = jnp.where(kept, loss, jnp.zeros((), loss.dtype))
    if reduction == "sum":
        loss = jnp.sum(loss)
    elif reduction == "mean":
        loss = jnp.sum(loss) / jnp.sum(kept).astype(loss.dtype)
    return (loss, s) if lse else loss


def _data(rng, lead=(T,), dtype=F64):
    h = rng.standard_normal((*lead, D)).astype(dtype)
    w = (0.5 * rng.standard_normal((V, D))).astype(dtype)
    labels = rng.integers(0, V, lead).astype(np.int32)
    labels.reshape(-1)[[3, 5, 11]] = IGNORE
    return h, w, labels


OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "soft_cap": {"logit_soft_cap": 3.0},
    "all": {"logit_soft_cap": 2.5, "label_smoothing": 0.2, "z_loss": 1e-2},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_values_and_gradients_equal_the_float64_loss(option, rng):
    """Every reduction's value and the gradients of ``h`` and ``w`` of the sum of its squares,
    with the log-sum-exps, in one program per option; ``h`` batched ``(2, T, D)`` for the
    soft cap, ``w`` given as ``(D, V)`` for the z-loss, small tiles for all of them."""
    kw = OPTIONS[option]
    ref_kw = {
        "eps": kw.get("label_smoothing", 0.0),
        "z_loss": kw.get("z_loss", 0.0),
        "cap": kw.get("logit_soft_cap"),
    }
    lead = (2, T // 2) if option == "soft_cap" else (T,)
    layout = "DV" if option == "z_loss" else "VD"
    with jax.enable_x64(True):
        h, w, labels = (jnp.asarray(a) for a in _data(rng, lead))
        given = w.T if layout == "DV" else w

        def ours(h, w, reduction):
            return foldax.linear_cross_entropy(
                h, w, labels, reduction=reduction, return_lse=True, w_layout=layout,
                block_size=(8, 32), **kw,
            )  # fmt: skip

        def theirs(h, w, reduction):
            return reference(h, w.T if layout == "DV" else w, labels, reduction=reduction,
                             lse=True, **ref_kw)  # fmt: skip

        def everything(f):
            def run(h, w):
                outs = {r: f(h, w, r) for r in ("mean", "sum", "none")}
                sq = lambda h, w: sum(jnp.sum(f(h, w, r)[0] ** 2) for r in outs)  # noqa: E731
                return outs, jax.grad(sq, (0, 1))(h, w)

            return jax.jit(run)(h, given)

        got, want = everything(ours), everything(theirs)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape
            scale = max(float(np.max(np.abs(e))), 1.0)
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-12, atol=1e-12 * scale)


def test_derivatives_of_every_order(rng):
    """``check_grads`` in float64, forward and reverse to second order, with every option on
    and tiles that leave partial blocks of tokens and of the vocabulary."""
    with jax.enable_x64(True):
        h = jnp.asarray(rng.standard_normal((5, 3)))
        w = jnp.asarray(rng.standard_normal((7, 3)))
        labels = jnp.asarray([0, 6, IGNORE, 3, 3], jnp.int32)

        def loss(h, w):
            return foldax.linear_cross_entropy(
                h, w, labels, logit_soft_cap=2.0, label_smoothing=0.1, z_loss=0.05,
                block_size=(2, 4),
            )  # fmt: skip

        assert np.all(np.isfinite(np.asarray(loss(h, w))))  # (check_grads takes NaN == NaN)
        check_grads(
            jax.jit(loss), (h, w), order=2, modes=("fwd", "rev"), eps=1e-6, atol=1e-6, rtol=1e-6
        )
        ref = lambda h, w: reference(h, w, labels, eps=0.1, z_loss=0.05, cap=2.0)  # noqa: E731
        dh, dw = jnp.asarray(rng.standard_normal((5, 3))), jnp.asarray(rng.standard_normal((7, 3)))
        got, want = jax.jvp(loss, (h, w), (dh, dw)), jax.jvp(ref, (h, w), (dh, dw))
        assert_allclose(jnp.stack(got), jnp.stack(want), dtype=F64)


def test_ignored_and_out_of_range_labels(rng):
    """Ignored tokens lose 0, are not counted and get no gradient; a label outside the
    vocabulary (other than ``ignore_index``) gives NaN, never another row's logit; a mean over
    no kept token is NaN (as PyTorch's)."""
    h, w, _ = _data(rng, dtype=F32)
    labels = np.full(T, IGNORE, np.int32)
    labels[:4] = [0, V - 1, V, -1]
    out = foldax.linear_cross_entropy(h, w, labels, reduction="none")
    assert np.all(np.isfinite(out[:2])) and np.all(np.isnan(out[2:4])) and np.all(out[4:] == 0)
    gh = jax.grad(lambda h: foldax.linear_cross_entropy(h, w, labels, reduction="sum"))(h)
    assert np.all(np.asarray(gh[4:]) == 0)
    labels[:4] = [1, 2, 3, IGNORE]
    mean = foldax.linear_cross_entropy(h, w, labels)
    assert_allclose(mean, reference(h, w, labels), dtype=F32, scale=10.0)
    assert np.isnan(foldax.linear_cross_entropy(h, w, np.full(T, 7, np.int32), ignore_index=7))
    assert np.isnan(foldax.linear_cross_entropy(h, w, np.full(T, IGNORE, np.int32)))


def test_wide_labels_and_ignore_index_are_compared_in_their_own_width(rng):
    """64-bit and unsigned labels, and an ``ignore_index`` the labels' dtype cannot hold, are
    never narrowed first: a label out of ``[0, V)`` is NaN (not the row it wraps onto, nor an
    ignored token), and ``ignore_index`` matches only the label it equals."""
    with jax.enable_x64(True):
        h, w = jnp.asarray(rng.standard_normal((4, 3))), jnp.asarray(rng.standard_normal((300, 3)))
        w10 = w[:10]

        def f(w, labels, **kw):
            return foldax.linear_cross_entropy(h, w, labels, reduction="none", **kw)

        plain = jax.jit(lambda w, labels: reference(h, w, labels, reduction="none"))
        want = np.asarray(plain(w10, np.array([1, 1, 3, 3], np.int32)))
        nan = np.nan
        cases = [  # (labels, ignore_index, what each token loses: NaN, 0 or its loss)
            (np.array([2**32 + 1, 1, 3, 2**32 + 3], np.int64), 2**32 + 3, [nan, 1, 1, 0]),
            (np.array([2**32 - 100, 1, 3, 3], np.uint32), IGNORE, [nan, 1, 1, 1]),
            (np.array([2**32 - 100, 1, 3, 2**32 - 1], np.uint32), 2**32 - 100, [0, 1, 1, nan]),
            (np.array([-1, 1, 3, 3], np.int8), 2**8 + 3, [nan, 1, 1, 1]),
        ]
        for labels, ignore, keep in cases:
            got = f(w10, jnp.asarray(labels), ignore_index=ignore)
            msg = f"{labels.dtype} labels, ignore_index={ignore}"
            assert_allclose(got, want * np.asarray(keep), dtype=F64, err_msg=msg)
        # uint8 labels and V = 300 beyond their range: every label is in range
        labels = np.array([255, 1, 3, 0], np.uint8)
        got = f(w, jnp.asarray(labels))
        assert_allclose(got, plain(w, labels.astype(np.int32)), dtype=F64)


def test_host_labels_wider_than_jax_integers_are_refused(rng):
    """Without x64, a NumPy label JAX's int32 cannot hold would wrap onto another token id
    when converted: refused, naming the label; labels that fit are taken."""
    h, w = rng.standard_normal((2, 3)).astype(F32), rng.standard_normal((V, 3)).astype(F32)
    for labels in (np.array([2**32 + 1, 2], np.int64), [2, -(2**40)]):
        with pytest.raises(ValueError, match=r"labels holds .* cannot hold"):
            foldax.linear_cross_entropy(h, w, labels)
    got = foldax.linear_cross_entropy(h, w, np.array([1, 2], np.int64), reduction="none")
    assert_allclose(got, reference(h, w, np.array([1, 2], np.int32), reduction="none"), dtype=F32)


def test_no_features_loses_log_v(rng):
    """``D = 0``: every logit is 0, so each kept token loses ``log V`` (plus the z-loss), as
    the plain loss does, in every reduction, with every option; the gradients are ``h``'s and
    ``w``'s empty shapes."""
    h, w = jnp.zeros((2, 5, 0), F32), jnp.zeros((V, 0), F32)
    labels = rng.integers(0, V, (2, 5)).astype(np.int32)
    labels[0, 1] = IGNORE
    kw = {"logit_soft_cap": 2.0, "label_smoothing": 0.1, "z_loss": 0.01}
    reductions = ("none", "mean", "sum")

    def everything(h, w):
        def ours(h, w, r):
            return foldax.linear_cross_entropy(h, w, labels, reduction=r, block_size=(4, 64), **kw)

        return [ours(h, w, r) for r in reductions], jax.grad(ours, (0, 1))(h, w, "mean")

    def theirs(h, w):
        return [reference(h, w, labels, reduction=r, eps=0.1, z_loss=0.01, cap=2.0)
                for r in reductions]  # fmt: skip

    values, grads = jax.jit(everything)(h, w)
    for r, got, want in zip(reductions, values, jax.jit(theirs)(h, w), strict=True):
        assert_allclose(got, want, dtype=F32, err_msg=r)
    kept = np.log(V) + 0.01 * np.log(V) ** 2
    assert_allclose(values[0], np.where(labels != IGNORE, kept, 0.0), dtype=F32)
    assert [(g.shape, g.dtype) for g in grads] == [(h.shape, h.dtype), (w.shape, w.dtype)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_size", [None, (8, 128)])
def test_half_precision_accumulates_in_float32(dtype, block_size, rng):
    """Half-precision ``h`` and ``w``: the loss in float32, the gradients in the inputs' dtype
    and no less accurate (against float64) than those of the plain loss with float32 logits --
    also in small tiles, with labels that repeat across tiles of tokens: each tile's share of
    ``dh`` and ``dw`` (the label's ``-w`` and ``-h`` among them) is summed in float32 and the
    gradients are rounded once."""
    t, v, d = 64, 2048, 64
    h = rng.standard_normal((t, d)).astype(F32)
    w = (0.2 * rng.standard_normal((v, d))).astype(F32)
    labels = rng.integers(0, v if block_size is None else 4, t).astype(np.int32)
    with jax.enable_x64(True):
        h64, w64 = jnp.asarray(h, F64), jnp.asarray(w, F64)
        g64 = jax.grad(lambda h, w: reference(h, w, labels), (0, 1))(h64, w64)
        want = reference(h64, w64, labels)
    hh, wh = jnp.asarray(h, dtype), jnp.asarray(w, dtype)

    def plain(h, w):  # the usual mixed-precision loss: float32 logits
        z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
        s = jax.nn.logsumexp(z, axis=-1)
        return jnp.mean(s - jnp.take_along_axis(z, jnp.asarray(labels)[:, None], 1)[:, 0])

    ours = lambda h, w: foldax.linear_cross_entropy(h, w, labels, block_size=block_size)  # noqa: E731
    loss = jax.jit(ours)(hh, wh)
    assert loss.dtype == jnp.float32
    assert abs(float(loss) - float(want)) <= 1e-2 * abs(float(want))
    err = {}
    for name, f in (("plain", plain), ("ours", ours)):
        grads = jax.jit(jax.grad(f, (0, 1)))(hh, wh)
        assert all(g.dtype == dtype for g in grads)
        err[name] = [
            float(np.max(np.abs(np.asarray(g, F64) - np.asarray(r))) / np.max(np.abs(r)))
            for g, r in zip(grads, g64, strict=True)
        ]
    for ours_err, plain_err in zip(err["ours"], err["plain"], strict=True):
        assert ours_err <= 1.2 * plain_err, err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"h": np.ones((4, 3), np.int32)}, "h has dtype int32"),
        ({"labels": np.zeros(4, F32)}, "labels has dtype float32"),
        ({"w": np.ones((5, 2), F32)}, "same D as w"),
        ({"w": np.ones(5, F32)}, "2-D"),
        ({"labels": np.zeros(3, np.int32)}, "one label per row of h"),
        ({"w_layout": "vd"}, "w_layout must be 'VD' or 'DV'"),
        ({"reduction": "avg"}, "reduction must be one of"),
        ({"z_loss": -1.0}, "z_loss must be non-negative"),
        ({"label_smoothing": 1.5}, "label_smoothing must be non-negative and at most 1"),
        ({"logit_soft_cap": 0.0}, "logit_soft_cap must be positive"),
        ({"logit_soft_cap": np.ones(2)}, "logit_soft_cap has shape"),
    ],
)
def test_bad_input_names_the_function_and_the_argument(kwargs, match):
    args = {"h": np.ones((4, 3), F32), "w": np.ones((5, 3), F32), "labels": np.zeros(4, np.int32)}
    args.update(kwargs)
    h, w, labels = args.pop("h"), args.pop("w"), args.pop("labels")
    with pytest.raises((ValueError, TypeError), match="foldax.linear_cross_entropy: .*" + match):
        foldax.linear_cross_entropy(h, w, labels, **args)


def _temps(loss, t, v, d, dtype):
    c = jax.ShapeDtypeStruct
    args = (c((t, d), dtype), c((v, d), dtype), c((t,), jnp.int32))
    grad = jax.grad(loss, (0, 1))
    return report(loss, *args).temp_bytes, report(grad, *args).temp_bytes


def _plain(h, w, labels):
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
    s = jax.nn.logsumexp(z, axis=-1)
    return jnp.mean(s - jnp.take_along_axis(z, labels[:, None], 1)[:, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_memory_flat_in_the_vocabulary_and_far_below_the_logits(dtype):
    """Temp at T = 8,192 tokens, D = 512, V = 32,768 and 131,072, forward and gradient: flat in
    V and under 1/100 of the plain loss's (whose logits alone are 4 GiB in float32), in
    bfloat16 too: the gradient sums ``dw`` in float32 one block of vocabulary rows at a time,
    rounding each block once when its sum is complete (no float32 ``(V, D)`` buffer), and no
    float32 copy of a bfloat16 ``w`` is made (jax < 0.11's XLA:CPU would make one before the
    loop)."""
    ours = lambda h, w, labels: foldax.linear_cross_entropy(h, w, labels)  # noqa: E731
    small, big = _temps(ours, 8192, 32768, 512, dtype), _temps(ours, 8192, 131072, 512, dtype)
    for what, s, b in zip(("forward", "gradient"), small, big, strict=True):
        assert b <= 1.1 * s + 2**20, (what, small, big)
    plain = _temps(_plain, 8192, 131072, 512, dtype)
    for what, o, p in zip(("forward", "gradient"), big, plain, strict=True):
        assert o * 100 <= p, (what, big, plain)


def test_under_vmap_and_jit(rng):
    """A batch of losses (``vmap`` over sequences) equals each sequence's own loss."""
    h, w, labels = _data(rng, (3, 12), dtype=F32)
    f = lambda h, labels: foldax.linear_cross_entropy(h, w, labels)  # noqa: E731
    got = jax.jit(jax.vmap(jax.value_and_grad(f)))(h, labels)
    for b in range(3):
        want = jax.value_and_grad(f)(h[b], labels[b])
        for g, e in zip(got, want, strict=True):
            assert_allclose(g[b], e, dtype=F32, scale=4.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_batch_sharing_w_is_one_fold(dtype, rng):
    """``jax.grad`` of a ``vmap`` over sequences with one ``w``: the batch is one fold over
    every sequence's tokens, so ``w``'s gradient is summed over the batch inside it -- equal,
    bit for bit, to the loss of the flattened batch (in bfloat16 too: rounded once, not once
    per sequence) -- and temp is the flattened call's, not one ``(V, D)`` sum per sequence."""
    b, t, v, d = 4, 40, 300, 16
    h = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    w = jnp.asarray(0.3 * rng.standard_normal((v, d)), dtype)
    labels = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    opts = dict(reduction="sum", block_size=(16, 128))
    f = lambda h, w, labels: foldax.linear_cross_entropy(h, w, labels, **opts)  # noqa: E731
    batch = lambda h, w: jnp.sum(jax.vmap(f, (0, None, 0))(h, w, labels))  # noqa: E731
    flat = lambda h, w: f(h.reshape(-1, d), w, labels.reshape(-1))  # noqa: E731
    got, want = (jax.jit(jax.value_and_grad(g, (0, 1)))(h, w) for g in (batch, flat))
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(e, F32))
    c = jax.ShapeDtypeStruct
    args = (c((4, 2048, 512), dtype), c((32768, 512), dtype), c((4, 2048), jnp.int32))
    batched = jax.vmap(foldax.linear_cross_entropy, (0, None, 0))
    temp = report(jax.grad(lambda *a: jnp.sum(batched(*a)), (0, 1)), *args).temp_bytes
    one = _temps(lambda *a: foldax.linear_cross_entropy(*a), 8192, 32768, 512, dtype)[1]
    assert temp <= 1.1 * one + 2**20, (temp, one)


def test_eager_calls_reuse_one_executable(rng):
    """A training loop's eager calls (new tokens, new labels, and an eager ``jax.grad``) run one
    cached executable each, with the right values."""
    h, w, labels = _data(rng, dtype=F32)
    f = foldax.linear_cross_entropy
    grad = jax.grad(f, (0, 1))
    f(h, w, labels), grad(h, w, labels)
    entries = len(_eager.CACHE)
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        batches = [_data(rng, dtype=F32) for _ in range(3)]
        got = [(f(hb, w, lb), grad(hb, w, lb)) for hb, _, lb in batches]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "/jax/core/compile/backend_compile_duration" not in compiles
    assert len(_eager.CACHE) == entries
    for (hb, _, lb), (loss, grads) in zip(batches, got, strict=True):
        assert_allclose(loss, reference(hb, w, lb), dtype=F32)
        for g, e in zip(grads, jax.grad(reference, (0, 1))(hb, w, lb), strict=True):
            assert_allclose(g, e, dtype=F32, scale=4.0)


def test_a_traced_label_smoothing_takes_its_derivative(rng):
    """``label_smoothing`` from a schedule (traced): the loss and its derivative in ``eps``
    equal the plain smoothed loss's, in float64."""
    h, w, labels = _data(rng)
    with jax.enable_x64(True):
        ours = lambda eps: foldax.linear_cross_entropy(h, w, labels, label_smoothing=eps)  # noqa: E731
        plain = lambda eps: reference(h, w, labels, eps=eps)  # noqa: E731
        got = jax.jit(jax.value_and_grad(ours))(jnp.asarray(0.1, F64))
        want = jax.value_and_grad(plain)(jnp.asarray(0.1, F64))
        for g, e in zip(got, want, strict=True):
            assert_allclose(g, e, dtype=F64)
