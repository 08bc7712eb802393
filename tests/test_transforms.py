"""Forward mode, higher order and outer batches: every family under jax.jvp / jacfwd /
linearize / hessian against float64 references, and memory that grows with neither N nor the
batch of an enclosing vmap (asserted through foldax.memory)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax
from foldax._tools import workloads as w
from foldax.memory import report

MB = 10**6


# ----------------------------------------------------------------------------------------------
# float64 references (NumPy) and their Jacobians by central differences


def _fd_jacobian(f, theta, h=1e-6):
    """``d f / d theta`` of a float64 NumPy function, by central differences."""
    theta = np.asarray(theta, np.float64)
    cols = []
    for k in range(theta.size):
        e = np.zeros_like(theta)
        e.flat[k] = h
        cols.append((np.asarray(f(theta + e)) - np.asarray(f(theta - e))) / (2 * h))
    return np.stack(cols, axis=-1).reshape(np.shape(f(theta)) + theta.shape)


def _segment_ref(name, v, sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = []
    for s, n in zip(starts, sizes, strict=True):
        seg = v[s : s + n]
        m = seg.max()
        lse = m + np.log(np.sum(np.exp(seg - m)))
        if name in ("softmax", "log_softmax"):
            out.append(seg - lse if name == "log_softmax" else np.exp(seg - lse))
            continue
        out.append(
            {
                "sum": seg.sum(),
                "mean": seg.mean(),
                "max": seg.max(),
                "min": seg.min(),
                "logsumexp": lse,
                "logmeanexp": lse - np.log(n),
            }[name]
        )
    return np.concatenate(out) if name in ("softmax", "log_softmax") else np.asarray(out)


SEGMENT = ["sum", "mean", "max", "min", "logsumexp", "logmeanexp", "softmax", "log_softmax"]


def _seg(name):
    return getattr(foldax, f"segment_{name}")


@pytest.mark.parametrize("name", SEGMENT)
def test_segment_forward_mode_matches_float64(name, rng):
    sizes = [37, 1, 200, 64]
    x = rng.standard_normal((sum(sizes), 3)).astype(np.float32)
    theta = rng.standard_normal(3).astype(np.float32)

    def f(t):
        return _seg(name)(jnp.asarray(x), sizes=sizes, fn=lambda r: jnp.sin(r @ t), chunk_size=16)

    ref = lambda t: _segment_ref(name, np.sin(x.astype(np.float64) @ t), sizes)  # noqa: E731
    want = _fd_jacobian(ref, theta)
    scale = float(np.max(np.abs(want))) + 1.0
    assert_allclose(jax.jacfwd(f)(jnp.asarray(theta)), want, dtype=np.float32, scale=scale)
    t = jnp.asarray(rng.standard_normal(3).astype(np.float32))
    out, tan = jax.jvp(f, (jnp.asarray(theta),), (t,))
    assert_allclose(out, ref(theta.astype(np.float64)), dtype=np.float32, scale=scale)
    assert_allclose(tan, want @ np.asarray(t, np.float64), dtype=np.float32, scale=scale)
    _, lin = jax.linearize(f, jnp.asarray(theta))
    assert_allclose(lin(t), want @ np.asarray(t, np.float64), dtype=np.float32, scale=scale)


def test_segment_jacfwd_wrt_data_and_unsorted_ids(rng):
    ids = rng.integers(0, 4, 50)
    x = jnp.asarray(rng.standard_normal(50).astype(np.float32))
    jac = jax.jacfwd(lambda x: foldax.segment_logsumexp(x, jnp.asarray(ids), 4, chunk_size=8))(x)
    dense = jax.jacfwd(
        lambda x: jnp.stack([jax.nn.logsumexp(jnp.where(ids == s, x, -jnp.inf)) for s in range(4)])
    )(x)
    assert_allclose(jac, dense, dtype=np.float32)


def test_hessian_and_jvp_of_grad(rng):
    sizes = [30, 70]
    x = jnp.asarray(rng.standard_normal((100, 3)).astype(np.float32))
    theta = jnp.asarray(rng.standard_normal(3).astype(np.float32))

    def loss(t):
        return jnp.sum(foldax.segment_logsumexp(x, sizes=sizes, fn=lambda r: r @ t, chunk_size=8))

    def dense(t):
        v = x @ t
        return jax.nn.logsumexp(v[:30]) + jax.nn.logsumexp(v[30:])

    assert_allclose(jax.hessian(loss)(theta), jax.hessian(dense)(theta), dtype=np.float32)
    u = jnp.ones(3, jnp.float32)
    got = jax.jvp(jax.grad(loss), (theta,), (u,))[1]
    want = jax.jvp(jax.grad(dense), (theta,), (u,))[1]
    assert_allclose(got, want, dtype=np.float32)
    got = jax.grad(lambda t: jnp.sum(jax.grad(loss)(t) ** 2))(theta)
    want = jax.grad(lambda t: jnp.sum(jax.grad(dense)(t) ** 2))(theta)
    assert_allclose(got, want, dtype=np.float32, scale=float(jnp.max(jnp.abs(want))))


def test_checkpoint_and_grad_of_vmap(rng):
    x = jnp.asarray(rng.standard_normal((64, 2)).astype(np.float32))
    thetas = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))

    def f(t):
        return foldax.segment_max(x, sizes=[20, 44], fn=lambda r: r @ t).sum()

    def dense(t):
        v = x @ t
        return v[:20].max() + v[20:].max()

    g = jax.grad(lambda ts: jax.vmap(jax.checkpoint(f))(ts).sum())(thetas)
    assert_allclose(g, jax.grad(lambda ts: jax.vmap(dense)(ts).sum())(thetas), dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Pairwise and S4


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


PAIRWISE = ["sum", "logsumexp", "max", "min", "softmax", "kmin"]


def _pairwise_ref(reduction, x, y):
    d = np.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)  # (M, N)
    if reduction == "sum":
        return d.sum(1)
    if reduction == "logsumexp":
        m = (-d).max(1, keepdims=True)
        return (m + np.log(np.exp(-d - m).sum(1, keepdims=True)))[:, 0]
    if reduction == "max":
        return d.max(1)
    if reduction == "min":
        return d.min(1)
    if reduction == "kmin":
        return np.sort(d, axis=1)[:, :3]
    p = np.exp(-d - (-d).max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ y


@pytest.mark.parametrize("reduction", PAIRWISE)
def test_pairwise_forward_mode_matches_float64(reduction, rng):
    x = rng.standard_normal((6, 2)).astype(np.float32)
    y = rng.standard_normal((23, 2)).astype(np.float32)

    def f(x):
        if reduction == "softmax":
            k = lambda a, b: (-_sqdist(a, b), b)  # noqa: E731
        elif reduction == "logsumexp":
            k = lambda a, b: -_sqdist(a, b)  # noqa: E731
        else:
            k = _sqdist
        out = foldax.pairwise_reduce(
            k, x, jnp.asarray(y), reduction=reduction, k=3 if reduction == "kmin" else None,
            block_size=(4, 8),
        )  # fmt: skip
        return out[0] if reduction == "kmin" else out

    ref = lambda xx: _pairwise_ref(reduction, xx.reshape(6, 2), y.astype(np.float64))  # noqa: E731
    want = _fd_jacobian(ref, x.astype(np.float64).ravel()).reshape(
        (*np.shape(ref(x.ravel())), 6, 2)
    )
    scale = float(np.max(np.abs(want))) + 1.0
    assert_allclose(jax.jacfwd(f)(jnp.asarray(x)), want, dtype=np.float32, scale=scale)


def test_pairwise_argmin_has_zero_tangent(rng):
    x = jnp.asarray(rng.standard_normal((5, 2)).astype(np.float32))
    out, tan = jax.jvp(
        lambda x: foldax.pairwise_reduce(_sqdist, x, x, reduction="argmin"), (x,), (x,)
    )
    assert out.dtype == jnp.int32 and tan.dtype == jax.dtypes.float0


def test_cauchy_and_vandermonde_jvp_match_complex128(rng):
    c = lambda *s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex64)  # noqa: E731
    v, w, dv, dw = c(3, 7), c(3, 7) - 2, c(3, 7), c(3, 7)
    z, dz = c(11), c(11)
    out, tan = jax.jvp(foldax.cauchy, (v, z, w), (dv, dz, dw))
    v64, z64, w64 = (a.astype(np.complex128) for a in (v, z, w))
    r = 1 / (z64[None, :, None] - w64[:, None, :])  # (H, L, N)
    want = np.sum(
        dv[:, None, :] * r + v64[:, None, :] * r**2 * (dw[:, None, :] - dz[None, :, None]), -1
    )
    assert_allclose(out, np.sum(v64[:, None, :] * r, -1), dtype=np.float32, scale=10)
    assert_allclose(tan, want, dtype=np.float32, scale=float(np.max(np.abs(want))))

    x, dx = c(2, 5) * 0.1 - 0.5, c(2, 5)
    out, tan = jax.jvp(lambda v, x: foldax.vandermonde(v, x, 9), (v[:2, :5], x), (dv[:2, :5], dx))
    ls = np.arange(9)[:, None]
    e = np.exp(x.astype(np.complex128)[:, None, :] * ls)  # (H, L, N)
    want = np.sum(dv[:2, None, :5] * e + v[:2, None, :5] * ls * e * dx[:, None, :], -1)
    assert_allclose(tan, want, dtype=np.float32, scale=float(np.max(np.abs(want))))


# ----------------------------------------------------------------------------------------------
# Memory: forward mode and second order are flat in N


def _sin_model(n):
    x = jax.ShapeDtypeStruct((n, 8), jnp.float32)
    theta = jax.ShapeDtypeStruct((8,), jnp.float32)
    sizes = [n // 4, n // 2, n - n // 4 - n // 2]

    def f(t, x):
        return foldax.segment_logsumexp(x, sizes=sizes, fn=lambda r: jnp.sin(r @ t))

    return f, theta, x


def test_jacfwd_and_grad_of_grad_memory_flat_in_n():
    """Beyond one step of rows (a 1 MB budget keeps steps below N), 4x the rows: jacfwd's temp
    grows <= 1.15x, grad-of-grad's <= 1.3x (no per-step residual stacks)."""
    temps = {}
    for n in (65_536, 262_144):
        f, theta, x = _sin_model(n)
        jac = jax.jacfwd(f)
        gg = jax.grad(lambda t, x, f=f: jnp.sum(jax.grad(lambda t: jnp.sum(f(t, x)))(t) ** 2))
        with foldax.memory_budget("1MB"):
            temps[n] = (report(jac, theta, x).temp_bytes, report(gg, theta, x).temp_bytes)
    (j1, g1), (j4, g4) = temps[65_536], temps[262_144]
    assert j4 <= 1.15 * j1, temps
    assert g4 <= 1.3 * g1, temps


