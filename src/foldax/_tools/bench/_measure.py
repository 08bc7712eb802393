"""Measuring the workloads of ``foldax bench`` (all but ``overhead``): each ``bench_*`` runs
one workload and returns a list of row dicts with the same keys (memory from XLA's compiled
analysis, median times after a warm-up, errors against float64 / complex128)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ..._memory import report
from ._config import Config, available
from ._noise import conditions
from ._progress import Progress


def _row(workload, case, impl, pass_, temp, seconds, err, **extra):
    """One row of results; where ``seconds`` is a ``workloads.Timing``, the spread of its runs
    beside it, and the load average now (see ``_noise.conditions``)."""
    return {
        "workload": workload,
        "case": case,
        "impl": impl,
        "pass": pass_,
        "temp_bytes": temp,
        "seconds": seconds,
        "rel_err": err,
        **extra,
        **conditions(seconds),
    }


def bench_seed(cfg: Config, prog: Progress) -> list[dict]:
    from .. import workloads as w

    rows = []
    for repeat, shrink, loop in cfg.seed_cases:
        problem = w.seed_problem(repeat=repeat, shrink=shrink, segments=cfg.seed_segments)
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


#: The likelihood's ways, the baseline first (a pair of row arrays: the slicing loop is left out)
LIKELIHOOD_WAYS = ("pad-and-scan", "global-max segment_sum", "foldax")


def bench_likelihood(cfg: Config, prog: Progress) -> list[dict]:
    """The seed workload in its client's form: a pair of row arrays, per segment
    ``logsumexp(model(theta, x) - log_prior) - log(size)``, vmapped over 10 theta, forward and
    gradient in theta; every way of a pass timed in turns."""
    from .. import workloads as w

    problem = w.seed_problem(shrink=cfg.likelihood_shrink)
    lp = np.random.default_rng(1).standard_normal(problem.n).astype(np.float32)
    args = (problem.thetas, problem.x, jnp.asarray(lp))
    case = f"N = {problem.n:,}, B = {problem.thetas.shape[0]}"
    prog.note(f"likelihood {case}: float64 reference")
    ref = dict(zip(("forward", "gradient"), w.reference(problem, lp), strict=True))
    fns = {way: w.forward_and_grad(w.WAYS[way](problem.sizes), rows=2) for way in LIKELIHOOD_WAYS}
    rows = []
    for i, pass_ in enumerate(("forward", "gradient")):
        jitted = {way: jax.jit(fns[way][i]) for way in LIKELIHOOD_WAYS}
        for way in LIKELIHOOD_WAYS:
            prog.step(f"likelihood {pass_}: {way}")
        times = w.median_times(
            {way: functools.partial(f, *args) for way, f in jitted.items()}, repeats=cfg.repeats
        )
        for way, f in jitted.items():
            err = w.max_rel_err(f(*args), ref[pass_])
            temp = report(fns[way][i], *args).temp_bytes
            rows.append(_row("likelihood", case, way, pass_, temp, times[way], err, n=problem.n))
    return rows


def bench_precomputed(cfg: Config, prog: Progress) -> list[dict]:
    """segment_logsumexp of n precomputed float32 values in 1000 unequal contiguous segments."""
    import foldax

    from .. import workloads as w

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
    from .. import workloads as w

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

    from .. import workloads as w

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
    ``kmin`` (each k of ``cfg.kmin_ks``), foldax against pykeops (skipped without it), timed in
    turns. The error column of the index rows is the fraction of indices that differ from
    NumPy's (float64 distances)."""
    import foldax

    n = cfg.gauss_n
    x, y, xj, yj = _point_clouds(n, seed=3)

    def fold(red, **kw):
        return lambda x, y: foldax.pairwise_reduce(_sq, x, y, reduction=red, **kw)

    kmins = {f"kmin, k = {k}": k for k in cfg.kmin_ks}
    impls = {"min": {"foldax": fold("min")}, "argmin": {"foldax": fold("argmin")}}
    for red, k in kmins.items():
        impls[red] = {"foldax": lambda x, y, k=k: fold("kmin", k=k)(x, y)[1]}
    ref = _nearest_reference(x, y, max(cfg.kmin_ks))
    ref.update({red: ref["kmin"][:, :k] for red, k in kmins.items()})
    if available("pykeops"):
        from pykeops.numpy import LazyTensor

        d2 = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
        impls["min"]["pykeops (CPU)"] = lambda: d2.min(1)[:, 0]
        impls["argmin"]["pykeops (CPU)"] = lambda: d2.argmin(1)[:, 0]
        for red, k in kmins.items():
            impls[red]["pykeops (CPU)"] = lambda k=k: d2.Kmin_argKmin(k, 1)[1]
    rows = []
    for red, fns in impls.items():
        rows += _nearest_rows(cfg, prog, red, fns, ref[red], n, xj, yj)
    return rows


def _nearest_reference(x, y, k):
    """NumPy's min, argmin and k nearest (stable: ties by index) on float64 distances."""
    ref = {"min": [], "argmin": [], "kmin": []}
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for s in range(0, x.shape[0], 1000):
        d = ((x64[s : s + 1000, None] - y64[None]) ** 2).sum(-1)
        ref["min"].append(d.min(1))
        ref["argmin"].append(d.argmin(1))
        ref["kmin"].append(np.argsort(d, axis=1, kind="stable")[:, :k])
    return {r: np.concatenate(v) for r, v in ref.items()}


def _nearest_rows(cfg, prog, red, fns, ref, n, xj, yj):
    """One reduction's rows: foldax and pykeops timed in turns (each call of one is followed by
    one of the other), after a warm-up that compiles (seconds)."""
    from .. import workloads as w

    calls = {
        name: (fn if name.startswith("pykeops") else functools.partial(jax.jit(fn), xj, yj))
        for name, fn in fns.items()
    }
    for name in fns:
        prog.step(f"nearest {red}: {name}")
    times = w.median_times(calls, repeats=cfg.repeats)
    rows = []
    for name, fn in fns.items():
        got = np.asarray(calls[name]())
        temp = None if name.startswith("pykeops") else report(fn, xj, yj).temp_bytes
        err = (
            w.max_rel_err(got, ref) if red == "min" else float(np.mean(got.astype(np.int64) != ref))
        )
        case = f"{red}, M = N = {n:,}"
        rows.append(_row("nearest", case, name, "forward", temp, times[name], err, reduction=red))
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
    from .. import workloads as w

    jf = jax.jit(fn)
    g = jax.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))
    jg = jax.jit(g)
    err = float(np.max(np.abs(np.asarray(jf(*args)) - ref)) / np.max(np.abs(ref)))
    rows = []
    for pass_, f, jitted, e in (("forward", fn, jf, err), ("gradient", g, jg, None)):
        secs = w.median_time(jitted, *args, repeats=cfg.repeats)
        rows.append(_row("attention", case, name, pass_, report(f, *args).temp_bytes, secs, e))
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
            **{k: r[k] for k in ("seconds_min", "seconds_max", "rounds") if k in r},
        )
        for r in out
    ]
