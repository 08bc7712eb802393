"""Hostile inputs: each case is the exact reproduction of a wrong number, silent garbage or an
unhelpful crash once found, now giving the right answer or a foldax error that names the
function, the argument and the fix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, pairwise_reference

import foldax

# ----------------------------------------------------------------------------------------------
# Half precision accumulates in float32 (as jnp.sum does); results keep the input dtype


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_export_serializes_with_gradients():
    from jax import export

    f = jax.jit(lambda d: foldax.segment_logsumexp(d, sizes=[3, 5]).sum())
    exp = export.export(f)(jax.ShapeDtypeStruct((8,), jnp.float32))
    back = export.deserialize(exp.serialize(vjp_order=1))
    x = jnp.linspace(0.0, 1.0, 8)
    assert_allclose(back.call(x), f(x), dtype=jnp.float32)
    assert_allclose(jax.grad(back.call)(x), jax.grad(f)(x), dtype=jnp.float32)


def test_symbolic_row_counts_are_refused_with_a_foldax_error():
    from jax import export

    (n,) = export.symbolic_shape("n")
    cases = {
        "segment_sum: the leading axis of data": (
            lambda d: foldax.segment_sum(d, jnp.zeros(d.shape[0], jnp.int32), 3),
            [jax.ShapeDtypeStruct((n,), jnp.float32)],
        ),
        "pairwise_reduce: the leading axis of x": (
            lambda x: foldax.pairwise_reduce(lambda a, b: jnp.sum(a * b), x, x),
            [jax.ShapeDtypeStruct((n, 3), jnp.float32)],
        ),
        r"cauchy: the N axis \(states\)": (
            foldax.cauchy,
            [jax.ShapeDtypeStruct(s, jnp.complex64) for s in ((n,), (5,), (n,))],
        ),
    }
    for match, (f, args) in cases.items():
        with pytest.raises(ValueError, match=match + r" has a symbolic size.*concrete shapes"):
            export.export(jax.jit(f))(*args)


# ----------------------------------------------------------------------------------------------
# Traced partitions: the caller's promise, checked at run time inside foldax.debug_checks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offsets": [0, 4, 2, 6]}, r"offsets must be non-decreasing, but offsets\[1\] = 4"),
        ({"sizes": [3, -1, 4]}, r"sizes must be >= 0, but sizes\[1\] = -1"),
        ({"sizes": [3, 1, 1]}, r"sizes sum to 5 but data has N = 6 rows"),
        ({"segment_ids": [2, 0, 1, 0, 2, 1]}, r"indices_are_sorted=True, but segment_ids are not"),
    ],
)
def test_debug_checks_catch_bad_traced_partitions(kwargs, match):
    (arg, value), data = next(iter(kwargs.items())), jnp.arange(1.0, 7.0)
    extra = {"num_segments": 3, "indices_are_sorted": True} if arg == "segment_ids" else {}
    f = jax.jit(lambda d, v: foldax.segment_sum(d, **{arg: v}, **extra))
    assert_allclose(
        f(data, jnp.asarray(value)).shape[0], len(value) - (arg == "offsets"), dtype=jnp.float32
    ) if arg != "segment_ids" else None
    with foldax.debug_checks():
        g = jax.jit(lambda d, v: foldax.segment_sum(d, **{arg: v}, **extra))
        with pytest.raises(Exception, match=r"foldax\.segment_sum: " + match):
            jax.block_until_ready(g(data, jnp.asarray(value)))
        good = {"offsets": [0, 2, 4, 6], "sizes": [3, 1, 2], "segment_ids": [0, 0, 1, 1, 2, 2]}[arg]
        want = jax.ops.segment_sum(data, jnp.asarray([0, 0, 1, 1, 2, 2]), 3)
        if arg == "sizes":
            want = jnp.asarray([6.0, 4.0, 11.0])
        assert_allclose(g(data, jnp.asarray(good)), want, dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Attention in mixed precision, and values that are pytrees


def _attention_reference(q, k, v):
    """The registry's softmax of the attention kernel ``(q . k, v)``, in float64."""
    logits = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T
    vals = np.broadcast_to(np.asarray(v, np.float64)[None], (*logits.shape, v.shape[-1]))
    return pairwise_reference("softmax", (logits, vals))


