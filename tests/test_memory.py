"""Memory bounds, asserted through foldax.memory (XLA's compiled, deterministic figures)."""

import dataclasses

import _callables
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import foldax
from foldax._tools import workloads as w
from foldax.memory import MemoryReport, format_bytes, report, report_from_compiled

REDUCTIONS = [
    foldax.segment_sum,
    foldax.segment_mean,
    foldax.segment_max,
    foldax.segment_min,
    foldax.segment_logsumexp,
    foldax.segment_logmeanexp,
    foldax.segment_softmax,
    foldax.segment_log_softmax,
]
PER_ROW = {foldax.segment_softmax, foldax.segment_log_softmax}


def test_report_fields_and_str():
    r = report(lambda x: jnp.exp(x).sum(), jax.ShapeDtypeStruct((1000,), jnp.float32))
    assert isinstance(r, MemoryReport)
    assert r.argument_bytes == 4000
    assert r.output_bytes == 4
    assert r.name == "<lambda>"
    assert "temp" in str(r) and "arguments 4.0 KB" in str(r)
    with pytest.raises(dataclasses_frozen_error()):
        r.temp_bytes = 1


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_report_static_kwargs_and_materialization():
    def f(x, *, n):
        return jnp.outer(x, x)[:n].sum()

    r = report(f, jax.ShapeDtypeStruct((512,), jnp.float32), n=3)
    assert r.temp_bytes >= 0
    dense = report(lambda x: jnp.cumsum(jnp.outer(x, x), 0).sum(), jnp.ones(512))
    assert dense.temp_bytes >= 512 * 512 * 4  # the outer product is materialized


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(1500) == "1.5 KB"
    assert format_bytes(92_800_000) == "92.8 MB"
    assert format_bytes(2 * 10**9) == "2.0 GB"


def _problem(n, segments=37, features=5):
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.integers(0, n, segments - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).tolist()
    return sizes, jax.ShapeDtypeStruct((n, features), jnp.float32)


def _fwd_bwd(red, sizes):
    theta = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)

    def fwd(x, theta):
        return red(x, sizes=sizes, fn=lambda rows: rows @ theta, chunk_size=1024)

    def loss(x, theta):
        out = fwd(x, theta)
        if red in PER_ROW:
            # A per-row output's cotangent is (N,) whenever the loss is not a plain sum: that
            # buffer is the caller's, so the bound is checked with a plain sum.
            return out.sum()
        return jnp.where(jnp.isfinite(out), out, 0.0).sum()

    return fwd, jax.grad(loss, argnums=(0, 1)), theta


@pytest.mark.slow
@pytest.mark.parametrize("red", REDUCTIONS, ids=lambda f: f.__name__)
def test_temp_memory_flat_in_n(red):
    """Forward and backward temp bytes do not grow with the reduced dimension N."""
    figures = {}
    for n in (20_000, 160_000):
        sizes, x = _problem(n)
        fwd, bwd, theta = _fwd_bwd(red, sizes)
        figures[n] = (report(fwd, x, theta).temp_bytes, report(bwd, x, theta).temp_bytes)
    (f1, b1), (f8, b8) = figures[20_000], figures[160_000]
    # 8x the rows: temp memory stays within 10% (+4 KB for the per-tile schedule).
    assert f8 <= 1.1 * f1 + 4096, figures
    extra = 0
    if red in PER_ROW:
        # A per-row softmax is two folds (the log-sum-exps, then the rows): the gradient with
        # respect to data sums one (N, F) cotangent from each, one more buffer of data's size.
        extra = (160_000 - 20_000) * 5 * 4
    assert b8 <= 1.1 * b1 + 4096 + extra, figures
    # And it is small in absolute terms: far below one copy of fn(data) for the larger N.
    if red not in PER_ROW:
        assert f8 < 160_000 * 4 / 4, figures


@pytest.mark.slow
@pytest.mark.parametrize("red", sorted(PER_ROW, key=lambda f: f.__name__), ids=lambda f: f.__name__)
def test_per_row_gradient_wrt_parameters_flat_in_n(red):
    """The gradient of a segment softmax with respect to fn's parameters writes nothing per row."""
    temps = {}
    for n in (20_000, 160_000):
        sizes, x = _problem(n)
        theta = jax.ShapeDtypeStruct((5,), jnp.float32)

        def loss(theta, x, sizes=sizes):
            # a plain sum: a per-row cotangent of any other form is an (N,) buffer of the caller's
            return red(x, sizes=sizes, fn=lambda rows: rows @ theta, chunk_size=1024).sum()

        temps[n] = report(jax.grad(loss), theta, x).temp_bytes
    assert temps[160_000] <= 1.1 * temps[20_000] + 4096, temps


