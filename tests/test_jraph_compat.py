"""foldax's segment functions as drop-ins for graph networks: jraph's segment scenarios with
foldax in place of ``jraph`` / ``jax.ops``, against jraph's results and the values jraph's own
tests expect; and the two conventions graph code relies on.

* An empty segment's mean is 0 (a node with no incoming edge), as in jraph, PyTorch Geometric
  and TensorFlow, with a zero gradient; ``empty=`` gives another value (NaN for ``0 / 0``).
* Plain data that is a scalar or has a leading axis of 1 is broadcast over the ids, exactly as
  ``jax.ops`` does (jraph's attention ``GraphNetwork`` passes a scalar logit to the softmax).

The jraph tests need ``jraph`` (the ``test`` extra); the convention tests run without it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EVERY, INT_OK, PUBLIC_NAMES, assert_allclose, op, reference

import foldax

F32 = np.float32

#: jraph's segment test data: 9 rows into 6 segments, segment 3 and 5 empty
ROWS = np.arange(9)
IDS = np.array([0, 1, 2, 0, 4, 0, 1, 1, 0])


@pytest.fixture
def jraph():
    return pytest.importorskip("jraph")


def _close(actual, desired):
    assert_allclose(actual, desired, dtype=F32)


# ----------------------------------------------------------------------------------------------
# jraph's segment scenarios


@pytest.mark.parametrize("num_segments", [6, None])
def test_segment_sum(jraph, num_segments):
    ids = jnp.asarray(IDS)
    ours = foldax.segment_sum(jnp.asarray(ROWS), ids, num_segments)
    np.testing.assert_array_equal(ours, jraph.segment_sum(jnp.asarray(ROWS), ids, num_segments))
    np.testing.assert_array_equal(ours, np.array([16, 14, 2, 0, 4, 0])[: num_segments or 5])


@pytest.mark.parametrize("nan_row", [False, True])
def test_segment_mean(jraph, nan_row):
    data, ids = jnp.asarray(ROWS, F32), jnp.asarray(IDS)
    want = np.array([4, 14 / 3, 2, 0, 4, 0], F32)  # segments 3 and 5 are empty: 0
    if nan_row:
        data, want[IDS[0]] = data.at[0].set(jnp.nan), np.nan
    ours = foldax.segment_mean(data, ids, 6)
    _close(ours, jraph.segment_mean(data, ids, 6))
    _close(ours, want)
    nan = foldax.segment_mean(data, ids, 6, empty=float("nan"))
    _close(nan, np.where([0, 0, 0, 1, 0, 1], np.nan, want))


#: (indices_are_sorted, unique_indices) -> (rows, ids, num_segments): jraph's max / min cases,
#: negative ids dropped
EXTREMA_CASES = {
    (False, False): (9, [0, 1, 2, 0, 4, 0, 1, 1, -6], 6),
    (True, False): (9, [0, 0, 0, 1, 1, 1, 2, 3, 4], 6),
    (True, True): (6, [0, 1, 2, 3, 4, 5], 6),
    (False, True): (6, [1, 0, 2, 4, 3, -5], 5),
}
#: what jraph's tests expect of each case (None: the empty segment's identity)
EXPECTED = {
    ("max", False, False): [5, 7, 2, None, 4, None],
    ("max", True, False): [2, 5, 6, 7, 8, None],
    ("min", False, False): [0, 1, 2, None, 4, None],
    ("min", True, False): [0, 3, 6, 7, 8, None],
    ("max", True, True): [0, 1, 2, 3, 4, 5],
    ("min", True, True): [0, 1, 2, 3, 4, 5],
    ("max", False, True): [1, 0, 2, 4, 3],
    ("min", False, True): [1, 0, 2, 4, 3],
}


@pytest.mark.parametrize("hints", list(EXTREMA_CASES))
@pytest.mark.parametrize("name", ["max", "min"])
def test_segment_extrema(jraph, name, hints):
    rows, ids, num = EXTREMA_CASES[hints]
    data, ids = jnp.arange(rows), jnp.asarray(ids)
    empty = np.iinfo(np.int32).min if name == "max" else np.iinfo(np.int32).max
    want = np.array([empty if v is None else v for v in EXPECTED[(name, *hints)]])
    ours, theirs = getattr(foldax, f"segment_{name}"), getattr(jraph, f"segment_{name}")
    np.testing.assert_array_equal(ours(data, ids, num, *hints), want)
    np.testing.assert_array_equal(ours(data, ids, num, *hints), theirs(data, ids, num, *hints))
    inferred = ours(data, ids, None, *hints)  # num_segments from the known ids
    np.testing.assert_array_equal(inferred, want[: int(ids.max()) + 1])
    jitted = jax.jit(ours, static_argnums=(2, 3, 4))(data, ids, num, *hints)
    np.testing.assert_array_equal(jitted, want)


@pytest.mark.parametrize("nan_row", [False, True])
def test_segment_softmax(jraph, nan_row):
    data, ids = jnp.asarray(ROWS, F32), jnp.asarray(IDS)
    want = np.array(
        [3.1741429e-04, 1.8088353e-03, 1.0, 6.3754367e-03, 1.0, 4.7108460e-02, 2.6845494e-01,
         7.2973621e-01, 9.4619870e-01], F32,
    )  # fmt: skip
    if nan_row:
        data = data.at[0].set(jnp.nan)
        want[IDS[0] == IDS] = np.nan  # NaN stays in its segment
    for ours in (
        foldax.segment_softmax(data, ids, 6),
        foldax.segment_softmax(data, ids),
        jax.jit(foldax.segment_softmax, static_argnums=2)(data, ids, 6),
    ):
        _close(ours, want)
        _close(ours, jraph.segment_softmax(data, ids, 6))


@pytest.mark.slow
def test_partition_softmax(jraph):
    # foldax takes floating logits (jraph's case has integers): cast first
    logits, parts = jnp.arange(9, dtype=F32), jnp.array([3, 2, 4])
    want = [0.090031, 0.244728, 0.665241, 0.268941, 0.731059, 0.032059, 0.087144, 0.236883,
            0.643914]  # fmt: skip
    ours = foldax.segment_softmax(logits, sizes=parts)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)  # jraph's 6 printed digits
    _close(ours, jraph.partition_softmax(logits, parts, 9))
    _close(jax.jit(lambda x, p: foldax.segment_softmax(x, sizes=p))(logits, parts), ours)


def _normalize(data, ids, num, eps=1e-8):
    """jraph's ``segment_normalize`` (z-scores per segment) from foldax's mean and variance."""
    mean = foldax.segment_mean(data, ids, num)[ids]
    var = foldax.segment_var(data, ids, num)[ids]
    return (data - mean) * jax.lax.rsqrt(jnp.maximum(var, jnp.asarray(eps, var.dtype)))


@pytest.mark.parametrize("nan_row", [False, True])
def test_segment_variance_and_normalize(jraph, nan_row):
    data, ids = jnp.arange(8, dtype=F32), jnp.array([0, 0, 0, 1, 1, 2, 2, 2])
    parts = [np.arange(3, dtype=F32), np.arange(3, 5, dtype=F32), np.arange(5, 8, dtype=F32)]
    var = np.array([p.var() for p in parts], F32)
    z = np.concatenate([(p - p.mean()) / p.std() for p in parts])
    if nan_row:
        data, var[0], z[:3] = data.at[0].set(jnp.nan), np.nan, np.nan
    _close(foldax.segment_var(data, ids, 3), var)
    _close(foldax.segment_var(data, ids, 3), jraph.segment_variance(data, ids, 3))
    _close(_normalize(data, ids, 3), z)
    _close(_normalize(data, ids, 3), jraph.segment_normalize(data, ids, 3))


# ----------------------------------------------------------------------------------------------
# Graph networks built with foldax's functions


def _graph(jraph, rng):
    """Three graphs, one of them with no nodes, with nodes that receive no edge."""
    n_node, n_edge = np.array([4, 0, 3]), np.array([5, 0, 2])
    senders = np.array([0, 1, 2, 2, 3, 4, 6])
    receivers = np.array([1, 1, 2, 0, 0, 5, 5])  # nodes 3, 4, 6 receive nothing
    return jraph.GraphsTuple(
        nodes=jnp.asarray(rng.standard_normal((7, 4)), F32),
        edges=jnp.asarray(rng.standard_normal((7, 3)), F32),
        senders=jnp.asarray(senders),
        receivers=jnp.asarray(receivers),
        globals=jnp.asarray(rng.standard_normal((3, 2)), F32),
        n_node=jnp.asarray(n_node),
        n_edge=jnp.asarray(n_edge),
    )


def _attention_network(jraph, segment, logit_fn):
    """A ``jraph.GraphNetwork`` with softmax attention over incoming edges and mean / max
    aggregations, its segment functions taken from ``segment`` (foldax or jraph)."""

    def update_node(nodes, sent, received, globals_):
        return jnp.concatenate([nodes, sent, received, globals_], axis=1)

    def update_global(nodes, edges, globals_):
        return jnp.concatenate([nodes, edges, globals_], axis=1)

    return jraph.GraphNetwork(
        update_edge_fn=lambda e, s, r, g: e * s[:, :3] + r[:, 1:],
        update_node_fn=update_node,
        update_global_fn=update_global,
        attention_logit_fn=logit_fn,
        attention_reduce_fn=lambda e, w: e * w.reshape(w.shape + (1,) * (e.ndim - w.ndim)),
        attention_normalize_fn=segment.segment_softmax,
        aggregate_edges_for_nodes_fn=segment.segment_mean,
        aggregate_nodes_for_globals_fn=segment.segment_mean,
        aggregate_edges_for_globals_fn=segment.segment_max,
    )


LOGITS = {
    # jraph's own attention test: one scalar logit for every edge
    "scalar": lambda e, s, r, g: jnp.array(1.0),
    "per_edge": lambda e, s, r, g: jnp.sum(s * r, axis=1),
    "per_edge_2d": lambda e, s, r, g: jnp.sum(e, axis=1, keepdims=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("logits", list(LOGITS))
def test_attention_graph_network(jraph, rng, logits):
    graph = _graph(jraph, rng)
    ours = _attention_network(jraph, foldax, LOGITS[logits])
    theirs = _attention_network(jraph, jraph, LOGITS[logits])

    def loss(net, nodes, edges):
        out = net(graph._replace(nodes=nodes, edges=edges))
        return jnp.sum(out.nodes**2) + jnp.sum(jnp.where(jnp.isfinite(out.globals), out.globals, 0))

    # the reference and its gradient, jitted: one compilation (foldax's: eager and jitted)
    want, want_grads = jax.jit(
        lambda graph: (
            theirs(graph),
            jax.grad(functools.partial(loss, theirs), argnums=(0, 1))(graph.nodes, graph.edges),
        )
    )(graph)
    assert np.isfinite(want.nodes).all() and want.globals.shape == (3, 17)
    for out in (ours(graph), jax.jit(ours)(graph)):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            if jnp.issubdtype(b.dtype, jnp.floating):
                _close(a, b)
            else:
                np.testing.assert_array_equal(a, b)

    grads = jax.grad(functools.partial(loss, ours), argnums=(0, 1))(graph.nodes, graph.edges)
    for a, b in zip(grads, want_grads, strict=True):
        _close(a, b)


def test_jraph_identity_attention_network(jraph, rng):
    """jraph's test: identity updates and a scalar logit leave the graph unchanged."""
    graph = _graph(jraph, rng)
    net = jraph.GraphNetwork(
        update_edge_fn=lambda e, s, r, g: e,
        update_node_fn=lambda n, s, r, g: n,
        update_global_fn=lambda n, e, g: g,
        attention_logit_fn=lambda e, s, r, g: jnp.array(1.0),
        attention_reduce_fn=lambda e, w: e,
        attention_normalize_fn=foldax.segment_softmax,
        aggregate_edges_for_nodes_fn=foldax.segment_sum,
        aggregate_nodes_for_globals_fn=foldax.segment_sum,
        aggregate_edges_for_globals_fn=foldax.segment_sum,
    )
    for out in (net(graph), jax.jit(net)(graph)):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(graph), strict=True):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# The mean of an empty segment: 0 and a zero gradient, in every form