@pytest.mark.slow
def test_mixed_precision_attention(rng):
    q, k = (jnp.asarray(rng.standard_normal((40, 8)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((40, 8)), jnp.bfloat16)

    def att(q, k, v):
        kernel = lambda qi, kv: (jnp.dot(qi, kv[0]), kv[1])  # noqa: E731
        return foldax.pairwise_reduce(kernel, q, (k, v), reduction="softmax")

    out = att(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert_allclose(out, _attention_reference(q, k, v), dtype=jnp.bfloat16)
    gq, gv = jax.grad(lambda q, v: att(q, k, v).astype(jnp.float32).sum(), (0, 1))(q, v)
    assert (gq.dtype, gv.dtype) == (jnp.float32, jnp.bfloat16)
    want_q, want_v = jax.grad(lambda q, v: att(q, k, v.astype(jnp.float32)).sum(), (0, 1))(
        q, v.astype(jnp.float32)
    )
    assert_allclose(gq, want_q, dtype=jnp.bfloat16, scale=10)
    assert_allclose(gv, want_v, dtype=jnp.bfloat16, scale=10)


@pytest.mark.slow
def test_attention_values_as_a_pytree(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((30, 4)), jnp.float32) for _ in range(3))

    def kernel(qi, kv):
        kj, vj = kv
        return jnp.dot(qi, kj), {"v": vj, "pair": (vj[:2] * 2.0, vj[3])}

    out = foldax.pairwise_reduce(kernel, q, (k, v), reduction="softmax")
    want = _attention_reference(q, k, v)
    single = lambda qi, kv: (jnp.dot(qi, kv[0]), {"v": kv[1]})  # noqa: E731  (one leaf)
    out1 = foldax.pairwise_reduce(single, q, (k, v), reduction="softmax")
    assert_allclose(out1["v"], want, dtype=jnp.float32)
    assert_allclose(out["v"], want, dtype=jnp.float32)
    assert_allclose(out["pair"][0], 2 * want[:, :2], dtype=jnp.float32)
    assert_allclose(out["pair"][1], want[:, 3], dtype=jnp.float32)
    g = jax.grad(
        lambda q: foldax.pairwise_reduce(kernel, q, (k, v), reduction="softmax")["pair"][1].sum()
    )(q)
    g_want = jax.grad(
        lambda q: foldax.pairwise_reduce(
            lambda a, b: (jnp.dot(a, b[0]), b[1][3]), q, (k, v), reduction="softmax"
        ).sum()
    )(q)
    assert_allclose(g, g_want, dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Empty inputs give the reduction's identity


@pytest.mark.slow
def test_empty_pairwise_and_s4_kernels():
    x = jnp.ones((6, 3))
    dot = lambda a, b: jnp.sum(a * b)  # noqa: E731
    assert_allclose(foldax.pairwise_reduce(dot, x, x[:0]), np.zeros(6), dtype=jnp.float32)
    lse = foldax.pairwise_reduce(dot, x, x[:0], reduction="logsumexp")
    assert np.all(np.asarray(lse) == -np.inf)
    wk = lambda a, b: (jnp.sum(a * b[0]), b[1])  # noqa: E731  (weighted log-sum-exp)
    wlse = foldax.pairwise_reduce(wk, x, (x[:0], jnp.ones(0)), reduction="logsumexp")
    assert np.all(np.asarray(wlse) == -np.inf)
    one_leaf = lambda a, b: (jnp.sum(a * b), {"v": b})  # noqa: E731
    assert_allclose(
        foldax.pairwise_reduce(one_leaf, x, x[:0], reduction="softmax")["v"],
        np.zeros((6, 3)),
        dtype=jnp.float32,
    )
    idx = foldax.pairwise_reduce(dot, x, x[:0], reduction="argmin")
    assert idx.dtype == jnp.int32 and np.all(np.asarray(idx) == np.iinfo(np.int32).max)
    c = lambda *s: jnp.ones(s, jnp.complex64)  # noqa: E731
    assert_allclose(foldax.cauchy(c(0), c(5), c(0)), np.zeros(5, np.complex64), dtype=jnp.float32)
    assert foldax.cauchy(c(4), c(0), c(4)).shape == (0,)
    assert foldax.cauchy(c(3, 4), c(0), c(3, 4)).shape == (3, 0)
    assert_allclose(foldax.vandermonde(c(0), c(0), 5), np.zeros(5, np.complex64), dtype=jnp.float32)
    g = jax.grad(lambda v: jnp.abs(foldax.cauchy(v, c(5), c(0))).sum(), holomorphic=False)
    assert g(jnp.ones((0,), jnp.float32).astype(jnp.complex64)).shape == (0,)


# ----------------------------------------------------------------------------------------------
# Small ones


def test_segment_ids_as_a_python_list():
    assert_allclose(foldax.segment_sum(jnp.ones(3), [0, 0, 1]), [2.0, 1.0], dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"segment_sum: segment_ids must contain Python ints"):
        foldax.segment_sum(jnp.ones(3), [0, 0.5, 1])


def test_tuple_data_without_fn_is_refused():
    with pytest.raises(TypeError, match=r"segment_sum: data is a tuple of arrays; pass fn="):
        foldax.segment_sum((jnp.ones(3), jnp.ones(3)), sizes=[3])
    assert_allclose(foldax.segment_sum([1.0, 2.0, 3.0], sizes=[3]), [6.0], dtype=jnp.float32)


def test_block_size_of_bools_is_refused():
    x = jnp.ones((4, 2))
    with pytest.raises(TypeError, match=r"pairwise_reduce: block_size must be a static int"):
        foldax.pairwise_reduce(lambda a, b: jnp.sum(a * b), x, x, block_size=(True, 2))


def test_memory_module_exports_its_api_only():
    public = {n for n in dir(foldax.memory) if not n.startswith("_")}
    assert public == set(foldax.memory.__all__)


@pytest.mark.slow
def test_s4_kernels_mix_real_and_complex_inputs_under_strict_promotion():
    v = jnp.asarray([1.0, 2.0], jnp.float32)  # real residues, complex poles and nodes
    w, z = jnp.asarray([-1.0 + 1j, -2.0], jnp.complex64), jnp.asarray([0j, 1j], jnp.complex64)
    want = foldax.cauchy(v.astype(jnp.complex64), z, w)
    assert_allclose(foldax.cauchy(v, z, w), want, dtype=jnp.float32)
    x = jnp.asarray([-0.5 + 1j, -0.1 + 0j], jnp.complex64)
    want = foldax.vandermonde(v.astype(jnp.complex64), x, 4)
    assert_allclose(foldax.vandermonde(v, x, 4), want, dtype=jnp.float32)


# ----------------------------------------------------------------------------------------------
# jax.random inside fn / kernel: key arrays as constants and as rows; per-row keys by fold_in


def _dropout(key, x, idx, fold):
    def fn(rows):
        r, i = rows
        keep = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 0.7, (3,)))(i)
        return jnp.where(keep, r / 0.7, jnp.zeros((), r.dtype))

    if fold:
        return foldax.segment_logsumexp((x, idx), sizes=[10, 10], fn=fn, chunk_size=4)
    return jnp.stack([jax.nn.logsumexp(v, axis=0) for v in jnp.split(fn((x, idx)), 2)])


@pytest.mark.slow
def test_fn_with_a_closed_over_key_and_per_row_keys(rng):
    x = jnp.asarray(rng.standard_normal((20, 3)).astype(np.float32))
    idx = jnp.arange(20)
    key = jax.random.key(3)
    keys = jax.random.split(key, 4)  # a batch of keys: dropout per example

    @functools.partial(jax.jit, static_argnums=4)  # one program per side (not op by op)
    def every(key_arg, keys, x, idx, fold):
        return (
            _dropout(key_arg, x, idx, fold),
            jax.grad(lambda x: _dropout(key, x, idx, fold).sum())(x),  # key closed over
            jax.vmap(_dropout, (0, None, None, None))(keys, x, idx, fold),
        )

    want, want_grad, want_batched = every(key, keys, x, idx, False)
    assert_allclose(_dropout(key, x, idx, True), want, dtype=np.float32)
    got, g, got_batched = every(key, keys, x, idx, True)
    assert_allclose(got, want, dtype=np.float32)
    # the default plan (no chunk_size) sizes its steps from the key's bytes too
    plain = foldax.segment_sum(x, sizes=[10, 10], fn=lambda r: r * jax.random.uniform(key, ()))
    assert_allclose(
        plain, jax.random.uniform(key, ()) * x.reshape(2, 10, 3).sum(1), dtype=np.float32
    )
    assert_allclose(g, want_grad, dtype=np.float32)
    assert_allclose(got_batched, want_batched, dtype=np.float32)


@pytest.mark.slow
def test_keys_as_rows_of_data_and_per_pair_keys_in_a_kernel(rng):
    x = jnp.asarray(rng.standard_normal((20, 3)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 20)
    fn = lambda rk: rk[0] + jax.vmap(lambda k: jax.random.normal(k, (3,)))(rk[1])  # noqa: E731
    got_max = lambda x, keys: foldax.segment_max((x, keys), sizes=[10, 10], fn=fn)  # noqa: E731
    want_max = lambda x, keys: fn((x, keys)).reshape(2, 10, 3).max(1)  # noqa: E731

    key, y = jax.random.key(1), x[:7]

    def kern(a, b):
        u = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, a[1]), b[1]))
        return jnp.sum(a[0] * b[0]) * u

    def dense(x):
        rows = jax.vmap(lambda a: jax.vmap(lambda b: kern(a, b))((y, jnp.arange(7))))
        return jax.nn.logsumexp(rows((x, jnp.arange(20))), axis=1)

    def fold(x):
        xs, ys = (x, jnp.arange(20)), (y, jnp.arange(7))
        return foldax.pairwise_reduce(kern, xs, ys, reduction="logsumexp")

    def every(seg, pair):  # one program per side: one compilation
        return jax.jit(
            lambda x, keys: (seg(x, keys), pair(x), jax.grad(lambda x: pair(x).sum())(x))
        )(x, keys)

    got, want = every(got_max, fold), every(want_max, dense)
    for a, b, what in zip(got, want, ("segment_max", "logsumexp", "gradient"), strict=True):
        assert_allclose(a, b, dtype=np.float32, err_msg=what)


