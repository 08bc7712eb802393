"""Segment ids of every integer dtype, and static plans that XLA does not constant-fold.

Unsigned and small signed ids (NumPy, concrete or traced; sorted or not; ``mode`` None or
"clip"), with values at their dtype's extremes, against ``jax.ops`` and float64 NumPy
references. ``jax.ops`` converts ids to int32 (it wraps uint32 ids >= 2**31 and 64-bit ids
outside int32), so where ids do not fit int32 the reference is ``jax.ops`` given the ids
clamped exactly (what an id out of range means: dropped, or clipped with "clip").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, check_each, jit_each, reference

import foldax

UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)
SMALL = (np.int8, np.int16)
EVERY = (*UNSIGNED, *SMALL, np.int32, np.int64)
#: Every reduction on the ids path (the normalizers share the partition too).
NAMES = ("sum", "mean", "max", "min", "prod", "logsumexp", "argmax", "var", "softmax")
JAXOPS = ("sum", "max", "min", "prod")


def exact(ids, s, clip=False):
    """``ids`` of any dtype as int64 in ``[-1, s]`` (``clip``: ``[0, s - 1]``), without wrapping."""
    lo, hi = (0, s - 1) if clip else (-1, s)
    return np.asarray([min(max(int(v), lo), hi) for v in np.asarray(ids)], np.int64)


def ref(name, x, ids, s, clip=False):
    """float64 reference of ``segment_<name>`` for ids of any dtype (``jax.ops`` for its four)."""
    e = exact(ids, s, clip)
    if name in JAXOPS:
        return getattr(jax.ops, f"segment_{name}")(jnp.asarray(x), jnp.asarray(e, jnp.int32), s)
    if name not in ("argmax", "var"):
        return reference(name, x, e, s)
    out = np.full(s, -1 if name == "argmax" else np.nan)
    for k in range(s):
        rows = np.flatnonzero(e == k)
        if rows.size:
            v = np.asarray(x, np.float64)[rows]
            out[k] = rows[np.argmax(v)] if name == "argmax" else v.var()
    return out


def check_all(outs, x, ids, s, names=NAMES, clip=False):
    def check(name):
        want = ref(name, x, ids, s, clip)
        if name == "argmax":
            np.testing.assert_array_equal(outs[name], want)
        else:
            assert_allclose(outs[name], want, dtype=np.float32)

    check_each(names, check)


def extreme_ids(rng, dtype, n, s):
    """``n`` random ids of ``dtype`` in ``[0, s)``, the first rows replaced by the dtype's extremes,
    the ids around ``s`` and, for wide dtypes, 2**31 + 3 (negative as int32) and 2**32 + 1."""
    info = np.iinfo(dtype)
    ids = rng.integers(0, min(s, info.max + 1), n).astype(dtype)
    special = [info.max, info.min, min(s, info.max), s - 1, 0]
    if info.max >= 2**32:
        special.append(2**32 + 1)
    if info.max >= 2**31:
        special.append(2**31 + 3)
    special = [v for v in special if info.min <= v <= info.max]
    ids[: len(special)] = np.asarray(special, dtype=object).astype(dtype)
    return ids


def _x(rng, n):
    return rng.standard_normal(n).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Issue 1: unsigned ids known at trace time, unsorted (np.diff wrapped: "sorted", garbage out)

REPRO_IDS = [3, 3, 3, 0, 0, 1, 1, 2, 2, 2]


def test_unsigned_known_unsorted_ids_repro():
    x = jnp.arange(1.0, 11.0)
    ids = np.array(REPRO_IDS, np.uint8)
    want = jax.ops.segment_sum(x, ids, 4)
    assert_allclose(want, [9.0, 13.0, 27.0, 6.0], dtype=np.float32)
    assert_allclose(foldax.segment_sum(x, ids, 4), want, dtype=np.float32)


@pytest.mark.parametrize("dtype", UNSIGNED + SMALL)
@pytest.mark.parametrize("concrete", [False, True], ids=["numpy", "concrete"])
def test_known_unsorted_ids_promised_sorted_raise(dtype, concrete):
    ids = np.array(REPRO_IDS, dtype)
    ids = jnp.asarray(ids) if concrete else ids
    x = jnp.arange(1.0, 11.0)
    msg = r"indices_are_sorted=True, but segment_ids are not sorted \(segment_ids\[2\] = 3 > "
    for name in NAMES:
        with pytest.raises(ValueError, match=rf"foldax\.segment_{name}: " + msg):
            getattr(foldax, f"segment_{name}")(x, ids, 4, indices_are_sorted=True)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64])
def test_every_reduction_with_known_unsorted_unsigned_ids(rng, dtype):
    s, n = 6, 40
    ids, x = extreme_ids(rng, dtype, n, s), _x(rng, n)
    outs = jit_each(NAMES, lambda name, x: getattr(foldax, f"segment_{name}")(x, ids, s))(x)
    check_all(outs, x, ids, s)


# ----------------------------------------------------------------------------------------------
# Issue 2: traced sorted ids of a small dtype (jnp.arange(S + 1, dtype=ids.dtype) wrapped)


def test_traced_sorted_uint8_ids_covering_all_256_values_repro():
    ids, x = jnp.arange(256, dtype=jnp.uint8), jnp.ones(256)
    f = jax.jit(lambda x, i: foldax.segment_sum(x, i, 256, indices_are_sorted=True))
    assert_allclose(f(x, ids), jax.ops.segment_sum(x, ids, 256), dtype=np.float32)
    assert_allclose(f(x, ids), np.ones(256), dtype=np.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "s"), [(np.uint8, 256), (np.int8, 200)], ids=["uint8-256", "int8-200"]
)
def test_every_reduction_with_traced_sorted_small_ids(rng, dtype, s):
    info = np.iinfo(dtype)
    ids = np.repeat(np.arange(info.min, info.max + 1), 2).astype(dtype)  # every value, twice
    x = _x(rng, ids.size)

    def call(name, x, i):
        return getattr(foldax, f"segment_{name}")(x, i, s, indices_are_sorted=True, chunk_size=16)

    outs = jit_each(NAMES, call)(x, jnp.asarray(ids))
    check_all(outs, x, ids, s)


# ----------------------------------------------------------------------------------------------
# Every dtype, every form, both modes; 64-bit ids under x64


@pytest.mark.parametrize("dtype", EVERY, ids=lambda d: np.dtype(d).name)
def test_ids_of_every_dtype_match_jax_ops(rng, dtype):
    """Known (NumPy) and traced ids (64-bit ones: known only, see the x64 test), sorted or not,
    dropped or clipped (sorted ones: clipping keeps them sorted), in one compilation."""
    s, n = 300, 64
    ids, x = extreme_ids(rng, dtype, n, s), _x(rng, n)
    perm = np.argsort(ids, kind="stable")
    rows = {False: (x, ids), True: (x[perm], ids[perm])}  # unsorted / sorted
    traced = np.dtype(dtype).itemsize < 8
    cases = [(o, c, t) for o in (False, True) for c in {False, o} for t in {False, traced}]

    def run(xs, traced_ids):
        out = {}
        for order, clip, tr in cases:
            v = traced_ids[order] if tr else rows[order][1]
            kw = {"indices_are_sorted": order, "mode": "clip" if clip else None}
            out[order, clip, tr] = foldax.segment_sum(xs[order], v, s, chunk_size=8, **kw)
        return out

    xs = {o: jnp.asarray(r[0]) for o, r in rows.items()}
    traced_ids = {o: jnp.asarray(r[1]) for o, r in rows.items()} if traced else {}
    outs = jax.jit(run)(xs, traced_ids)
    for order, clip, tr in cases:
        xv, v = rows[order]
        want = ref("sum", xv, v, s, clip)
        assert_allclose(outs[order, clip, tr], want, dtype=np.float32, err_msg=f"{order, clip, tr}")


def test_64_bit_ids_under_x64(rng):
    """uint64 ids beyond int64 and int64 ids beyond int32, traced and known (one compilation)."""
    x = rng.standard_normal(48)
    rows = {}
    for dtype in (np.uint64, np.int64):
        ids = extreme_ids(rng, dtype, 48, 7)
        perm = np.argsort(ids, kind="stable")
        name = np.dtype(dtype).name
        rows.update({(name, False): (x, ids), (name, True): (x[perm], ids[perm])})
    cases = [(k, k[1] and t, t) for k in rows for t in (False, True)]  # (clip: sorted, traced)

    def run(traced):
        return {
            (k, c, t): foldax.segment_sum(
                jnp.asarray(rows[k][0]), traced[k] if t else rows[k][1], 7,
                indices_are_sorted=k[1], mode="clip" if c else None,
            )
            for k, c, t in cases
        }  # fmt: skip

    with jax.enable_x64(True):
        outs = jax.jit(run)({k: jnp.asarray(v[1]) for k, v in rows.items()})
        for k, c, t in cases:
            got, (xv, v) = outs[k, c, t], rows[k]
            assert got.dtype == jnp.float64
            want = reference("sum", xv, exact(v, 7, c), 7)
            assert_allclose(got, want, dtype=np.float64, err_msg=f"{k, c, t}")


def test_traced_unsigned_ids_under_vmap(rng):
    ids = np.sort(rng.integers(0, 256, (3, 50)), axis=1).astype(np.uint8)
    x = _x(rng, 50)
    f = jax.vmap(lambda i: foldax.segment_sum(x, i, 256, indices_are_sorted=True))
    got = jax.jit(f)(jnp.asarray(ids))
    for row, want_ids in zip(got, ids, strict=True):
        assert_allclose(row, reference("sum", x, want_ids.astype(np.int64), 256), dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Validation in one place: dtype, shape, number of segments; debug checks exact in any dtype


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize(("ids", "match"), [
    (np.array([True, False, True]), "segment_ids must have an integer dtype, got bool"),
    (np.array([0.0, 1.0, 1.0], np.float32), "segment_ids must have an integer dtype, got float32"),
])  # fmt: skip
def test_non_integer_ids_refused(ids, match, traced):
    f = lambda i: foldax.segment_sum(jnp.ones(3), i, 2)  # noqa: E731
    with pytest.raises(TypeError, match=r"foldax\.segment_sum: " + match):
        jax.jit(f)(jnp.asarray(ids)) if traced else f(ids)


def test_ids_shape_and_num_segments_checked():
    with pytest.raises(ValueError, match=r"segment_sum: segment_ids must have shape \(N,\)"):
        foldax.segment_sum(jnp.ones(4), np.zeros((2, 2), np.uint8), 2)
    # (eval_shape of traced or unsorted ids: were they accepted, nothing would be allocated)
    ids = jax.ShapeDtypeStruct((2,), jnp.uint32)
    with pytest.raises(ValueError, match=r"segment_mean: num_segments must be at most"):
        jax.eval_shape(lambda i: foldax.segment_mean(jnp.ones(2), i, 2**31), ids)
    with pytest.raises(ValueError, match=r"segment_max: num_segments must be at most"):
        big = np.array([2**32, 0], np.uint64)  # inferred: 2**32 + 1 segments
        jax.eval_shape(lambda: foldax.segment_max(jnp.ones(2), big))


def test_debug_checks_compare_ids_in_their_dtype():
    x = jnp.ones(3)
    with foldax.debug_checks():
        g = jax.jit(lambda x, i: foldax.segment_sum(x, i, 3, indices_are_sorted=True))
        msg = r"not sorted \(segment_ids\[1\] = 2147483651 > segment_ids\[2\] = 1\)"
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(g(x, jnp.array([0, 2**31 + 3, 1], jnp.uint32)))
        with jax.enable_x64(True):  # sorted uint64 beyond int64: no false alarm
            ids = jnp.array([1, 2, 2**63 + 1], jnp.uint64)
            h = jax.jit(lambda x, i: foldax.segment_sum(x, i, 3, indices_are_sorted=True))
            assert_allclose(h(x, ids), [0.0, 1.0, 1.0], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Issue 3: static plans of many segments (XLA constant-folded their tile tables: tens of seconds)

#: A constant is large above this many elements (4 KiB of int32).
LARGE = 1024


def _lowered_constants(lowered):
    """Element counts of the constants of a lowered (StableHLO) computation."""
    dims = re.findall(r"constant dense<[^>]*> : tensor<((?:\d+x)+)\w+>", lowered.as_text())
    return [int(np.prod([int(d) for d in t.rstrip("x").split("x")])) for t in dims]


def _compiled_constants(compiled):
    """Element counts of the constants of an optimized (HLO) computation."""
    dims = re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} constant\(", compiled.as_text())
    return [int(np.prod([int(d) for d in t.split(",")])) for t in dims]


@pytest.mark.parametrize("form", ["sizes", "offsets", "ids"])
def test_one_row_segments_compile_from_a_compact_plan(form):
    """1M one-row segments (50 s to compile before): the plan's tables are an iota, so the
    computation holds no large constant at all."""
    n = 1_000_000 if form == "sizes" else 200_000
    kw = {
        "sizes": {"sizes": [1] * n},
        "offsets": {"offsets": list(range(n + 1))},
        "ids": {"segment_ids": np.arange(n, dtype=np.uint32), "num_segments": n},
    }[form]
    lowered = jax.jit(lambda x: foldax.segment_sum(x, **kw)).lower(
        jax.ShapeDtypeStruct((n,), jnp.float32)
    )
    assert max(_lowered_constants(lowered), default=0) <= LARGE


@pytest.mark.parametrize("name", ["sum", "softmax"])
@pytest.mark.parametrize("order", ["sorted", "sizes"])
def test_static_tables_are_not_constant_folded(rng, name, order):
    """Many static segments of random sizes: their tables stay constants, but XLA folds nothing
    from them (each folded table would be one more large constant after optimization)."""
    n, s = 8_000, 2_000
    ids = np.sort(rng.integers(0, s, n)).astype(np.int32)
    f = getattr(foldax, f"segment_{name}")
    if order == "sizes":
        sizes = np.bincount(ids, minlength=s)
        call = lambda x: f(x, sizes=sizes)  # noqa: E731
    else:
        call = lambda x: f(x, ids, s)  # noqa: E731
    lowered = jax.jit(call).lower(jax.ShapeDtypeStruct((n,), jnp.float32))
    before = [c for c in _lowered_constants(lowered) if c > LARGE]
    after = [c for c in _compiled_constants(lowered.compile()) if c > LARGE]
    assert len(after) <= len(before), (before, after)
