"""What a call costs beside its work: jitted calls take JAX's C++ dispatch path, eager calls run a
cached executable (never with stale values), and a long loop of eager calls keeps its memory."""

from __future__ import annotations

import functools
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, pairwise_reference

import foldax
from foldax import _closure, _eager

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((40, 3)), jnp.float32)
IDS = jnp.asarray(np.sort(RNG.integers(0, 5, 40)), jnp.int32)


def _count_calls(name, f, n=10):
    """How many times a Python function called ``name`` runs during ``n`` calls of ``f``."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == name:
            count += 1

    sys.setprofile(prof)
    try:
        for _ in range(n):
            out = f()
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return count


class _Compiles:
    """Counts XLA compilations while active."""

    def __enter__(self):
        self.count = 0
        self._listener = lambda event, *a, **k: self._seen(event)
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def _seen(self, event):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def _seg(x):
    return foldax.segment_sum(x, IDS, num_segments=5, fn=lambda r: jnp.tanh(r) * 2.0)


def _pair(x):
    return foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, x, reduction="min")


@pytest.mark.parametrize(
    "f, x",
    [
        (jax.jit(_seg), X),
        (jax.jit(jax.grad(lambda x: _seg(x).sum())), X),
        (jax.jit(jax.vmap(_seg)), jnp.stack([X, -X])),
        (jax.jit(jax.grad(lambda x: _pair(x).sum())), X),
    ],
    ids=["segment", "grad", "vmap", "pairwise-grad"],
)
def test_jitted_calls_take_the_fast_path(f, x):
    """A jitted function with folds in it is an ordinary (low) jaxpr, so after its first call
    JAX dispatches it from C++: no Python ``cache_miss`` per call."""
    f(x)
    assert getattr(jax.make_jaxpr(f)(x).jaxpr, "is_high", False) is False
    assert _count_calls("cache_miss", lambda: f(x)) == 0


@pytest.mark.slow
def test_eager_calls_reuse_their_executable():
    _eager.CACHE.clear()
    ref = jax.ops.segment_sum(X, IDS, num_segments=5)
    foldax.segment_sum(X, IDS, num_segments=5)
    with _Compiles() as c:
        for _ in range(5):
            out = foldax.segment_sum(X, IDS, num_segments=5)
            # a fresh lambda with the same code: the same structure, the same executable
            out_fn = foldax.segment_sum(X, IDS, num_segments=5, fn=lambda r: r * 2.0)
    assert_allclose(out, ref, dtype=jnp.float32)
    assert_allclose(out_fn, 2 * ref, dtype=jnp.float32)
    assert c.count <= 1  # the fn version's first call only
    assert len(_eager.CACHE) == 2


def test_eager_calls_never_use_stale_closed_over_values():
    w = jnp.ones(3, jnp.float32)

    def fn(r):
        return r * w[None, :]  # reads the cell each call

    values = [jnp.full(3, 3.0, jnp.float32), jnp.asarray([1.0, -1.0, 0.5], jnp.float32)]
    first = foldax.segment_sum(X, IDS, num_segments=5, fn=fn)
    with _Compiles() as c:
        w = values[0]
        second = foldax.segment_sum(X, IDS, num_segments=5, fn=fn)
        w = values[1]
        third = foldax.segment_sum(X, IDS, num_segments=5, fn=fn)
    assert c.count == 0  # new values are arguments of the same executable
    assert_allclose(second, 3 * first, dtype=jnp.float32)
    assert_allclose(third, first * values[1][None, :], dtype=jnp.float32)


_SCALE = 2.0


def _reads_global(r):
    return r * _SCALE


def test_eager_calls_see_rebound_globals_and_new_structure():
    global _SCALE
    _SCALE = 2.0
    a = foldax.segment_sum(X, IDS, num_segments=5, fn=_reads_global)
    _SCALE = 5.0  # a Python float: a literal of the trace, so a new structure (a new entry)
    b = foldax.segment_sum(X, IDS, num_segments=5, fn=_reads_global)
    _SCALE = 2.0
    assert_allclose(b, 2.5 * a, dtype=jnp.float32)


@pytest.mark.slow
def test_eager_kernel_and_mask_closures_are_inputs():
    y = jnp.asarray(RNG.standard_normal((30, 3)), jnp.float32)
    keep = jnp.asarray(RNG.integers(0, 2, 30), jnp.int32)
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731

    def dense(s, kept):
        d = np.asarray(((X[:, None] * s - y[None]) ** 2).sum(-1))
        return pairwise_reference("min", d, valid=np.asarray(kept)[None, :] == 1)

    def call(scale, kept):  # fresh closures over new arrays: the same executable
        return foldax.pairwise_reduce(
            lambda a, b: sq(a * scale, b), X, y, reduction="min", mask=lambda i, j: kept[j] == 1
        )

    for s in (1.0, 3.0):
        for kept in (keep, 1 - keep):
            assert_allclose(call(jnp.float32(s), kept), dense(s, kept), dtype=jnp.float32)


@pytest.mark.slow
def test_eager_cache_keys_budget_static_ids_and_checks():
    _eager.CACHE.clear()
    foldax.segment_sum(X, IDS, num_segments=5)
    with foldax.memory_budget("1MB"):
        foldax.segment_sum(X, IDS, num_segments=5)
    with foldax.debug_checks():
        foldax.segment_sum(X, IDS, num_segments=5)
    assert len(_eager.CACHE) == 3
    other = np.sort(RNG.integers(0, 5, 40))  # known ids: keyed by content, so never mixed up
    for ids in (np.asarray(IDS), other, other[::-1].copy()):
        got = foldax.segment_sum(X, ids, num_segments=5)
        assert_allclose(
            got, jax.ops.segment_sum(X, jnp.asarray(ids), num_segments=5), dtype=jnp.float32
        )
    sizes = [10, 0, 30]
    assert_allclose(foldax.segment_max(X, sizes=sizes)[0], X[:10].max(0), dtype=jnp.float32)
    sizes[0], sizes[2] = 30, 10  # a list mutated between calls
    assert_allclose(foldax.segment_max(X, sizes=sizes)[0], X[:30].max(0), dtype=jnp.float32)


@pytest.mark.slow
def test_jitted_calls_bypass_the_cache():
    _eager.CACHE.clear()
    jax.jit(lambda x: foldax.segment_sum(x, IDS, num_segments=5))(X)
    f = lambda t: foldax.segment_sum(X, IDS, num_segments=5, fn=lambda r: r * t).sum()  # noqa: E731
    jax.jit(jax.grad(f))(1.0)
    jax.checkpoint(f)(1.0)
    assert len(_eager.CACHE) == 0


def test_eager_transformations_reuse_their_executable():
    """An eager jax.grad / jax.vmap / jax.jvp calls the cached executable with its tracers:
    new values (of the differentiated parameter too) compile nothing, and the values are
    right."""
    _eager.CACHE.clear()
    ids = np.asarray(IDS)

    def loss(t, x=X):
        return jnp.sum(foldax.segment_max(x, IDS, num_segments=5, fn=lambda r: r * t) ** 2)

    def want_grad(t):  # t > 0: each max is t times the segment's, so loss = t^2 sum(m^2)
        m = np.stack([np.asarray(X)[ids == s].max(0) for s in range(5)])
        return 2 * t * np.sum(m.astype(np.float64) ** 2)

    grad = jax.grad(loss)
    batched = jax.vmap(lambda x: foldax.segment_sum(x, IDS, num_segments=5))
    xs = jnp.stack([X, 2 * X, -X])
    grad(2.0), batched(xs), jax.jvp(loss, (2.0,), (1.0,))
    flipped = xs[::-1]
    entries = len(_eager.CACHE)
    with _Compiles() as c:
        got = [grad(t) for t in (1.5, 3.0)]
        out = batched(flipped)
        tangent = jax.jvp(loss, (3.0,), (1.0,))[1]
    assert c.count == 0 and len(_eager.CACHE) == entries
    for t, g in zip((1.5, 3.0), got, strict=True):
        assert_allclose(g, want_grad(t), dtype=jnp.float32)
    assert_allclose(tangent, want_grad(3.0), dtype=jnp.float32)
    for k, x in enumerate(flipped):
        assert_allclose(out[k], jax.ops.segment_sum(x, IDS, num_segments=5), dtype=jnp.float32)


def test_eager_errors_are_the_uncached_ones():
    with pytest.raises(ValueError, match=r"foldax\.segment_sum: .*sizes"):
        foldax.segment_sum(X, sizes=[1, 2])
    with pytest.raises(TypeError, match="fn must return one array"):
        foldax.segment_sum(X, sizes=[40], fn=lambda r: (r, r))
    with pytest.raises(TypeError, match="kernel"):
        foldax.pairwise_reduce(lambda a: a, X, X)


def test_structure_keys():
    ex = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    key = lambda f: _closure.trace(f, ex)[0]  # noqa: E731
    assert key(lambda r: jax.nn.relu(r) * 2.0) == key(lambda r: jax.nn.relu(r) * 2.0)
    assert key(lambda r: r * 2.0) != key(lambda r: r * 3.0)
    assert key(lambda r: r * 2.0) != key(lambda r: r + 2.0)
    assert key(lambda r: jnp.sort(r, axis=0)) != key(lambda r: jnp.sort(r, axis=1))
    lookup = jnp.arange(3.0)
    other = lookup + 1
    c1, consts = _closure.trace(lambda r: r * lookup[None, :], ex)
    assert len(consts) == 1 and c1 == _closure.trace(lambda r: r * other[None, :], ex)[0]


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_many_eager_calls_keep_host_memory():
    """1,000 eager calls (a fresh lambda closing over a fresh array each time, as a loop in a
    notebook does) leave host memory where 10 calls left it."""

    def call(i):
        w = jnp.full(3, float(i))
        a = foldax.segment_max(X, IDS, num_segments=5, fn=lambda r: r * w[None, :])
        b = foldax.segment_logsumexp(X, IDS, num_segments=5)
        return a, b

    for i in range(10):
        jax.block_until_ready(call(i))
    gc.collect()
    before = _rss_mb()
    for i in range(1000):
        jax.block_until_ready(call(i))
    gc.collect()
    assert _rss_mb() - before < 8


def test_eager_calls_with_no_rows():
    """Empty data with an ``fn``: the cached call gives the identity, as the uncached one."""
    x = jnp.zeros((0, 3), jnp.float32)
    for _ in range(2):
        got = foldax.segment_sum(x, sizes=[0, 0], fn=lambda r: r * 2.0)
        assert_allclose(got, np.zeros((2, 3)), dtype=jnp.float32)
        lse = foldax.segment_logsumexp(x, jnp.zeros((0,), jnp.int32), 2, fn=lambda r: r.sum(-1))
        assert_allclose(lse, np.full(2, -np.inf), dtype=jnp.float32)


def _hlo(f, *args):
    return (f if hasattr(f, "lower") else jax.jit(f)).lower(*args).compile().as_text()


@pytest.mark.slow
def test_plain_sum_is_one_scatter_unless_batched():
    """A sum of plain data under unsorted ids is XLA's scatter-add (jax.ops' program: no loop,
    no temp) and its gradients are a scatter and a gather; under ``vmap`` the walk keeps the
    budget (a batched scatter would copy the whole batch of rows)."""
    n, s = 100_000, 100
    x = jnp.asarray(RNG.standard_normal((n, 4)), jnp.float32)
    ids = jnp.asarray(RNG.integers(-3, s + 3, n), jnp.int32)  # some dropped, negative ones too

    def ours(x, i):
        return foldax.segment_sum(x, i, num_segments=s)

    def theirs(x, i):
        return jax.ops.segment_sum(x, i, num_segments=s)

    w = jnp.asarray(RNG.standard_normal((s, 4)), jnp.float32)
    loss = lambda f: lambda x, i: jnp.sum(f(x, i) * w)  # noqa: E731
    for f in (ours, jax.grad(loss(ours))):
        text = _hlo(f, x, ids)
        assert " while(" not in text
        assert jax.jit(f).lower(x, ids).compile().memory_analysis().temp_size_in_bytes < 64 * s
    assert_allclose(ours(x, ids), theirs(x, ids), dtype=np.float32)
    assert_allclose(jax.grad(loss(ours))(x, ids), jax.grad(loss(theirs))(x, ids), dtype=np.float32)
    t = jnp.ones_like(x)
    assert_allclose(
        jax.jvp(lambda x: ours(x, ids), (x,), (t,))[1], theirs(t, ids), dtype=np.float32
    )
    batch = jnp.stack([x] * 8)
    vm = jax.vmap(ours, (0, None))
    assert " while(" in _hlo(vm, batch, ids)
    temp = jax.jit(vm).lower(batch, ids).compile().memory_analysis().temp_size_in_bytes
    assert temp < batch.nbytes / 4
    assert_allclose(vm(batch, ids), jax.vmap(theirs, (0, None))(batch, ids), dtype=np.float32)


@pytest.mark.slow
def test_plain_sum_under_sorted_ids_is_jax_ops_program():
    """Sorted ids, known or traced, and static ``sizes`` give jax.ops' scatter too -- except
    narrow rows in long segments, which the walk reduces faster (the CPU policy, fitted to
    measurements); half precision (accumulated in float32) keeps the walk."""
    n, s, rng = 10_000, 50, np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    known = jnp.asarray(np.sort(rng.integers(0, s, n)), jnp.int32)
    want = jax.ops.segment_sum(x, known, s)
    mine = lambda x: foldax.segment_sum(x, known, s, indices_are_sorted=True)  # noqa: E731
    traced = lambda x, i: foldax.segment_sum(x, i, s, indices_are_sorted=True)  # noqa: E731
    assert " while(" not in _hlo(mine, x)
    assert " while(" not in _hlo(traced, x, known)
    assert_allclose(mine(x), want, dtype=np.float32)
    assert_allclose(jax.jit(traced)(x, known), want, dtype=np.float32)
    sizes = np.bincount(np.asarray(known), minlength=s)  # 200 rows a segment: scattered
    by_sizes = lambda x: foldax.segment_sum(x, sizes=sizes)  # noqa: E731
    assert " while(" not in _hlo(by_sizes, x)
    assert_allclose(jax.jit(by_sizes)(x), want, dtype=np.float32)
    long = [n // 4] * 4  # 2,500 rows a segment of one value each: walked
    assert " while(" in _hlo(lambda x: foldax.segment_sum(x, sizes=long), x)
    assert " while(" in _hlo(lambda x: foldax.segment_sum(x, np.repeat(np.arange(4), n // 4)), x)
    assert " while(" not in _hlo(
        lambda x: foldax.segment_sum(jnp.tile(x[:, None], (1, 8)), sizes=long), x
    )
    half = x.astype(jnp.bfloat16)  # summed in float32, rounded once
    exact = jax.ops.segment_sum(half.astype(jnp.float32), known, s).astype(jnp.bfloat16)
    got = jax.jit(lambda x, i: foldax.segment_sum(x, i, s))(half, known)
    as32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    assert np.isfinite(as32(exact)).all()  # assert_allclose takes NaN == NaN
    np.testing.assert_allclose(as32(got), as32(exact), rtol=2**-7)  # 2 ulps of bfloat16


@pytest.mark.parametrize(
    "name", ["segment_logsumexp", "segment_sum", "segment_max", "segment_softmax", "segment_mean"]
)
def test_rows_of_one_value_reduce_as_values(name):
    """Rows of one value held as ``(N, 1)`` take the program of the ``(N,)`` values they are
    (a walk over a last axis of size 1 vectorised nothing: a log-sum-exp took 1.3-2x the
    ``jax.ops`` program), with the same values and gradients; a softmax walks such rows in
    long segments (the CPU policy), and scatters them in short ones."""
    n = 6_000
    f = getattr(foldax, name)
    x = jnp.asarray(RNG.standard_normal(n), jnp.float32)
    for sizes in ([n // 3] * 3, [6] * (n // 6)):  # long segments (walked), short (scattered)
        one = lambda a, sizes=sizes: f(a, sizes=sizes)  # noqa: E731
        col = lambda a, sizes=sizes: f(a[:, None, None], sizes=sizes)  # noqa: E731
        got, want = jax.jit(col)(x), jax.jit(one)(x)
        assert got.shape == (*want.shape, 1, 1)
        np.testing.assert_array_equal(np.asarray(got)[..., 0, 0], np.asarray(want))
        loss = lambda g: lambda a: jnp.sum(jnp.sin(g(a)))  # noqa: E731
        np.testing.assert_array_equal(
            np.asarray(jax.jit(jax.grad(loss(col)))(x)),
            np.asarray(jax.jit(jax.grad(loss(one)))(x)),
        )
        walked = len(sizes) == 3
        assert (" while(" in _hlo(col, x)) == walked, (name, len(sizes))
        eqns = jax.make_jaxpr(col)(x).jaxpr.eqns
        folded = [v.aval.shape for e in eqns if e.primitive.name == "foldax_fold" for v in e.invars]
        assert (n, 1, 1) not in folded, folded
    ids = jnp.asarray(np.repeat(np.arange(3), n // 3), jnp.int32)  # ids, sorted: as sizes
    got = jax.jit(lambda a: f(a[:, None], ids, 3, indices_are_sorted=True))(x)
    want = jax.jit(lambda a: f(a, ids, 3, indices_are_sorted=True))(x)
    np.testing.assert_array_equal(np.asarray(got)[..., 0], np.asarray(want))


def _direct_kinds(f, *args):
    """The direct kinds (``Spec.direct``) of the folds in ``f``'s jaxpr."""
    eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
    return [e.params["fold_rule"].spec.direct for e in eqns if e.primitive.name == "foldax_fold"]


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "bfloat16"])
def test_mean_gradient_divides_per_segment_and_gathers_once(dtype):
    """A mean's gradient is ``jax.ops``' own program: the cotangent divided by each segment's
    count, then gathered once (dividing per row gathered the counts too: twice ``jax.ops``'
    time on a TPU), with ids dropped (negative, too large) and segments empty; complex and
    half-precision means (summed wider) walk, with the same values."""
    n, s = 200, 9
    ids = jnp.asarray(RNG.integers(-2, s + 2, n), jnp.int32)
    ids = jnp.where(ids == 4, 5, ids)  # segment 4 empty
    x = RNG.standard_normal((n, 3))
    x = x + 1j * RNG.standard_normal((n, 3)) if dtype == "complex64" else x
    wide = {"bfloat16": jnp.float32}.get(dtype, dtype)
    with jax.enable_x64(dtype == "float64"):
        x = jnp.asarray(x, dtype)
        w = jnp.asarray(RNG.standard_normal((s, 3)), dtype)
        loss = lambda f: lambda x: jnp.real(jnp.sum(f(x) * w))  # noqa: E731
        ours = lambda x: foldax.segment_mean(x, ids, s)  # noqa: E731

        def theirs(x):
            total = jax.ops.segment_sum(x.astype(wide), ids, s)
            count = jax.ops.segment_sum(jnp.ones(n, total.real.dtype), ids, s)
            return (total / jnp.maximum(count, 1)[:, None].astype(total.dtype)).astype(x.dtype)

        if dtype in ("float32", "float64"):
            assert _direct_kinds(jax.grad(loss(ours)), x)[-1] == "mean_gather"
        got, want = jax.grad(loss(ours))(x), jax.grad(loss(theirs))(x)
        assert got.dtype == x.dtype
        assert_allclose(got, want, dtype=jnp.finfo(x.dtype).dtype)
        assert not np.any(np.asarray(got[(ids < 0) | (ids >= s)], np.complex128))


