"""What survives a transformation and what it costs: checkpoint inside grad of vmap; jax.export
of the forward pass, the gradient and jacfwd; temp memory (asserted through foldax.memory) of
jacfwd, grad of grad and the gradients of prod / var / std / argmax / argmin flat in N; and the
memory budget (foldax.memory_budget) that binds the plan.

The transformations' values are in test_vmap.py, test_jvp.py, test_grad.py and test_hessian.py;
memory under a large outer vmap in test_vmap.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MORE, assert_allclose, dense, op

import foldax
from foldax.memory import report

# ----------------------------------------------------------------------------------------------
# checkpoint and export


@pytest.mark.slow
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


# Plain data takes custom derivatives outside the engine (the softmaxes, the extrema under
# ids); their ids must reach the derivative as arguments, whichever way the call is jitted.
_JITTED_DERIVATIVES = {
    "grad(jit(f))": lambda f: jax.grad(jax.jit(f)),
    "jit(grad(f))": lambda f: jax.jit(jax.grad(f)),
    "jacfwd(jit(f))": lambda f: jax.jacfwd(jax.jit(f)),
    "hessian(jit(f))": lambda f: jax.hessian(jax.jit(f)),
}


_PLAIN_SIZES = [3, 0, 5, 1, 4]
_PLAIN_IDS = np.repeat(np.arange(len(_PLAIN_SIZES)), _PLAIN_SIZES).astype(np.int32)


def _plain_loss(out, keep, w):
    return jnp.sum(jnp.where(keep, out, 0.0) * w) + jnp.sum(jnp.where(keep, out, 0.0) ** 2)


@functools.partial(jax.jit, static_argnames="name")
def _plain_dense_derivatives(name, x, keep, w):
    """The dense reference's gradient (what grad, jacfwd of the scalar loss give) and Hessian,
    in one program per name, whichever composition the test checks."""

    def dense_loss(x):
        return _plain_loss(dense(name, x, _PLAIN_IDS, len(_PLAIN_SIZES)), keep, w)

    return {"gradient": jax.grad(dense_loss)(x), "hessian": jax.hessian(dense_loss)(x)}


@pytest.mark.parametrize("how", list(_JITTED_DERIVATIVES))
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "max", "min", "sum", "logsumexp"])
def test_derivatives_of_jitted_plain_data(rng, name, how):
    """jax.grad / jacfwd / hessian of a jitted call and jit of a gradient, with ids passed in
    (traced), closed over and as static sizes, against the dense reference."""
    sizes, ids = _PLAIN_SIZES, _PLAIN_IDS
    x = jnp.asarray(rng.standard_normal(ids.size))  # continuous: no ties
    w = jnp.asarray(rng.standard_normal(ids.size if name in ("softmax", "log_softmax") else 5))
    keep = np.isfinite(np.asarray(op(name)(x, sizes=sizes)))

    def loss(out):
        return _plain_loss(out, keep, w)

    calls = {
        "traced ids": lambda x, i: loss(op(name)(x, i, len(sizes))),
        "closed-over ids": lambda x, i: loss(op(name)(x, jnp.asarray(ids), len(sizes))),
        "sizes": lambda x, i: loss(op(name)(x, sizes=sizes)),
    }
    dense_derivatives = _plain_dense_derivatives(name, x, keep, w)
    want = dense_derivatives["hessian" if how.startswith("hessian") else "gradient"]
    for form, f in calls.items():
        got = _JITTED_DERIVATIVES[how](lambda x, f=f: f(x, jnp.asarray(ids)))(x)
        assert_allclose(got, want, dtype=np.float32, err_msg=f"{name}, {how}, {form}")


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------------
# Memory: forward mode, second order and the gradients of the other reductions are flat in N


def _sin_model(n):
    x = jax.ShapeDtypeStruct((n, 8), jnp.float32)
    theta = jax.ShapeDtypeStruct((8,), jnp.float32)
    sizes = [n // 4, n // 2, n - n // 4 - n // 2]

    def f(t, x):
        return foldax.segment_logsumexp(x, sizes=sizes, fn=lambda r: jnp.sin(r @ t))

    return f, theta, x


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("name", MORE)
def test_temp_memory_flat_in_n(name):
    """XLA temp bytes of forward (and gradient, where there is one) flat when N grows 4x."""
    f = op(name)
    temps = {}
    for n in (40_000, 160_000):
        x = jax.ShapeDtypeStruct((n, 4), jnp.float32)
        ids = jax.ShapeDtypeStruct((n,), jnp.int32)
        fwd = lambda x, i, f=f: f(x, i, 37, chunk_size=1024)  # noqa: E731
        t = [report(fwd, x, ids).temp_bytes]
        if not name.startswith("arg"):
            t.append(report(jax.grad(lambda x, i, g=fwd: g(x, i).sum()), x, ids).temp_bytes)
        sz = [n // 37] * 36 + [n - 36 * (n // 37)]
        t.append(report(lambda x, f=f, sz=sz: f(x, sizes=sz, chunk_size=1024), x).temp_bytes)
        temps[n] = t
    for a, b in zip(temps[40_000], temps[160_000], strict=True):
        assert b <= 1.1 * a + 16_384, temps
        assert b < 160_000 * 4 * 4 / 4, temps


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


@pytest.mark.slow
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