# ----------------------------------------------------------------------------------------------
# vmap over an empty batch gives an empty result, as plain JAX does


@pytest.mark.slow
def test_vmap_over_an_empty_batch():
    seg = jax.vmap(lambda x: foldax.segment_sum(x, sizes=[2, 3]))(jnp.ones((0, 5)))
    assert seg.shape == (0, 2)
    sm = jax.vmap(lambda x: foldax.segment_softmax(x, sizes=[2, 3]))(jnp.ones((0, 5)))
    assert sm.shape == (0, 5)
    grad = jax.vmap(jax.grad(lambda x: foldax.segment_logsumexp(x, sizes=[2, 3]).sum()))
    assert grad(jnp.ones((0, 5))).shape == (0, 5)
    nested = jax.vmap(jax.vmap(lambda x: foldax.segment_max(x, sizes=[2, 3])))
    assert nested(jnp.ones((3, 0, 5))).shape == (3, 0, 2)
    kmin = jax.vmap(
        lambda x: foldax.pairwise_reduce(lambda a, b: jnp.sum(a * b), x, x, reduction="kmin", k=2)
    )
    vals, idx = kmin(jnp.ones((0, 5, 2)))
    assert vals.shape == idx.shape == (0, 5, 2)
    v = jnp.ones((0, 4), jnp.complex64)
    w = jnp.full((4,), -0.5 + 1j, jnp.complex64)
    z = jnp.ones(6, jnp.complex64)
    assert jax.vmap(lambda v: foldax.cauchy(v, z, w))(v).shape == (0, 6)
    assert jax.jit(jax.vmap(lambda v: foldax.vandermonde(v, w, 6)))(v).shape == (0, 6)