def test_pairwise_jacfwd_memory_flat_in_n():
    temps = {}
    for n in (4096, 16_384):
        x = jax.ShapeDtypeStruct((n, 3), jnp.float32)
        scale = jax.ShapeDtypeStruct((), jnp.float32)

        def f(s, x):
            k = lambda a, b: jnp.exp(-s * jnp.sum((a - b) ** 2))  # noqa: E731
            return foldax.pairwise_reduce(k, x, x)

        temps[n] = report(jax.jacfwd(f), scale, x).temp_bytes
    # The output (and its tangent) is (N,): allow O(N) bytes, never O(N^2).
    assert temps[16_384] <= 1.15 * temps[4096] + 8 * 3 * (16_384 - 4096), temps


# ----------------------------------------------------------------------------------------------
# Memory: an outer vmap does not multiply the plan


@pytest.fixture(scope="module")
def seed_batched():
    sizes = w.seed_sizes()
    x = jax.ShapeDtypeStruct((sum(sizes), w.FEATURES), jnp.float32)
    out = {}
    for b in (10, 100, 1000):
        fwd, grad = w.forward_and_grad(w.way_foldax(sizes))
        th = jax.ShapeDtypeStruct((b, w.FEATURES), jnp.float32)
        out[b] = (report(fwd, th, x).temp_bytes, report(grad, th, x).temp_bytes)
    with foldax.memory_budget(8_000_000):
        th = jax.ShapeDtypeStruct((1000, w.FEATURES), jnp.float32)
        out["8MB", 1000] = (report(fwd, th, x).temp_bytes, report(grad, th, x).temp_bytes)
    return out