def _mean_cases(rng):
    """Edge features ``(7, 3)`` onto 6 nodes, nodes 1, 3 and 5 without an edge; a NaN in a
    real segment would show through any leak, so the data is finite."""
    x = jnp.asarray(rng.standard_normal((7, 3)), F32)
    ids = np.array([0, 0, 2, 2, 2, 4, 4])
    return x, ids, [2, 0, 3, 0, 2, 0]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["ids", "traced_ids", "sizes", "offsets", "fn"])
def test_mean_of_empty_segments(rng, form):
    x, ids, sizes = _mean_cases(rng)
    w = jnp.asarray(rng.standard_normal((1, 3)), F32)  # (1, 3): rows scaled per feature
    call = {
        "ids": lambda v: foldax.segment_mean(v, jnp.asarray(ids), 6),
        "traced_ids": lambda v: jax.jit(foldax.segment_mean, static_argnums=2)(v, ids, 6),
        "sizes": lambda v: foldax.segment_mean(v, sizes=sizes),
        "offsets": lambda v: foldax.segment_mean(v, offsets=np.cumsum([0, *sizes])),
        "fn": lambda v: foldax.segment_mean(
            {"v": v}, ids, 6, fn=lambda r: r["v"] * w, chunk_size=2
        ),
    }[form]
    scale = w if form == "fn" else jnp.ones((1, 3), F32)
    data = np.asarray(x * scale)
    _close(call(x), reference("mean", data, ids, 6))
    assert (np.asarray(call(x))[[1, 3, 5]] == 0).all()
    # gradient and tangents: the rows' share 1 / n of their segment, 0 from empty segments
    g = jax.grad(lambda v: jnp.sum(call(v) * jnp.arange(1.0, 7.0, dtype=F32)[:, None]))(x)
    _close(g, ((ids + 1) / np.bincount(ids, minlength=6)[ids])[:, None] * np.asarray(scale))
    t = jnp.asarray(rng.standard_normal(x.shape), F32)
    _, dout = jax.jvp(call, (x,), (t,))
    _close(dout, reference("mean", np.asarray(t * scale), ids, 6))
    batch = jnp.stack([x, 2 * x])
    _close(jax.vmap(call)(batch), np.stack([call(x), call(2 * x)]))
    g_sum = (1 / np.bincount(ids, minlength=6)[ids])[:, None] * np.asarray(scale)
    _close(jax.vmap(jax.grad(lambda v: jnp.sum(call(v))))(batch), np.stack([g_sum, g_sum]))


