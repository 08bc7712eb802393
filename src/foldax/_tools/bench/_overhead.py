"""The ``overhead`` workload of ``foldax bench``: what a call costs beside its work (eager and
jitted call latency, compile time), foldax against the op a user would otherwise call."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ._config import Config
from ._measure import _point_clouds, _row, _sq
from ._progress import Progress


def _overhead_calls(n, cfg):
    """``(case, foldax_fn, peer_fn, args)`` per call measured for its overhead."""
    import foldax

    rng = np.random.default_rng(5)
    s = max(10, n // 100)
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, s, n)), jnp.int32)
    pts = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)

    def lse_peer(x):  # the usual stable way: per-segment max, then a shifted sum
        m = jax.ops.segment_max(x, ids, s, indices_are_sorted=True)
        e = jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, s, indices_are_sorted=True)
        return m + jnp.log(e)

    def dense_min(p):
        return jnp.min(jnp.sum((p[:, None] - p[None]) ** 2, -1), axis=1)

    def dense_kmin(p):
        return jax.lax.top_k(-jnp.sum((p[:, None] - p[None]) ** 2, -1), 5)

    def seg(name):
        return lambda x: getattr(foldax, name)(x, ids, s, indices_are_sorted=True)

    def peer(name):
        return lambda x: getattr(jax.ops, name)(x, ids, s, indices_are_sorted=True)

    size = f"N = {n:,}"
    return [
        (f"segment_sum, {size}, S = {s:,} (jax.ops.segment_sum)", seg("segment_sum"),
         peer("segment_sum"), (x,)),
        (f"segment_max, {size}, S = {s:,} (jax.ops.segment_max)", seg("segment_max"),
         peer("segment_max"), (x,)),
        (f"segment_logsumexp, {size}, S = {s:,} (jax.ops max + shifted sum)",
         seg("segment_logsumexp"), lse_peer, (x,)),
        (f"pairwise min, M = N = {min(n, cfg.overhead_pairs):,}, D = 3 (dense jnp.min)",
         lambda p: foldax.pairwise_reduce(_sq, p, p, reduction="min"), dense_min,
         (pts[: cfg.overhead_pairs],)),
        (f"pairwise kmin, k = 5, M = N = {min(n, cfg.overhead_pairs):,}, D = 3 (dense lax.top_k)",
         lambda p: foldax.pairwise_reduce(_sq, p, p, reduction="kmin", k=5), dense_kmin,
         (pts[: cfg.overhead_pairs],)),
    ]  # fmt: skip


#: The calls of ``_overhead_calls`` at each size.
_CALLS_PER_SIZE = 5
#: The steps of each call at each size: eager call, jitted call, compile.
_STEPS_PER_CALL = 3
#: Compile-only cases: (name, reductions).
_COMPILE_ONLY = ("min", "argmin", "kmin", "ragged forward", "ragged gradient")


def overhead_steps(cfg) -> int:
    """The progress steps of ``bench_overhead``: every call at every size, then the
    compile-only cases."""
    return len(cfg.overhead_sizes) * _CALLS_PER_SIZE * _STEPS_PER_CALL + len(_COMPILE_ONLY)


def _compile_seconds(make, args, repeats):
    """Median seconds (a ``workloads.Timing``, with its spread) to trace, lower and compile
    ``jax.jit(make())`` for ``args`` (a new function each time, so no cache is hit)."""
    from .. import workloads as w

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.jit(make()).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return w.Timing(times)


def _eager_and_jitted(case, f, g, args, cfg, prog):
    """Eager and jitted call latency (in turns) and compile time of ``f`` (foldax) and ``g``."""
    from .. import workloads as w

    rows = []
    for label, wrap in (("eager call", lambda h: h), ("jitted call", jax.jit)):
        prog.step(f"overhead {case}: {label}")
        fs, gs = wrap(f), wrap(g)
        calls = {
            "foldax": functools.partial(fs, *args),
            "without foldax": functools.partial(gs, *args),
        }
        times = w.median_times(calls, repeats=max(cfg.repeats, 5) * 3, warmup=2)
        rows += [_row("overhead", case, k, label, None, t, None) for k, t in times.items()]
    prog.step(f"overhead {case}: compile")
    for name, h in (("foldax", f), ("without foldax", g)):
        secs = _compile_seconds(lambda h=h: lambda *a: h(*a), args, max(1, cfg.repeats // 2))
        rows.append(_row("overhead", case, name, "compile", None, secs, None))
    return rows


def _compile_cases(cfg):
    """``(case, pass, {impl: (make, args)})`` for the compile-only rows: the nearest-neighbour
    reductions at the bench's size against the dense program, the ragged logsumexp under vmap
    against the global-max segment_sum program."""
    import foldax

    from .. import workloads as w

    n = cfg.gauss_n
    _, _, xj, yj = _point_clouds(n, seed=3)
    d2 = lambda x, y: jnp.sum((x[:, None] - y[None]) ** 2, -1)  # noqa: E731
    dense = {
        "min": lambda x, y: jnp.min(d2(x, y), 1),
        "argmin": lambda x, y: jnp.argmin(d2(x, y), 1),
        "kmin": lambda x, y: jax.lax.top_k(-d2(x, y), 5)[1],
    }
    kw = {"min": {}, "argmin": {}, "kmin": {"k": 5}}
    out = []
    for red in ("min", "argmin", "kmin"):

        def fold(red=red):
            return lambda x, y: foldax.pairwise_reduce(_sq, x, y, reduction=red, **kw[red])

        case = f"nearest {red}{', k = 5' if red == 'kmin' else ''}, M = N = {n:,} (dense XLA)"

        def plain(red=red):  # a new function each time: no cache of JAX's is hit
            return lambda x, y: dense[red](x, y)

        impls = {"foldax": (fold, (xj, yj)), "without foldax": (plain, (xj, yj))}
        out.append((case, "compile", impls))
    problem = w.seed_problem(shrink=cfg.overhead_shrink)
    args = (problem.thetas, problem.x)
    for p, i in (("forward", 0), ("gradient", 1)):
        impls = {
            name: (lambda way=way, i=i: w.forward_and_grad(w.WAYS[way](problem.sizes))[i], args)
            for name, way in (("foldax", "foldax"), ("without foldax", "global-max segment_sum"))
        }
        case = f"ragged logsumexp under vmap, N = {problem.n:,}, {p} (global-max segment_sum)"
        out.append((case, "compile", impls))
    return out


def bench_overhead(cfg: Config, prog: Progress) -> list[dict]:
    """What a call costs beside its work: eager and jitted call latency and compile time, foldax
    against the op a user would otherwise call, in turns in this one process."""
    rows = []
    for n in cfg.overhead_sizes:
        for case, f, g, args in _overhead_calls(n, cfg):
            rows += _eager_and_jitted(case, f, g, args, cfg, prog)
    for case, pass_, impls in _compile_cases(cfg):
        prog.step(f"overhead {case}")
        for name, (make, args) in impls.items():
            secs = _compile_seconds(make, args, max(1, cfg.repeats // 2))
            rows.append(_row("overhead", case, name, pass_, None, secs, None))
    return rows