#: plain-data reductions whose fold is XLA's scatters on CPU, besides the sum
_SCATTERED = ("max", "min", "logsumexp", "logmeanexp", "softmax")


def _jraph_softmax(x, ids, s, log=False):
    """jraph's segment softmax: max, gather, exp, sum, gather, divide (or subtract the log)."""
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, s))
    e = jnp.exp(x - m[ids])
    total = jax.ops.segment_sum(e, ids, s)[ids]
    return (x - m[ids]) - jnp.log(total) if log else e / total


def _plain_logsumexp(x, ids, s):
    """The stable log-sum-exp a user writes with jax.ops: max, gather, exp, sum, log."""
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, s))
    return m + jnp.log(jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, s))


def _temp(f, *args):
    f = f if hasattr(f, "lower") else jax.jit(f)
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _walked(f):
    """``f`` under a ``vmap`` of two: the tile walk, the reference twin of the scatters."""
    return lambda x, *a: jax.vmap(f, (0, *(None,) * len(a)))(jnp.stack([x, x]), *a)[0]


def _finite_loss(f, w):
    return lambda x, i: jnp.sum(jnp.where(jnp.isfinite(f(x, i)), f(x, i), 0) * w)


def _scattered_calls(name, s, w, **kw):
    """``(f, grad of a loss of f, jvp of f)`` of ``segment_<name>``."""
    op = getattr(foldax, f"segment_{name}")

    def f(x, i):
        return op(x, i, s, **kw)

    def jvp(x, i, t):
        return jax.jvp(lambda a: f(a, i), (x,), (t,))[1]

    return f, jax.grad(_finite_loss(f, w)), jvp