@pytest.mark.slow
def test_users_who_forbid_rank_promotion(rng):
    """A codebase that sets ``jax_numpy_rank_promotion="raise"`` can call every family, with
    its derivatives and under ``vmap``: foldax's own code broadcasts only explicitly. The
    transformed calls are traced and lowered under jit (the check happens while tracing, the same
    eagerly; XLA's compile adds nothing to it), and conftest.py sets "raise" for every test of
    the suite, eager ones too."""
    x = jnp.asarray(rng.standard_normal((50, 3)), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 5, 50)), jnp.int32)
    sizes = [10, 0, 15, 25]
    p = jnp.asarray(rng.standard_normal((30, 3)), jnp.float32)
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    t = jnp.ones(3, jnp.float32)
    fn = lambda r, t: r @ t  # noqa: E731
    w = jnp.asarray(rng.standard_normal((4, 8)) + 1j, jnp.complex64)
    z = jnp.asarray(rng.standard_normal(16) + 1j * rng.standard_normal(16), jnp.complex64)
    with jax.numpy_rank_promotion("raise"):
        for f in (foldax.segment_sum, foldax.segment_max, foldax.segment_logsumexp,
                  foldax.segment_var, foldax.segment_softmax, foldax.segment_argmax):  # fmt: skip
            jax.jit(jax.vmap(lambda t, f=f: f(x, sizes=sizes, fn=lambda r: fn(r, t)))).lower(
                jnp.ones((4, 3))
            )
            jax.jit(lambda a, f=f: f(a, ids, 5, indices_are_sorted=True)).lower(x)
            f(x[:, 0], jnp.asarray(rng.integers(0, 5, 50), jnp.int32), 5)
            if f is not foldax.segment_argmax:
                loss = lambda t, f=f: jnp.sum(f(x, sizes=sizes, fn=lambda r: fn(r, t)) ** 2)  # noqa: E731
                jax.jit(jax.grad(loss)).lower(t)
                jax.jit(jax.jacfwd(lambda t, f=f: f(x, sizes=sizes, fn=lambda r: fn(r, t)))).lower(
                    t
                )
        for red, kw in (("sum", {}), ("min", {}), ("argmin", {}), ("min_argmin", {}),
                        ("kmin", {"k": 3}), ("logsumexp", {})):  # fmt: skip
            first = lambda q, red=red, kw=kw: jax.tree.leaves(  # noqa: E731
                foldax.pairwise_reduce(sq, q, p, reduction=red, mask=lambda i, j: i >= j, **kw)
            )[0]
            jax.jit(first).lower(p)
            if red not in ("argmin",):
                loss = lambda q, first=first: jnp.sum(first(q).astype(jnp.float32))  # noqa: E731
                jax.jit(jax.grad(loss)).lower(p)
        jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(foldax.cauchy(v, z, w))))).lower(w)
        jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(foldax.vandermonde(v, w, 16))))).lower(w)


