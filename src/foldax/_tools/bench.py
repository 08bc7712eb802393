"""``foldax bench``: every headline number, side by side with each peer that is installed.

One run measures every workload (memory from XLA's compiled analysis, median times after a
warm-up, errors against float64 / complex128), writes ``results.json`` with every figure and
the machine, renders ``BENCHMARKS.md`` and the plots *from that JSON*, and, when the output
folder's ``README.md`` has the results markers, its "Results" block too. Ratios always compare
numbers measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._memory import format_bytes, report

WORKLOADS = ("seed", "precomputed", "s4", "gaussian", "nearest", "attention", "overhead", "sharded")
README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"
PLOT_DIR = "bench"


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one run (``FULL`` or ``QUICK``)."""

    repeats: int
    seed_cases: tuple  # (repeat, shrink, with the slicing loop)
    precomputed_n: int
    s4_ns: tuple
    s4_h: int
    s4_l: int
    gauss_n: int
    att_n: int
    sharded: tuple  # (repeat, shrink)
    overhead_pairs: int = 4000  # M = N of the pairwise call whose overhead is measured


FULL = Config(
    7, ((1, 1, True), (10, 1, False)), 50_000_000, (64, 256, 512), 256, 1024, 20_000, 4096, (10, 1)
)
QUICK = Config(
    2, ((1, 10, True), (1, 1, False)), 2_000_000, (32, 128), 32, 256, 2_000, 512, (1, 10), 2000
)


# ----------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A one-line progress bar on stderr: steps done / total, the step, elapsed time."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        self.stream = stream or sys.stderr

    def step(self, what: str) -> None:
        self.done = min(self.done + 1, self.total)
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        secs = time.perf_counter() - self.t0
        print(
            f"[{bar}] {self.done:3d}/{self.total} {secs:6.0f} s  {what}",
            file=self.stream,
            flush=True,
        )

    def note(self, what: str) -> None:
        print(
            f"{'':>{24 + 2}} {'':>7} {time.perf_counter() - self.t0:6.0f} s  {what}",
            file=self.stream,
            flush=True,
        )


def _steps(cfg: Config, only) -> int:
    from . import workloads as w

    count = {
        "seed": sum(2 * (len(w.WAYS) - (0 if loop else 1)) for _, _, loop in cfg.seed_cases),
        "precomputed": 4,
        "s4": len(cfg.s4_ns) * len(w.S4_WAYS) * 2,
        "gaussian": 6,
        "nearest": 6,
        "attention": 6,
        "overhead": len(_OVERHEAD_CALLS) * 3 + len(_COMPILE_ONLY),
        "sharded": 1,
    }
    return sum(count[k] for k in only)


# ----------------------------------------------------------------------------------------------
# Machine and peers


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores visible, jax {m['jax']} ({m['backend']}: {m['device']}), "
        f"numpy {m['numpy']}, Python {m['python']}"
    )


#: peer -> (module to import, the extra that brings it)
PEERS = {
    "torch.segment_reduce": ("torch", ".[torch]"),
    "pykeops": ("pykeops", ".[keops]"),
    "plots (matplotlib)": ("matplotlib", ".[plot]"),
}


