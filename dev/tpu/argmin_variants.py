# ruff: noqa: E731
"""On a TPU: what a kernel's nearest-point reduction costs, by how it keeps its state. Each
variant is a small Pallas kernel over the same ``(N, N)`` squared distances of 3-D points
(``|x|^2 + |y|^2 - 2 x y^T``, blocks of 1024 x 1024, ``y``'s axis innermost); they differ
only in what a tile adds to each row's state:

  min:        the row min (one float reduction across lanes per tile);
  argmin_i32: the min, then the first column attaining it (an int32 reduction);
  argmin_f32: the same with the column as float32 (exact below 2^24);
  lanes_min / lanes_argmin: a (1024, 128) state, one per lane, updated by selects over the
              tile's 128-lane chunks in column order (no reduction across lanes until the last
              tile; the first index wins ties lane by lane, then across lanes).

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/argmin_variants.py [N]

Prints each variant's median time and checks its indices against ``jnp.argmin`` of blocks.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BM = BN = 1024
LANES = 128
BIG = 3.0e38


def _distances(x_ref, yt_ref):
    x, yt = x_ref[...], yt_ref[...]  # (BM, 8), (8, BN); features past 3 are zero
    xx = jnp.sum(x * x, axis=1, keepdims=True)
    yy = jnp.sum(yt * yt, axis=0, keepdims=True)
    return xx + yy - 2 * jnp.dot(x, yt, preferred_element_type=jnp.float32)


def _started(m_ref, i_ref):
    """The step along ``y``; at the first, the state's identity."""
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, BIG, jnp.float32)
        i_ref[...] = jnp.zeros(i_ref.shape, jnp.float32)

    return j


def _finished(j, m_out, i_out, result):
    """At the last step, each row's ``result()`` ``(min, index)`` written out."""

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        best, first = result()
        m_out[...] = jnp.broadcast_to(best, m_out.shape)
        i_out[...] = jnp.broadcast_to(first, i_out.shape)


def _per_row(kind):
    def kernel(x_ref, yt_ref, m_out, i_out, m_ref, i_ref):
        j = _started(m_ref, i_ref)

        d = _distances(x_ref, yt_ref)
        m = jnp.min(d, axis=1, keepdims=True)  # (BM, 1)
        better = m < m_ref[...]
        if kind != "min":
            if kind == "argmin_i32":
                col = lax_iota(jnp.int32) + j * BN
                at = jnp.min(jnp.where(d == m, col, 2**30), axis=1, keepdims=True)
                at = at.astype(jnp.float32)
            else:
                col = lax_iota(jnp.float32) + (j * BN).astype(jnp.float32)
                at = jnp.min(jnp.where(d == m, col, BIG), axis=1, keepdims=True)
            i_ref[...] = jnp.where(better, at, i_ref[...])
        m_ref[...] = jnp.where(better, m, m_ref[...])

        _finished(j, m_out, i_out, lambda: (m_ref[...], i_ref[...]))

    return kernel, (BM, 1)


def lax_iota(dtype):
    return jax.lax.broadcasted_iota(jnp.int32, (1, BN), 1).astype(dtype)  # (Mosaic: int iota)


def _lanes(kind):
    def kernel(x_ref, yt_ref, m_out, i_out, m_ref, i_ref):
        j = _started(m_ref, i_ref)

        d = _distances(x_ref, yt_ref)
        m, at = m_ref[...], i_ref[...]
        lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1) + j * BN
        lane = lane.astype(jnp.float32)
        for c in range(BN // LANES):
            chunk = d[:, c * LANES : (c + 1) * LANES]
            better = chunk < m
            m = jnp.where(better, chunk, m) if kind == "lanes_argmin" else jnp.minimum(chunk, m)
            if kind == "lanes_argmin":
                at = jnp.where(better, lane + c * LANES, at)
        m_ref[...], i_ref[...] = m, at

        def across():
            best = jnp.min(m, axis=1, keepdims=True)
            return best, jnp.min(jnp.where(m == best, at, BIG), axis=1, keepdims=True)

        _finished(j, m_out, i_out, across)

    return kernel, (BM, LANES)


VARIANTS = {
    "min": _per_row("min"),
    "argmin_i32": _per_row("argmin_i32"),
    "argmin_f32": _per_row("argmin_f32"),
    "lanes_min": _lanes("lanes_min"),
    "lanes_argmin": _lanes("lanes_argmin"),
}


@functools.partial(jax.jit, static_argnames="kind")
def nearest(x, yt, kind):
    n = x.shape[0]
    kernel, state = VARIANTS[kind]
    out = jax.ShapeDtypeStruct((n, LANES), jnp.float32)
    m, i = pl.pallas_call(
        kernel,
        grid=(n // BM, n // BN),
        in_specs=[
            pl.BlockSpec((BM, 8), lambda i, j: (i, 0)),
            pl.BlockSpec((8, BN), lambda i, j: (0, j)),
        ],
        out_specs=[pl.BlockSpec((BM, LANES), lambda i, j: (i, 0))] * 2,
        out_shape=[out, out],
        scratch_shapes=[pltpu.VMEM(state, jnp.float32)] * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=jax.default_backend() != "tpu",
    )(x, yt)
    return m[:, 0], i[:, 0].astype(jnp.int32)


def main(n):
    rng = np.random.default_rng(0)
    pts = lambda: np.pad(rng.standard_normal((n, 3)).astype(np.float32), ((0, 0), (0, 5)))
    x, y = jnp.asarray(pts()), jnp.asarray(pts())
    yt = y.T
    d = lambda xb: (
        jnp.sum(xb * xb, 1)[:, None] + jnp.sum(y * y, 1)[None] - 2 * xb @ y.T
    )  # (the reference's own rounding differs: indices agree where the min is unique)
    want = jax.jit(lambda x: jax.lax.map(lambda b: jnp.argmin(d(b), 1), x.reshape(-1, BM, 8)))(x)
    want = np.asarray(want).reshape(-1)
    print(jax.devices()[0].device_kind, jax.__version__, f"N={n}", flush=True)
    import foldax

    sq = lambda a, b: jnp.sum((a - b) ** 2)
    for r, impl in [(r, i) for r in ("min", "argmin") for i in (None, "pallas")]:
        # the engine's kernel for the same points (asked for: its states per lane)
        f = jax.jit(
            lambda x, y, r=r, i=impl: foldax.pairwise_reduce(
                sq, x[:, :3], y[:, :3], reduction=r, implementation=i
            )
        )
        jax.block_until_ready(f(x, y))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, y))
            ts.append(time.perf_counter() - t0)
        print(f"  foldax {r} ({impl or 'as chosen'}): {np.median(ts) * 1e3:.2f} ms", flush=True)
    for kind in VARIANTS:
        try:
            t0 = time.perf_counter()
            jax.block_until_ready(nearest(x, yt, kind))
            first = time.perf_counter() - t0
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                jax.block_until_ready(nearest(x, yt, kind))
                ts.append(time.perf_counter() - t0)
            _, idx = nearest(x, yt, kind)
            same = float(np.mean(np.asarray(idx) == want))
            note = "" if kind.endswith("min") and "arg" not in kind else f", indices {same:.4f}"
            print(f"  {kind}: {np.median(ts) * 1e3:.2f} ms (1st {first:.1f} s{note})", flush=True)
        except Exception as e:  # (a variant Mosaic refuses: the others still run)
            print(f"  {kind}: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 98_304)
