"""Property test: random partitions (with empty segments), chunk sizes and partition forms."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    SHIFTS,
    Partition,
    apply,
    assert_allclose,
    check_each,
    data_scale,
    jit_each,
    permute_rows,
    reference,
    segment_data,
)
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # hypothesis compiles a program per drawn shape

NAMES = ("logsumexp", "sum")


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    chunk_size=st.one_of(st.none(), st.integers(1, 20)),
    form=st.sampled_from(["sizes", "offsets", "unsorted_ids", "jit_sizes", "jit_sorted_ids"]),
    features=st.sampled_from([(), (2,)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_logsumexp_and_sum_match_reference(sizes, chunk_size, form, features, seed):
    rng = np.random.default_rng(seed)
    part = Partition(np.asarray(sizes, np.int64))
    ids = part.ids
    x = segment_data(rng, ids, part.num_segments, feature_shape=features, shifts=SHIFTS)
    if "unsorted" in form:
        ids, x = permute_rows(rng, ids, x)
    s = part.num_segments
    outs = jit_each(NAMES, lambda n, x: apply(n, x, ids, s, form, chunk_size=chunk_size))(
        jnp.asarray(x)
    )

    def check(name):
        assert outs[name].shape == (s, *features)
        ref = reference(name, x, ids, s)
        assert_allclose(outs[name], ref, dtype=np.float32, scale=data_scale(x))

    check_each(NAMES, check)


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    dtype=st.sampled_from([jnp.float16, jnp.bfloat16]),
    chunk_size=st.one_of(st.none(), st.integers(1, 64)),
    seed=st.integers(0, 2**32 - 1),
)
def test_half_precision_matches_float32_accumulation(sizes, dtype, chunk_size, seed):
    """Half-precision values: every reduction accumulates in float32 (whatever the chunk size),
    so the result is the float64 reference rounded once to the half dtype."""
    rng = np.random.default_rng(seed)
    part = Partition(np.asarray(sizes, np.int64))
    x = np.asarray(jnp.asarray(rng.uniform(-4, 4, part.ids.shape[0]), dtype), np.float64)
    s = part.num_segments
    names = ("sum", "mean", "logsumexp", "logmeanexp", "softmax", "max")
    outs = jit_each(names, lambda n, x: apply(n, x, part.ids, s, "sizes", chunk_size=chunk_size))(
        jnp.asarray(x, dtype)
    )

    def check(name):
        assert outs[name].dtype == dtype
        ref = reference(name, x, part.ids, s)
        assert_allclose(
            outs[name],
            ref,
            dtype=dtype,
            scale=max(1.0, float(np.max(np.abs(x), initial=0))),
        )

    check_each(names, check)


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=5),
    magnitude=st.sampled_from([1e3, 3e4, 1e5]),
    sign=st.sampled_from([-1.0, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_large_logits_keep_relative_precision(sizes, magnitude, sign, seed):
    """Logits near +-1e5 (float32 spacing 0.008 there): softmax and the log-sum-exp gradient
    keep float32's relative precision (the max and the log-sum are kept apart)."""
    import jax

    import foldax

    rng = np.random.default_rng(seed)
    part = Partition(np.asarray(sizes, np.int64))
    x = (rng.standard_normal(part.ids.shape[0]) * 3 + sign * magnitude).astype(np.float32)
    x64 = x.astype(np.float64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want = np.empty_like(x64)
    for lo, hi in itertools.pairwise(bounds):
        e = np.exp(x64[lo:hi] - x64[lo:hi].max())
        want[lo:hi] = e / e.sum()
    sm, g = jax.jit(  # one program per example: one compilation
        lambda v: (
            foldax.segment_softmax(v, sizes=sizes),
            jax.grad(lambda v: foldax.segment_logsumexp(v, sizes=sizes).sum())(v),
        )
    )(jnp.asarray(x))
    for got in (np.asarray(sm, np.float64), np.asarray(g, np.float64)):
        assert np.max(np.abs(got - want) / want) <= 1e-5


#: Id dtypes that wrap in ``np.diff`` (unsigned) or in ``jnp.arange(S + 1, dtype)`` (small).
ID_DTYPES = (np.uint8, np.uint16, np.uint32, np.int8, np.int16)
JAXOPS = ("sum", "max", "min", "prod")


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    dtype=st.sampled_from(ID_DTYPES),
    form=st.sampled_from(["sorted_ids", "unsorted_ids", "jit_sorted_ids", "jit_unsorted_ids"]),
    outside=st.lists(st.sampled_from(["min", "max", "-1", "S", "2**31"]), max_size=3),
    clip=st.booleans(),
    values=st.sampled_from([np.float32, np.int32]),
    chunk_size=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 2**32 - 1),
)
def test_small_and_unsigned_ids_match_jax_ops(
    sizes, dtype, form, outside, clip, values, chunk_size, seed
):
    """Ids of a small or unsigned dtype (known or traced, sorted or not), some out of range at
    the dtype's extremes, dropped or clipped; float32 values, or int32 values at int32's
    extremes (sums and products wrap alike): against ``jax.ops`` given the same ids clamped
    exactly to int32 (``jax.ops`` itself wraps uint32 ids >= 2**31 to negative ones)."""
    import jax

    import foldax

    rng = np.random.default_rng(seed)
    part = Partition(np.asarray(sizes, np.int64))
    s, info = part.num_segments, np.iinfo(dtype)
    extra = {"min": info.min, "max": info.max, "-1": -1, "S": s, "2**31": 2**31}
    out = [int(extra[k]) for k in outside if info.min <= extra[k] <= info.max]
    exact = np.sort(np.concatenate([part.ids, np.asarray(out, np.int64)]).astype(np.int64))
    if "unsorted" in form:
        exact = rng.permutation(exact)
    ids = np.asarray([int(v) for v in exact], dtype=object).astype(dtype)
    if values is np.int32:
        x = rng.integers(-(2**31), 2**31 - 1, exact.size, endpoint=True).astype(np.int32)
        x[rng.random(exact.size) < 0.3] = rng.choice([-(2**31), 2**31 - 1, -1, 0, 1])
    else:
        x = rng.standard_normal(exact.size).astype(np.float32)
    mode = "clip" if clip else None
    sort = "unsorted" not in form

    def call(name, x, i):
        f = getattr(foldax, f"segment_{name}")
        return f(x, i, s, indices_are_sorted=sort, mode=mode, chunk_size=chunk_size)

    work = jnp.asarray(np.clip(exact, -1, s), jnp.int32)

    def ours_and_jax_ops(name, x, i, work):  # one program per example: one compilation
        want = getattr(jax.ops, f"segment_{name}")(x, work, s, mode=mode)
        return (call(name, x, i) if form.startswith("jit_") else call(name, x, ids)), want

    both = jit_each(JAXOPS, ours_and_jax_ops)(jnp.asarray(x), jnp.asarray(ids), work)
    outs = {name: got for name, (got, _) in both.items()}

    def check(name):
        want = both[name][1]
        assert outs[name].dtype == want.dtype
        if values is np.int32:
            np.testing.assert_array_equal(outs[name], want)
        else:
            assert_allclose(outs[name], want, dtype=np.float32, scale=data_scale(x))

    check_each(JAXOPS, check)
