"""Gaussian kernel sum ``out[i] = sum_j exp(-|x_i - x_j|^2) b[j]`` as Pallas TPU kernels of several
formulations, timed against ``lax.map`` baselines, errors against a float64 reference.

    python dev/tpu/gauss_variants.py [--n 98304] [--variants a,b] [--blocks 512x1024,...] [--ks 32]
    python dev/tpu/gauss_variants.py --interpret --n 2048      # CPU correctness check

Grid (N//bi, N//bj), ("parallel", "arbitrary"); (bi, 128) lane partial sums in VMEM, written as
lanes of a (1, N) output at the last j step. x rows as (N, 8) (coordinates in columns 0..2), y as
(8, N), b as (1, N). ``_rK``: a loop over row chunks of K inside the tile. Writes
``$OUT/gauss_variants.json`` (else ./gauss_variants.json)."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32, BF16 = jnp.float32, jnp.bfloat16
HI = lax.Precision.HIGHEST
KA = 16  # contraction width of the augmented operands [x, |x|^2, 1] (5 used)
KS = 32  # contraction width of the bf16 split operands (24 used); --ks changes it
PAIRS = [(0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1)]  # (x part, y part): hi=0 mid=1 lo=2


def lmap(x, b, precision=None, rows=1024):
    nx = jnp.sum(x * x, axis=1)

    def block(xb):
        d = jnp.sum(xb * xb, axis=1)[:, None] + nx[None] - 2 * jnp.dot(xb, x.T, precision=precision)
        return jnp.dot(jnp.exp(-d), b, precision=precision)

    return lax.map(block, x.reshape(-1, rows, 3)).reshape(-1)


def dist_vpu(x, y):
    """x (r, 8) rows, y (8, c) columns -> (r, c) squared distances, coordinate by coordinate."""
    t = [x[:, k : k + 1] - y[k : k + 1, :] for k in range(3)]
    return t[0] * t[0] + t[1] * t[1] + t[2] * t[2]


def fold_lanes(q):
    """(r, c) -> (r, 128): sum of the 128-lane column slabs (VPU adds, no cross-lane work)."""
    return sum((q[:, s : s + 128] for s in range(128, q.shape[1], 128)), q[:, :128])


def for_rows(bi, rows, body):
    """body(row index) once over the whole tile, or over chunks of `rows` rows."""
    if rows is None or rows >= bi:
        return body(slice(None))

    def step(r, carry):
        body(pl.ds(pl.multiple_of(r * rows, rows), rows))
        return carry

    lax.fori_loop(0, bi // rows, step, 0)


def trunc_bf16(a):
    """a's low 16 bits cleared: exact in bf16 (no compiler may skip it as excess precision)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.int32) & -65536, F32)


def split3(a):  # hi + mid + lo == a exactly (each exact in bf16)
    hi = trunc_bf16(a)
    mid = trunc_bf16(a - hi)
    return hi, mid, a - hi - mid


def split_masks(ks, e2=False):
    """lm (8, ks): rows 0-2 pick x_k, 3 |x|^2, 4 one, 5-7 part hi/mid/lo, per LHS column.
    rm (ks, 8): columns 0-2 pick -2 y_k, 3 one, 4 |y|^2, 5-7 part, per RHS row.
    e2: the values scaled by -log2(e) before the split, so that the matmul gives -d log2(e)."""
    lm, rm = np.zeros((8, ks), np.float32), np.zeros((ks, 8), np.float32)
    s = -np.log2(np.e) if e2 else 1.0
    for c in range(3):
        for t, (px, py) in enumerate(PAIRS):
            k = 6 * c + t
            lm[c, k], lm[5 + px, k], rm[k, c], rm[k, 5 + py] = 1, 1, -2 * s, 1
    for p in range(3):
        lm[3, 18 + p], lm[5 + p, 18 + p], rm[18 + p, 3], rm[18 + p, 5] = s, 1, 1, 1
        lm[4, 21 + p], lm[5, 21 + p], rm[21 + p, 4], rm[21 + p, 5 + p] = 1, 1, s, 1
    return jnp.asarray(lm), jnp.asarray(rm)


def weight(d, e2):  # exp(-d), d the matmul's output (scaled by -log2(e) where e2)
    return jnp.exp2(d) if e2 else jnp.exp(-d)


