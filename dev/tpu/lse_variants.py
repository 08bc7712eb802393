# ruff: noqa: E731
"""On a TPU: a segment log-sum-exp's gradient (E rows of F features into V segments, sorted ids)
by the ways its rows' weights could be gathered, against ``jax.ops``' program (which keeps the
forward's exponentials). Each way compiled once, then the median of 7 calls; writes
``$OUT/lse_variants.json``.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/lse_variants.py [E,V,F]

Ways (``foldax._engine._direct``'s ``lse_gather`` replaced for the run): ``foldax`` (its own
on this platform: on a TPU the max gathered as the forward gathers it, which XLA computes
once; elsewhere ``jax.ops``' program, the exponentials and sums made as the forward makes
them), ``two gathers`` (the shift and the scale apart), ``the forward's gather`` (the TPU's form, on any platform), ``side by side``
(shift and scale as one array of rows twice as wide, one gather), and with ``LSE_ALL=1``
``the forward's exponentials`` (the forward's whole expression, gather and exponential).
With ``LSE_REFERENCE=1`` each way's gradient is also compared with a float64 one computed on
the host at the rows of 2,000 sampled segments (``max_err_vs_float64``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._engine import _direct

OUT = os.environ.get("OUT", "/tmp")
E, V, F = map(int, (sys.argv[1] if len(sys.argv) > 1 else "4000000,400000,128").split(","))
finite = lambda a: jnp.where(jnp.isfinite(a), a, jnp.zeros_like(a))


def _scale(m, rel, g):
    g = g.astype(rel.dtype)
    scale = jnp.where((m > -jnp.inf) & (g != 0), g * jnp.exp(-rel), jnp.zeros_like(rel))
    return jnp.where((m == jnp.inf) & (g != 0), jnp.full_like(rel, jnp.nan), scale)


def _finish(ix, x, a, e, m_r, scale_r):
    live = ~jnp.isnan(m_r) & (scale_r != 0) & (a != -jnp.inf)
    live = live if ix.in_range else live & ix.keep(x.ndim)
    return (), (), (jnp.where(live, e * scale_r, jnp.zeros_like(e)).astype(x.dtype),)


def forward_gather(ix, slots, rows):
    x, (m, rel, g) = rows[0], slots
    m_r, scale_r = ix.at_rows(m), ix.at_rows(_scale(m, rel, g))
    shift_r = jnp.where(m_r == -jnp.inf, jnp.zeros_like(m_r), m_r)
    a = x - shift_r
    return _finish(ix, x, a, jnp.exp(a), m_r, scale_r)


def forward_exp(ix, slots, rows):
    x, (m, rel, g) = rows[0], slots
    m_r, scale_r = ix.at_rows(m), ix.at_rows(_scale(m, rel, g))
    e = jnp.exp(x - finite(m_r))
    a = jnp.where((m_r == jnp.inf) & (x != jnp.inf), -jnp.inf, x)
    return _finish(ix, x, a, e, m_r, scale_r)


def side_by_side(ix, slots, rows):
    x, (m, rel, g) = rows[0], slots
    shift = jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)
    both = ix.at_rows(jnp.stack([shift, _scale(m, rel, g)], axis=-1))
    shift_r, scale_r = both[..., 0], both[..., 1]
    a = x - shift_r
    return _finish(ix, x, a, jnp.exp(a), shift_r, scale_r)


def two_gathers(ix, slots, rows):
    x, (m, rel, g) = rows[0], slots
    shift = jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)
    shift_r, scale_r = ix.at_rows(shift), ix.at_rows(_scale(m, rel, g))
    a = x - shift_r
    return _finish(ix, x, a, jnp.exp(a), shift_r, scale_r)


def reference(x, ids, w, count=2000, seed=1):
    """``(rows, grads)``: the gradient at the rows of ``count`` segments, in float64 on the host."""
    pick = np.sort(np.random.default_rng(seed).choice(V, count, replace=False))
    start, stop = np.searchsorted(ids, pick), np.searchsorted(ids, pick, side="right")
    rows = np.concatenate([np.arange(a, b) for a, b in zip(start, stop, strict=True)])
    x64 = x[rows].astype(np.float64)
    seg = ids[rows]
    m = np.full((V, F), -np.inf)
    np.maximum.at(m, seg, x64)
    tot = np.zeros((V, F))
    np.add.at(tot, seg, np.exp(x64 - m[seg]))
    with np.errstate(divide="ignore"):  # (segments not sampled: log 0)
        lse = m + np.log(tot)
    return rows, w[seg].astype(np.float64) * np.exp(x64 - lse[seg])


def inputs(e, v, f):
    """``(x (e, f), sorted ids (e,), weights (v, f))`` in NumPy, the same for every script."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((e, f)).astype(np.float32)
    ids = np.sort(rng.integers(0, v, e)).astype(np.int32)
    return x, ids, rng.standard_normal((v, f)).astype(np.float32)


def main():
    x_np, ids_np, w_np = inputs(E, V, F)
    x, ids, w = jnp.asarray(x_np), jnp.asarray(ids_np), jnp.asarray(w_np)
    ref = reference(x_np, ids_np, w_np) if os.environ.get("LSE_REFERENCE") else None

    def plain(x, i):
        m = jax.lax.stop_gradient(jax.ops.segment_max(x, i, V, indices_are_sorted=True))
        e = jnp.exp(x - m[i])
        return m + jnp.log(jax.ops.segment_sum(e, i, V, indices_are_sorted=True))

    ours = lambda x, i: foldax.segment_logsumexp(x, i, V, indices_are_sorted=True)
    grad = lambda f: jax.grad(lambda x, i: jnp.sum(f(x, i) * w))
    tables = (_direct._LOWER, _direct._LOWER_ON_TPU)
    saved = [t["lse_gather"] for t in tables]
    real = saved[1] if jax.default_backend() == "tpu" else saved[0]
    ways = {
        "jax.ops": (plain, None),
        "foldax": (ours, real),
        "two gathers": (ours, two_gathers),
        "the forward's gather": (ours, forward_gather),
        "side by side": (ours, side_by_side),
    }
    if os.environ.get("LSE_ALL"):
        ways["the forward's exponentials"] = (ours, forward_exp)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "E,V,F": [E, V, F]}
    want = None
    for way, (f, lower) in ways.items():
        for t in tables:
            t["lse_gather"] = lower or real
        try:
            t0 = time.perf_counter()
            g = jax.jit(grad(f)).lower(x, ids).compile()
            compile_s = time.perf_counter() - t0
        finally:
            for t, f in zip(tables, saved, strict=True):
                t["lse_gather"] = f
        got = jax.block_until_ready(g(x, ids))
        want = got if want is None else want
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            jax.block_until_ready(g(x, ids))
            ts.append(time.perf_counter() - t0)
        results[way] = {
            "ms": float(np.median(ts)) * 1e3,
            "compile_s": compile_s,
            "temp_mib": g.memory_analysis().temp_size_in_bytes / 2**20,
            "max_diff_from_jax_ops": float(jnp.max(jnp.abs(got - want))),
        }
        if ref is not None:  # against float64 on the host, at the rows of sampled segments
            err = np.abs(np.asarray(got)[ref[0]].astype(np.float64) - ref[1])
            results[way]["max_err_vs_float64"] = float(np.max(err))
            results[way]["nan"] = bool(np.isnan(err).any())
        print(way, results[way], flush=True)
        with open(os.path.join(OUT, "lse_variants.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
