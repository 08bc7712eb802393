"""Eager segment_sum with new segment ids on every call (a loop over graph batches), against
jax.ops.segment_sum, in turns in one process: the median per-call time over the turns (each
turn after a warm-up, with ids never seen before), and the growth of host memory (RSS) over
one turn's calls. Also the same ids on every call, and an eager jax.vmap over 16 graphs. Each
case runs in a process of its own (a fresh heap: memory another case freed would hide growth).

python dev/eager/fresh_ids.py            # a few minutes on 2 CPU cores
PYTHONPATH=<a checkout>/src python dev/eager/fresh_ids.py   # another version, to compare
TURNS=3 python dev/eager/fresh_ids.py 10000   # fewer turns, one size
"""

import gc
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax

S = 1_000
TURNS = int(os.environ.get("TURNS", 5))
RNG = np.random.default_rng(0)


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def new_ids(n, sorted_, count):
    """``count`` new jax.Arrays of ids (never seen before: new objects, new values)."""
    out = []
    for _ in range(count):
        a = RNG.integers(0, S, n).astype(np.int32)
        out.append(jnp.asarray(np.sort(a) if sorted_ else a))
    return jax.block_until_ready(out)


def per_call(f, x, idss):
    """Mean seconds per call of ``f(x, ids)`` over ``idss``, each result waited for."""
    t0 = time.perf_counter()
    for ids in idss:
        jax.block_until_ready(f(x, ids))
    return (time.perf_counter() - t0) / len(idss)


def ours(x, ids):
    return foldax.segment_sum(x, ids, S)


def theirs(x, ids):
    return jax.ops.segment_sum(x, ids, S)


def fresh(n, sorted_, calls):
    """Per-call ms of both with new ids each call (median over the turns), and the RSS growth
    (MB) over the first turn of foldax's calls."""
    x = jnp.asarray(RNG.standard_normal(n), jnp.float32)
    for f in (ours, theirs):  # warm-up: this shape compiled, the ids read once
        per_call(f, x, new_ids(n, sorted_, 2))
    times, grew = {ours: [], theirs: []}, None
    for _ in range(TURNS):
        for f in (ours, theirs):
            idss = new_ids(n, sorted_, calls)
            gc.collect()
            before = rss_mb()
            times[f].append(per_call(f, x, idss))
            if f is ours and grew is None:  # (the ids themselves were there before)
                gc.collect()
                grew = rss_mb() - before
    return [1e3 * statistics.median(times[f]) for f in (ours, theirs)], grew


def same(n, sorted_, calls):
    """Per-call ms of both with the same ids on every call (median over the turns)."""
    x = jnp.asarray(RNG.standard_normal(n), jnp.float32)
    (ids,) = new_ids(n, sorted_, 1)
    idss = [ids] * calls
    times = {ours: [], theirs: []}
    for f in (ours, theirs):
        per_call(f, x, idss[:2])
    for _ in range(TURNS):
        for f in (ours, theirs):
            times[f].append(per_call(f, x, idss))
    return [1e3 * statistics.median(times[f]) for f in (ours, theirs)]


def batched(n, graphs, fresh_ids, calls=10):
    """Per-call ms of an eager jax.vmap over ``graphs`` graphs, from the second call (the
    same ids every call, or new ones with ``fresh_ids``)."""
    xs = jnp.asarray(RNG.standard_normal((graphs, n)), jnp.float32)
    one = jnp.stack(new_ids(n, False, graphs))
    stacks = [jnp.stack(new_ids(n, False, graphs)) if fresh_ids else one for _ in range(calls)]
    fs = {g: jax.vmap(g) for g in (ours, theirs)}  # (eager: each call is traced anew)
    times = {ours: [], theirs: []}
    for f in fs.values():
        jax.block_until_ready(f(xs, one))
    for _ in range(TURNS):
        for g, f in fs.items():
            times[g].append(per_call(f, xs, stacks))
    return [1e3 * statistics.median(times[g]) for g in (ours, theirs)]


def row(label, ms, extra=""):
    a, b = ms
    print(f"{label:<48} foldax {a:8.3f} ms   jax.ops {b:8.3f} ms   {a / b:5.2f}x{extra}")


def case(kind, n, flag):
    """One case, in this process: ``flag`` is whether the ids are sorted (``"fresh"``,
    ``"same"``) or new on every call (``"vmap"``)."""
    label = "sorted" if flag else "unsorted"
    if kind == "fresh":
        calls = 100 if n <= 100_000 else 20
        ms, grew = fresh(n, flag, calls)
        row(f"new ids each call, N = {n:,}, {label}", ms, f"   RSS +{grew:.1f} MB / {calls} calls")
    elif kind == "same":
        row(f"same ids each call, N = {n:,}, {label}", same(n, flag, 20))
    else:
        ids = "new ids" if flag else "same ids"
        row(f"vmap over 16 graphs, N = {n:,}, {ids}", batched(n, 16, flag))


def main(sizes):
    print(f"jax {jax.__version__}, {jax.default_backend()}, S = {S}, median of {TURNS} turns")
    cases = [(k, n, f) for n in sizes for f in (True, False) for k in ("fresh", "same")]
    cases += [("vmap", 10_000, f) for f in (False, True)]
    for kind, n, flag in cases:
        argv = [sys.executable, __file__, "--case", kind, str(n), str(int(flag))]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        print(out.stdout.strip() or out.stderr.strip()[-2000:], flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        case(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        main([int(a) for a in sys.argv[1:]] or [10_000, 1_000_000])
