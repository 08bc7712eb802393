"""Hostile inputs: each case is the exact reproduction of a wrong number, silent garbage or an
unhelpful crash once found, now giving the right answer or a foldax error that names the
function, the argument and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax

# ----------------------------------------------------------------------------------------------
# Half precision accumulates in float32 (as jnp.sum does); results keep the input dtype


def test_half_precision_logsumexp_of_many_zeros():
    x = jnp.zeros(100_000, jnp.float16)
    lse = foldax.segment_logsumexp(x, sizes=[100_000])
    assert lse.dtype == jnp.float16
    assert_allclose(lse, [np.log(100_000)], dtype=jnp.float16)
    lme = foldax.segment_logmeanexp(x, sizes=[100_000])
    assert_allclose(lme, [0.0], dtype=jnp.float16)
    sm = foldax.segment_softmax(x, sizes=[100_000])
    assert sm.dtype == jnp.float16
    assert_allclose(sm, np.full(100_000, 1e-5), dtype=jnp.float16, scale=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 256, 4096])
def test_bfloat16_sum_does_not_depend_on_chunk_size(chunk_size):
    x = jnp.full(200_000, 0.25, jnp.bfloat16)
    got = foldax.segment_sum(x, sizes=[200_000], chunk_size=chunk_size)
    assert got.dtype == jnp.bfloat16
    assert float(got[0]) == float(jnp.asarray(50_000.0, jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_gradients_and_forward_mode(dtype, rng):
    x = rng.standard_normal(3000).astype(np.float32) * 3
    sizes = [1000, 0, 1, 1999]
    xh = jnp.asarray(x, dtype)
    want = jax.grad(lambda v: foldax.segment_logsumexp(v, sizes=sizes).sum())(
        jnp.asarray(xh, jnp.float32)
    )
    got = jax.grad(lambda v: foldax.segment_logsumexp(v, sizes=sizes).sum())(xh)
    assert got.dtype == dtype
    assert_allclose(got, want, dtype=dtype)
    _, tan = jax.jvp(lambda v: foldax.segment_sum(v, sizes=sizes), (xh,), (jnp.ones_like(xh),))
    assert_allclose(tan, [1000, 0, 1, 1999], dtype=dtype, scale=2000)


# ----------------------------------------------------------------------------------------------
# Large logits: softmax and the log-sum-exp gradient keep float32's relative precision


@pytest.mark.parametrize("shift", [-1e5, 1e5, -3e4])
def test_softmax_and_lse_gradient_near_large_logits(shift, rng):
    x = jnp.asarray(rng.standard_normal(1000).astype(np.float32) + np.float32(shift))
    x64 = np.asarray(x, np.float64)
    want = np.exp(x64 - x64.max()) / np.exp(x64 - x64.max()).sum()
    sm = foldax.segment_softmax(x, sizes=[1000])
    assert np.max(np.abs(np.asarray(sm, np.float64) - want) / want) <= 1e-5
    assert abs(float(jnp.sum(sm)) - 1) <= 1e-5
    g = jax.grad(lambda v: foldax.segment_logsumexp(v, sizes=[1000])[0])(x)
    assert np.max(np.abs(np.asarray(g, np.float64) - want) / want) <= 1e-5
    ls = foldax.segment_log_softmax(x, sizes=[1000])
    assert np.max(np.abs(np.asarray(ls, np.float64) - np.log(want))) <= 1e-5 * 10
    # second order still right: d2/dx2 logsumexp = diag(p) - p p^T, its trace = 1 - |p|^2
    h = jax.hessian(lambda v: foldax.segment_logsumexp(v, sizes=[50])[0])(x[:50])
    p = np.exp(x64[:50] - x64[:50].max())
    p /= p.sum()
    assert_allclose(np.trace(np.asarray(h)), 1 - np.sum(p**2), dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# foldax.memory.scaling with 0 bytes at the smallest size


def test_scaling_fits_growth_that_starts_from_zero():
    def make(n):
        return (lambda x: jnp.max(jnp.outer(x, x), 0).sum(), (jnp.ones(n),))

    s = foldax.memory.scaling(make, [16, 64, 1024])
    assert s.temp_bytes[0] == 0 < s.temp_bytes[-1]
    assert s.exponent > 0.5, s


# ----------------------------------------------------------------------------------------------
# indices_are_sorted=True with unsorted ids


def test_indices_are_sorted_checked_where_the_ids_are_known():
    data, ids = jnp.arange(1.0, 7.0), jnp.array([2, 0, 1, 0, 2, 1])
    with pytest.raises(ValueError, match=r"segment_sum: indices_are_sorted=True.*segment_ids"):
        foldax.segment_sum(data, ids, 3, indices_are_sorted=True)
    # without the flag, eager and jit agree
    eager = foldax.segment_sum(data, ids, 3)
    jitted = jax.jit(lambda d, i: foldax.segment_sum(d, i, 3))(data, ids)
    assert_allclose(eager, [6, 9, 6], dtype=jnp.float32)
    assert_allclose(jitted, eager, dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# shard_map without an enclosing jit


def test_shard_map_without_jit_forward_and_gradient():
    mesh = jax.make_mesh((1,), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    d = jax.device_put(jnp.linspace(-1.0, 1.0, 64), jax.sharding.NamedSharding(mesh, spec))

    def f(d):
        return foldax.segment_logsumexp(d, sizes=[64], axis_name="x")

    fwd = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=jax.sharding.PartitionSpec())
    grad = jax.shard_map(jax.grad(lambda d: f(d).sum()), mesh=mesh, in_specs=spec, out_specs=spec)
    assert_allclose(fwd(d), jax.nn.logsumexp(d)[None], dtype=jnp.float32)
    assert_allclose(grad(d), jax.nn.softmax(d), dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# jax.export


def test_export_serializes_with_gradients():
    pytest.importorskip("flatbuffers")
    from jax import export

    f = jax.jit(lambda d: foldax.segment_logsumexp(d, sizes=[3, 5]).sum())
    exp = export.export(f)(jax.ShapeDtypeStruct((8,), jnp.float32))
    back = export.deserialize(exp.serialize(vjp_order=1))
    x = jnp.linspace(0.0, 1.0, 8)
    assert_allclose(back.call(x), f(x), dtype=jnp.float32)
    assert_allclose(jax.grad(back.call)(x), jax.grad(f)(x), dtype=jnp.float32)