@pytest.mark.slow
def test_mean_empty_value(jraph, rng):
    """``empty=`` sets the value of an empty segment only; NaN's gradient still reaches no one."""
    x, ids, _ = _mean_cases(rng)
    _close(foldax.segment_mean(x, ids, 6), jraph.segment_mean(x, jnp.asarray(ids), 6))
    for empty in (float("nan"), -1.0, np.float32(2.5)):
        out = foldax.segment_mean(x, ids, 6, empty=empty)
        want = reference("mean", np.asarray(x), ids, 6)
        want[[1, 3, 5]] = empty
        _close(out, want)
    g = jax.grad(lambda v: jnp.sum(foldax.segment_mean(v, ids, 6)))(x)
    g_nan = jax.grad(lambda v: jnp.nansum(foldax.segment_mean(v, ids, 6, empty=float("nan"))))(x)
    np.testing.assert_array_equal(g_nan, g)
    assert np.isfinite(g).all()
    # no rows at all (every segment empty)
    _close(foldax.segment_mean(x[:0], sizes=[0, 0]), np.zeros((2, 3)))
    _close(foldax.segment_mean(x[:0], sizes=[0, 0], empty=float("nan")), np.full((2, 3), np.nan))
    z = jax.lax.complex(x[:, 0], x[:, 1])
    _close(foldax.segment_mean(z, ids, 6, empty=1j)[1], 1j)