def build_lhs(x, c, m):
    """x (r, 8), centre c (1, 8), masks m (8, K) -> (r, K) bf16 split LHS."""
    xc = x - c
    cols = [xc[:, k : k + 1] for k in range(3)]
    nx = cols[0] * cols[0] + cols[1] * cols[1] + cols[2] * cols[2]
    a = cols[0] * m[0:1] + cols[1] * m[1:2] + cols[2] * m[2:3] + nx * m[3:4] + m[4:5]
    hi, mid, lo = split3(a)
    return (hi * m[5:6] + mid * m[6:7] + lo * m[7:8]).astype(BF16)


def build_rhs(y, c, m):
    """y (8, c), centre c (8, 1), masks m (K, 8) -> (K, c) bf16 split RHS."""
    yc = y - c
    rows = [yc[k : k + 1, :] for k in range(3)]
    ny = rows[0] * rows[0] + rows[1] * rows[1] + rows[2] * rows[2]
    a = rows[0] * m[:, 0:1] + rows[1] * m[:, 1:2] + rows[2] * m[:, 2:3] + m[:, 3:4] + ny * m[:, 4:5]
    hi, mid, lo = split3(a)
    return (hi * m[:, 5:6] + mid * m[:, 6:7] + lo * m[:, 7:8]).astype(BF16)


SPECS = {  # how an input is blocked: kind -> (block shape, index map), given its shape
    "i": lambda s, bi, bj: ((bi, s[1]), lambda i, j: (i, 0)),  # rows of the i block
    "iT": lambda s, bi, bj: ((s[0], bi), lambda i, j: (0, i)),  # lanes of the i block
    "j": lambda s, bi, bj: ((s[0], bj), lambda i, j: (0, j)),  # lanes of the j block
    "jr": lambda s, bi, bj: ((bj, s[1]), lambda i, j: (j, 0)),  # rows of the j block
    "c": lambda s, bi, bj: (s, lambda i, j: (0, 0)),  # the whole (small) array
}


def pallas_sum(tile, ins, n, bi, bj, interpret, scratch=(), init=None):
    """tile(in_refs, scratch_refs, acc_ref) adds (bi, 128) partial sums into acc_ref;
    init(in_refs, scratch_refs) runs at j == 0 (per i block)."""
    n_in = len(ins)

    def kernel(*refs):
        in_refs, o_ref, acc, extra = refs[:n_in], refs[n_in], refs[n_in + 1], refs[n_in + 2 :]
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _():
            acc[...] = jnp.zeros(acc.shape, F32)
            if init is not None:
                init(in_refs, extra)

        tile(in_refs, extra, acc)

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            o_ref[...] = jnp.sum(acc[...].T, axis=0, keepdims=True)  # (bi,128)->(128,bi)->(1,bi)

    out = pl.pallas_call(
        kernel,
        grid=(n // bi, n // bj),
        in_specs=[pl.BlockSpec(*SPECS[k](a.shape, bi, bj)) for a, k in ins],
        out_specs=pl.BlockSpec((1, bi), lambda i, j: (0, i)),
        out_shape=jax.ShapeDtypeStruct((1, n), F32),
        scratch_shapes=[pltpu.VMEM((bi, 128), F32), *scratch],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=64 * 2**20
        ),
        interpret=interpret,
    )(*[a for a, _ in ins])
    return out[0]


def host_xyb(x, b):
    xs = jnp.pad(x, ((0, 0), (0, 5)))  # (N, 8)
    return xs, xs.T, b[None, :]  # (N, 8), (8, N), (1, N)


def v_vpu_vpu(x, b, bi, bj, interpret, rows=None):
    xs, yt, br = host_xyb(x, b)

    def tile(refs, extra, acc):
        x_ref, y_ref, b_ref = refs
        y, bv = y_ref[...], b_ref[...]

        def body(rs):
            acc[rs, :] += fold_lanes(jnp.exp(-dist_vpu(x_ref[rs, :], y)) * bv)

        for_rows(bi, rows, body)

    return pallas_sum(tile, [(xs, "i"), (yt, "j"), (br, "j")], x.shape[0], bi, bj, interpret)