def available(peer: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(PEERS[peer][0]) is not None


# ----------------------------------------------------------------------------------------------
# Workloads: each returns a list of row dicts with the same keys


def _row(workload, case, impl, pass_, temp, seconds, err, **extra):
    return {
        "workload": workload,
        "case": case,
        "impl": impl,
        "pass": pass_,
        "temp_bytes": temp,
        "seconds": seconds,
        "rel_err": err,
        **extra,
    }


def bench_seed(cfg: Config, prog: Progress) -> list[dict]:
    from . import workloads as w

    rows = []
    for repeat, shrink, loop in cfg.seed_cases:
        problem = w.seed_problem(repeat=repeat, shrink=shrink)
        case = f"N = {problem.n:,}"
        prog.note(f"seed {case}: float64 reference")
        ref = w.reference(problem)
        ways = [k for k in w.WAYS if loop or k != "slicing loop"]
        for r in w.measure_seed(
            problem,
            ways=ways,
            repeats=cfg.repeats,
            ref=ref,
            progress=lambda m, c=case: prog.step(f"seed {c}: {m}"),
        ):
            rows.append(
                _row(
                    "seed",
                    case,
                    r.way,
                    r.pass_,
                    r.temp_bytes,
                    r.seconds,
                    r.rel_err,
                    n=problem.n,
                    segments=len(problem.sizes),
                )
            )
    return rows


def bench_precomputed(cfg: Config, prog: Progress) -> list[dict]:
    """segment_logsumexp of n precomputed float32 values in 1000 unequal contiguous segments."""
    import foldax

    from . import workloads as w

    n, segments = cfg.precomputed_n, 1000
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 2 * n // segments, segments)
    sizes = (sizes * (n / sizes.sum())).astype(np.int64)
    sizes[-1] += n - sizes.sum()
    ids = np.repeat(np.arange(segments, dtype=np.int32), sizes)
    x_np = rng.standard_normal(n, dtype=np.float32)
    x, ids_j, sizes_l = jnp.asarray(x_np), jnp.asarray(ids), sizes.tolist()
    offs = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.array(
        [np.logaddexp.reduce(x_np[a:b].astype(np.float64)) for a, b in itertools.pairwise(offs)]
    )

    def jax_ops(x, ids):
        m = jax.ops.segment_max(x, ids, segments, indices_are_sorted=True)
        s = jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, segments, indices_are_sorted=True)
        return m + jnp.log(s)

    impls = [
        ("floor: jnp.exp(x).sum()", lambda x: jnp.exp(x).sum(), (x,), False),
        ("jax.ops segment_max + segment_sum", jax_ops, (x, ids_j), True),
        ("foldax", lambda x: foldax.segment_logsumexp(x, sizes=sizes_l), (x,), True),
    ]
    case = f"{n:,} values, {segments} segments"
    rows = []
    for name, fn, args, check in impls:
        prog.step(f"precomputed: {name}")
        jf = jax.jit(fn)
        secs = w.median_time(jf, *args, repeats=cfg.repeats)
        err = w.max_rel_err(jf(*args), ref) if check else None
        rows.append(
            _row("precomputed", case, name, "forward", report(fn, *args).temp_bytes, secs, err)
        )
    prog.step("precomputed: torch.segment_reduce")
    if available("torch.segment_reduce"):
        import torch

        xt, lengths = torch.from_numpy(x_np), torch.from_numpy(sizes)

        def torch_lse():
            m = torch.segment_reduce(xt, "max", lengths=lengths)
            s = torch.segment_reduce(
                torch.exp(xt - torch.repeat_interleave(m, lengths)), "sum", lengths=lengths
            )
            return m + torch.log(s)

        secs = w.median_time(torch_lse, repeats=cfg.repeats)
        err = w.max_rel_err(torch_lse().numpy(), ref)
        rows.append(
            _row("precomputed", case, "torch.segment_reduce max + sum", "forward", None, secs, err)
        )
    return rows


def bench_s4(cfg: Config, prog: Progress) -> list[dict]:
    from . import workloads as w

    out = w.measure_s4(
        ns=cfg.s4_ns,
        repeats=cfg.repeats,
        h=cfg.s4_h,
        length=cfg.s4_l,
        progress=lambda m: prog.step(f"S4 {m}") if "reference" not in m else prog.note(f"S4 {m}"),
    )
    return [
        _row(
            "s4",
            f"N = {r['n']}",
            r["way"],
            r["pass_"],
            r["temp_bytes"],
            r["seconds"],
            r["rel_err"],
            n=r["n"],
            h=cfg.s4_h,
            length=cfg.s4_l,
        )
        for r in out
    ]


