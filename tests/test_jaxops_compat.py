"""foldax.segment_* against jax.ops.segment_*: jax's own test cases (ported: values and
gradients) with ``foldax.`` in place of ``jax.ops.``, the positional signature, and every ``mode``
on random ids including negative and too-large ones."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, identity

import foldax

JAXOPS = ("sum", "max", "min", "prod")
ORDER = (
    "data",
    "segment_ids",
    "num_segments",
    "indices_are_sorted",
    "unique_indices",
    "bucket_size",
    "mode",
)
MODES = (None, "clip", "drop", "fill", "promise_in_bounds", jax.lax.GatherScatterMode.CLIP)


def _both(name):
    return getattr(foldax, f"segment_{name}"), getattr(jax.ops, f"segment_{name}")


@pytest.mark.parametrize("name", JAXOPS)
def test_positional_signature_matches_jax_ops(name):
    ours, theirs = _both(name)
    mine = list(inspect.signature(ours).parameters)[: len(ORDER)]
    assert mine == list(ORDER)
    assert list(inspect.signature(theirs).parameters)[: len(ORDER)] == list(ORDER)


def test_segment_sum_behaviour_cases():
    """jax's testSegmentSum, unchanged but for the namespace."""
    data = jnp.array([5, 1, 7, 2, 3, 4, 1, 3])
    ids = jnp.array([0, 0, 0, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(foldax.segment_sum(data, ids, num_segments=4), [13, 2, 7, 4])
    np.testing.assert_array_equal(foldax.segment_sum(data, ids, num_segments=5), [13, 2, 7, 4, 0])
    np.testing.assert_array_equal(foldax.segment_sum(data, ids), [13, 2, 7, 4])
    ids = jnp.array([0, 4, 8, 1, 2, -6, -1, 3])
    np.testing.assert_array_equal(foldax.segment_sum(data, ids, num_segments=4), [5, 2, 3, 3])
    ids = jnp.array([3, 3, 3, 4, 5, 5, -7, -6])
    np.testing.assert_array_equal(foldax.segment_sum(data, ids), [0, 0, 0, 13, 2, 7])


def test_segment_sum_out_of_bounds_gradient():
    """jax's testSegmentSumOutOfBounds: every id out of range, value 0 and gradient 0."""

    def fn(data, segment_ids):
        return foldax.segment_sum(data, segment_ids, 2).sum()

    val, grad = jax.value_and_grad(fn)(np.array([0, 0], np.float32), np.array([2, 3]))
    np.testing.assert_array_equal(val, 0.0)
    np.testing.assert_array_equal(grad, [0.0, 0.0])


def _np_reduce(op, identity, data, ids, num_segments):
    size = num_segments if num_segments is not None else int(ids.max()) + 1
    out = np.full((size, *data.shape[1:]), identity, data.dtype)
    for i, val in zip(ids, data, strict=True):
        if 0 <= i < size:
            out[i] = op(out[i], val).astype(data.dtype)
    return out


_CASES = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


@pytest.mark.slow
@pytest.mark.parametrize("name", JAXOPS)
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
@pytest.mark.parametrize("shape", [(8,), (7, 4), (6, 4, 2)])
def test_segment_reduce_cases(rng, name, dtype, shape):
    """jax's testSegmentReduce / testSegmentReduceBoolean: ids in [-2, 3), num_segments None, 1
    or 3, bucket_size None or 2, against a NumPy loop and jax.ops (also under jit)."""
    if dtype == np.bool_ and name in ("sum", "prod"):
        pytest.skip("jax.ops tests bool only for min / max")
    op = _CASES[name]
    ours, theirs = _both(name)
    data = rng.standard_normal(shape) * 3
    data = (data > 0) if dtype == np.bool_ else data.astype(dtype)
    ids = rng.integers(-2, 3, size=shape[0]).astype(np.int32)
    for num_segments in (None, 1, 3):
        for bucket_size in (None, 2):
            want = _np_reduce(op, identity(name, dtype), data, ids, num_segments)
            got = ours(jnp.asarray(data), jnp.asarray(ids), num_segments, bucket_size=bucket_size)
            also = theirs(
                jnp.asarray(data), jnp.asarray(ids), num_segments, bucket_size=bucket_size
            )
            assert got.dtype == also.dtype
            assert_allclose(got, want, dtype=np.float32)
            assert_allclose(got, also, dtype=np.float32)
            if num_segments is not None:
                jitted = jax.jit(lambda d, i, n=num_segments: ours(d, i, n))(data, ids)
                assert_allclose(jitted, want, dtype=np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", JAXOPS)
def test_every_mode_on_random_ids(rng, name):
    """Negative and too-large ids, positional hints, every mode: jax.ops' values, with static and
    traced ids, sorted (hinted) or not."""
    ours, theirs = _both(name)
    n, s = 50, 6
    data = jnp.asarray(rng.standard_normal((n, 2)) * 0.9 + 1.0, jnp.float32)
    ids = rng.integers(-4, s + 4, size=n).astype(np.int32)
    for mode in MODES:
        want = theirs(data, jnp.asarray(ids), s, False, False, None, mode)
        got = ours(data, jnp.asarray(ids), s, False, False, None, mode)
        assert_allclose(got, want, dtype=np.float32, err_msg=str(mode))
        traced = jax.jit(lambda d, i, m=mode: ours(d, i, s, mode=m, chunk_size=7))(data, ids)
        assert_allclose(traced, want, dtype=np.float32, err_msg=f"jit {mode}")
        srt = np.sort(ids)
        want = theirs(data, jnp.asarray(srt), s, True, mode=mode)
        got = jax.jit(lambda d, i, m=mode: ours(d, i, s, True, True, 4, m))(data, srt)
        assert_allclose(got, want, dtype=np.float32, err_msg=f"sorted {mode}")
        assert_allclose(ours(data, srt, s, True, mode=mode), want, dtype=np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ("sum", "max", "min"))
def test_gradients_match_jax_ops(rng, name):
    """Gradients of sum / max / min (no ties) with out-of-range ids and every mode but
    ``promise_in_bounds`` (jax.ops' is undefined for out-of-range ids: its forward pass drops
    them, its backward pass clamps them). jax.ops' own gradient under ``clip`` is not finite for
    max / min: the reference clips the ids first."""
    ours, theirs = _both(name)
    data = jnp.asarray(rng.standard_normal((40, 3)), jnp.float32)
    ids = jnp.asarray(rng.integers(-3, 8, size=40), jnp.int32)
    w = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    for mode in (None, "clip", "drop", "fill"):

        def loss(f, d, mode=mode, ids=ids):
            out = f(d, ids, 5, mode=mode)
            return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * w)

        g_ours = jax.grad(lambda d: loss(ours, d))(data)
        ref_ids = jnp.clip(ids, 0, 4) if mode == "clip" else ids
        g_theirs = jax.grad(lambda d, i=ref_ids: loss(theirs, d, None, i))(data)
        assert_allclose(g_ours, g_theirs, dtype=np.float32, err_msg=str(mode))


@pytest.mark.slow
def test_segment_prod_gradient_unique_ids_matches_jax_ops(rng):
    """jax.ops.segment_prod differentiates only with unique ids: there, the same gradient."""
    data = jnp.asarray(rng.standard_normal(10) + 2.0, jnp.float32)
    ids = jnp.asarray(rng.permutation(12)[:10], jnp.int32)
    f = lambda op: jax.grad(lambda d: op(d, ids, 12, unique_indices=True).sum())(data)  # noqa: E731
    assert_allclose(f(foldax.segment_prod), f(jax.ops.segment_prod), dtype=np.float32)


def test_bad_hints_are_refused():
    x, ids = jnp.ones(4), jnp.array([0, 1, 1, 2])
    with pytest.raises(ValueError, match=r"foldax\.segment_sum: mode must be"):
        foldax.segment_sum(x, ids, 3, mode="wrap")
    with pytest.raises(ValueError, match="mode must be"):
        foldax.segment_sum(x, ids, 3, mode=jax.lax.GatherScatterMode.ONE_HOT)
    with pytest.raises(ValueError, match="bucket_size must be positive"):
        foldax.segment_max(x, ids, 3, bucket_size=0)
    with pytest.raises(TypeError, match="unique_indices must be a bool"):
        foldax.segment_min(x, ids, 3, unique_indices="yes")
