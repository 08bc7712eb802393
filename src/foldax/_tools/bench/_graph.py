"""The ``graph`` workload of ``foldax bench``: a graph network's message reductions -- ``E``
messages reduced to ``V`` receiver nodes, the most common use of segment reductions in JAX
(jraph, GNN code, point-cloud pooling) -- against the ``jax.ops`` program a user would write
(for the softmax, jraph's: max, gather, exp, sum, gather, divide)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..._memory import report
from ._config import Config
from ._measure import _row
from ._progress import Progress

PEER = "jax.ops (jraph's way)"


def _jraph_softmax(x, ids, v, sorted_):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, v, indices_are_sorted=sorted_))
    e = jnp.exp(x - m[ids])
    return e / jax.ops.segment_sum(e, ids, v, indices_are_sorted=sorted_)[ids]


def _jax_ops_log_softmax(x, ids, v, sorted_):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, v, indices_are_sorted=sorted_))
    d = x - m[ids]
    return d - jnp.log(jax.ops.segment_sum(jnp.exp(d), ids, v, indices_are_sorted=sorted_))[ids]


def _peer(reduction):
    if reduction == "softmax":
        return _jraph_softmax
    if reduction == "log_softmax":
        return _jax_ops_log_softmax
    f = getattr(jax.ops, f"segment_{reduction}")
    return lambda x, ids, v, sorted_: f(x, ids, v, indices_are_sorted=sorted_)


def _ours(reduction, layout, sizes):
    import foldax

    f = getattr(foldax, f"segment_{reduction}")
    if layout == "sizes":
        return lambda x, ids, v, sorted_: f(x, sizes=sizes)
    return lambda x, ids, v, sorted_: f(x, ids, v, indices_are_sorted=sorted_)


def graph_cases(cfg: Config):
    """``(reduction, features, layout)`` of each case."""
    return [
        ("sum", 64, "unsorted ids"),
        ("sum", 64, "sorted ids"),
        ("sum", 64, "sizes"),
        ("sum", 1, "unsorted ids"),
        ("max", 64, "unsorted ids"),
        ("max", 64, "sizes"),
        ("max", 1, "unsorted ids"),
        ("softmax", 8, "unsorted ids"),
        ("softmax", 8, "sizes"),
        ("log_softmax", 8, "unsorted ids"),
    ]


def bench_graph(cfg: Config, prog: Progress) -> list[dict]:
    e, v = cfg.graph
    rng = np.random.default_rng(4)
    unsorted = rng.integers(0, v, e).astype(np.int32)
    ordered = np.sort(unsorted)
    sizes = np.bincount(ordered, minlength=v)
    rows = []
    for reduction, feat, layout in graph_cases(cfg):
        case = f"{reduction}, F = {feat}, {layout}"
        prog.step(f"graph {case}")
        ids = jnp.asarray(unsorted if layout == "unsorted ids" else ordered)
        x = jnp.asarray(rng.standard_normal((e, feat)), jnp.float32)
        impls = {"foldax": _ours(reduction, layout, sizes), PEER: _peer(reduction)}
        sorted_ = layout != "unsorted ids"
        calls = {k: functools.partial(f, v=v, sorted_=sorted_) for k, f in impls.items()}
        rows += _measure_case(cfg, case, calls, x, ids, rng)
    return rows


def _measure_case(cfg, case, calls, x, ids, rng):
    """Forward and gradient rows of one case: every way timed in turns, its temp, its error
    against the peer's forward."""
    from .. import workloads as w

    want = np.asarray(jax.jit(calls[PEER])(x, ids))
    wgt = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    # the cotangent's weights an argument, as a training step's are: closed over, they are a
    # constant of the program (XLA:TPU took minutes to compile over one of 2 GB)
    passes = {
        "forward": (calls, (x, ids)),
        "gradient": (
            {k: jax.grad(lambda x, i, wgt, f=f: jnp.sum(f(x, i) * wgt)) for k, f in calls.items()},
            (x, ids, wgt),
        ),
    }
    rows = []
    for pass_, (fns, args) in passes.items():
        jitted = {k: jax.jit(f) for k, f in fns.items()}
        secs = w.median_times(
            {k: functools.partial(f, *args) for k, f in jitted.items()}, repeats=cfg.repeats
        )
        for name, f in fns.items():
            err = (
                w.max_rel_err(np.asarray(jitted[name](*args)), want) if pass_ == "forward" else None
            )
            temp = report(f, *args).temp_bytes
            e, v = cfg.graph
            rows.append(_row("graph", case, name, pass_, temp, secs[name], err, edges=e, nodes=v))
    return rows