def _point_clouds(n, seed):
    """Two clouds of ``n`` points in 3-D, float32: NumPy ``x, y`` and their JAX copies."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3), dtype=np.float32)
    y = rng.standard_normal((n, 3), dtype=np.float32)
    return x, y, jnp.asarray(x), jnp.asarray(y)


def _sq(a, b):
    """Squared distance between two points."""
    return jnp.sum((a - b) ** 2)


def bench_gaussian(cfg: Config, prog: Progress) -> list[dict]:
    """Gaussian-kernel sum and logsumexp, M = N = n, D = 3: dense XLA, foldax, pykeops."""
    import foldax

    from . import workloads as w

    n = cfg.gauss_n
    x, y, xj, yj = _point_clouds(n, seed=2)
    sq = _sq

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
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    ref = {"sum": [], "logsumexp": []}
    for s in range(0, n, 1000):
        d = -((x64[s : s + 1000, None] - y64[None]) ** 2).sum(-1)
        m = d.max(1, keepdims=True)
        ref["sum"].append(np.exp(d).sum(1))
        ref["logsumexp"].append((m + np.log(np.exp(d - m).sum(1, keepdims=True)))[:, 0])
    ref = {k: np.concatenate(v) for k, v in ref.items()}
    if available("pykeops"):
        from pykeops.numpy import LazyTensor

        xl, yl = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :])
        d2 = ((xl - yl) ** 2).sum(-1)
        impls["sum"]["pykeops (CPU)"] = lambda: (-d2).exp().sum(1)[:, 0]
        impls["logsumexp"]["pykeops (CPU)"] = lambda: (-d2).logsumexp(1)[:, 0]
    rows = []
    for red, fns in impls.items():
        for name, fn in fns.items():
            prog.step(f"gaussian {red}: {name}")
            if name.startswith("pykeops"):
                fn()  # the first call compiles (seconds)
                secs = w.median_time(fn, repeats=cfg.repeats)
                got, temp = fn(), None
            else:
                jf = jax.jit(fn)
                secs = w.median_time(jf, xj, yj, repeats=cfg.repeats)
                got, temp = jf(xj, yj), report(fn, xj, yj).temp_bytes
            rows.append(
                _row(
                    "gaussian",
                    f"{red}, M = N = {n:,}",
                    name,
                    "forward",
                    temp,
                    secs,
                    w.max_rel_err(got, ref[red]),
                    reduction=red,
                )
            )
        if "pykeops (CPU)" not in fns:
            prog.step(f"gaussian {red}: pykeops skipped")
    return rows


def bench_nearest(cfg: Config, prog: Progress) -> list[dict]:
    """Nearest neighbours, M = N = n, D = 3: squared distance reduced by ``min``, ``argmin`` and
    ``kmin`` (k = 5), foldax against pykeops (skipped without it). The error column of the index
    rows is the fraction of indices that differ from NumPy's (float64 distances)."""
    import foldax

    from . import workloads as w

    n, k = cfg.gauss_n, 5
    x, y, xj, yj = _point_clouds(n, seed=3)
    sq = _sq

    def fold(red, **kw):
        return lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction=red, **kw)

    impls = {
        "min": {"foldax": fold("min")},
        "argmin": {"foldax": fold("argmin")},
        f"kmin, k = {k}": {"foldax": lambda x, y: fold("kmin", k=k)(x, y)[1]},
    }
    ref = {"min": [], "argmin": [], f"kmin, k = {k}": []}
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for s in range(0, n, 1000):
        d = ((x64[s : s + 1000, None] - y64[None]) ** 2).sum(-1)
        ref["min"].append(d.min(1))
        ref["argmin"].append(d.argmin(1))
        ref[f"kmin, k = {k}"].append(np.argsort(d, axis=1, kind="stable")[:, :k])
    ref = {r: np.concatenate(v) for r, v in ref.items()}
    if available("pykeops"):
        from pykeops.numpy import LazyTensor

        d2 = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
        impls["min"]["pykeops (CPU)"] = lambda: d2.min(1)[:, 0]
        impls["argmin"]["pykeops (CPU)"] = lambda: d2.argmin(1)[:, 0]
        impls[f"kmin, k = {k}"]["pykeops (CPU)"] = lambda: d2.Kmin_argKmin(k, 1)[1]
    rows = []
    for red, fns in impls.items():
        # foldax and pykeops timed in turns (each call of one is followed by one of the other)
        calls = {
            name: (fn if name.startswith("pykeops") else functools.partial(jax.jit(fn), xj, yj))
            for name, fn in fns.items()
        }
        for name in fns:
            prog.step(f"nearest {red}: {name}")
        times = w.median_times(calls, repeats=cfg.repeats)  # warm-up: compiles (seconds)
        for name, fn in fns.items():
            secs, got = times[name], calls[name]()
            temp = None if name.startswith("pykeops") else report(fn, xj, yj).temp_bytes
            got = np.asarray(got)
            err = (
                w.max_rel_err(got, ref[red])
                if red == "min"
                else float(np.mean(got.astype(np.int64) != ref[red]))
            )
            case = f"{red}, M = N = {n:,}"
            rows.append(_row("nearest", case, name, "forward", temp, secs, err, reduction=red))
        if "pykeops (CPU)" not in fns:
            prog.step(f"nearest {red}: pykeops skipped")
    return rows


