"""A graph attention (GAT) layer the jraph way, its messages fused into ``foldax.segment_sum``.

A graph of ``V`` nodes and ``E`` directed edges (``senders[e] -> receivers[e]``, unsorted). The
layer projects node features to ``H`` heads of ``F`` features, ``z = h W`` ``(V, H, F)``, scores
every edge per head, ``e = leaky_relu(a_src . z[sender] + a_dst . z[receiver])`` ``(E, H)``,
normalises the scores over each receiver's incoming edges (a segment softmax), and sums the
weighted messages ``alpha[e] z[sender]`` into their receivers:

    out[v] = sum_{e: receivers[e] = v} alpha[e] z[senders[e]]     (V, H, F)

Written with ``jax.ops`` (or ``jraph.segment_softmax``), the messages are an ``(E, H, F)`` array,
and the gradient keeps more of them. With foldax, the per-edge logits are computed inside
``foldax.segment_softmax(..., fn=)`` and the messages inside ``foldax.segment_sum(..., fn=)``,
chunk by chunk from the edges' endpoints (tuple data ``(senders, alpha)``): the ``(E, H, F)``
messages never exist, forward or backward; only the ``(E, H)`` attention weights do.

The script checks the layer's output and its parameters' gradient against the ``jax.ops`` way
(and ``jraph.segment_softmax``, where jraph is installed: the ``examples`` extra brings it),
then prints XLA temp memory (``foldax.memory``) and time (compiled, after warm-up, the ways in
turns, median of repeats) of the forward pass and of the gradient.

Measured with ``python examples/graph_attention.py`` (about 60 s on 2 CPU cores, shared with
other jobs; ``--smoke``, about 10 s), V = 20,000 nodes, E = 400,000 edges, H = 4 heads of
F = 32 features: output and gradient agree with ``jax.ops`` and jraph to 2e-7 and 5e-7 relative;
XLA temp memory forward 18.8 MB against 221.4 MB (both), gradient 71.9 MB against 874.2 MB (the
foldax figures grow with V H F and E H, not E H F); median time forward 262 ms against 376 ms
(``jax.ops``) and 396 ms (jraph), gradient 853 ms against 1133 ms and 1332 ms: 0.70x and 0.75x
the ``jax.ops`` way's (0.61x and 0.73x in another run).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import format_bytes, report_from_compiled

HAS_JRAPH = importlib.util.find_spec("jraph") is not None


def init_params(key, f_in, heads, f_out):
    """GAT parameters: ``w (f_in, H, F)``, attention vectors ``a_src``, ``a_dst`` ``(H, F)``."""
    kw, ks, kd = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(kw, (f_in, heads, f_out)) / np.sqrt(f_in),
        "a_src": jax.random.normal(ks, (heads, f_out)) / np.sqrt(f_out),
        "a_dst": jax.random.normal(kd, (heads, f_out)) / np.sqrt(f_out),
    }


def project(params, nodes):
    """Node features ``(V, f_in)`` to ``z (V, H, F)`` and each node's two scores ``(V, H)``."""
    z = jnp.einsum("vi,ihf->vhf", nodes, params["w"])
    return (
        z,
        jnp.einsum("vhf,hf->vh", z, params["a_src"]),
        jnp.einsum("vhf,hf->vh", z, params["a_dst"]),
    )


def gat_foldax(params, nodes, senders, receivers):
    """The layer with foldax: per-edge logits and messages computed chunk by chunk of edges."""
    v = nodes.shape[0]
    z, s_src, s_dst = project(params, nodes)

    def logits(edges):  # a chunk of (senders, receivers) -> (C, H)
        s, r = edges
        return jax.nn.leaky_relu(s_src[s] + s_dst[r], 0.2)

    alpha = foldax.segment_softmax((senders, receivers), receivers, v, fn=logits)  # (E, H)

    def messages(edges):  # a chunk of (senders, alpha) -> (C, H, F)
        s, a = edges
        return a[:, :, None] * z[s]

    return foldax.segment_sum((senders, alpha), receivers, v, fn=messages)  # (V, H, F)


def softmax_jax_ops(logits, receivers, v):
    """Segment softmax with ``jax.ops``: max, shifted exponentials, sum, divide."""
    top = jax.ops.segment_max(logits, receivers, v)
    ex = jnp.exp(logits - top[receivers])
    return ex / jax.ops.segment_sum(ex, receivers, v)[receivers]


