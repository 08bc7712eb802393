"""Benchmarks for foldax's segment reductions; writes BENCHMARKS.md.

    .venv/bin/python benchmarks/run.py            # everything (~10 min on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # smaller repeats

Every ratio is measured side by side in one run: median of several repeats after a warm-up.
Memory is XLA's compiled temp-buffer estimate (``foldax.memory.report``), which is deterministic.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax import _workloads as w
from foldax.memory import format_bytes, report

COMMAND = "python benchmarks/run.py"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores visible, jax {jax.__version__} "
        f"({jax.default_backend()}), numpy {np.__version__}, Python {platform.python_version()}"
    )


def seed_table(repeat, ways, repeats, log):
    problem = w.seed_problem(repeat=repeat)
    log(f"seed workload N x {repeat} = {problem.n:,} rows: float64 reference ...")
    ref = w.reference(problem)
    rows = w.measure_seed(
        problem, ways=ways, repeats=repeats, ref=ref, progress=lambda m: log(f"  {m}")
    )
    return problem, rows


def precomputed(n, segments, repeats, log):
    """segment_logsumexp of n float32 values in `segments` unequal contiguous segments."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 2 * n // segments, segments)
    sizes = (sizes * (n / sizes.sum())).astype(np.int64)
    sizes[-1] += n - sizes.sum()
    ids = np.repeat(np.arange(segments, dtype=np.int32), sizes)
    x = jnp.asarray(rng.standard_normal(n, dtype=np.float32))
    ids_j = jnp.asarray(ids)
    sizes_l = sizes.tolist()

    def floor(x):
        return jnp.exp(x).sum()

    def jax_ops(x, ids):
        m = jax.ops.segment_max(x, ids, segments, indices_are_sorted=True)
        s = jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, segments, indices_are_sorted=True)
        return m + jnp.log(s)

    def fold(x):
        return foldax.segment_logsumexp(x, sizes=sizes_l)

    out = {}
    for name, fn, args in (
        ("floor: jnp.exp(x).sum()", floor, (x,)),
        ("jax.ops segment_max + segment_sum", jax_ops, (x, ids_j)),
        ("foldax.segment_logsumexp", fold, (x,)),
    ):
        log(f"  precomputed: {name}")
        jf = jax.jit(fn)
        out[name] = (w.median_time(jf, *args, repeats=repeats), report(fn, *args).temp_bytes)
    got = np.asarray(jax.jit(fold)(x), np.float64)
    xs = np.asarray(x, np.float64)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    want = np.array(
        [
            np.log(np.exp(xs[a:b] - xs[a:b].max()).sum()) + xs[a:b].max()
            for a, b in itertools.pairwise(offs)
        ]
    )
    err = w.max_rel_err(got, want)
    return out, err