def bench_attention(cfg: Config, prog: Progress) -> list[dict]:
    """Softmax-weighted sum (exact attention) against jax.nn.dot_product_attention, float32."""
    import foldax

    m = n = cfg.att_n
    d = 64
    rng = np.random.default_rng(3)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((m, d), (n, d), (n, d))
    )
    scale = 1.0 / np.sqrt(d)

    window = 256
    masks = {  # case suffix -> (foldax mask, jax.nn.dot_product_attention keywords)
        "": (None, {}),
        ", causal": (lambda i, j: j <= i, {"is_causal": True}),
        f", sliding window {window}": (
            lambda i, j: (j <= i) & (j > i - window),
            {"local_window_size": (window - 1, 0)},
        ),
    }
    rows = []
    for suffix, (mask, kw) in masks.items():

        def fold_att(q, k, v, mask=mask):
            return foldax.pairwise_reduce(
                lambda qi, kv: (jnp.dot(qi, kv[0]) * scale, kv[1]),
                q,
                (k, v),
                reduction="softmax",
                mask=mask,
            )

        def xla_att(q, k, v, kw=kw):
            qkv = (q[None, :, None], k[None, :, None], v[None, :, None])
            return jax.nn.dot_product_attention(*qkv, **kw)[0, :, 0]

        keep = (
            np.ones((m, n), bool)
            if mask is None
            else np.asarray(mask(np.arange(m)[:, None], np.arange(n)[None, :]))
        )
        with jax.enable_x64(True):
            q64, k64, v64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (q, k, v))
            logits = jnp.where(keep, q64 @ k64.T * scale, -jnp.inf)
            ref = np.asarray(jax.nn.softmax(logits, axis=-1) @ v64)
        case = f"M = N = {m:,}, D = {d}{suffix}"
        for name, fn in (("jax.nn.dot_product_attention", xla_att), ("foldax", fold_att)):
            prog.step(f"attention{suffix}: {name}")
            rows += _attention_rows(cfg, case, name, fn, (q, k, v), ref)
    return rows


def _attention_rows(cfg, case, name, fn, args, ref):
    """Forward and gradient rows (median time, XLA temp bytes; the forward's error) of ``fn``."""
    from . import workloads as w

    jf = jax.jit(fn)
    g = jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))
    jg = jax.jit(g)
    err = float(np.max(np.abs(np.asarray(jf(*args)) - ref)) / np.max(np.abs(ref)))
    rows = []
    for pass_, f, jitted, e in (("forward", fn, jf, err), ("gradient", g, jg, None)):
        secs = w.median_time(jitted, *args, repeats=cfg.repeats)
        rows.append(_row("attention", case, name, pass_, report(f, *args).temp_bytes, secs, e))
    return rows


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
    ]  # fmt: skip


#: Sizes of the calls whose overhead is measured (N rows; pairwise: min(N, overhead_pairs)).
_OVERHEAD_CALLS = (1_000, 100_000)
#: Compile-only cases: (name, reductions).
_COMPILE_ONLY = ("min", "argmin", "kmin", "ragged forward", "ragged gradient")