# ----------------------------------------------------------------------------------------------
# Segment ids keep their width; zeros of either sign tie; NaN shows; empty sequences


def _count_pairs(ids):
    """Pairs kept per row of ``x`` by ``segment_ids`` (a kernel of ones)."""
    x = jnp.zeros((len(ids), 1), jnp.float32)
    one = lambda a, b: jnp.sum(a + b) + 1.0  # noqa: E731
    return np.asarray(foldax.pairwise_reduce(one, x, x, segment_ids=ids))


def test_wide_segment_ids_are_not_truncated():
    """Ids 7 and 7 + 2**32 are two documents: as 64-bit host ids without x64, as int64 JAX
    arrays with x64 (both once cast to int32, silently merged)."""
    ids = np.array([7, 7 + 2**32, 7 + 2**32, 5], np.int64)
    want = [1, 2, 2, 1]
    np.testing.assert_array_equal(_count_pairs(ids), want)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(_count_pairs(jnp.asarray(ids)), want)
        np.testing.assert_array_equal(_count_pairs(ids), want)
        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 1, 8)), jnp.float32)
        got = foldax.dot_product_attention(q, q, q, segment_ids=jnp.asarray(ids)[None])
        keep = np.asarray(ids)[:, None] == np.asarray(ids)[None, :]
        want_attn = jax.nn.dot_product_attention(q, q, q, mask=jnp.asarray(keep)[None, None])
        assert_allclose(got, want_attn, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"pairwise_reduce: segment_ids of x .* one dtype"):
        x = jnp.zeros((4, 1))
        foldax.pairwise_reduce(lambda a, b: jnp.sum(a + b), x, x, segment_ids=(jnp.arange(4), ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kmin_ties_negative_zero_with_zero_by_index(rng, dtype):
    """-0.0 == 0.0: among equal values the lower index comes first (a stable argsort), and
    ``k = 1`` agrees with argmin."""
    y = jnp.asarray(rng.choice([0.0, -0.0, 1.0], size=(37, 1)), dtype)
    x = jnp.ones((2, 1), dtype)
    kern = lambda a, b: a[0] * b[0]  # noqa: E731
    want = np.argsort(np.asarray(y[:, 0], np.float32), kind="stable")
    for k, block in ((1, None), (3, None), (5, (2, 8))):
        _, idx = foldax.pairwise_reduce(kern, x, y, reduction="kmin", k=k, block_size=block)
        np.testing.assert_array_equal(np.asarray(idx)[0], want[:k])
    arg = foldax.pairwise_reduce(kern, x, y, reduction="argmin")
    np.testing.assert_array_equal(arg, [want[0]] * 2)


def test_nan_shows_through_attention_and_weighted_logsumexp(rng):
    """A NaN key makes the queries that attend to it NaN, as in jax.nn (not 0), with NaN
    gradients; a NaN or negative weight of a weighted log-sum-exp acts as in
    jax.nn.logsumexp."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 20, 2, 8)), jnp.float32) for _ in range(3))
    k = k.at[0, 5, 0, 0].set(jnp.nan)  # head 0: queries 5.. attend to it causally
    jax_nn = jax.jit(  # the references: one program, not op by op
        lambda q, k, v: [jax.nn.dot_product_attention(q, k, v, is_causal=c) for c in (False, True)]
    )(q, k, v)
    for causal, want in zip((False, True), jax_nn, strict=True):
        want = np.asarray(want)
        got = np.asarray(foldax.dot_product_attention(q, k, v, is_causal=causal, block_size=8))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(want).any()
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], atol=1e-5)
    grad = jax.grad(lambda q: foldax.dot_product_attention(q, k, v, is_causal=True).sum())(q)
    assert np.isnan(np.asarray(grad)[0, 5:, 0]).all()
    x, y = (jnp.asarray(rng.standard_normal((n, 2)), jnp.float32) for n in (6, 9))
    logits = np.asarray(x @ y.T)
    weighted = jax.jit(
        lambda w: jax.nn.logsumexp(logits, b=jnp.broadcast_to(w, logits.shape), axis=1)
    )
    for w in (rng.random(9), [0.5] * 3 + [np.nan] + [0.5] * 5, [0.5] * 8 + [-0.1], [-1.0] * 9):
        w = jnp.asarray(w, jnp.float32)
        got = foldax.pairwise_reduce(
            lambda a, b: (a @ b[:2], b[2]), x, jnp.concatenate([y, w[:, None]], 1),
            reduction="logsumexp",
        )  # fmt: skip
        want = weighted(w)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert_allclose(jnp.nan_to_num(got), jnp.nan_to_num(want), dtype=jnp.float32)
    sm = foldax.pairwise_reduce(
        lambda a, b: (a @ b, b), x, y.at[4, 0].set(jnp.nan), reduction="softmax"
    )
    assert np.isnan(np.asarray(sm)).all()


@pytest.mark.parametrize("t, s, h", [(0, 5, 4), (5, 0, 4), (5, 5, 0), (0, 0, 4)])
def test_attention_of_empty_sequences_and_heads(t, s, h):
    """Empty queries, keys or heads give jax.nn's empty (or zero) result, and a gradient."""
    q = jnp.ones((2, t, 4, h), jnp.float32)
    k = v = jnp.ones((2, s, 2, h), jnp.float32)
    scale = 1.0 if h == 0 else None  # jax.nn's default divides by sqrt(h)
    want = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), scale=scale)
    got = foldax.dot_product_attention(q, k, v)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    grad = jax.grad(lambda q: foldax.dot_product_attention(q, k, v, is_causal=t == s).sum())(q)
    assert grad.shape == q.shape