def test_seed_workload_under_vmap_stays_within_the_budget(seed_batched):
    """The seed workload vmapped over B = 10, 100, 1000 parameter vectors at default settings:
    temp <= 32 MB forward and <= 64 MB for the gradient, whatever B; a smaller budget binds."""
    for b in (10, 100, 1000):
        f, g = seed_batched[b]
        assert f <= 32 * MB and g <= 64 * MB, seed_batched
    f, g = seed_batched["8MB", 1000]
    assert f <= 12 * MB and g <= 16 * MB, seed_batched
    # the (B, S) per-segment states are the only thing allowed to grow with B
    assert seed_batched[1000][0] <= seed_batched[10][0] + 16 * 1000 * 123 * 4, seed_batched


def test_pairwise_and_cauchy_under_large_vmap():
    """B = 256 copies of a pairwise reduction (and S4's H = 256 channels): the tiles shrink with
    the batch, so temp stays far below one batch of (M, N) tiles and flat in N."""
    temps = {}
    fwd = jax.vmap(lambda x, y: foldax.pairwise_reduce(_sqdist, x, y, reduction="min"), (0, None))
    grad = jax.grad(lambda v, z: jnp.sum(jnp.abs(foldax.cauchy(v, z, v))), argnums=(0, 1))
    for n in (256, 1024):
        # min's tile is 1024 columns wide when the budget allows: N from one tile to four
        x = jax.ShapeDtypeStruct((256, 64, 3), jnp.float32)
        y = jax.ShapeDtypeStruct((4 * n, 3), jnp.float32)
        v = jax.ShapeDtypeStruct((256, n), jnp.complex64)
        z = jax.ShapeDtypeStruct((64,), jnp.complex64)
        temps[n] = (report(fwd, x, y).temp_bytes, report(grad, v, z).temp_bytes)
    (p1, c1), (p4, c4) = temps[256], temps[1024]
    assert p4 <= 1.15 * p1 + 4096, temps
    # the gradient's own (H, N) cotangents grow with N; nothing (H, L, N) does
    assert c4 <= 1.15 * c1 + 3 * 256 * (1024 - 256) * 8, temps
    from foldax._engine._budget import DEFAULT_BUDGET

    assert max(p4, c4) <= DEFAULT_BUDGET < 256 * 64 * 1024 * 4, temps  # < one batch of tiles