@pytest.mark.slow
def test_temp_memory_flat_with_traced_sizes_and_ids():
    def with_sizes(x, sizes):
        return foldax.segment_logsumexp(x, sizes=sizes, chunk_size=1024)

    def with_ids(x, ids):
        return foldax.segment_logsumexp(x, ids, 37, chunk_size=1024)

    temps = {}
    for n in (20_000, 160_000):
        x = jax.ShapeDtypeStruct((n,), jnp.float32)
        s = jax.ShapeDtypeStruct((37,), jnp.int32)
        ids = jax.ShapeDtypeStruct((n,), jnp.int32)
        temps[n] = (
            report(jax.grad(lambda x, s: with_sizes(x, s).sum()), x, s).temp_bytes,
            report(jax.grad(lambda x, i: with_ids(x, i).sum()), x, ids).temp_bytes,
        )
    for a, b in zip(temps[20_000], temps[160_000], strict=True):
        # traced sizes carry a schedule of ~N/T + S tiles: a few KB per 100K rows
        assert b <= 1.1 * a + 16_384, temps


@pytest.fixture(scope="module")
def seed_memory():
    """XLA temp memory of the seed workload at N and N x 10, foldax vs the global-max version."""
    out = {}
    for repeat in (1, 10):
        sizes = w.seed_sizes() * repeat
        x = jax.ShapeDtypeStruct((sum(sizes), w.FEATURES), jnp.float32)
        thetas = jax.ShapeDtypeStruct((10, w.FEATURES), jnp.float32)
        for way in ("global-max segment_sum", "foldax"):
            fwd, grad = w.forward_and_grad(w.WAYS[way](sizes))
            out[repeat, way] = (
                report(fwd, thetas, x).temp_bytes,
                report(grad, thetas, x).temp_bytes,
            )
    return out


@pytest.mark.slow
def test_seed_workload_memory_targets(seed_memory):
    base_f, base_b = seed_memory[1, "global-max segment_sum"]
    fx_f, fx_b = seed_memory[1, "foldax"]
    assert fx_f * 25 <= base_f, seed_memory
    assert fx_b * 50 <= base_b, seed_memory


@pytest.mark.slow
def test_seed_workload_memory_flat_at_10x(seed_memory):
    fx_f, fx_b = seed_memory[1, "foldax"]
    fx10_f, fx10_b = seed_memory[10, "foldax"]
    # N x 10 repeats the segments, so S grows 10x too: the (B, S) per-segment states (the
    # output's size, a few copies of them in the loop carry) may grow; nothing of size N may.
    states = 4 * 10 * 1230 * 4  # four (B = 10, S = 1230) float32 arrays
    assert fx10_f <= 1.1 * fx_f + states, seed_memory
    assert fx10_b <= 1.1 * fx_b + states, seed_memory
    gm10_f, gm10_b = seed_memory[10, "global-max segment_sum"]
    assert fx10_f * 100 < gm10_f and fx10_b * 100 < gm10_b, seed_memory
    # ... while the global-max version grows linearly
    assert (
        seed_memory[10, "global-max segment_sum"][0]
        > 9 * seed_memory[1, "global-max segment_sum"][0]
    )


# ----------------------------------------------------------------------------------------------
# foldax.memory_budget: the sizes it reads


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("2 tb", 2 * 10**12),
        (np.int64(10**6), 10**6),
        (np.uint32(4096), 4096),
        ("1.5 GiB", 3 * 2**29),
        ("64 mb", 64 * 10**6),
        ("64mB", 64 * 10**6),
        ("512KiB", 512 * 1024),
        (" 8000000 ", 8_000_000),
        (10**13, 10**13),
    ],
)
def test_memory_budget_reads_units_and_numpy_integers(value, nbytes):
    from foldax._engine import current_budget

    with foldax.memory_budget(value) as b:
        assert b == current_budget() == nbytes
        assert type(b) is int


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1.5e6, TypeError, r"got 1500000\.0 \(write int\(\.\.\.\) for a whole number of bytes\)"),
        (np.float64(2e6), TypeError, r"number of bytes \(int\).*write int"),
        (True, TypeError, r"got True"),
        (np.bool_(True), TypeError, r"number of bytes \(int\)"),
        (None, TypeError, r"got NoneType"),
        (-5, ValueError, r"must be positive, got -5"),
        (np.int64(0), ValueError, r"must be positive"),
        ("-5MB", ValueError, r"must be positive, got '-5MB'"),
        ("0 TiB", ValueError, r"must be positive"),
        ("12 parsecs", ValueError, r"units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
        ("1PB", ValueError, r"cannot read '1PB'"),
    ],
)
def test_memory_budget_refuses_with_a_clear_error(value, error, match):
    with pytest.raises(error, match=match) as info, foldax.memory_budget(value):
        pass
    assert str(info.value).startswith("foldax.memory_budget: ")