def v_vpu_mxu(x, b, bi, bj, interpret, precision=None):
    xs, yt, _ = host_xyb(x, b)
    bm = jnp.zeros((x.shape[0], 128), F32).at[:, 0].set(b)  # b in column 0

    def tile(refs, extra, acc):
        x_ref, y_ref, b_ref = refs
        p = jnp.exp(-dist_vpu(x_ref[...], y_ref[...]))
        acc[...] += jnp.dot(p, b_ref[...], precision=precision, preferred_element_type=F32)

    return pallas_sum(tile, [(xs, "i"), (yt, "j"), (bm, "jr")], x.shape[0], bi, bj, interpret)


def v_mxu_aug(x, b, bi, bj, interpret, dtype=F32):
    """d = [x, |x|^2, 1] @ [-2y; 1; |y|^2] as one matmul (f32 HIGHEST, or bf16 one pass)."""
    nx, one = jnp.sum(x * x, axis=1, keepdims=True), jnp.ones((x.shape[0], 1), F32)
    zero = jnp.zeros((x.shape[0], KA - 5), F32)
    xa = jnp.concatenate([x, nx, one, zero], 1)  # (N, KA)
    ya = jnp.concatenate([-2 * x, one, nx, zero], 1).T  # (KA, N)
    precision = HI if dtype == F32 else None

    def tile(refs, extra, acc):
        xa_ref, ya_ref, b_ref = refs
        d = jnp.dot(xa_ref[...], ya_ref[...], precision=precision, preferred_element_type=F32)
        acc[...] += fold_lanes(jnp.exp(-d) * b_ref[...])

    ins = [(xa.astype(dtype), "i"), (ya.astype(dtype), "j"), (b[None, :], "j")]
    return pallas_sum(tile, ins, x.shape[0], bi, bj, interpret)


def v_split(x, b, bi, bj, interpret, rows=None, e2=False):
    """bf16 hi/mid/lo split operands built in the kernel, centred on the i block's first point:
    the LHS once per i block (j == 0, cached in VMEM), the RHS per step, d from one matmul."""
    xs, yt, br = host_xyb(x, b)
    lm, rm = split_masks(KS, e2)

    def init(refs, extra):
        x_ref, lm_ref = refs[0], refs[4]
        extra[0][...] = build_lhs(x_ref[...], x_ref[0:1, :], lm_ref[...])

    def tile(refs, extra, acc):
        _, xt_ref, y_ref, b_ref, _, rm_ref = refs
        rhs, bv = build_rhs(y_ref[...], xt_ref[:, 0:1], rm_ref[...]), b_ref[...]

        def body(rs):
            d = jnp.dot(extra[0][rs, :], rhs, preferred_element_type=F32)
            acc[rs, :] += fold_lanes(weight(d, e2) * bv)

        for_rows(bi, rows, body)

    ins = [(xs, "i"), (yt, "iT"), (yt, "j"), (br, "j"), (lm, "c"), (rm, "c")]
    scratch = [pltpu.VMEM((bi, KS), BF16)]
    return pallas_sum(tile, ins, x.shape[0], bi, bj, interpret, scratch=scratch, init=init)


def v_split_host(x, b, bi, bj, interpret, e2=False):
    """The same split operands built once on the host, without centring."""
    xs, yt, br = host_xyb(x, b)
    lm, rm = split_masks(KS, e2)
    lhs = build_lhs(xs, jnp.zeros((1, 8), F32), lm)  # (N, KS) bf16
    rhs = build_rhs(yt, jnp.zeros((8, 1), F32), rm)  # (KS, N) bf16

    def tile(refs, extra, acc):
        l_ref, r_ref, b_ref = refs
        d = jnp.dot(l_ref[...], r_ref[...], preferred_element_type=F32)
        acc[...] += fold_lanes(weight(d, e2) * b_ref[...])

    return pallas_sum(tile, [(lhs, "i"), (rhs, "j"), (br, "j")], x.shape[0], bi, bj, interpret)


BASELINES = {"lmap_default": lmap, "lmap_highest": partial(lmap, precision=HI)}
VARIANTS = {
    "vpu_vpu": v_vpu_vpu,
    "vpu_vpu_r64": partial(v_vpu_vpu, rows=64),
    "vpu_mxu": v_vpu_mxu,
    "vpu_mxu_highest": partial(v_vpu_mxu, precision=HI),
    "mxu_split_vpu": v_split,
    "mxu_split_vpu_r128": partial(v_split, rows=128),
    "mxu_split_host": v_split_host,
    "mxu_split_vpu_e2": partial(v_split, e2=True),
    "mxu_split_host_e2": partial(v_split_host, e2=True),
    "mxu_f32_vpu": v_mxu_aug,
    "mxu_bf16_vpu": partial(v_mxu_aug, dtype=BF16),
}
BLOCKS = [(512, 1024), (1024, 1024), (1024, 2048), (256, 2048)]


