# ruff: noqa: E731
"""On a TPU: where two slow workloads spend their time, in variants the engine could take.
One process; writes ``$OUT/breakdown.json`` and prints a table.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/breakdown.py [SECTION ...]

SECTIONs:
  knn_whole: k nearest (k = 10, 784 dimensions) as blocks of every column, one top-k per
    block (the engine's ``whole_rows`` plan forced to 16 / 128 / 1024 rows), against a
    ``lax.map`` of a GEMM distance block and ``lax.top_k`` (``KNN_SIZES=M,N,D``);
  knn_compile: where the k-NN's compile time goes, part by part (``KNN_SIZES``);
  chamfer_parts: the vmapped Chamfer gradient of 4 pairs of 98k points, whole; without its
    pass over three-way ties; its forward folds alone (``CHAMFER_N`` points); with the kernels
    asked for (``implementation="pallas"``: the extrema's states per lane).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import run

import foldax
from foldax._engine import _primitive

results = run.results
sq = lambda a, b: jnp.sum((a - b) ** 2)


def save():
    with open(os.path.join(run.OUT, "breakdown.json"), "w") as fh:
        json.dump(results, fh, indent=1)


def compiled_row(name, ways, args, reps=7):
    """Like ``run.row``, for ways ``(f, rows)``: each compiled with the engine's blocks of
    every column forced to ``rows`` rows (``None``: as chosen), held while it compiles (a
    TPU lowers the fold when the program compiles, after tracing)."""
    out = {"name": name}
    for way, (f, rows) in ways.items():
        real = _primitive.whole_rows
        if rows is not None:
            _primitive.whole_rows = lambda spec, avals, r=rows: min(r, spec.plan.num_slots)
        try:
            t0 = time.perf_counter()
            g = jax.jit(lambda *a, f=f: f(*a)).lower(*args).compile()  # (a new trace)
            first = time.perf_counter() - t0
        finally:
            _primitive.whole_rows = real
        jax.block_until_ready(g(*args))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(g(*args))
            ts.append(time.perf_counter() - t0)
        temp = g.memory_analysis().temp_size_in_bytes / 2**20
        out[way] = {"ms": float(np.median(ts)) * 1e3, "first_s": first, "temp_mib": temp}
        out[way]["indices"] = g(*args)[1]
    want = out["lax.map"]["indices"]
    for way in ways:
        got = out[way].pop("indices")
        out[way]["same_indices_as_lax_map"] = float(jnp.mean(got == want))
    results["rows"].append(out)
    print(name + ": " + " | ".join(
        f"{w}: {v['ms']:.2f} ms (compile {v['first_s']:.1f} s, temp {v['temp_mib']:.1f} MiB, "
        f"indices {v['same_indices_as_lax_map']:.4f})"
        for w, v in out.items() if w != "name"
    ), flush=True)  # fmt: skip
    save()


def knn_whole():
    m, n, d = map(int, os.environ.get("KNN_SIZES", "10240,60000,784").split(","))
    q, data = run.normal((m, d)), run.normal((n, d))
    ours = lambda q, x: foldax.pairwise_reduce(sq, q, x, reduction="kmin", k=10)

    def lmap(q, x, block=1024):
        def one(qb):
            dist = jnp.sum(qb**2, 1)[:, None] + jnp.sum(x**2, 1)[None] - 2 * qb @ x.T
            neg, idx = jax.lax.top_k(-dist, 10)
            return -neg, idx

        out = jax.lax.map(one, q.reshape(-1, block, d))
        return jax.tree.map(lambda a: a.reshape(m, 10), out)

    ways = {"lax.map": (lmap, None), "foldax": (ours, None)}
    for rows in (16, 128, 1024):
        ways[f"whole {rows}"] = (ours, rows)
    compiled_row(f"knn k=10 {m}x{n} D={d}", ways, (q, data))


def knn_compile():
    """Where the k-NN's compile time goes (``KNN_SIZES=M,N,D``): trace and lower, then compile,
    of the whole k-NN, of its candidates' k-min fold alone (the matrix-product form), of the
    whole without the re-fold of the rows it cannot certify, and of the exact kernel's plain
    k-min fold (what that re-fold is), against the ``lax.map`` way."""
    from foldax._pairwise import _distances
    from foldax._reductions import KMin

    m, n, d = map(int, os.environ.get("KNN_SIZES", "10240,60000,784").split(","))
    q, data = run.normal((m, d)), run.normal((n, d))
    hi = jax.lax.Precision.HIGHEST
    approx = lambda a, b: jnp.sum(a * a) + jnp.sum(b * b) - 2 * jnp.dot(a, b, precision=hi)
    unmatched = lambda a, b: jnp.sum(jnp.abs(a - b) ** 2)  # the same values, not recognized
    knn = lambda kernel, k=10, **kw: (
        lambda q, x: foldax.pairwise_reduce(kernel, q, x, reduction="kmin", k=k, **kw)
    )

    def lmap(q, x, block=1024):
        def one(qb):
            dist = jnp.sum(qb**2, 1)[:, None] + jnp.sum(x**2, 1)[None] - 2 * qb @ x.T
            return jax.lax.top_k(-dist, 10)

        return jax.lax.map(one, q.reshape(-1, block, d))

    real = _distances._certified
    ways = {  # way: (function, the k-min kernel's tile, a replacement of _certified)
        "lax.map": (lmap, None, None),
        "whole": (knn(sq), None, None),
        "candidates (k-min of the product form, k=18)": (knn(approx, 18), None, None),
        "plain k-min fold of the exact kernel": (knn(unmatched), None, None),
        "plain k-min fold, XLA": (knn(unmatched, implementation="xla"), None, None),
        "whole without the re-fold": (knn(sq), None, _no_refold(real)),
        "whole, the re-fold by the XLA loop": (knn(sq), None, _xla_refold(real)),
    }
    for tile in ((128, 512), (128, 256), (256, 256)):
        ways[f"candidates, k-min kernel tile {tile}"] = (knn(approx, 18), tile, None)
        ways[f"whole, k-min kernel tile {tile}"] = (knn(sq), tile, None)
        ways[f"whole, tile {tile}, the re-fold by the XLA loop"] = (
            knn(sq), tile, _xla_refold(real))  # fmt: skip
    chosen = os.environ.get("KNN_COMPILE_WAYS")
    if chosen:
        ways = {w: v for w, v in ways.items() if w in chosen.split(";")}
    out = {"name": f"knn compile {m}x{n} D={d}"}
    tile0 = KMin.kernel_tile
    for way, (f, tile, certified) in ways.items():
        KMin.kernel_tile = tile or tile0
        _distances._certified = certified or real
        try:
            t0 = time.perf_counter()
            lowered = jax.jit(lambda *a, f=f: f(*a)).lower(q, data)
            t1 = time.perf_counter()
            g = lowered.compile()
            t2 = time.perf_counter()
        except Exception as e:
            out[way] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(way, out[way], flush=True)
            continue
        finally:
            _distances._certified, KMin.kernel_tile = real, tile0
        jax.block_until_ready(g(q, data))
        t3 = time.perf_counter()
        jax.block_until_ready(g(q, data))
        out[way] = {
            "lower_s": t1 - t0,
            "compile_s": t2 - t1,
            "ms": (time.perf_counter() - t3) * 1e3,
        }
        print(f"{way}: trace+lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s, "
              f"a call {out[way]['ms']:.1f} ms", flush=True)  # fmt: skip
    results["rows"].append(out)
    save()


def _xla_refold(real):
    """``_certified`` with its re-fold of the rows not certified by the XLA loop."""
    from foldax import _engine

    def certified(conv, consts, x, y, mon, approx, plain, leaves):
        def xla(*args, **kwargs):
            with _engine.implementation("xla"):
                return plain(*args, **kwargs)

        return real(conv, consts, x, y, mon, approx, xla, leaves)

    return certified


def _no_refold(real):
    """``_certified`` of a k-min without its re-fold of the rows not certified (zeros in their
    place: for timing the compile only)."""

    def certified(conv, consts, x, y, mon, approx, plain, leaves):
        def zeros(mon, consts, x, y, mask, rows_first=False):
            m = jax.tree.leaves(x)[0].shape[0]
            return (jnp.zeros((m, mon.k), jnp.float32), jnp.zeros((m, mon.k), jnp.int32)), mon

        return real(conv, consts, x, y, mon, approx, zeros, leaves)

    return certified


def chamfer(x, y):
    near = lambda a, b: foldax.pairwise_reduce(sq, a, b, reduction="min")
    return jnp.mean(near(x, y)) + jnp.mean(near(y, x))


def clouds():
    """4 pairs of ``CHAMFER_N`` (98,304) 3-D points: ``(n, xs, ys)``."""
    n = int(os.environ.get("CHAMFER_N", "98304"))
    return n, run.normal((4, n, 3)), run.normal((4, n, 3))


def chamfer_parts():
    from foldax._reductions import _base, _extremum

    n, xs, ys = clouds()

    def deriv_forward(x, y):  # the folds a gradient's forward runs: the indices kept
        far = lambda a, b: foldax.pairwise_reduce(sq, a, b, reduction="argmin")
        return far(x, y), far(y, x)

    grad = jax.vmap(jax.value_and_grad(chamfer, (0, 1)))

    def no_ties(x, y):
        owners = (_base._ValuesAndIndices, _extremum._ExtremumAndIndex)
        saved = [(c, c.streamed_rows) for c in owners]
        for c, _ in saved:
            c.streamed_rows = lambda self, info: None
        try:
            return grad(x, y)
        finally:
            for c, f in saved:
                c.streamed_rows = f

    ways = {
        "value_and_grad": grad,
        "value_and_grad, kernels asked for": run.with_impl("pallas", grad),  # (the tie pass's too)
        "without the tie pass": no_ties,
        "forward": jax.vmap(chamfer),
        "argmin both ways": jax.vmap(deriv_forward),
    }
    run.row(f"chamfer parts 4 pairs N={n}", ways, (xs, ys))
    save()


def chamfer_buffers():
    """The largest buffers live at the peak of the Chamfer gradient (``foldax.memory.audit``)."""
    n, xs, ys = clouds()
    report = foldax.memory.audit(jax.vmap(jax.value_and_grad(chamfer, (0, 1))), xs, ys, top=14)
    print(report, flush=True)
    results["rows"].append({"name": f"chamfer buffers 4 pairs N={n}", "audit": str(report)})
    save()


SECTIONS = {
    "knn_whole": knn_whole,
    "chamfer_parts": chamfer_parts,
    "chamfer_buffers": chamfer_buffers,
    "knn_compile": knn_compile,
}

if __name__ == "__main__":
    print(results["device"], jax.__version__, results.get("libtpu"), flush=True)
    for name in [a for a in sys.argv[1:] if a in SECTIONS] or list(SECTIONS):
        SECTIONS[name]()
