"""Log-sum-exps, and their derivatives, that do not take a platform's logarithm's rounding: on a
TPU, float32 ``log`` is off by up to 1.1e-4 (a v5e, against float64), and a gradient read as
``exp((x - m) - log(s))`` carried that error (1.7e-4 against float64, where ``jax.ops``'
``exp(x - m) / s`` is 2.4e-6 off). Here a logarithm off by 1e-4 is put in the log-sum-exps'
place on a CPU: values and gradients must stay float32-exact."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax
from foldax._engine import _direct
from foldax._reductions import _base, _logsumexp, _softmax
from foldax._segment import _fold

ERROR = 1e-4


@pytest.fixture
def rounded_log(monkeypatch):
    """Every logarithm the log-sum-exps' modules take, off by ``ERROR``, as a TPU's may be."""
    fake = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    fake.log = lambda a: jnp.log(a) + jnp.asarray(ERROR, jnp.result_type(a))
    for module in (_base, _logsumexp, _softmax, _direct, _fold):
        monkeypatch.setattr(module, "jnp", fake)
    assert abs(float(_base.jnp.log(1.0)) - ERROR) < 1e-9


def _reference(x, ids, s, w):
    """``w[ids] * exp(x - logsumexp)`` per row: the gradient of ``sum(lse * w)``, in float64."""
    x64 = np.asarray(x, np.float64)
    m = np.full((s, *x64.shape[1:]), -np.inf)
    np.maximum.at(m, ids, x64)
    tot = np.zeros_like(m)
    np.add.at(tot, ids, np.exp(x64 - m[ids]))
    return np.asarray(w, np.float64)[ids] * np.exp(x64 - (m + np.log(tot))[ids])


@pytest.fixture
def as_on_a_tpu(monkeypatch):
    """The direct programs (``jax.ops``' scatters and gathers) as a TPU lowers them: a CPU's
    take XLA's own logarithm, exact there."""
    for kind, lower in _direct._LOWER_ON_TPU.items():
        monkeypatch.setitem(_direct._LOWER, kind, lower)


@pytest.mark.parametrize("form", ["ids", "sorted", "long", "fn"])
def test_segment_logsumexp_takes_no_rounded_log(rounded_log, as_on_a_tpu, form):
    """Scattered by ids (unsorted, sorted; the TPU's program), walked (long segments of one
    value) and through a ``fn`` of the rows (walked, the two-pass gradient): values and
    gradients float32-exact."""
    rng = np.random.default_rng(0)
    n, s = 3_000, (3 if form == "long" else 300)
    ids_np = np.sort(rng.integers(0, s, n)) if form != "ids" else rng.integers(0, s, n)
    feat = () if form == "long" else (4,)
    # spread wide: a segment's largest row takes most of its weight (an error relative to the
    # weights shows where they are near 1)
    x = jnp.asarray(6.0 * rng.standard_normal((n, *feat)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((s, *feat)), jnp.float32)
    ids = jnp.asarray(ids_np, jnp.int32)
    sorted_ = form != "ids"
    if form == "fn":
        f = lambda x: foldax.segment_logsumexp(  # noqa: E731
            x, ids, s, fn=lambda r: 2.0 * r, chunk_size=64
        )
        x_ref = 2.0 * x
    else:
        f = lambda x: foldax.segment_logsumexp(x, ids, s, indices_are_sorted=sorted_)  # noqa: E731
        x_ref = x
    value = jax.jit(f)(x)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * w)))(x)
    want = _reference(x_ref, ids_np, s, w) * (2.0 if form == "fn" else 1.0)
    x64 = np.asarray(x_ref, np.float64)
    m = np.full((s, *feat), -np.inf)
    np.maximum.at(m, ids_np, x64)
    tot = np.zeros_like(m)
    np.add.at(tot, ids_np, np.exp(x64 - m[ids_np]))
    assert_allclose(value, m + np.log(tot), dtype=np.float32, scale=float(np.abs(m).max()))
    assert_allclose(grad, want, dtype=np.float32)