def _jvp_and_walked_values(jvp, walk_f, walk_jvp):
    return lambda x, i, t: (jvp(x, i, t), walk_f(x, i), walk_jvp(x, i, t))


@pytest.mark.slow
def test_plain_extrema_and_logsumexps_are_scatters_unless_batched():
    """Max, min, log-sum-exps and softmaxes of plain data under unsorted ids are XLA's scatters
    and gathers (no loop), derivatives included, at no more temp than the jax.ops / jraph way.
    Values and derivatives are the tile walk's (batched, in steps of 64 rows): ties (integer
    data), NaN, +-inf, an all -inf segment, empty segments, dropped ids."""
    n, s, rng = 20_000, 100, np.random.default_rng(5)
    x = rng.integers(-4, 4, (n, 3)).astype(np.float32)
    ids = rng.integers(-3, s + 3, n).astype(np.int32)
    ids[ids == 7] = 8  # an empty segment
    x[ids == 9] = -np.inf  # a segment of -inf only
    x[3, 0], x[11, 1], x[12, 2] = np.nan, np.inf, -np.inf
    x, ids = jnp.asarray(x), jnp.asarray(ids)
    t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    peers = {
        "max": jax.ops.segment_max,
        "min": jax.ops.segment_min,
        "logsumexp": _plain_logsumexp,
        "softmax": _jraph_softmax,
    }
    for name in _SCATTERED:
        w = jnp.asarray(rng.standard_normal((n if "softmax" in name else s, 3)), jnp.float32)
        f, grad, jvp = _scattered_calls(name, s, w)
        # jitted, as _hlo and _temp compile them: each program compiles once (not op by op)
        walk = [_walked(g) for g in _scattered_calls(name, s, w, chunk_size=64)]
        # the programs whose HLO or memory is inspected compile alone; the values only compared
        # (the jvp and the walked value and jvp) share one program
        values = jax.jit(_jvp_and_walked_values(jvp, walk[0], walk[2]))
        walk_grad = jax.jit(walk[1])
        f, grad = (jax.jit(g) for g in (f, grad))
        for g in (f, grad):
            assert " while(" not in _hlo(g, x, ids), name
        assert " while(" in _hlo(walk_grad, x, ids), name
        got_jvp, walk_f, walk_jvp = values(x, ids, t)
        assert_allclose(f(x, ids), walk_f, dtype=np.float32, err_msg=name)
        assert_allclose(grad(x, ids), walk_grad(x, ids), dtype=np.float32, err_msg=name)
        assert_allclose(got_jvp, walk_jvp, dtype=np.float32, err_msg=name)
        if name in peers:
            p = jax.jit(functools.partial(lambda x, i, op: op(x, i, s), op=peers[name]))
            # (a softmax's folds hold one segment more, where the rows in no segment go)
            slack = 2 * x.shape[1] * 4 if "softmax" in name else 0
            assert _temp(f, x, ids) <= _temp(p, x, ids) + slack, name
            if name in ("max", "min"):  # (the others' peers are NaN where a max is infinite)
                assert_allclose(f(x, ids), p(x, ids), dtype=np.float32, err_msg=name)
            assert _temp(grad, x, ids) <= _temp(jax.grad(_finite_loss(p, w)), x, ids) + slack, name