def _compile_seconds(make, args, repeats):
    """Median seconds to trace, lower and compile ``jax.jit(make())`` for ``args`` (a new
    function each time, so no cache is hit)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.jit(make()).lower(*args).compile()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _eager_and_jitted(case, f, g, args, cfg, prog):
    """Eager and jitted call latency (in turns) and compile time of ``f`` (foldax) and ``g``."""
    from . import workloads as w

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

    from . import workloads as w

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
    problem = w.seed_problem(shrink=10 if cfg is QUICK else 1)
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
    for n in _OVERHEAD_CALLS:
        for case, f, g, args in _overhead_calls(n, cfg):
            rows += _eager_and_jitted(case, f, g, args, cfg, prog)
    for case, pass_, impls in _compile_cases(cfg):
        prog.step(f"overhead {case}")
        for name, (make, args) in impls.items():
            secs = _compile_seconds(make, args, max(1, cfg.repeats // 2))
            rows.append(_row("overhead", case, name, pass_, None, secs, None))
    return rows


def bench_sharded(cfg: Config, prog: Progress) -> list[dict]:
    """The seed workload on 1 and on 8 host CPU devices: a subprocess (the device count is
    fixed when JAX starts)."""
    repeat, shrink = cfg.sharded
    prog.step(f"sharded: seed N x {repeat} on 1 vs 8 host devices (subprocess)")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "foldax._tools.workloads",
        "sharded",
        str(repeat),
        str(cfg.repeats),
        str(shrink),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"foldax bench: the sharded run failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return [
        _row(
            "sharded",
            f"N = {r['n']:,}",
            f"{r['devices']} device(s)",
            r["pass"],
            r["temp_bytes"],
            r["seconds"],
            r["rel_err"],
            n=r["n"],
            devices=r["devices"],
            argument_bytes=r["argument_bytes"],
            all_gather=r["all_gather"],
        )
        for r in out
    ]


BENCHES: dict[str, Callable[[Config, Progress], list[dict]]] = {
    "seed": bench_seed,
    "precomputed": bench_precomputed,
    "s4": bench_s4,
    "gaussian": bench_gaussian,
    "nearest": bench_nearest,
    "attention": bench_attention,
    "overhead": bench_overhead,
    "sharded": bench_sharded,
}


# ----------------------------------------------------------------------------------------------
# Rendering (from the JSON only)

#: The baseline each workload's ratios are taken against ("time / baseline").
BASELINE = {
    "seed": "global-max segment_sum",
    "precomputed": "floor: jnp.exp(x).sum()",
    "s4": "naive broadcast",
    "gaussian": "dense XLA",
    "nearest": "pykeops (CPU)",
    "attention": "jax.nn.dot_product_attention",
    "overhead": "without foldax",
    "sharded": "1 device(s)",
}

TITLES = {
    "seed": "The ragged logsumexp under vmap: per-segment logsumexp(f(theta, x)) - log(size), "
    "vmapped over 10 theta",
    "precomputed": "Precomputed data: segment logsumexp of float32 values",
    "s4": "S4's Cauchy kernel, complex64 (forward k = cauchy(v, z, w); gradient of sum |k|^2)",
    "gaussian": "Gaussian kernel, D = 3, float32",
    "nearest": "Nearest neighbours: squared distance, D = 3, float32 (min, argmin, k-min)",
    "attention": "Exact attention, float32 (pairwise_reduce softmax vs jax.nn.dot_product_attention)",
    "overhead": "What a call costs beside its work: eager call, jitted call and compile time",
    "sharded": "The ragged logsumexp on 8 host CPU devices (rows split over a mesh), per-device "
    "memory",
}


NOTES = {
    "seed": "Ways: `slicing loop` (materialize f, one dynamic slice + logsumexp per segment; "
    "left out at N x 10, where its 1230 slices take minutes to compile), `global-max "
    "segment_sum` (the usual stable way: one global max, then `jax.ops.segment_sum` of exp), "
    "`pad-and-scan` (pad every segment to the largest, `lax.scan` over segments with a masked "
    "logsumexp), `foldax` "
    "(`segment_logsumexp(x, sizes=..., fn=model)`). Gradient: of the per-segment sum with "
    "respect to theta.",
    "precomputed": "The floor is `jnp.exp(x).sum()`: one pass over the data, no segments. "
    "torch runs on the same CPU with its default threads.",
    "gaussian": "`sum_j exp(-|x_i - y_j|^2)` and `logsumexp_j(-|x_i - y_j|^2)`. XLA fuses the dense "
    "sum into its reduction (0 B temp) but not the logsumexp; pykeops' memory is not XLA's.",
    "nearest": "`min_j |x_i - y_j|^2`, its `argmin` and the k = 5 nearest "
    '(`reduction="kmin"`, pykeops\' `Kmin_argKmin`). The error column of argmin and k-min is '
    "the fraction of indices that differ from NumPy's on float64 distances (near-ties may "
    "round either way in float32). foldax spreads each step's large fusions over XLA:CPU's "
    "threads, pykeops runs one loop per thread: on a shared 2-core virtual machine, where "
    "waking a thread sometimes costs far more than usual, foldax's times can double from one "
    "run to the next while pykeops' stay put; on one core (`taskset -c 0`) both are steady.",
    "overhead": "Each case names the op a user would call without foldax (`without foldax`). "
    "`eager call`: the function called directly, as in a notebook or a Python loop (foldax runs "
    "a cached executable: the same shapes, static arguments and `fn` / `kernel` structure "
    "compile once). `jitted call`: `jax.jit` of the function, after its first call (dispatch "
    "and run). `compile`: trace, lower and compile a new `jax.jit` of it. Small calls are "
    "mostly overhead; the 100,000-row calls also show the work.",
    "sharded": "One process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`: the same "
    "program on one device and with the rows split over 8 (N padded to a multiple of 8, padding "
    "rows dropped by id). The 8 simulated devices share this machine's cores: the time ratio "
    "shows 8 device programs keeping the cores busy, not more hardware.",
}


def _fmt_time(s):
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def _fmt_err(e):
    return "n/a" if e is None else f"{e:.1e}"


def _base(rows, r, baseline):
    for b in rows:
        if b["case"] == r["case"] and b["pass"] == r["pass"] and b["impl"] == baseline:
            return b
    return None


def workload_table(results: dict, name: str) -> list[str]:
    rows = results["workloads"][name]
    base_name = BASELINE[name]
    extra = name == "sharded"
    head = (
        f"| case | implementation | pass | XLA temp | median time | time relative to {base_name} |"
    )
    head += " arguments / device | all-gather |" if extra else " max rel err vs float64 |"
    sep = "|---|---|---|---:|---:|---:|" + ("---:|---|" if extra else "---:|")
    lines = [head, sep]
    for r in rows:
        b = _base(rows, r, base_name)
        ratio = "n/a" if b is None or not b["seconds"] else f"{r['seconds'] / b['seconds']:.2f}"
        temp = "n/a" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"])
        tail = (
            f" {format_bytes(r['argument_bytes'])} | {'yes' if r['all_gather'] else 'no'} |"
            if extra
            else f" {_fmt_err(r['rel_err'])} |"
        )
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['pass']} | {temp} | {_fmt_time(r['seconds'])} | {ratio} |"
            + tail
        )
    return lines


def _pick(results, workload, impl, pass_, case=None):
    for r in results["workloads"].get(workload, []):
        if r["impl"] == impl and r["pass"] == pass_ and (case is None or r["case"] == case):
            return r
    return None


def headlines(results: dict) -> list[tuple[str, str, str]]:
    """``(claim, memory, time)`` rows for the README, each from the JSON."""
    out = []
    seed_cases = sorted(
        {r["case"] for r in results["workloads"].get("seed", [])},
        key=lambda c: int(c.split("=")[1].replace(",", "")),
    )
    for case in seed_cases:
        for p in ("forward", "gradient"):
            b = _pick(results, "seed", "global-max segment_sum", p, case)
            f = _pick(results, "seed", "foldax", p, case)
            if b and f:
                out.append(
                    (
                        f"ragged logsumexp under vmap, {case}, {p}: foldax vs global-max segment_sum",
                        f"{format_bytes(f['temp_bytes'])} vs {format_bytes(b['temp_bytes'])} ({b['temp_bytes'] / f['temp_bytes']:.0f}x less)",
                        f"{f['seconds'] / b['seconds']:.2f}x",
                    )
                )
    pre = results["workloads"].get("precomputed", [])
    if pre:
        fl = _pick(results, "precomputed", "floor: jnp.exp(x).sum()", "forward")
        for impl in (
            "foldax",
            "jax.ops segment_max + segment_sum",
            "torch.segment_reduce max + sum",
        ):
            r = _pick(results, "precomputed", impl, "forward")
            if r:
                out.append(
                    (
                        f"precomputed segment logsumexp ({r['case']}): {impl} vs the `jnp.exp(x).sum()` floor",
                        "",
                        f"{r['seconds'] / fl['seconds']:.2f}x (of the floor)",
                    )
                )
    s4 = results["workloads"].get("s4", [])
    if s4:
        top = max(r["n"] for r in s4)
        for p in ("forward", "gradient"):
            b = _pick(results, "s4", "naive broadcast", p, f"N = {top}")
            f = _pick(results, "s4", "foldax.cauchy", p, f"N = {top}")
            out.append(
                (
                    f"S4 Cauchy, H = {f['h']}, L = {f['length']}, N = {top}, {p}: foldax vs naive broadcast",
                    f"{format_bytes(f['temp_bytes'])} vs {format_bytes(b['temp_bytes'])}",
                    f"{f['seconds'] / b['seconds']:.2f}x",
                )
            )
    for wl, red in (
        ("gaussian", "sum"),
        ("gaussian", "logsumexp"),
        ("nearest", "min"),
        ("nearest", "argmin"),
        ("nearest", "kmin, k = 5"),
    ):
        rows = [r for r in results["workloads"].get(wl, []) if r.get("reduction") == red]
        f = next((r for r in rows if r["impl"] == "foldax"), None)
        for r in rows:
            if f and r["impl"] != "foldax":
                mem = (
                    ""
                    if r["temp_bytes"] is None
                    else f"{format_bytes(f['temp_bytes'])} vs {format_bytes(r['temp_bytes'])}"
                )
                if r["temp_bytes"] == 0:
                    mem += " (XLA fuses this dense sum: no N x M buffer either)"
                out.append(
                    (
                        f"{'Gaussian kernel' if wl == 'gaussian' else 'nearest'} {r['case']}: foldax vs {r['impl']}",
                        mem,
                        f"{f['seconds'] / r['seconds']:.2f}x",
                    )
                )
    for p in ("forward", "gradient"):
        b = _pick(results, "attention", "jax.nn.dot_product_attention", p)
        f = _pick(results, "attention", "foldax", p)
        if b and f:
            out.append(
                (
                    f"attention {f['case']}, {p}: foldax vs jax.nn.dot_product_attention",
                    f"{format_bytes(f['temp_bytes'])} vs {format_bytes(b['temp_bytes'])}",
                    f"{f['seconds'] / b['seconds']:.2f}x",
                )
            )
    plain = _pick(results, "attention", "foldax", "forward")
    for r in results["workloads"].get("attention", []):
        if plain and r["impl"] == "foldax" and r["pass"] == "forward" and r is not plain:
            out.append(
                (
                    f"attention {r['case']}, forward: foldax masked vs foldax unmasked",
                    f"{format_bytes(r['temp_bytes'])} vs {format_bytes(plain['temp_bytes'])}",
                    f"{r['seconds'] / plain['seconds']:.2f}x",
                )
            )
    out += _overhead_headlines(results)
    for p in ("forward", "gradient"):
        one = _pick(results, "sharded", "1 device(s)", p)
        eight = next(
            (
                r
                for r in results["workloads"].get("sharded", [])
                if r["pass"] == p and r["devices"] > 1
            ),
            None,
        )
        if one and eight:
            out.append(
                (
                    f"ragged logsumexp {one['case']} on {eight['devices']} host devices, {p} (per device)",
                    f"arguments {format_bytes(eight['argument_bytes'])} vs {format_bytes(one['argument_bytes'])}, temp {format_bytes(eight['temp_bytes'])} vs {format_bytes(one['temp_bytes'])}",
                    f"{eight['seconds'] / one['seconds']:.2f}x",
                )
            )
    return out


def _overhead_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The overhead rows a user meets first: eager and jitted calls of ``segment_sum``, an eager
    pairwise call, and the compile times of the nearest-neighbour and ragged programs."""
    rows = results["workloads"].get("overhead", [])
    out = []
    for r in rows:
        first = (r["case"].startswith("segment_sum") and r["pass"] != "compile") or (
            r["case"].startswith("pairwise") and r["pass"] == "eager call"
        )
        compile_only = r["case"].startswith(("nearest", "ragged")) and r["pass"] == "compile"
        if r["impl"] != "foldax" or not (first or compile_only):
            continue
        peer = _base(rows, r, BASELINE["overhead"])
        if peer and peer["seconds"]:
            secs = _fmt_time(r["seconds"]) + " vs " + _fmt_time(peer["seconds"])
            out.append(
                (
                    f"{r['pass']}: {r['case']}",
                    "",
                    f"{r['seconds'] / peer['seconds']:.2f}x ({secs})",
                )
            )
    return out