def softmax_jraph(logits, receivers, v):
    import jraph

    return jraph.segment_softmax(logits, receivers, v)


def gat_dense(softmax, params, nodes, senders, receivers):
    """The layer as usually written: ``(E, H)`` logits, ``(E, H, F)`` messages, ``jax.ops`` sum."""
    v = nodes.shape[0]
    z, s_src, s_dst = project(params, nodes)
    logits = jax.nn.leaky_relu(s_src[senders] + s_dst[receivers], 0.2)  # (E, H)
    alpha = softmax(logits, receivers, v)
    messages = alpha[:, :, None] * z[senders]  # (E, H, F)
    return jax.ops.segment_sum(messages, receivers, v)


def ways():
    """The layer written the ways compared (label -> ``layer(params, nodes, senders, receivers)``)."""
    out = {
        "foldax": gat_foldax,
        "jax.ops": lambda *a: gat_dense(softmax_jax_ops, *a),
    }
    if HAS_JRAPH:
        out["jraph.segment_softmax"] = lambda *a: gat_dense(softmax_jraph, *a)
    return out


def loss_of(layer):
    """A scalar loss of the layer's output (what a training step differentiates)."""
    return lambda params, *graph: jnp.mean(jnp.tanh(layer(params, *graph)) ** 2)


def make_graph(v, e, f_in, seed=0):
    """Random node features ``(V, f_in)`` and ``E`` random edges, unsorted, some nodes with
    none incoming."""
    rng = np.random.default_rng(seed)
    nodes = jnp.asarray(rng.standard_normal((v, f_in)), jnp.float32)
    senders = jnp.asarray(rng.integers(0, v, e), jnp.int32)
    receivers = jnp.asarray(rng.integers(0, v, e), jnp.int32)
    return nodes, senders, receivers


def rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def timed_in_turns(fns, args, repeats):
    """Median seconds of each compiled ``fn(*args)``, after a warm-up, the functions in turns."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(ts) for label, ts in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="small sizes, about 10 s")
    parser.add_argument("--nodes", type=int, default=20_000, help="V")
    parser.add_argument("--edges", type=int, default=400_000, help="E")
    parser.add_argument("--heads", type=int, default=4, help="H")
    parser.add_argument("--features", type=int, default=32, help="F per head (and f_in)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each way")
    args = parser.parse_args(argv)
    v, e, heads, feat, repeats = args.nodes, args.edges, args.heads, args.features, args.repeats
    if args.smoke:
        v, e, heads, feat, repeats = 500, 5_000, 2, 8, 2
    print(f"GAT layer, V = {v:,} nodes, E = {e:,} edges, H = {heads} heads of F = {feat}")
    missing = "not installed (pip install -e '.[examples]')"
    print(f"jraph: {'installed' if HAS_JRAPH else missing}")
    graph = make_graph(v, e, feat)
    params = init_params(jax.random.key(0), feat, heads, feat)
    args = (params, *graph)
    compile_ = lambda fn: jax.jit(fn).lower(*args).compile()  # noqa: E731
    fwd = {label: compile_(layer) for label, layer in ways().items()}
    grad = {label: compile_(jax.grad(loss_of(layer))) for label, layer in ways().items()}

    out, g = fwd["foldax"](*args), grad["foldax"](*args)
    ok = True
    for label in list(fwd)[1:]:
        ev, eg = rel_err(out, fwd[label](*args)), rel_err(g, grad[label](*args))
        ok &= ev < 1e-5 and eg < 1e-4
        print(f"  foldax vs {label}: output rel. error {ev:.1e}, gradient {eg:.1e}")
    print(f"agreement check: {'passed' if ok else 'FAILED'}")

    for kind, fns in (("forward", fwd), ("gradient", grad)):
        times = timed_in_turns(fns, args, repeats)
        print(f"{kind} (XLA temp memory, median time of {repeats}):")
        for label, fn in fns.items():
            temp = report_from_compiled(fn).temp_bytes
            print(f"  {label:22s} {format_bytes(temp):>9s}  {times[label] * 1000:9.1f} ms")
    if not ok:
        sys.exit("foldax's GAT layer disagrees with the jax.ops one")


if __name__ == "__main__":
    main()