@pytest.mark.parametrize("sorted_ids", [False, True])
def test_logsumexp_gradient_is_the_jax_ops_program(sorted_ids):
    """On a CPU a log-sum-exp's gradient of plain rows computes what ``jax.ops``' computes: its
    exponentials made once for both passes, no more logarithms (XLA fuses the work per segment
    into the gather per row: a refined logarithm and two exponentials per row and feature
    made it 1.5-4.5x slower), with no more temp."""
    n, s, feat = 4_000, 100, 16
    rng = np.random.default_rng(3)
    ids = np.sort(rng.integers(0, s, n)) if sorted_ids else rng.integers(0, s, n)
    x = jnp.asarray(rng.standard_normal((n, feat)), jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    w = jnp.asarray(rng.standard_normal((s, feat)), jnp.float32)
    ours = lambda x, i: foldax.segment_logsumexp(x, i, s, indices_are_sorted=sorted_ids)  # noqa: E731
    peer = lambda x, i: _plain_logsumexp(x, i, s)  # noqa: E731
    grads = [jax.jit(jax.grad(_finite_loss(f, w))) for f in (ours, peer)]
    mine, theirs = (_hlo(g, x, ids) for g in grads)
    for op in (" exponential(", " log("):
        assert mine.count(op) <= theirs.count(op), op
    assert _temp(grads[0], x, ids) <= _temp(grads[1], x, ids)


@pytest.mark.parametrize("sorted_ids", [False, True])
def test_softmax_gradient_keeps_fewer_rows_than_jraphs(sorted_ids):
    """A segment softmax's gradient of plain rows keeps the softmax and ``p * g`` (the scatter's
    input) as its arrays of rows, where jraph's keeps the exponentials, the gathered sums and
    its scatter's input: written ``p * (dx - sum(p * dx))`` it made six, and held as much temp
    as jraph's (71.2 against 74.4 MB at 1 M rows of 8 features; now 42.4)."""
    n, s, feat = 20_000, 500, 8
    rng = np.random.default_rng(5)
    ids = rng.integers(0, s, n)
    ids = jnp.asarray(np.sort(ids) if sorted_ids else ids, jnp.int32)
    x = jnp.asarray(rng.standard_normal((n, feat)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, feat)), jnp.float32)

    def jraph(x, i):
        m = jax.lax.stop_gradient(jax.ops.segment_max(x, i, s, indices_are_sorted=sorted_ids))
        e = jnp.exp(x - m[i])
        return e / jax.ops.segment_sum(e, i, s, indices_are_sorted=sorted_ids)[i]

    ours = lambda x, i: foldax.segment_softmax(x, i, s, indices_are_sorted=sorted_ids)  # noqa: E731
    grads = [jax.jit(jax.grad(lambda x, i, f=f: jnp.sum(f(x, i) * w))) for f in (ours, jraph)]
    assert _temp(grads[0], x, ids) <= 0.75 * _temp(grads[1], x, ids)
    assert_allclose(grads[0](x, ids), grads[1](x, ids), dtype=np.float32)