def render_markdown(results: dict) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{results['command']}` on {results['date']}, from `{PLOT_DIR}/results.json`.",
        f"Machine: {machine_line(results['machine'])}.",
        "",
        "Memory is XLA's compiled temp-buffer figure (`foldax.memory.report`; deterministic). Times "
        f"are medians of {results['repeats']} runs after a warm-up, all in this one run; every "
        "ratio compares numbers from the same run. Time ratios are time relative to the baseline "
        "named in each table (this way's median time / the baseline's): below 1 means faster than "
        "the baseline. Errors are max relative errors against float64 (complex128 for S4).",
        "",
    ]
    if results["skipped"]:
        lines += ["Skipped peers (not installed; the extra brings them):", ""]
        lines += [f"* {s['peer']}: `pip install -e '{s['extra']}'`" for s in results["skipped"]]
        lines.append("")
    for name in WORKLOADS:
        if name not in results["workloads"]:
            continue
        note = [NOTES[name], ""] if name in NOTES else []
        lines += [f"## {TITLES[name]}", "", *note, *workload_table(results, name), ""]
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({PLOT_DIR}/{p})" for p in results["plots"]] + [""]
    return "\n".join(lines)


def render_readme_block(results: dict) -> str:
    lines = [
        README_START,
        f"Measured by `{results['command']}` on {results['date']} ({machine_line(results['machine'])}); "
        "every figure, with errors against float64, in [BENCHMARKS.md](BENCHMARKS.md).",
        "",
        "| foldax vs | XLA temp memory | time relative to the other (< 1: foldax is faster) |",
        "|---|---|---|",
        *(f"| {c} | {m} | {t} |" for c, m, t in headlines(results)),
        "",
    ]
    if "time_ratios.png" in results.get("plots", []):
        lines += [f"![time ratios]({PLOT_DIR}/time_ratios.png)", ""]
    lines.append(README_END)
    return "\n".join(lines)


def plots(results: dict, out_dir: str) -> list[str]:
    """Temp memory against N (log-log) and time ratios against each peer; file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (wl, xkey, title) in zip(
        axes,
        (("seed", "n", "ragged logsumexp under vmap (rows N)"), ("s4", "n", "S4 Cauchy (poles N)")),
        strict=True,
    ):
        rows = results["workloads"].get(wl, [])
        for impl in dict.fromkeys(r["impl"] for r in rows):
            for p, style in (("forward", "o-"), ("gradient", "s--")):
                pts = sorted(
                    (r[xkey], r["temp_bytes"]) for r in rows if r["impl"] == impl and r["pass"] == p
                )
                if len(pts) > 1:
                    ax.loglog(*zip(*pts, strict=True), style, label=f"{impl} ({p})")
        ax.set(title=title, xlabel="N", ylabel="XLA temp bytes")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory_vs_n.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append("memory_vs_n.png")

    labels, ratios = [], []
    for wl in ("seed", "precomputed", "s4", "gaussian", "nearest", "attention"):
        rows = results["workloads"].get(wl, [])
        for r in rows:
            if r["impl"] in ("foldax", "foldax.cauchy") or r["seconds"] is None:
                continue
            f = next(
                (
                    x
                    for x in rows
                    if x["case"] == r["case"]
                    and x["pass"] == r["pass"]
                    and x["impl"] in ("foldax", "foldax.cauchy")
                ),
                None,
            )
            if f:
                name = {"seed": "ragged logsumexp"}.get(wl, wl)
                labels.append(f"{name} {r['case']}, {r['pass']}: {r['impl']}")
                ratios.append(f["seconds"] / r["seconds"])
    fig, ax = plt.subplots(figsize=(11, 0.25 * len(labels) + 1.2))
    ax.barh(
        range(len(labels)), ratios, color=["tab:green" if q <= 1 else "tab:red" for q in ratios]
    )
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("foldax time relative to the peer's (< 1: foldax is faster)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "time_ratios.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append("time_ratios.png")
    return written


def terminal_table(results: dict, name: str) -> str:
    rows = results["workloads"][name]
    base_name = BASELINE[name]
    cells = [
        (
            "case",
            "implementation",
            "pass",
            "XLA temp",
            "median time",
            f"time rel. to {base_name}",
            "rel err",
        )
    ]
    for r in rows:
        b = _base(rows, r, base_name)
        cells.append(
            (
                r["case"],
                r["impl"],
                r["pass"],
                "n/a" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"]),
                _fmt_time(r["seconds"]),
                "n/a" if b is None else f"{r['seconds'] / b['seconds']:.2f}",
                _fmt_err(r["rel_err"]),
            )
        )
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(cells[0]))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The command


def run(quick: bool = False, only=None, out: str = ".", command: str | None = None) -> dict:
    """Run the benchmarks, write ``results.json``, plots, ``BENCHMARKS.md`` (and the README's
    results block if ``out/README.md`` has the markers). Returns the results."""
    cfg = QUICK if quick else FULL
    names = list(WORKLOADS) if not only else list(only)
    for n in names:
        if n not in BENCHES:
            raise SystemExit(
                f"foldax bench: unknown workload {n!r}; choose from {', '.join(WORKLOADS)}"
            )
    command = command or "foldax bench" + (" --quick" if quick else "") + "".join(
        f" --only {n}" for n in (only or [])
    )
    skipped = [{"peer": p, "extra": PEERS[p][1]} for p in PEERS if not available(p)]
    for s in skipped:
        print(
            f"skipped: {s['peer']} (not installed; pip install -e '{s['extra']}')", file=sys.stderr
        )
    prog = Progress(_steps(cfg, names))
    results = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "quick": quick,
        "repeats": cfg.repeats,
        "config": dataclasses.asdict(cfg),
        "skipped": skipped,
        "workloads": {},
        "plots": [],
    }
    for name in names:
        results["workloads"][name] = BENCHES[name](cfg, prog)
        print(f"\n{TITLES[name]}\n{terminal_table(results, name)}\n", flush=True)
    write(results, out)
    return results


def write(results: dict, out: str) -> None:
    plot_dir = os.path.join(out, PLOT_DIR)
    os.makedirs(plot_dir, exist_ok=True)
    if available("plots (matplotlib)"):
        results["plots"] = plots(results, plot_dir)
    with open(os.path.join(plot_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    _write_text(results, out)
    print(
        f"wrote {plot_dir}/results.json, {out}/BENCHMARKS.md"
        + (f", plots {results['plots']}" if results["plots"] else "")
    )


def _write_text(results: dict, out: str) -> None:
    with open(os.path.join(out, "BENCHMARKS.md"), "w") as f:
        f.write(render_markdown(results))
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        if README_START in text and README_END in text:
            head, rest = text.split(README_START, 1)
            tail = rest.split(README_END, 1)[1]
            with open(readme, "w") as f:
                f.write(head + render_readme_block(results) + tail)


def render(out: str) -> None:
    """Rewrite ``BENCHMARKS.md`` and the README block from ``out/bench/results.json`` (no runs)."""
    with open(os.path.join(out, PLOT_DIR, "results.json")) as f:
        results = json.load(f)
    _write_text(results, out)


def readme_block_of(text: str) -> str | None:
    if README_START not in text or README_END not in text:
        return None
    return README_START + text.split(README_START, 1)[1].split(README_END, 1)[0] + README_END