# ----------------------------------------------------------------------------------------------
# The budget


def test_memory_budget_parses_and_restores():
    from foldax._engine import current_budget
    from foldax._engine._budget import DEFAULT_BUDGET

    assert current_budget() == DEFAULT_BUDGET
    with foldax.memory_budget("64MB") as b:
        assert b == current_budget() == 64 * 10**6
        with foldax.memory_budget("512KiB"):
            assert current_budget() == 512 * 1024
        assert current_budget() == 64 * 10**6
    assert current_budget() == DEFAULT_BUDGET
    with foldax.memory_budget(" 1.5 gb "):
        assert current_budget() == 1_500_000_000


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("lots", ValueError, "cannot read 'lots'"),
        ("12 parsecs", ValueError, "units: B, KB"),
        (0, ValueError, "must be positive"),
        (-5, ValueError, "must be positive"),
        (True, TypeError, "number of bytes"),
        (1.5e6, TypeError, "number of bytes"),
    ],
)
def test_memory_budget_errors_name_the_function(value, error, match):
    with pytest.raises(error, match=match) as info, foldax.memory_budget(value):
        pass
    assert "foldax.memory_budget" in str(info.value)


def test_memory_budget_binds_the_plan():
    sizes = [50_000, 150_000]
    x = jax.ShapeDtypeStruct((200_000, 5), jnp.float32)
    th = jax.ShapeDtypeStruct((64, 5), jnp.float32)

    def make():  # a new function each time: JAX caches what it traced (and the budget with it)
        def f(t, x):
            return jax.vmap(
                lambda t: foldax.segment_logsumexp(x, sizes=sizes, fn=lambda r: jnp.sin(r @ t))
            )(t)

        return f

    big = report(make(), th, x).temp_bytes
    with foldax.memory_budget("256KB"):
        small = report(make(), th, x).temp_bytes
    assert small < big / 2, (small, big)


def test_jax_export_forward_and_gradient(rng):
    from jax import export

    x = jnp.asarray(rng.standard_normal((100, 3)).astype(np.float32))

    def f(t):
        return foldax.segment_logsumexp(x, sizes=[40, 60], fn=lambda r: r @ t)

    t = jnp.asarray(rng.standard_normal(3).astype(np.float32))
    assert_allclose(export.export(jax.jit(f))(t).call(t), f(t), dtype=np.float32)
    g = jax.grad(lambda t: f(t).sum())
    assert_allclose(export.export(jax.jit(g))(t).call(t), g(t), dtype=np.float32)
    j = jax.jacfwd(f)
    assert_allclose(export.export(jax.jit(j))(t).call(t), j(t), dtype=np.float32)