@pytest.mark.parametrize("features", [3, 40])
@pytest.mark.parametrize("sorted_ids", [False, True])
def test_logsumexp_gradient_as_a_tpu_gathers_it(features, sorted_ids, monkeypatch):
    """A TPU gathers a log-sum-exp's maximum for its gradient as the forward gathers it (XLA
    then gathers it once); here, on a CPU, that form gives the gradient the CPU's forms give
    and the tile walk's: ties, NaN, +-inf, an all -inf segment, empty segments, dropped ids."""
    from foldax._engine import _direct

    n, s, rng = 2_000, 30, np.random.default_rng(7)
    x = rng.integers(-4, 4, (n, features)).astype(np.float32)
    ids = rng.integers(-3, s + 3, n).astype(np.int32)
    ids = np.sort(ids) if sorted_ids else ids
    ids[ids == 7] = 8  # an empty segment
    x[ids == 9] = -np.inf  # a segment of -inf only
    x[3, 0], x[11, 1], x[12, 2] = np.nan, np.inf, -np.inf
    x, ids = jnp.asarray(x), jnp.asarray(ids)
    w = jnp.asarray(rng.standard_normal((s, features)), jnp.float32)
    grad = lambda: jax.jit(_scattered_calls("logsumexp", s, w, indices_are_sorted=sorted_ids)[1])  # noqa: E731
    cpu = grad()(x, ids)
    walked = jax.jit(_walked(_scattered_calls("logsumexp", s, w, chunk_size=64)[1]))(x, ids)
    monkeypatch.setitem(_direct._LOWER, "lse_gather", _direct._LOWER_ON_TPU["lse_gather"])
    as_tpu = grad()(x, ids)
    assert_allclose(as_tpu, cpu, dtype=np.float32)
    assert_allclose(as_tpu, walked, dtype=np.float32)
    assert (np.asarray(as_tpu) == 0).any()  # (rows dropped, -inf rows)


def test_eager_transformations_keep_custom_rules():
    """Two fns alike but for a custom_jvp rule, differentiated eagerly: each by its own rule
    (the cache, whose key leaves rules out, does not serve them)."""
    ids = jnp.asarray(np.arange(40) % 5, jnp.int32)

    def scaled_identity(scale):
        @jax.custom_jvp
        def f(r):
            return r

        f.defjvp(lambda p, t: (p[0], t[0] * scale))
        return f

    for scale in (1.0, 3.0):
        f = scaled_identity(scale)
        g = jax.grad(lambda x, f=f: foldax.segment_sum(x, ids, num_segments=5, fn=f).sum())(X)
        assert_allclose(g, jnp.full(X.shape, scale), dtype=jnp.float32)
