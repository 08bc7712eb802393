"""Benchmarks for foldax's segment reductions; writes BENCHMARKS.md.

    .venv/bin/python benchmarks/run.py            # everything (~5 min on 2 cores)
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
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    log(f"wrote {args.out}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