# ----------------------------------------------------------------------------------------------
# Half-precision cotangents of y, narrowed one block of rows at a time


def _half_attention(q, k, v):
    kernel = lambda qi, kv: (jnp.dot(qi, kv[0], preferred_element_type=jnp.float32), kv[1])  # noqa: E731
    out = foldax.pairwise_reduce(kernel, q, (k, v), reduction="softmax", block_size=(8, 16))
    return out.astype(jnp.float32)


@pytest.mark.parametrize("how", ["grad", "vmap", "second order"])
def test_half_precision_row_cotangents_walked_by_blocks_of_rows(how, rng, monkeypatch):
    """The gradient of a pairwise fold with bfloat16 ``y`` walks ``y``'s blocks outermost and
    rounds each block's float32 sum once, when it is complete: the gradient of the walk that
    keeps every row's float32 sum to the end (the same sums, ``x``'s in another order: equal
    to a rounding of bfloat16), also with a last block that overlaps the one before it (50
    rows in blocks of 16), under ``vmap`` and in the second-order fold."""
    from foldax._engine import _loop

    q = jnp.asarray(rng.standard_normal((2, 40, 8)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, 50, 8)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    loss = lambda q, k, v: jnp.sum(w * _half_attention(q, k, v))  # noqa: E731
    if how == "grad":
        f = lambda q, k, v: jax.grad(loss, (0, 1, 2))(q[0], k[0], v[0])  # noqa: E731
    elif how == "vmap":
        f = jax.vmap(jax.grad(loss, (0, 1, 2)))
    else:  # the tangent of the cotangent fold (its outputs narrowed the same way)
        g = lambda k: jax.grad(loss, 2)(q[0], k, v[0]).astype(jnp.float32)  # noqa: E731
        f = lambda q, k, v: jax.jvp(g, (k[0],), (k[1],))  # noqa: E731
    chosen = []
    rows_outer = _loop._rows_outer
    monkeypatch.setattr(_loop, "_rows_outer", lambda *a: chosen.append(rows_outer(*a)) or False)
    want = jax.jit(lambda *a: f(*a))(q, k, v)
    assert any(chosen), "the test's folds would not be walked by blocks of rows"
    monkeypatch.setattr(_loop, "_rows_outer", rows_outer)
    got = jax.jit(lambda *a: f(*a))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        assert_allclose(a, b, dtype=jnp.bfloat16, scale=float(jnp.max(jnp.abs(b))))
    if how == "grad":  # and right: against the float32 inputs' gradient
        up = [x.astype(jnp.float32) for x in (q[0], k[0], v[0])]
        for a, b in zip(got, jax.grad(loss, (0, 1, 2))(*up), strict=True):
            assert a.dtype == jnp.bfloat16
            assert_allclose(a, b, dtype=jnp.bfloat16, scale=float(jnp.max(jnp.abs(b))))