def reference(x, b, rows):
    """float64 sums and sum_j |exp(-d) b_j| for the given rows."""
    x64, bb = x.astype(np.float64), np.stack([b, np.abs(b)], 1).astype(np.float64)
    out = []
    for ch in np.array_split(rows, max(1, len(rows) * len(x) // 2**22)):
        out.append(np.exp(-((x64[ch, None, :] - x64[None, :, :]) ** 2).sum(-1)) @ bb)
    return np.concatenate(out).T


def measure(f, args, reps, interpret):
    def call():
        t0 = time.perf_counter()
        return jax.block_until_ready(f(*args)), time.perf_counter() - t0

    out, first = call()  # compile + first run
    if interpret:
        return out, first, None
    call()
    return out, first, float(np.median([call()[1] for _ in range(reps)]))


def run_one(name, bi, bj, x, b, check, a):
    """One (variant, block): time it and check it; an error is recorded, not raised."""
    row = {"variant": name, "bi": bi, "bj": bj}
    try:
        fn = BASELINES.get(name) or partial(VARIANTS[name], bi=bi, bj=bj, interpret=a.interpret)
        out, first, med = measure(jax.jit(fn), (x, b), a.reps, a.interpret)
        rows, ref, den = check
        err = float(np.max(np.abs(np.asarray(out, np.float64)[rows] - ref) / den))
        row.update(time_s=med, first_s=first, rel_err=err)
        ms = "-" if med is None else f"{1e3 * med:.3f}"
        msg = f"{ms:>10s} {first:8.2f} {err:9.2e}"
    except Exception as e:  # lowering / compile / runtime
        line = (str(e).strip() or "-").splitlines()[0]
        row.update(error=f"{type(e).__name__}: {line}", error_full=traceback.format_exc()[-6000:])
        msg = f"FAILED {row['error'][:300]}"
    print(f"{name:22s} {bi or '-':>5} {bj or '-':>5} {msg}", flush=True)
    return row


def main():
    global KS
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=98304)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ks", type=int, default=KS, help="padded K of the split operands (>= 24)")
    ap.add_argument("--variants", default="", help="comma list (default: all, baselines too)")
    ap.add_argument("--blocks", default="", help="e.g. 512x1024,1024x2048")
    a = ap.parse_args()
    KS, n = a.ks, a.n
    if a.interpret:
        jax.config.update("jax_platforms", "cpu")
    blocks = [tuple(map(int, s.split("x"))) for s in a.blocks.split(",") if s]
    blocks = blocks or ([(256, 512)] if a.interpret else BLOCKS)
    names = [s for s in a.variants.split(",") if s] or [*BASELINES, *VARIANTS]

    rng = np.random.default_rng(0)
    x_np = (0.3 * rng.standard_normal((n, 3))).astype(np.float32)
    b_np = rng.standard_normal(n).astype(np.float32)
    rows = np.sort(rng.choice(n, size=min(256, n), replace=False))
    check = (rows, *reference(x_np, b_np, rows))
    x, b = jnp.asarray(x_np), jnp.asarray(b_np)

    dev = jax.devices()[0].device_kind
    res = dict(device=dev, jax=jax.__version__, n=n, ks=KS, interpret=a.interpret, rows=[])
    path = os.path.join(os.environ.get("OUT", "."), "gauss_variants.json")
    print(f"# {dev} jax {jax.__version__} n={n} ks={KS} interpret={a.interpret}", flush=True)
    print(f"{'variant':22s} {'bi':>5s} {'bj':>5s} {'median_ms':>10s} {'first_s':>8s} rel_err")
    for name in names:
        ok = [bk for bk in blocks if n % bk[0] == 0 and n % bk[1] == 0]
        for bi, bj in [(None, None)] if name in BASELINES else ok:
            res["rows"].append(run_one(name, bi, bj, x, b, check, a))
            with open(path, "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