def s4_md(rows):
    base = {(r["n"], r["pass_"]): r for r in rows if r["way"] == "naive broadcast"}
    lines = [
        "| N | way | pass | XLA temp memory | median time | time / naive | max rel err vs complex128 |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = base[r["n"], r["pass_"]]
        lines.append(
            f"| {r['n']} | {r['way']} | {r['pass_']} | {format_bytes(r['temp_bytes'])} | "
            f"{r['seconds'] * 1e3:.1f} ms | {r['seconds'] / b['seconds']:.2f} | {r['rel_err']:.1e} |"
        )
    return lines


def gaussian(n, repeats, log):
    """Gaussian-kernel sum and logsumexp, M = N = n, D = 3, float32: dense XLA, foldax, pykeops."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, 3), dtype=np.float32)
    y = rng.standard_normal((n, 3), dtype=np.float32)
    xj, yj = jnp.asarray(x), jnp.asarray(y)

    def sq(a, b):
        return jnp.sum((a - b) ** 2)

    impls = {
        "sum": {
            "dense XLA": lambda x, y: jnp.exp(-((x[:, None] - y[None]) ** 2).sum(-1)).sum(1),
            "foldax": lambda x, y: foldax.pairwise_reduce(lambda a, b: jnp.exp(-sq(a, b)), x, y),
        },
        "logsumexp": {
            "dense XLA": lambda x, y: jax.nn.logsumexp(-((x[:, None] - y[None]) ** 2).sum(-1), 1),
            "foldax": lambda x, y: foldax.pairwise_reduce(
                lambda a, b: -sq(a, b), x, y, reduction="logsumexp"
            ),
        },
    }
    # float64 reference, 1000 rows of x at a time
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    ref = {"sum": [], "logsumexp": []}
    for s in range(0, n, 1000):
        d = -((x64[s : s + 1000, None] - y64[None]) ** 2).sum(-1)
        m = d.max(1, keepdims=True)
        ref["sum"].append(np.exp(d).sum(1))
        ref["logsumexp"].append((m + np.log(np.exp(d - m).sum(1, keepdims=True)))[:, 0])
    ref = {k: np.concatenate(v) for k, v in ref.items()}
    try:
        from pykeops.numpy import LazyTensor

        X, Y = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :])
        D2 = ((X - Y) ** 2).sum(-1)
        impls["sum"]["pykeops (CPU)"] = lambda: (-D2).exp().sum(1)[:, 0]
        impls["logsumexp"]["pykeops (CPU)"] = lambda: (-D2).logsumexp(1)[:, 0]
        keops_note = None
    except ImportError:
        keops_note = "pykeops: skipped (not installed; `pip install -e '.[keops]'` brings it)"
    rows = []
    for red, fns in impls.items():
        for name, fn in fns.items():
            log(f"  gaussian {red}: {name}")
            if name.startswith("pykeops"):
                fn()  # the first call compiles (seconds)
                secs = w.median_time(fn, repeats=repeats)
                got, temp = fn(), None
            else:
                jf = jax.jit(fn)
                secs = w.median_time(jf, xj, yj, repeats=repeats)
                got, temp = jf(xj, yj), report(fn, xj, yj).temp_bytes
            rows.append((red, name, secs, temp, w.max_rel_err(got, ref[red])))
    return rows, keops_note


def attention(m, n, d, repeats, log):
    """Softmax-weighted sum (exact attention) against jax.nn.dot_product_attention, float32."""
    rng = np.random.default_rng(3)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((m, d), (n, d), (n, d))
    )
    scale = 1.0 / np.sqrt(d)

    def fold_att(q, k, v):
        return foldax.pairwise_reduce(
            lambda qi, kv: (jnp.dot(qi, kv[0]) * scale, kv[1]), q, (k, v), reduction="softmax"
        )

    def xla_att(q, k, v):
        return jax.nn.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None])[
            0, :, 0
        ]

    ref = np.asarray(jax.jit(xla_att)(q, k, v), np.float64)
    rows = []
    for name, fn in (("jax.nn.dot_product_attention", xla_att), ("foldax softmax", fold_att)):
        log(f"  attention: {name}")
        jf = jax.jit(fn)
        g = jax.jit(jax.grad(lambda q, k, v, f=fn: f(q, k, v).sum(), argnums=(0, 1, 2)))
        rows.append(
            (
                name,
                w.median_time(jf, q, k, v, repeats=repeats),
                report(fn, q, k, v).temp_bytes,
                w.median_time(g, q, k, v, repeats=repeats),
                report(
                    jax.grad(lambda q, k, v, f=fn: f(q, k, v).sum(), argnums=(0, 1, 2)), q, k, v
                ).temp_bytes,
                float(np.max(np.abs(np.asarray(jf(q, k, v)) - ref)) / np.max(np.abs(ref))),
            )
        )
    return rows


def seed_md(title, problem, rows):
    base = {r.pass_: r for r in rows if r.way == "global-max segment_sum"}
    lines = [
        f"### {title}",
        "",
        f"N = {problem.n:,} rows x {w.FEATURES} features, {len(problem.sizes)} segments, "
        f"batch {problem.thetas.shape[0]} theta (vmap), float32.",
        "",
        "| way | pass | XLA temp memory | median time | time / global-max | temp / global-max | max rel err vs float64 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = base[r.pass_]
        lines.append(
            f"| {r.way} | {r.pass_} | {format_bytes(r.temp_bytes)} | {r.seconds * 1e3:.1f} ms | "
            f"{r.seconds / b.seconds:.2f} | {r.temp_bytes / b.temp_bytes:.4f} | {r.rel_err:.1e} |"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller precomputed N")
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 7
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    p1, rows1 = seed_table(1, tuple(w.WAYS), repeats, log)
    # The slicing loop needs one slice per segment: at N x 10 (1230 segments) it takes minutes
    # to compile, so it is left out of that table.
    p10, rows10 = seed_table(10, ("global-max segment_sum", "foldax"), repeats, log)
    n_pre = 5_000_000 if args.quick else 50_000_000
    pre, pre_err = precomputed(n_pre, 1000, repeats, log)

    log("S4 Cauchy kernel sweep")
    s4_rows = w.measure_s4(repeats=repeats, progress=lambda m: log(f"  {m}"))
    n_gauss = 5_000 if args.quick else 20_000
    log(f"Gaussian kernel, M = N = {n_gauss}")
    g_rows, keops_note = gaussian(n_gauss, repeats, log)
    att_n = 1024 if args.quick else 4096
    log(f"attention, M = N = {att_n}, D = 64")
    a_rows = attention(att_n, att_n, 64, repeats, log)

    fx1 = {r.pass_: r for r in rows1 if r.way == "foldax"}
    fx10 = {r.pass_: r for r in rows10 if r.way == "foldax"}
    cmd = COMMAND + (" --quick" if args.quick else "")
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{cmd}` on {time.strftime('%Y-%m-%d')}.",
        f"Machine: {machine()}.",
        "",
        "Memory is XLA's compiled temp-buffer figure from `foldax.memory.report` (deterministic).",
        f"Times are medians of {repeats} runs after a warm-up, all measured in this one run; "
        "ratios compare numbers from the same run.",
        "",
        "## Seed workload: per-segment logsumexp(f(theta, x)) - log(size), vmapped over theta",
        "",
        "Forward is `vmap(per_theta)`; gradient is `vmap(grad(sum . per_theta))` with respect to theta.",
        "",
        *seed_md("N (the seed's exact sizes)", p1, rows1),
        "",
        *seed_md("N x 10 (the sizes repeated 10 times)", p10, rows10),
        "",
        "foldax temp memory from N to N x 10: "
        + ", ".join(
            f"{p} {format_bytes(fx1[p].temp_bytes)} -> {format_bytes(fx10[p].temp_bytes)} "
            f"({fx10[p].temp_bytes / fx1[p].temp_bytes - 1:+.1%})"
            for p in ("forward", "gradient")
        )
        + ".",
        "",
        f"## Precomputed data: segment_logsumexp of {n_pre:,} float32 values, 1000 unequal segments",
        "",
        "| implementation | median time | x floor | XLA temp memory |",
        "|---|---:|---:|---:|",
    ]
    floor_t = pre["floor: jnp.exp(x).sum()"][0]
    for name, (t, temp) in pre.items():
        lines.append(f"| {name} | {t * 1e3:.1f} ms | {t / floor_t:.2f} | {format_bytes(temp)} |")
    lines += ["", f"foldax max relative error against float64: {pre_err:.1e}.", ""]
    lines += [
        f"## S4's Cauchy kernel: H = {w.S4_H} channels, L = {w.S4_L}, complex64",
        "",
        "Forward: `k = cauchy(v, z, w)`, `(H, L)`. Gradient: of `sum |k|^2` w.r.t. `(v, z, w)`.",
        "`naive broadcast` forms `v[:, None, :] / (z[None, :, None] - w[:, None, :])`;",
        "`vmap-style (report)` is the seed report's per-N function vmapped over L and H.",
        "",
        *s4_md(s4_rows),
        "",
    ]
    fx = {(r["n"], r["pass_"]): r["temp_bytes"] for r in s4_rows if r["way"] == "foldax.cauchy"}
    lines += [
        "foldax temp memory, N = 512 over N = 64: "
        + ", ".join(f"{p} {fx[512, p] / fx[64, p]:.2f}x" for p in ("forward", "gradient"))
        + ".",
        "",
        f"## Gaussian kernel, M = N = {n_gauss:,}, D = 3, float32",
        "",
        "`sum_j exp(-|x_i - y_j|^2)` and `logsumexp_j(-|x_i - y_j|^2)`.",
        "",
        "| reduction | implementation | median time | time / foldax | XLA temp memory | max rel err vs float64 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    fold_t = {red: secs for red, name, secs, _, _ in g_rows if name == "foldax"}
    for red, name, secs, temp, err in g_rows:
        tmp = "n/a" if temp is None else format_bytes(temp)
        lines.append(
            f"| {red} | {name} | {secs * 1e3:.1f} ms | {secs / fold_t[red]:.2f} | {tmp} | {err:.1e} |"
        )
    if keops_note:
        lines += ["", keops_note + "."]
    lines += [
        "",
        f"## Exact attention, M = N = {att_n}, D = 64, float32",
        "",
        '`pairwise_reduce(..., reduction="softmax")` with kernel `(q.k / sqrt(D), v)` against '
        "`jax.nn.dot_product_attention` (XLA implementation on CPU). Gradient: of the output's sum.",
        "",
        "| implementation | forward | forward temp | gradient | gradient temp | max abs err / max abs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ft, fm, gt, gm, err in a_rows:
        lines.append(
            f"| {name} | {ft * 1e3:.1f} ms | {format_bytes(fm)} | {gt * 1e3:.1f} ms | "
            f"{format_bytes(gm)} | {err:.1e} |"
        )
    lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    log(f"wrote {args.out}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