def test_pairwise_logsumexp_and_loss_take_no_rounded_log(rounded_log):
    """A pairwise log-sum-exp of inner products (the XLA fold, and the kernel in interpret
    mode) and the language-model loss: gradients float32-exact under a rounded logarithm."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((300, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal(40), jnp.float32)
    logits = np.asarray(x, np.float64) @ np.asarray(y, np.float64).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_x = (np.asarray(g, np.float64)[:, None] * p) @ np.asarray(y, np.float64)
    for impl in ("xla", "pallas"):
        f = lambda x, impl=impl: foldax.pairwise_reduce(  # noqa: E731
            lambda a, b: jnp.dot(a, b), x, y, reduction="logsumexp", implementation=impl
        )
        got = jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x) * g)))(x)
        assert_allclose(got, want_x, dtype=np.float32, scale=4.0, err_msg=impl)
    labels = jnp.asarray(rng.integers(0, 300, 40), jnp.int32)
    loss = lambda h: foldax.linear_cross_entropy(h, y, labels, reduction="sum")  # noqa: E731
    onehot = np.eye(300)[np.asarray(labels)]
    want_h = (p - onehot) @ np.asarray(y, np.float64)
    assert_allclose(jax.jit(jax.grad(loss))(x), want_h, dtype=np.float32, scale=4.0)


def test_segment_softmax_of_a_fn_takes_no_rounded_log(rounded_log):
    """A softmax of a ``fn`` of the rows (walked: its rows written from the log-sum-exp's max and
    sum) is ``exp(x - max) / sum``: float32-exact under a rounded logarithm."""
    rng = np.random.default_rng(2)
    n, s = 2_000, 40
    ids_np = np.sort(rng.integers(0, s, n))
    x = jnp.asarray(6.0 * rng.standard_normal((n, 3)), jnp.float32)
    ids = jnp.asarray(ids_np, jnp.int32)
    got = jax.jit(lambda x: foldax.segment_softmax(x, ids, s, fn=lambda r: r + 1.0, chunk_size=64))(
        x
    )
    x64 = np.asarray(x, np.float64)
    m = np.full((s, 3), -np.inf)
    np.maximum.at(m, ids_np, x64)
    e = np.exp(x64 - m[ids_np])
    tot = np.zeros((s, 3))
    np.add.at(tot, ids_np, e)
    assert_allclose(got, e / tot[ids_np], dtype=np.float32)


def test_attention_takes_no_rounded_log(rounded_log):
    """Attention's saved log-sum-exp, and so its gradient (the XLA fold, and the kernels in
    interpret mode): float32-exact under a rounded logarithm."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    g = jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32)
    q64, k64, v64 = (np.asarray(a, np.float64)[0].transpose(1, 0, 2) for a in (q, k, v))
    z = 4.0 * np.einsum("htd,hsd->hts", q64, k64) / np.sqrt(16)  # (sharp weights)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    g64 = np.asarray(g, np.float64)[0].transpose(1, 0, 2)
    dp = np.einsum("htd,hsd->hts", g64, v64)
    dz = p * (dp - np.sum(dp * p, -1, keepdims=True))
    want_q = (4.0 / np.sqrt(16)) * np.einsum("hts,hsd->htd", dz, k64)
    for impl in ("xla", "pallas"):
        f = lambda q, impl=impl: foldax.dot_product_attention(  # noqa: E731
            q, k, v, scale=4.0 / np.sqrt(16), implementation=impl
        )
        got = jax.jit(jax.grad(lambda q, f=f: jnp.sum(f(q) * g)))(q)
        got = np.asarray(got, np.float64)[0].transpose(1, 0, 2)
        assert_allclose(got, want_q, dtype=np.float32, scale=8.0, err_msg=impl)


@pytest.mark.parametrize("sorted_ids", [False, True])
def test_segment_log_softmax_as_on_a_tpu_takes_no_rounded_log(rounded_log, sorted_ids, monkeypatch):
    """A log-softmax of plain rows, the program a TPU runs (jraph's, its logarithm refined):
    float32-exact with a logarithm off by 1e-4."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    rng = np.random.default_rng(2)
    n, s = 3_000, 300
    ids_np = rng.integers(0, s, n)
    ids_np = np.sort(ids_np) if sorted_ids else ids_np
    x = jnp.asarray(6.0 * rng.standard_normal((n, 4)), jnp.float32)
    f = lambda x: foldax.segment_log_softmax(x, ids_np, s, indices_are_sorted=sorted_ids)  # noqa: E731
    got = jax.jit(f)(x)
    x64 = np.asarray(x, np.float64)
    m = np.full((s, 4), -np.inf)
    np.maximum.at(m, ids_np, x64)
    tot = np.zeros_like(m)
    np.add.at(tot, ids_np, np.exp(x64 - m[ids_np]))
    want = x64 - (m + np.log(tot))[ids_np]
    assert_allclose(got, want, dtype=np.float32, scale=float(np.abs(want).max()))