def test_format_bytes_terabytes():
    assert format_bytes(2_199_000_000_000) == "2.2 TB"
    assert format_bytes(999 * 10**9) == "999.0 GB"


# ----------------------------------------------------------------------------------------------
# foldax.memory.report on any callable: the figures of the plain jitted function of arrays


@pytest.mark.parametrize("case", sorted(_callables.CASES))
def test_report_of_any_callable_equals_the_plain_jitted_function(case):
    (fn, args, kwargs), (plain, plain_args) = _callables.CASES[case]
    got = report(fn, *args, **kwargs)
    want = report_from_compiled(jax.jit(plain).lower(*plain_args).compile())
    assert dataclasses.replace(got, name="") == dataclasses.replace(want, name=""), (got, want)
    assert got.argument_bytes > 0 and got.output_bytes > 0


def test_report_names_an_equinox_transform_after_its_function():
    (fn, args, _), _ = _callables.CASES["eqx.filter_grad"]
    assert report(fn, *args).name == "loss"


def test_report_traces_the_array_leaves_of_keyword_arguments():
    def f(x, *, w, how):
        return getattr(jnp, how)(x @ w).sum()

    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    r = report(f, x, w=w, how="sin")
    assert r.argument_bytes == (8 * 16 + 16 * 4) * 4, r


# ----------------------------------------------------------------------------------------------
# A drop-in for jax.ops on rows computed in the same jit


_PEERS = {
    foldax.segment_sum: jax.ops.segment_sum,
    foldax.segment_max: jax.ops.segment_max,
    foldax.segment_min: jax.ops.segment_min,
}


@pytest.mark.parametrize("graph", ["data", "constant"])
@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("red", list(_PEERS), ids=lambda f: f.__name__)
def test_drop_in_on_messages_holds_no_more_than_jax_ops(red, sort, graph):
    """A graph attention layer's messages ``h[senders] * att`` reduced to their receivers, in
    one jit: temp bytes, forward and gradient (wrt h and att), at most the jax.ops call's -- with
    the graph passed as data (traced, as a jraph GraphsTuple's) or closed over as NumPy
    constants (a fixed graph: the ids are known when the program is traced)."""
    e, v, heads, feat = 20_000, 2_000, 8, 16
    rng = np.random.default_rng(0)
    senders = rng.integers(0, v, e).astype(np.int32)
    receivers = rng.integers(0, v, e).astype(np.int32)
    receivers = np.sort(receivers) if sort else receivers
    args = [
        jax.ShapeDtypeStruct((v, heads, feat), jnp.float32),  # h
        jax.ShapeDtypeStruct((e, heads), jnp.float32),  # att
        jax.ShapeDtypeStruct((v, heads, feat), jnp.float32),  # the loss's weights
    ]
    if graph == "data":
        args += [jax.ShapeDtypeStruct((e,), jnp.int32), jnp.asarray(receivers)]

    def layer(reduce):
        def fwd(h, att, w, snd=senders, rcv=receivers):
            msgs = h[snd] * att[..., None]
            return reduce(msgs, rcv, v, indices_are_sorted=sort)

        def loss(h, att, w, *graph):
            out = fwd(h, att, w, *graph)
            return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * w)

        return fwd, jax.grad(loss, argnums=(0, 1))

    ours, peer = layer(red), layer(_PEERS[red])
    for i, what in enumerate(("forward", "gradient")):
        mine, theirs = report(ours[i], *args).temp_bytes, report(peer[i], *args).temp_bytes
        assert mine <= theirs, (what, mine, theirs)