@pytest.mark.parametrize("empty", [True, "0", jnp.zeros(()), None])
def test_mean_empty_value_errors(empty):
    x = jnp.arange(6.0, dtype=F32)
    with pytest.raises(TypeError, match=r"foldax\.segment_mean: empty"):
        foldax.segment_mean(x, sizes=[2, 0, 4], empty=empty)
    with pytest.raises(TypeError, match=r"foldax\.segment_mean: empty.*complex"):
        foldax.segment_mean(x, sizes=[2, 0, 4], empty=1j)


# ----------------------------------------------------------------------------------------------
# Scalar and leading-size-1 data, broadcast over the ids as jax.ops broadcasts it

JAX_OPS = ("sum", "max", "min", "prod")
SHAPES = [(), (1,), (1, 3), (1, 1)]


def _broadcast_reference(name, data, ids, num):
    """``segment_<name>`` of ``data`` broadcast by hand to ``(len(ids), *data.shape[1:])``."""
    data = np.asarray(data)
    full = np.broadcast_to(data, (len(ids), *data.shape[1:]))
    if name in JAX_OPS:
        return getattr(jax.ops, f"segment_{name}")(jnp.asarray(data), jnp.asarray(ids), num)
    return reference(name, full, ids, num)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", EVERY)
def test_broadcast_data_as_jax_ops(rng, name, shape):
    ids, num = np.array([0, 0, 2, 2, 2, -1]), 3  # segment 1 empty, the last row dropped
    data = (rng.standard_normal(shape) + 2).astype(F32)
    want = _broadcast_reference(name, data, ids, num)
    if name in JAX_OPS:  # jax.ops's result is the broadcast one
        _close(want, reference(name, np.broadcast_to(data, (6, *shape[1:])), ids, num))
    f = op(name)
    for out in (
        f(jnp.asarray(data), jnp.asarray(ids), num),
        jax.jit(f, static_argnums=2)(jnp.asarray(data), ids, num),
    ):
        assert out.shape == np.shape(want)
        _close(out, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sum", "mean", "max", "softmax"])
def test_broadcast_scalar_forms(rng, name):
    """A Python number, static sizes / offsets, ``vmap`` over the scalar, and its gradient."""
    f, ids = op(name), np.array([0, 0, 1, 2, 2])
    want = _broadcast_reference(name, np.float32(1.5), ids, 3)
    _close(f(1.5, ids, 3), want)
    _close(f(jnp.float32(1.5), sizes=[2, 1, 2]), want)
    _close(f(jnp.float32(1.5), offsets=[0, 2, 3, 5]), want)
    vs = jnp.asarray([0.5, -1.0], F32)
    batched = jax.vmap(lambda v: f(v, jnp.asarray(ids), 3))(vs)
    _close(batched, np.stack([_broadcast_reference(name, v, ids, 3) for v in np.asarray(vs)]))
    if name in ("sum", "mean", "max"):  # d/dv of every output: the rows it counts
        g = jax.grad(lambda v: jnp.sum(f(v, jnp.asarray(ids), 3)))(jnp.float32(1.5))
        _close(g, {"sum": 5.0, "mean": 3.0, "max": 3.0}[name])


@pytest.mark.parametrize("name", EVERY)
def test_broadcast_rejects_what_jax_ops_rejects(name):
    ids = jnp.array([0, 0, 1, 2])
    bad = jnp.ones((3,), F32)
    if name in JAX_OPS:
        with pytest.raises(ValueError):
            getattr(jax.ops, f"segment_{name}")(bad, ids, 3)
    f, public = op(name), PUBLIC_NAMES[name]
    with pytest.raises(ValueError, match=f"{public}: data has leading size 3 but segment_ids"):
        f(bad, ids, 3)
    with pytest.raises(ValueError, match=f"{public}: data has leading size 3 but sizes"):
        f(bad, sizes=[2, 2])
    with pytest.raises(ValueError, match=f"{public}: data is a scalar, but sizes"):
        jax.jit(lambda s: f(jnp.float32(1.0), sizes=s))(jnp.array([2, 2]))
    with pytest.raises(ValueError, match=f"{public}: data must have a leading axis.*fn"):
        f({"a": jnp.float32(1.0)}, ids, 3, fn=lambda r: r["a"])


def test_broadcast_integer_and_bool_data():
    ids = jnp.array([0, 0, 1, 2])
    for name in INT_OK:
        want = _broadcast_reference(name, np.int32(2), np.asarray(ids), 3)
        np.testing.assert_array_equal(op(name)(2, ids, 3), want)
    np.testing.assert_array_equal(
        foldax.segment_max(jnp.bool_(True), ids, 4), jax.ops.segment_max(jnp.bool_(True), ids, 4)
    )
